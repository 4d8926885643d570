"""What a record is handed by the user's code, checked at the record for kind, shape, dtype and range: the
stream loop_step= returns (the targets and the logits of head=: flt_diag.records._targets, beside the exit loss that
takes them), and what a record returns. A value
that does not fit raises Unrecordable, one line saying what it is and what the record needs, and the run's record
guard (flt_diag.instruments.guard) skips the record: never an IndexError or AttributeError from inside the
forward, nor a cross-entropy on out-of-range targets (on a GPU a device-side assert that ends the process)."""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flt_diag.instruments.guard import Skipped, Unrecordable, why_of
from flt_diag.records import Record, RecordContext
from flt_diag.records._targets import kind
from flt_diag.storage import metric_names as M


def checked_step(loop_step: Callable) -> Callable:
    """loop_step, whose value is checked at each call: the next loop-end stream, a real tensor of the shape of
    the one it was given (h(t-1) -> h(t) keeps the stream's shape)."""
    def step(h: torch.Tensor) -> torch.Tensor:
        out = loop_step(h)
        if not torch.is_tensor(out) or not out.is_floating_point() or out.shape != h.shape:
            raise Unrecordable(f"loop_step= gave {kind(out)} for a loop-end stream of shape {tuple(h.shape)} "
                               f"({h.dtype}); it maps one stream to the next: a real tensor of the same shape")
        return out
    return step


def recorded(record: Record, values) -> list[tuple[str, torch.Tensor | float]]:
    """What a record's compute returned, as the step log takes it: {metric it declares: one real number (a tensor
    of one element, or a number a float holds)}; anything else is Unrecordable, raised inside the record's own
    guard (so the record at fault is the one named and skipped, and nothing of it is logged)."""
    if not isinstance(values, dict):
        raise Unrecordable(f"it returned {kind(values)}; a record returns {{metric: number}}")
    out: list[tuple[str, torch.Tensor | float]] = []
    for metric, value in values.items():
        if metric not in record.metrics:
            raise Unrecordable(f"it returned the metric {metric!r}, not one of its own ({', '.join(record.metrics)})")
        if torch.is_tensor(value) and value.numel() == 1 and not value.is_complex():
            out.append((metric, value.reshape(()) if value.dim() else value))
        elif isinstance(value, numbers.Real) and not torch.is_tensor(value):
            try:
                out.append((metric, float(value)))
            except OverflowError:
                raise Unrecordable(f"its {metric} is {kind(value)} {str(value)[:20]}..., beyond a float") from None
        else:
            raise Unrecordable(f"its {metric} is {kind(value)}; a record's value is one real number (a tensor of "
                               "one element, or a number)")
    return out


def logged(record: Record, log: Callable[..., None], values, loop: int, layer: int) -> None:
    """`values` ({metric: number}) checked (`recorded`) and logged at (loop, layer); a metric whose value is an
    error (the record could not take it) is skipped alone, with why (Skipped, after the others are logged)."""
    if not isinstance(values, dict):
        recorded(record, values)  # (its line: no dict)
    failed = {m: why_of(v) for m, v in values.items() if isinstance(v, Exception) and m in record.metrics}
    rows = recorded(record, {m: v for m, v in values.items() if m not in failed})
    for metric, value in rows:
        log(metric, value, loop, layer)
    if failed:
        raise Skipped(failed)


def take_record(record: Record, log: Callable[..., None], args: Sequence, states: dict[Record, Any],
                loop: int = M.NONE, layer: int = M.NONE, context: RecordContext | None = None) -> None:
    """`record` computed on `args` (no gradient; its state, if it keeps one, as `state=`: made at its first call,
    kept in `states`; a record of `context=True` gets `ctx=`, the step's `context` with its own state), its values
    checked and logged at (loop, layer) (`logged`). Called inside the record's guard."""
    kwargs: dict[str, Any] = {}
    if record.state is not None and record not in states:
        states[record] = record.state()
    if record.context:
        if context is None:
            raise Unrecordable("it needs the step's context, which this moment does not give")
        kwargs["ctx"] = dataclasses.replace(context, state=states.get(record))
    elif record.state is not None:
        kwargs["state"] = states[record]
    with torch.no_grad():
        values = record.compute(*args, **kwargs)
    logged(record, log, values, loop, layer)


def take_finish(record: Record, log: Callable[..., None], loops: int, states: dict[Record, Any],
                context: RecordContext | None = None) -> None:
    """A loop_end record's `finish` at the recorded forward's end, on its state (none yet: nothing kept, nothing
    taken), or at the step (`finish_at="step"`: given `context`, the step's, with its state): {metric: {loop:
    value}}, every value checked, at (loop,) (`logged`: a failed value skipped alone). Called inside the record's
    guard."""
    if record.finish is None or record not in states:
        return
    with torch.no_grad():
        if record.finish_at == "step":
            if context is None:
                raise Unrecordable("its finish needs the step's context, which this moment does not give")
            values = record.finish(ctx=dataclasses.replace(context, state=states[record]))
        else:
            values = record.finish(loops, state=states[record])
    if not (isinstance(values, dict) and all(isinstance(v, dict) for v in values.values())):
        raise Unrecordable(f"its finish returned {kind(values)}; a finish returns {{metric: {{loop: number}}}}")
    failed: dict[str, str] = {}
    for loop in sorted({t for by_loop in values.values() for t in by_loop}):
        try:
            logged(record, log, {m: by_loop[loop] for m, by_loop in values.items() if loop in by_loop}, loop, M.NONE)
        except Skipped as e:
            failed |= {m: why for m, why in e.whys.items() if m not in failed}
    if failed:
        raise Skipped(failed)


def take_loop_map(record: Record, log: Callable[..., None], states: dict[Record, Any], context: RecordContext) -> None:
    """A record of moment loop_map computed on the step's `context` (its state, if it keeps one, made at its first
    call, kept in `states`), not under no_grad (the step's loop map differentiates: its methods take their own grad
    mode): {metric: number, {loop: number} or {(loop, layer): number}}, every value checked (`recorded`) before any is
    logged, at (loop, layer) (NONE where not given), metric by metric in the order returned. Called inside the
    record's guard."""
    if record.state is not None and record not in states:
        states[record] = record.state()
    values = record.compute(ctx=dataclasses.replace(context, state=states.get(record)))
    if not isinstance(values, dict):
        recorded(record, values)  # (its line: no dict)
    rows: list[tuple[str, torch.Tensor | float, int, int]] = []
    for metric, by_place in values.items():
        for place, value in (by_place.items() if isinstance(by_place, dict) else [((M.NONE, M.NONE), by_place)]):
            loop, layer = place if isinstance(place, tuple) else (place, M.NONE)
            if not (isinstance(loop, int) and isinstance(layer, int)):
                raise Unrecordable(f"its {metric} is at {kind(place)}; a place is a loop or (loop, layer), ints")
            rows += [(m, v, loop, layer) for m, v in recorded(record, {metric: value})]
    for metric, value, loop, layer in rows:
        log(metric, value, loop, layer)
