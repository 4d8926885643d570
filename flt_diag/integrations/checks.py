"""What watch() and probe.step() are given, checked where it comes in (docs/api.md, the refusal table): a
keyword of the wrong kind is one ProbeError line at watch(), before a folder is made or a hook registered,
and a wrong step() argument one line before anything of the step is recorded, never a traceback from a
hook inside the model's forward or from the metrics table later. Torch, no other part of the probe."""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flt_diag.storage.folders import CONFIG
from flt_diag.instruments.callbacks import Callback
from flt_diag.instruments.loop_hooks import ProbeError
from flt_diag.instruments.record_checks import kind
from flt_diag.config.run_config import MAX_SEED, MAX_VOCAB, DiagnosticsConfig
from flt_diag.config.variants import VARIANTS

# A step number is stored as a 64-bit integer and read back into float64 columns by the judges and the
# figures: exact up to 2**53, so no step above it is taken (watch(steps=), step(step=)).
MAX_STEP = 2**53


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _whole(name: str, x, low: int, high: int) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not low <= int(x) <= high:
        raise ProbeError(f"watch({name}={x!r}): an integer from {low} to {high:,} is expected"
                         if isinstance(x, numbers.Integral) and not isinstance(x, bool)
                         else f"watch({name}=...): an integer is expected, not {kind(x)}")


def learning_rate(optimizer) -> float:
    """The learning rate of `optimizer`'s first parameter group (recorded as lr at each step), or one line
    saying why it cannot be read: no `param_groups`, none in it, or no number under "lr"."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)) or not groups:
        what = "no param_groups" if groups is None else "no parameter group"
        raise ProbeError(f"optimizer= ({type(optimizer).__name__}) has {what}; give the torch.optim optimizer that "
                         "steps the model (its learning rate is recorded), or leave optimizer= out")
    lr = groups[0].get("lr") if isinstance(groups[0], Mapping) else None
    if torch.is_tensor(lr) and lr.numel() == 1 and not lr.is_complex() and not lr.is_meta:
        lr = float(lr)
    if lr is None or not _real(lr):
        raise ProbeError(f"optimizer= ({type(optimizer).__name__}): its first parameter group holds no learning rate "
                         f"(a number under 'lr', found {kind(lr)})")
    return float(lr)


def _fraction(name: str, x, high: float) -> None:
    if x is not None and not (_real(x) and math.isfinite(x) and 0 <= x <= high):
        raise ProbeError(f"watch({name}={x!r}): a number from 0 to {high:g} (or None) is expected")


def check_watch(model, folder, *, loss, optimizer, callbacks, loop_boundary, diagnostics, steps, seed, vocab_size,
                grad_scale, unigram_entropy, note, variant, warmdown, grad_clip, head=None, loop_step=None,
                targets=None, scheduler=None, predictor_path=None, **_) -> None:
    """watch()'s arguments, each of the kind docs/api.md names (one ProbeError line for the first that is not)."""
    if not isinstance(model, torch.nn.Module):
        raise ProbeError(f"watch() diagnoses an nn.Module, not {kind(model)}")
    if not isinstance(folder, (str, os.PathLike)):
        raise ProbeError(f"watch(folder=...): a path is expected, not {kind(folder)}")
    if not str(os.fspath(folder)):
        raise ProbeError("watch(folder=''): the folder's name is empty; give the folder to write the run into")
    meta = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if meta is not None:
        raise ProbeError(f"{type(model).__name__}.{meta} is on the meta device (a shape without values): initialize "
                         "or load the model's weights on a real device before watch()")
    if loss is not None and not callable(loss):
        raise ProbeError(f"loss= is a function of the model's output (output -> loss tensor), not {kind(loss)}")
    for name, value, what in (("head", head, "a module or function of the loop-end stream (stream -> logits)"),
                              ("loop_step", loop_step, "a function of one loop-end stream (h(t-1) -> h(t))"),
                              ("targets", targets, "a function of the forward's arguments (-> targets)")):
        if value is not None and not callable(value):
            raise ProbeError(f"{name}= is {what}, not {kind(value)}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise ProbeError(f"scheduler= is a learning-rate scheduler (it has step()), not {kind(scheduler)}")
    if predictor_path is not None and not (isinstance(predictor_path, (str, os.PathLike))
                                           and os.path.isfile(predictor_path)):
        raise ProbeError(f"predictor_path={predictor_path!r}: no such predictor file (fit-predictor writes one)")
    if optimizer is not None:
        learning_rate(optimizer)
    if callbacks is not None:
        if not isinstance(callbacks, (list, tuple)):
            raise ProbeError(f"callbacks= is a list of flt-diag training callbacks, not {kind(callbacks)}")
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, Callback):
                raise ProbeError(f"callbacks= item {i + 1} ({kind(cb)}) is not an flt-diag training callback "
                                 "(a subclass of flt_diag.instruments.callbacks.Callback)")
    if not (loop_boundary is None or isinstance(loop_boundary, torch.nn.Module)
            or isinstance(loop_boundary, str) and loop_boundary == "manual"):
        raise ProbeError(f"loop_boundary= is a module whose forward ends each loop, or 'manual'; not {loop_boundary!r}")
    if diagnostics is not None and not isinstance(diagnostics, DiagnosticsConfig):
        raise ProbeError(f"diagnostics= is a flt_diag.config.run_config.DiagnosticsConfig, not {kind(diagnostics)}")
    if steps is not None:
        _whole("steps", steps, 1, MAX_STEP)
    if seed is not None:
        _whole("seed", seed, 0, MAX_SEED)
    if vocab_size is not None:
        _whole("vocab_size", vocab_size, 1, MAX_VOCAB)
    if not (_real(grad_scale) and math.isfinite(grad_scale) and grad_scale > 0):
        raise ProbeError(f"watch(grad_scale={grad_scale!r}): a finite number above 0 is expected")
    if unigram_entropy is not None and not (_real(unigram_entropy) and math.isfinite(unigram_entropy)
                                            and unigram_entropy >= 0):
        raise ProbeError(f"watch(unigram_entropy={unigram_entropy!r}): a finite number of nats, 0 or more, is expected")
    if variant is not None and variant not in VARIANTS:
        raise ProbeError(f"watch(variant={variant!r}): one of flt-diag's variants ({', '.join(VARIANTS)}), or None "
                         "for a model that is none of them")
    _fraction("warmdown", warmdown, 1)
    _fraction("grad_clip", grad_clip, math.inf)
    if note is not None and not isinstance(note, str):
        raise ProbeError(f"watch(note=...): a text is expected, not {kind(note)}")
    release_stale_probes(model)  # (last: a refused watch() lets go of nothing)


def release_stale_probes(model: torch.nn.Module) -> None:
    """A probe still watching `model` (or a module inside it) when another watch() of it comes was not closed: its
    run ended by an exception it was not told of (a Trainer's train() that raised outside the model's forward).
    Two probes would record beside each other, the old one into memory for ever: the old one lets go (its hooks
    and its folder's lock; its rows stay, no summary), said in one line on stderr. Found by its forward pre-hook,
    a method wrapped by lets_go_on_refusal."""
    for module in model.modules():
        for hook in list(module._forward_pre_hooks.values()):
            probe: Any = getattr(hook, "__self__", None)
            if getattr(getattr(hook, "__func__", None), "probe_hook", False) and probe._handles:
                print(f"flt_diag.watch: {type(module).__name__} still carried the hooks of the probe writing "
                      f"{probe.folder}, never closed (its run raised?): let go of (its rows stay, no summary)",
                      file=sys.stderr, flush=True)
                error = ProbeError(f"a new watch() of {type(module).__name__} let go of this probe")
                probe.__exit__(type(error), error, None)


def _as_float(x) -> float:
    """A real number as a float; one too large for a float (10**400, a huge Fraction) is +-inf, as a float64 loss
    that overflows float32 is recorded."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def one_loss(value, where: str):
    """A loss as the step records it (a tensor of one value, kept on its device, or a float), or one
    ProbeError line: `where` names what gave it (step(loss=...), or the loss= function of watch())."""
    if torch.is_tensor(value):
        if value.is_nested or value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.is_meta:
            n = "a nested tensor" if value.is_nested else f"a tensor of {value.numel()} values (shape " \
                f"{tuple(value.shape)})" if value.numel() != 1 else f"a tensor of a {value.dtype} on {value.device} " \
                f"(shape {tuple(value.shape)})"
            raise ProbeError(f"{where} gave {n}; the step's loss is one real number: its mean over the batch and "
                             "tokens")
        value = value.to_dense() if value.layout != torch.strided else value  # (a sparse scalar: its one value)
        return (value.dequantize() if value.is_quantized else value).detach().reshape(())
    if _real(value):
        return _as_float(value)
    if hasattr(value, "__array__") and getattr(value, "size", None) == 1 and getattr(value, "dtype", None) is not None \
            and getattr(value.dtype, "kind", None) in ("f", "i", "u"):
        return float(value.reshape(()))
    raise ProbeError(f"{where} gave {kind(value)}; the step's loss is one real number (a tensor of one value, "
                     "or a float)")


def step_arguments(loss, step, optimizer, next_step: int, recorded: bool, forward_seen: bool):
    """(the step's number, its loss, the optimizer's lr) of a step() call, each checked before anything of the
    step is recorded, so that a refusal changes nothing: `next_step` is the default number, `recorded` whether
    a step was recorded before (the last one is next_step - 1), `forward_seen` whether a training forward
    came since (a second step() for one optimizer step would record it twice)."""
    last, step = next_step - 1 if recorded else None, next_step if step is None else step
    try:  # step(step=...): an integer from 0 to MAX_STEP, after the last step recorded
        s = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        s = None
    if s is None:
        raise ProbeError(f"step(step=...) is the optimizer step's number, an integer; not {kind(step)}")
    if not 0 <= s <= MAX_STEP:
        raise ProbeError(f"step(step={s}): a step number from 0 to {MAX_STEP:,} (2**53) is expected")
    if last is not None and s <= last:
        raise ProbeError(f"step(step={s}) comes after step {last} was recorded: each optimizer step is recorded "
                         "once, and its number only grows")
    if not forward_seen:
        raise ProbeError("step() came before any recorded training forward of the model: call it after each "
                         "optimizer step, with the model in training mode" if last is None else
                         f"step() came without a training forward of the model since step {last} was recorded: "
                         "call it once per optimizer step, after the step's forward (model in training mode)")
    return s, one_loss(loss, "step(loss=...)") if loss is not None else None, \
        learning_rate(optimizer) if optimizer is not None else None


def leave_no_trace(folder: Path, writer, wrote_config: bool) -> None:
    """A probe that stored no metrics part leaves its folder as it found it (a refusal at the first forward or
    the first step(), a close() before any step): its config.json and empty metrics/ go, so the corrected retry
    may use the same folder (the lock, and the folder if the probe made it, go with the lock)."""
    if writer is None or any(writer.dir.glob("part-*.parquet")):
        return
    with contextlib.suppress(OSError):
        if wrote_config:
            (Path(folder) / CONFIG).unlink(missing_ok=True)
        writer.dir.rmdir()


def lets_go_on_refusal(hook):
    """A hook of the probe's, run inside the model's forward: a refusal in it (ProbeError) lets go of the model
    and the folder (the probe's __exit__) before it is raised, so nothing stays behind, `with` or not, and
    inside a Trainer that tells its callbacks of no exception."""
    @functools.wraps(hook)
    def guarded(probe, *args):
        try:
            return hook(probe, *args)
        except ProbeError as e:
            probe.__exit__(type(e), e, None)
            raise
    guarded.probe_hook = True  # type: ignore[attr-defined]  # (release_stale_probes finds a probe by it)
    return guarded
