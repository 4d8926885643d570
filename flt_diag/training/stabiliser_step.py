"""What a stabiliser variant changes in a training step (flt_diag.model.stabilisers; DESIGN.md §2b): the step's
loop count (Huginn's and STARS's sampled counts; every other variant runs K) and its objective (STARS's and the
Jacobian penalty's loss terms; the recorded `loss` stays the cross-entropy, what the verdict judges). Both draw
from generators seeded by (seed, step), so a resumed run draws exactly what an uninterrupted one does.
"""
from __future__ import annotations

import torch

from flt_diag.model.stabilisers import huginn, jacobian_fro, stars
from flt_diag.model.transformer import LoopedTransformer

SAMPLERS = {"poisson-lognormal": huginn.sample_loops, "lognormal": stars.sample_loops}
LOSS_TERMS = {"stars": stars, "jacobian-fro": jacobian_fro}
_STREAM = {"loops": 0x4C4F4F50, "penalty": 0x50454E41}  # separate streams: a loop draw never shifts a probe


def generator(seed: int, step: int, micro: int, stream: str) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, step, micro, _STREAM[stream])) & (2 ** 63 - 1))


def step_loops(model: LoopedTransformer, seed: int, step: int) -> int | None:
    """The loop count of training step `step` (one draw a step, every micro-batch alike); None: the model's K."""
    sampler = SAMPLERS.get(model.rule.loop_count)
    return None if sampler is None else sampler(model.cfg.loops, generator(seed, step, 0, "loops"))


def objective(model: LoopedTransformer, ce: torch.Tensor, seed: int, step: int, micro: int,
              steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what to backpropagate, the penalty or None): the variant's loss term at the forward just run."""
    term = LOSS_TERMS.get(model.rule.loss_term)
    if term is None:
        return ce, None
    pen = term.penalty(model, generator(seed, step, micro, "penalty"))
    return term.objective(ce, pen, step, steps), pen.detach()
