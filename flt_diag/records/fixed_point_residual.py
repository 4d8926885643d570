"""The fixed-point residual (one of the loop dynamics, switched by `loop_dynamics`; DESIGN.md §3, "Loop dynamics"):
at each recorded loop end t >= 2, the mean over tokens of ||h(t) - h(t-1)|| / ||h(t-1)||, h the loop-end state (norms
over the last dim, in fp32). At each loop end one subtraction and two norms of the stream (`keep`); the ratio and
the mean over tokens are taken once for all the forward's loops at its end (`finish`: a few operations a forward,
not a few a loop). Its state keeps the previous loop end's h and norms and the forward's (loop, ||h - h_prev||,
||h_prev||) per token; loop 1 starts a forward and has none. Where the stream changes shape between two loops there
is no residual there (said once, by the record guard); the loops after the change are measured against the new
shape, their means taken one at a time."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flt_diag.records import Record, RecordOptions, Unrecordable
from flt_diag.records._streams import per_token_norms

RESIDUAL = "fixed_point_residual"


@dataclass
class Loops:
    """The recorded forward's loop ends so far: the last one's state h and ||h|| per token, and per loop t >= 2
    (t, ||h(t) - h(t-1)||, ||h(t-1)||) per token."""
    h: Any = None
    norms: Any = None
    steps: list[tuple[int, Any, Any]] = field(default_factory=list)


def keep(state: Loops, loop: int, h) -> None:
    """Loop `loop`'s norms against the previous loop end (none at loop 1, which starts a forward); h kept."""
    import torch  # (records/ is torch-free until a record is taken)
    if loop == 1:
        state.h = state.norms = None
        state.steps = []
    prev, prev_norms = state.h, state.norms
    state.h = state.norms = None  # (a norm that fails leaves no previous loop end for the next loop)
    hf = h.float()
    norms = per_token_norms(h) if h.dtype == torch.float32 else torch.linalg.vector_norm(hf, dim=-1)  # (the hooks')
    if prev is not None and prev.shape == h.shape and prev_norms is not None:
        state.steps.append((loop, torch.linalg.vector_norm(hf - prev.float(), dim=-1), prev_norms))
    state.h, state.norms = h, norms
    if prev is not None and prev.shape != h.shape:
        raise Unrecordable(f"the loop-end stream changed shape ({tuple(prev.shape)} -> {tuple(h.shape)}): no "
                           f"{RESIDUAL} there")


def ratios(steps: list[tuple[int, Any, Any]]):
    """The residual of each loop of `steps`, as one tensor: the ratios of one shape and their means in one
    operation each."""
    import torch
    if len({num.shape for _, num, _ in steps}) == 1:
        num, den = torch.stack([n for _, n, _ in steps]), torch.stack([d for _, _, d in steps])
        return (num / den.clamp_min(1e-30)).reshape(len(steps), -1).mean(1)
    return torch.stack([(n / d.clamp_min(1e-30)).mean() for _, n, d in steps])  # (the batch or sequence changed)


def compute(loop: int, h, state: Loops) -> dict:
    keep(state, loop, h)
    return {}


def finish(loops: int, state: Loops) -> dict:
    steps, state.steps = state.steps, []
    return {RESIDUAL: dict(zip([t for t, _, _ in steps], ratios(steps).unbind()))} if steps else {}


RECORD = Record(options=RecordOptions, switched_by="loop_dynamics", moment="loop_end", compute=compute,
                finish=finish, state=Loops,
                metrics={RESIDUAL: "mean over tokens of ||h(t) - h(t-1)|| / ||h(t-1)||, h(t) the loop-end state, "
                                   "loop t >= 2"})
