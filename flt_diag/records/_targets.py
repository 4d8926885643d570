"""What the exit loss is handed by the user's code (a helper of records/, no record: its name starts with _), checked
at the record for kind, shape, dtype and range: the targets (the model's loop_targets, watch(targets=),
probe.step(targets=)) and the logits the head returns. A value that does not fit raises Unrecordable, one line saying
what it is and what the record needs, and the run's record guard (flt_diag.instruments.guard) skips the record: never
a cross-entropy on out-of-range targets (on a GPU a device-side assert that ends the process). Torch is imported
where a value is checked (records/ is torch-free until a record is taken); flt_diag.instruments.record_checks holds
the checks of the other values the user's code gives (loop_step=)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flt_diag.records import Unrecordable

IGNORE_INDEX = -100  # a target the exit loss leaves out (as F.cross_entropy)


def kind(x) -> str:
    """What a value is, in a few words (a tensor: its shape and dtype)."""
    import torch
    return f"a tensor of shape {tuple(x.shape)} ({x.dtype})" if torch.is_tensor(x) else type(x).__name__


def checked_targets(targets, where: str) -> Any:
    """The step's targets as the exit loss takes them - class indices, an integer tensor (-100 ignored), dense,
    detached - or None for none; anything else is Unrecordable (`where` names what gave it)."""
    import torch
    if isinstance(targets, Exception):  # (what the user's targets= raised: said in the record that takes them)
        raise Unrecordable(f"{where} failed: {type(targets).__name__}: {str(targets).strip()[:200]}") from targets
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


def target_span(targets: Any) -> tuple[int, int] | None:
    """(lowest, highest) of the targets that are not ignored (one host transfer), None if all are."""
    import torch
    kept = targets != IGNORE_INDEX
    if targets.numel() == 0 or not bool(kept.any()):
        return None
    lo, hi = torch.stack([torch.where(kept, targets, targets.max()).min(),
                          torch.where(kept, targets, targets.min()).max()]).tolist()
    return int(lo), int(hi)


def checked_head(head: Callable, positions: int, span: tuple[int, int] | None) -> Callable:
    """head, whose logits are checked before the exit loss takes them: a real tensor (..., classes), one row per
    position of the stream (`positions` of them), with a class for every target (`span`)."""
    import torch

    def logits_of(h: Any) -> Any:
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
