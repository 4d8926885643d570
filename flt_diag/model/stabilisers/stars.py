"""STARS's loss term and loop count (STARS, arXiv 2605.26733; `njuyxw/STARS`).

    loss = (1 - lambda) CE + lambda |v^T J_g(h)|^2,    g one loop at the detached final state h = h(K)

with v a random unit vector refined by one power step, v = J J^T v0 / |J J^T v0| (so |v^T J|^2 estimates the top
squared singular value of J: the penalty pushes the loop map towards a contraction), lambda = 0.1 after warm-up,
and a log-normal loop count per training step, r = round(exp(N(ln K - sigma^2 / 2, sigma))) clipped to [1, 2K].

flt-diag's choices, where the source leaves a detail open: the warm-up is a linear ramp of lambda from 0 over the
first 10 % of the steps; sigma = 0.5 (Huginn's); v0 is drawn from a generator seeded by (seed, step), so a
resumed run draws what an uninterrupted one does; v is one unit vector over the whole micro-batch's state
(B x T x d). The recorded `loss` is the CE alone (what the verdict judges); the penalty is recorded as
`stabiliser_penalty`. Validation runs K loops. Zero strength: lambda = 0 is the base variant's loss.
"""
from __future__ import annotations

import math

from flt_diag.model.stabilisers import Stabiliser
from flt_diag.model.stabilisers._penalty import differentiable, final_loop_map, vjp

WEIGHT, WARMUP_FRAC, SIGMA = 0.1, 0.1, 0.5


def sample_loops(K: int, generator) -> int:
    """r = round(exp(N(ln K - sigma^2/2, sigma))), clipped to [1, 2K] (E[exp(...)] = K)."""
    import torch
    z = torch.randn((), generator=generator, dtype=torch.float64).item()
    return min(max(round(math.exp(math.log(K) - SIGMA ** 2 / 2 + SIGMA * z)), 1), 2 * K)


def weight(step: int, steps: int) -> float:
    """lambda at `step` of `steps`: a linear ramp from 0 to WEIGHT over the first WARMUP_FRAC of the steps."""
    ramp = max(1.0, WARMUP_FRAC * steps)
    return WEIGHT * min(1.0, step / ramp)


def penalty(model, generator):
    """|v^T J|^2 at the last training forward's final state (a graph to the loop's weights)."""
    import torch
    g, h = final_loop_map(model)
    with differentiable(model), torch.enable_grad():
        y = g(h)
        v0 = torch.randn(h.shape, generator=generator, dtype=h.dtype).to(h.device)
        v0 = v0 / torch.linalg.vector_norm(v0)
        dummy = torch.zeros_like(y, requires_grad=True)
        jt = vjp(y, h, dummy, create_graph=True)  # J^T dummy, linear in dummy
        u = vjp(y, h, v0, create_graph=False)  # J^T v0
        ju = torch.autograd.grad(jt, dummy, u, retain_graph=True)[0]  # J u = J J^T v0
        v = (ju / torch.linalg.vector_norm(ju).clamp_min(1e-30)).detach()
        return vjp(y, h, v, create_graph=True).square().sum()


def objective(ce, pen, step: int, steps: int, strength: float = 1.0):
    """(1 - lam) CE + lam pen, --strength multiplying lam (0: the base's CE alone)."""
    lam = strength * weight(step, steps)
    return (1 - lam) * ce + lam * pen


STABILISER = Stabiliser(
    name="stars",
    description="loss (1-l) CE + l |v^T J|^2 of one loop at the detached final state, log-normal loop count (on LT)",
    source="STARS, arXiv 2605.26733 (njuyxw/STARS)",
    composes=True,
    ours={"warm-up": "lambda ramps linearly from 0 over the first 10 % of the steps (the source: 0, then 0.1 past "
                     "20 %)", "sigma": "0.5 (Huginn's; the source's 0.7)",
          "power step": "one, v = J J^T v0 / |J J^T v0| (issue 56's request; the source takes none: stars-source)",
          "depth": "mean K, clipped to [1, 2K] (the source: LogNormal(2, 0.7) in [1, 100] at eval depth 4)",
          "v0": "drawn from a generator seeded by (seed, step)", "v": "one unit vector over the micro-batch's state"},
    penalty=penalty,
    strength="lambda = 0.1 (the source's), (1 - lambda) CE + lambda pen",
    strength_max=10.0,  # lambda = 0.1 S <= 1: beyond, (1 - lambda) would weigh the CE negatively
    objective=objective,
    loop_count=sample_loops,
)
