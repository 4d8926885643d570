"""The exit loss (of the loop dynamics, switched by `loop_dynamics`; DESIGN.md §3, "Loop dynamics"): at each recorded
loop end t of the steps `exit_loss_every` names, the cross-entropy of head(h(t)) against the step's targets (class
indices, -100 ignored), no gradient: what the model would lose if it stopped at loop t. One head matmul of the stream
a loop.

The head and the targets come from the record's context (RecordContext): on flt-diag's own model its loop_head and
loop_targets of the forward's arguments; under flt_diag.watch head= and targets= of the forward's arguments, or, with
head= and no targets=, the targets given to probe.step(targets=): the loop ends are kept and scored at the step
(`finish_at="step"`). No head: no exit loss. Both are checked at the record (flt_diag.records._targets): targets of
the wrong kind, logits of the wrong shape or too few classes for the targets are said once (the record guard) and
skipped, as are targets that do not fit the stream (one per position) and a stream that is not (batch, seq, dim).
Targets of a forward that are None (a batch without labels) are said once: no exit loss at such steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flt_diag.records import Record, RecordContext, RecordOptions, Unrecordable
from flt_diag.records._targets import checked_head, checked_targets, target_span

EXIT_LOSS = "exit_loss"
UNSET = object()  # (a forward's targets' span not taken yet)


@dataclass
class Kept:
    """The span of the forward's targets (taken once: one host transfer), and the loop ends (loop, h) kept for the
    step's targets (targets that come only at the step)."""
    span: Any = UNSET
    loops: list[tuple[int, Any]] = field(default_factory=list)


def exit_loss(h: Any, head: Any, targets: Any) -> Any:
    """Cross-entropy of head(h) against targets (-100 ignored), in fp32, no gradient."""
    import torch
    import torch.nn.functional as F
    with torch.no_grad():
        logits = head(h.detach())
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def scored(h: Any, head: Any, targets: Any, state: Kept) -> Any:
    """The exit loss of one loop end, its targets and the head's logits checked (flt_diag.records._targets)."""
    if tuple(targets.shape) != tuple(h.shape[:-1]):
        raise Unrecordable(f"targets of shape {tuple(targets.shape)} do not fit the loop-end stream "
                           f"{tuple(h.shape)} (one target per position)")
    if state.span is UNSET:
        state.span = target_span(targets)
    return exit_loss(h, checked_head(head, targets.numel(), state.span), targets.to(h.device))


def compute(loop: int, h, ctx: RecordContext[Kept]) -> dict:
    state = ctx.state
    assert state is not None  # (a state it keeps)
    if loop == 1:
        state.span = UNSET
    if ctx.head is None:
        return {}
    if h.dim() != 3:  # (the streams' similarity says the same: one line for both, the diagnostics')
        raise Unrecordable(f"a loop-end stream of shape {tuple(h.shape)} is not (batch, seq, dim)")
    if ctx.targets_at_step:
        state.loops.append((loop, h))
        return {}
    targets = checked_targets(ctx.targets, "targets=")
    if targets is None:
        raise Unrecordable("head= is given but the exit loss's targets (targets=, or the batch's labels) were None "
                           "for a recorded step's forward: no exit_loss at such steps (return one class index per "
                           "position, or leave head= out)")
    return {EXIT_LOSS: scored(h, ctx.head, targets, state)}


def finish(ctx: RecordContext[Kept]) -> dict:
    """At the step: the loop ends kept, scored against the step's targets (probe.step(targets=))."""
    state = ctx.state
    assert state is not None  # (a state it keeps)
    kept, state.loops, state.span = state.loops, [], UNSET
    if not kept:
        return {}
    targets = checked_targets(ctx.targets, "step(targets=)")
    if targets is None:
        raise Unrecordable("head= is given but no targets: give probe.step(targets=) or watch(targets=) for "
                           "exit_loss")
    out: dict[int, Any] = {}
    for loop, h in kept:
        try:
            out[loop] = scored(h, ctx.head, targets, state)
        except Exception as e:  # (that loop end alone: named by the guard)
            out[loop] = e
    return {EXIT_LOSS: out}


RECORD = Record(options=RecordOptions, switched_by="loop_dynamics", every="exit_loss_every", moment="loop_end",
                compute=compute, finish=finish, finish_at="step", state=Kept, context=True,
                metrics={EXIT_LOSS: "cross-entropy of the head applied to h(t) against the step's targets, loop t, "
                                    "no gradient"})
