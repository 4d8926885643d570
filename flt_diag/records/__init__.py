"""Records in one file each: every module of this package holds one diagnostic record, `RECORD`, with everything
about it: its options (a small typed model, `RecordOptions`: default and help beside each field), its metric names
with a one-line definition each, its schedule, the moment it is taken at, its state between calls if it keeps one,
and its computation. A researcher's own record, outside the package, joins by `register_record(RECORD)` (also
`flt_diag.register_record`) or by an entry point of the group `flt_diag.records` (docs/extending.md).
DiagnosticsConfig's record options (flt_diag.config.run_config) and the recorded metric names
(flt_diag.storage.metric_names.RECORDED) are assembled from `all_records()`; the diagnostics take each record that
is switched on at its moment, for flt-diag's Trainer and flt_diag.watch alike (flt_diag.instruments.diagnostics,
through the run's record guard: one that fails, or returns what is no {metric: number}, is said once and skipped).

The schedule is the record's first option, its switch: a bool (on: every recorded step, `dense_steps` then
`every`), or an int N (every recorded step that is a multiple of N; 0 = never); `every` (an int option of
DiagnosticsConfig, by name) thins it to the recorded steps that are multiples of that option (the exit loss's and the
streams' similarity's `exit_loss_every`). A record of `schedule="every_n"` (moment loop_map: the loop map, the per-loop
gradient agreement, the sharpness) has an int switch N and is taken every N steps whether or not the step is recorded,
and at the steps a decided stop asks for besides (flt_diag.training.decided_stop). Torch-free, and importing nothing
of flt_diag.config (which imports it): a record computes through the tensors it is handed (the diagnostics run it
under no_grad), so config/ and storage/ read its declaration without torch (docs/DESIGN.md §7, "A record is one
file").
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

MOMENTS = {  # when a record is taken, what its compute is given; it returns {metric: 0-d tensor or number}
    "after_block": "after each block's forward in a recorded forward: compute(block, args, output), at (loop, layer)",
    "loop_end": "at each recorded loop's end, after its last block: compute(loop, h), h the loop-end state (the "
                "model's loop_state of the stream on flt-diag's own model, the stream itself on any other), at (loop,)",
    "loop_map": "every N steps, recorded or not (schedule every_n), after the backward, on rank 0 only: compute(ctx=), "
                "ctx.loop_map the step's loop map (flt_diag.instruments.dynamics_callback.LoopMap: stats(), agreement(), "
                "sharpness() at the step's first micro-batch, fp32 outside autocast, a generator seeded by the step, "
                "nothing written to any .grad; on a model flt-diag did not write only the recorded steps, stats() from "
                "the loop-end streams), ctx.idx and ctx.targets that micro-batch; returns {metric: number, {loop: "
                "number} or {(loop, layer): number}}, without no_grad",
    "after_backward": "the gradients ready, before clipping: compute(model), at no loop and no layer",
    "after_clip": "the gradients clipped: compute(model), at no loop and no layer",
    "after_step": "the optimizer stepped: compute(model), at no loop and no layer",
}
ENTRY_POINTS = "flt_diag.records"  # the entry-point group of records defined outside the package


class RecordOptions(BaseModel):
    """A record's options, a small typed model (a pydantic model: fields declared with pydantic's `Field(default,
    description=help, ...)`); its first field is its switch. Validated as every option is (strict, finite)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True, validate_by_name=True,
                              validate_by_alias=True)


O = TypeVar("O", bound=RecordOptions)
Schedule = Literal["recorded", "every_n"]  # (Record.schedule)
S = TypeVar("S")


class Unrecordable(Exception):
    """A value a record cannot take (the line says what it is and what the record needs): the record is
    skipped, and this line is why (the run's record guard, flt_diag.instruments.guard)."""


@dataclass(frozen=True)
class RecordContext(Generic[S]):
    """What a record of `context=True` is handed as `ctx=`, besides its moment's arguments: the `step`; the run's
    diagnostics options `cfg` (DiagnosticsConfig: the core options by name, e.g. `cfg.dynamics_batch`); the batch of
    the step's recorded forward, `idx` (its first argument, or `idx=`) and `targets` (the model's `loop_targets` of
    the forward's arguments on flt-diag's own model, the user's `targets=` of them under flt_diag.watch, else None;
    as given: a record checks what it takes); the loop's `head` (h -> logits: the model's loop_head on flt-diag's own
    model, watch's head=, else None; as given); `targets_at_step`: the targets come only at the step
    (flt_diag.watch with head= and no targets=: probe.step(targets=)), so a record that needs them keeps what it
    needs and takes them in its finish at the step (Record `finish_at="step"`, where `targets` are the step's); and
    the record's own `state` (its `state` factory's, made once per run; None without one); `loop_map` (moment
    loop_map only) the step's loop map the records of that moment compute through (MOMENTS). Built per call by the
    diagnostics and the loop dynamics (flt_diag.instruments)."""

    step: int
    cfg: Any
    idx: Any = None
    targets: Any = None
    state: S | None = None
    head: Any = None
    targets_at_step: bool = False
    loop_map: Any = None


@dataclass(frozen=True, eq=False)
class Record(Generic[O]):
    """One record: `options` its RecordOptions model, the first field its switch; `metrics` name -> definition;
    `moment` one of MOMENTS; `compute` as its moment says. `state`: for a quantity of two steps or two loops, a
    factory of the record's state (made once per run, kept between calls and steps), handed to compute as
    `state=`; the record resets it where it must (loop 1 starts a forward). `context`: compute is handed
    `ctx=` a RecordContext (the step, the diagnostics options, the step's batch, its state) instead of `state=`.
    `switched_by`: the switch is that option of DiagnosticsConfig, declared elsewhere (a core option, or another
    record's), shared by a family of records (the loop dynamics: `loop_dynamics`); its own options may then be none
    (`RecordOptions` itself). `finish` (moment loop_end only): called at each recorded forward's end as
    finish(loops, state=), it returns {metric: {loop: value}}, values its loop ends kept for taking together (a few
    operations a forward, not a few a loop; the fixed-point residual's). `finish_at="step"` (a record of
    `context=True`): finish is called instead at the step's end, as finish(ctx=), ctx the step's context whose
    `targets` are those the step was given (probe.step(targets=); None if none): what its loop ends kept for targets
    that come only then (the exit loss under flt_diag.watch without targets=). `every`: an int option of
    DiagnosticsConfig by name; the record is due only on recorded steps that are multiples of it (0 = never).
    `schedule`: "recorded" (the recorded steps, as the module docstring says) or "every_n" (moment loop_map and
    `context=True` only: the switch, an int N, takes it every N steps whether recorded or not, and at the steps a
    decided stop asks for: flt_diag.instruments.dynamics_callback)."""

    options: type[O]
    metrics: dict[str, str]
    moment: str
    compute: Callable[..., dict]
    state: Callable[[], Any] | None = None
    context: bool = False
    switched_by: str | None = None
    finish: Callable[..., dict] | None = None
    finish_at: str = "forward"
    every: str | None = None
    schedule: Schedule = "recorded"

    def __post_init__(self) -> None:
        if not (isinstance(self.options, type) and issubclass(self.options, RecordOptions)):
            raise ValueError(f"a record's options are a RecordOptions model (got {self.options!r})")
        if self.moment not in MOMENTS or not (self.options.model_fields or self.switched_by) or not self.metrics:
            raise ValueError(f"a record needs options (or switched_by), metrics and one of the moments "
                             f"{', '.join(MOMENTS)} (got {self.moment!r})")
        if self.finish is not None and (self.moment != "loop_end" or self.state is None):
            raise ValueError("a record's finish is for a record of moment loop_end that keeps a state")
        if self.finish_at not in ("forward", "step") or (self.finish_at == "step" and not self.context):
            raise ValueError(f"a record's finish_at is 'forward' or 'step' (a record of context=True; got "
                             f"{self.finish_at!r})")
        if (self.schedule == "every_n") != (self.moment == "loop_map") or self.schedule not in ("recorded", "every_n") \
                or (self.moment == "loop_map" and (not self.context or self.every is not None)):
            raise ValueError(f"a record of moment loop_map has schedule='every_n' and context=True, and only it (got "
                             f"{self.moment!r}, {self.schedule!r})")
        if self.switched_by is None and self.options.model_fields[self.switch].annotation not in (bool, int):
            raise ValueError(f"a record's first option ({self.switch}) is its switch: a bool or an int")

    @property
    def switch(self) -> str:
        """The option that switches it on: `switched_by`, else its first option."""
        return self.switched_by or next(iter(self.options.model_fields))

    @property
    def module(self) -> str:
        """The module that defines it (its compute's): what a run's environment names."""
        return getattr(self.compute, "__module__", None) or "?"

    def options_of(self, cfg) -> O:
        """Its options as set in DiagnosticsConfig `cfg`, typed."""
        return self.options.model_validate({name: getattr(cfg, name) for name in self.options.model_fields})

    def due(self, cfg, step: int) -> bool:
        """Whether a recorded `step` takes it under DiagnosticsConfig `cfg` (the module docstring's schedule)."""
        on = getattr(cfg, self.switch)
        if self.every is not None and not (getattr(cfg, self.every) > 0 and step % getattr(cfg, self.every) == 0):
            return False
        return on if isinstance(on, bool) else on > 0 and step % on == 0


_REGISTERED: list[Record] = []  # register_record's, in order


def register_record(record: Record) -> Record:
    """A record of the user's own joins the records (docs/extending.md): call it before flt-diag's config is
    first read (before watch, the command line, DiagnosticsConfig); registering one record twice is once."""
    if not isinstance(record, Record):
        raise TypeError(f"register_record takes a flt_diag.records.Record, got {type(record).__name__}")
    if any(r is record for r in _REGISTERED):
        return record
    if all_records.cache_info().currsize:
        raise RuntimeError(f"the record {record.switch} ({record.module}) came after flt-diag's records were read: "
                           "call register_record before anything of flt_diag.config is imported (watch, the command "
                           "line, DiagnosticsConfig)")
    _REGISTERED.append(record)
    return record


def _left_out(what: str, why: str) -> None:
    print(f"warning: record {what} left out: {why}", file=sys.stderr)


def _entry_point_records() -> list[Record]:
    """The records installed distributions name (ENTRY_POINTS). One that fails to load (a syntax error, an import
    that fails, whatever it raises) or names no Record is said in one warning line and left out, as a broken
    stabiliser plugin is: it never stops flt-diag's commands."""
    out = []
    for point in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda p: p.name):
        try:
            found = point.load()
        except (Exception, SystemExit) as e:  # (a plugin's own error, whatever it is, or its exit: said in one line)
            said = (str(e).strip().splitlines() or ["(no code)" if isinstance(e, SystemExit) else ""])[0]
            _left_out(f"entry point {point.name} = {point.value}", f"{type(e).__name__}: {said}")
            continue
        record = getattr(found, "RECORD", found)  # (a module holding RECORD, or the record itself)
        if not isinstance(record, Record):
            _left_out(f"entry point {point.name} = {point.value}", f"it names a {type(record).__name__}, no Record")
            continue
        out.append(record)
    return out


def refuse_options_named(taken) -> None:
    """One ValueError line naming the first record one of whose options is in `taken` (flt-diag's own option names:
    the config's sections, checked by flt_diag.config.run_config; the commands' and grids', by flt_diag.cli.options)."""
    for record in all_records():
        if clash := sorted(set(record.options.model_fields) & set(taken)):
            raise ValueError(f"the record {record.switch} ({record.module}) names the option {', '.join(clash)}, "
                             "which is flt-diag's own: rename it in the record")


@functools.cache
def all_records() -> tuple[Record, ...]:
    """The RECORD of every module of this package (but its helpers, named _*), by module name, then the entry points' (by name), then those
    registered; one of the latter two that names an option or metric an earlier record names is said in one warning
    line and left out (flt-diag's own come first)."""
    own = [importlib.import_module(f"{__name__}.{m.name}").RECORD
           for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name) if not m.name.startswith("_")]
    records: list[Record] = list(own)
    for record in [*_entry_point_records(), *_REGISTERED]:
        if any(r is record for r in records):  # (an entry point's record registered too: once)
            continue
        taken = {n for r in records for n in (*r.options.model_fields, *r.metrics)}
        if clash := sorted(taken & {*record.options.model_fields, *record.metrics}):
            _left_out(f"{record.switch} ({record.module})", f"an earlier record names {', '.join(clash)} already")
            continue
        records.append(record)
    return tuple(records)
