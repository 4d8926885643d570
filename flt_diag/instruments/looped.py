"""What the instruments read of a looped model: a small protocol (`LoopedModel`) that flt-diag's own model
(flt_diag.model.transformer.LoopedTransformer) implements, so that no instrument imports the model, and the loop
of one batch it gives (`LoopStep`). A model that does not implement it (any other, under flt_diag.watch) is
measured from its hooks and what the user gives (head=, loop_step=, targets=): instruments/dynamics_callback.py."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

Run = Callable[[Tensor, "Tensor | None", int], Tensor]


@runtime_checkable
class LoopedModel(Protocol):
    """The looped model as the instruments see it: its blocks (reused every loop, in order), the module that
    ends each loop (its output: the loop-end stream), its head (logits of a loop-end state), the loop step of a
    batch, the loop-end state of a stream, the targets among a forward's arguments, how many loops send no
    gradient, and `differentiable()`, entered around every record that differentiates twice (its ops must allow it)."""

    blocks: nn.ModuleList
    loop_end: nn.Module

    @property
    def detached_loops(self) -> int: ...  # loops 1..n of a forward send no gradient (truncated backpropagation)

    def loop_head(self, h: Tensor) -> Tensor: ...
    def loop_step(self, idx: Tensor) -> tuple[Tensor, Run, int]: ...  # (start, run, loops): LoopStep's
    def loop_state(self, stream: Tensor) -> Tensor: ...
    def loop_targets(self, *args, **kwargs) -> Tensor | None: ...
    def differentiable(self) -> AbstractContextManager: ...


@dataclass(frozen=True)
class LoopStep:
    """One batch's loop: `start`, the stream entering loop 1; `run(x, h_prev, t)`, loop t's pass (t from 0, h_prev
    None in loop 1) from the raw stream x to the raw stream at its end, the batch's own inputs held fixed;
    `state(x)`, the loop-end state h(t) of a raw stream; `loops`, K."""

    start: Tensor
    run: Run
    loops: int
    state: Callable[[Tensor], Tensor]

    @classmethod
    def of(cls, model: LoopedModel, idx: Tensor) -> "LoopStep":
        start, run, loops = model.loop_step(idx)
        return cls(start, run, loops, model.loop_state)

    def states(self) -> list[Tensor]:
        """h(1), ..., h(K) of the batch, as the forward computes them, no gradient."""
        with torch.no_grad():
            x, h, out = self.start, None, []
            for t in range(self.loops):
                x = self.run(x, h, t)
                h = self.state(x)
                out.append(h)
        return out

    def map(self, t: int) -> Callable[[Tensor], Tensor]:
        """The loop map h(t-1) -> h(t) of loop t (from 0) >= 1, taken on the normed state h (a variant that starts a
        loop from the raw stream - Parcae, Huginn - gets h there too)."""
        return lambda h: self.state(self.run(h, h, t))

    def maps(self) -> list[Callable[[Tensor], Tensor]]:
        """The loop map at h(t-1) of every loop t = 2..K."""
        return [self.map(t) for t in range(1, self.loops)]
