"""What a record is handed by the user's code, checked at the record for kind, shape, dtype and range: the
targets (watch(targets=), probe.step(targets=)), the logits head= returns, the stream loop_step= returns. A value
that does not fit raises Unrecordable, one line saying what it is and what the record needs, and the run's record
guard (flt_diag.instruments.guard) skips the record: never an IndexError or AttributeError from inside the
forward, nor a cross-entropy on out-of-range targets (on a GPU a device-side assert that ends the process)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from flt_diag.instruments.guard import Unrecordable

IGNORE_INDEX = -100  # a target the exit loss leaves out (as F.cross_entropy)


def kind(x) -> str:
    """What a value is, in a few words (a tensor: its shape and dtype)."""
    return f"a tensor of shape {tuple(x.shape)} ({x.dtype})" if torch.is_tensor(x) else type(x).__name__


def checked_targets(targets, where: str) -> torch.Tensor | None:
    """The step's targets as the exit loss takes them - class indices, an integer tensor (-100 ignored), dense,
    detached - or None for none; anything else is Unrecordable (`where` names what gave it)."""
    if targets is None:
        return None
    if not torch.is_tensor(targets):
        raise Unrecordable(f"{where} gave {kind(targets)}; the exit loss needs a tensor of class indices, one per "
                           "position of the loop-end stream")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise Unrecordable(f"{where} gave {targets.dtype} targets; the exit loss needs class indices (an integer "
                           f"tensor, {IGNORE_INDEX} ignored), one per position of the loop-end stream")
    if targets.layout != torch.strided:
        targets = targets.to_dense()
    return targets.detach()


def target_span(targets: torch.Tensor) -> tuple[int, int] | None:
    """(lowest, highest) of the targets that are not ignored (one host transfer), None if all are."""
    kept = targets != IGNORE_INDEX
    if targets.numel() == 0 or not bool(kept.any()):
        return None
    lo, hi = torch.stack([torch.where(kept, targets, targets.max()).min(),
                          torch.where(kept, targets, targets.min()).max()]).tolist()
    return int(lo), int(hi)


def checked_head(head: Callable, positions: int, span: tuple[int, int] | None) -> Callable:
    """head, whose logits are checked before the exit loss takes them: a real tensor (..., classes), one row per
    position of the stream (`positions` of them), with a class for every target (`span`)."""
    def logits_of(h: torch.Tensor) -> torch.Tensor:
        logits = head(h)
        if not torch.is_tensor(logits):
            raise Unrecordable(f"head= gave {kind(logits)}; the exit loss needs logits, a tensor (..., classes) "
                               "with one row per position of the loop-end stream")
        if not logits.is_floating_point():
            raise Unrecordable(f"head= gave {logits.dtype} logits; the exit loss needs real (floating-point) ones")
        if logits.dim() < 2 or logits.shape[:-1].numel() != positions:
            raise Unrecordable(f"head= gave logits of shape {tuple(logits.shape)} for a loop-end stream of shape "
                               f"{tuple(h.shape)}: one row of class scores per position is needed")
        classes = logits.shape[-1]
        if span is not None and (span[0] < 0 or span[1] >= classes):
            raise Unrecordable(f"the targets run from {span[0]} to {span[1]}, outside the {classes} classes of "
                               f"head='s logits (0 to {classes - 1}; {IGNORE_INDEX} ignored)")
        return logits
    return logits_of


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
