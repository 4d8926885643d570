"""STARS as its source trains it (STARS, arXiv 2605.26733; `njuyxw/STARS`, train_addition/train.py).

    loss = (1 - lambda) CE + lambda |v^T J_g(h)|^2,   v = v0 / |v0|,  v0 ~ N(0, I),   g one loop at h = h(K)

one random unit probe and no power step (the source's `spectral_iters = 1` loop takes one vector-Jacobian product
from the random v and returns |v^T J|^2 of that product, train.py lines ~548-571: the normalised vector it then
forms is never used), so |v^T J|^2 estimates |J|_F^2 / n (E[v v^T] = I / n, n = B x T x d). v is one unit vector
over the micro-batch's whole state, as the source's torch.norm(v) over the batch. lambda = reg_weight = 0.1,
switched on abruptly once the step is past 20 % of the steps, zero before (train.py line ~793: `step >
config.warmup_steps`, 2,000 of total_steps 10,000). The loop count per training step (sample_random_loops, lines
~455-467; config lines ~47-50):

    r = round(LogNormal(mu, sigma)),   sigma = 0.7,   mu = 2 + ln(K / 4),   clipped to [1, 25 K]

The source draws LogNormal(2, 0.7) clipped to [1, 100] and evaluates at l_loops = 4 (train.py line ~42; its mean
e^(2 + 0.245) = 9.4 loops, median e^2 = 7.4, mode e^(2 - 0.49) = 4.5): flt-diag evaluates at K, so the
distribution is the source's rescaled by K / 4 (K = 4 is the source's exactly), a mean of 2.36 K loops per step.
Validation runs K loops. The recorded `loss` is the CE alone; the penalty is `stabiliser_penalty`.

flt-diag's choices (`ours`): that rescaling; the switch-on at 20 % of flt-diag's steps (the source's 2,000 is also
its lr warm-up's end); v0 from a generator seeded by (seed, step, micro-batch); the map g(h) = norm(loop(h)) at
the detached normed state (the source's at its raw state, _penalty.py). Zero strength: lambda = 0.
`stars` (round one) keeps its own form: one power step, a ramp over 10 %, a mean-K depth with sigma 0.5.
"""
from __future__ import annotations

import math

from flt_diag.model.stabilisers import Stabiliser
from flt_diag.model.stabilisers._penalty import differentiable, final_loop_map, vjp

WEIGHT, SWITCH_FRAC = 0.1, 0.2  # reg_weight; warmup_steps / total_steps = 2000 / 10000
MU, SIGMA, EVAL_LOOPS, MAX_LOOPS = 2.0, 0.7, 4, 100  # random_loop_mu, _sigma, l_loops, random_loop_max


def sample_loops(K: int, generator) -> int:
    """r = round(exp(N(MU + ln(K / 4), SIGMA))), clipped to [1, 25 K] (round half to even, as numpy's np.round)."""
    import torch
    z = torch.randn((), generator=generator, dtype=torch.float64).item()
    r = round(math.exp(MU + math.log(K / EVAL_LOOPS) + SIGMA * z))
    return min(max(r, 1), MAX_LOOPS * K // EVAL_LOOPS)


def weight(step: int, steps: int) -> float:
    """lambda at `step` (from 0) of `steps`: 0 up to 20 % of the steps, WEIGHT after (the source's step > 2000)."""
    return WEIGHT if step > SWITCH_FRAC * steps else 0.0


def penalty(model, generator):
    """|v^T J|^2 for one random unit v, at the last training forward's final state (a graph to the loop's
    weights)."""
    import torch
    g, h = final_loop_map(model)
    with differentiable(model), torch.enable_grad():
        y = g(h)
        v = torch.randn(h.shape, generator=generator, dtype=h.dtype).to(h.device)
        v = v / torch.linalg.vector_norm(v)
        return vjp(y, h, v, create_graph=True).square().sum()


def objective(ce, pen, step: int, steps: int, strength: float = 1.0):
    """(1 - lam) CE + lam pen, --strength multiplying lam (0: the base's CE alone)."""
    lam = strength * weight(step, steps)
    return (1 - lam) * ce + lam * pen


STABILISER = Stabiliser(
    name="stars-source",
    description="STARS as its source: loss (1-l) CE + l |v^T J|^2, one random unit v, l = 0.1 after 20 % of the "
                "steps; r ~ round(LogNormal(2 + ln(K/4), 0.7)) loops (on LT)",
    source="STARS, arXiv 2605.26733 (njuyxw/STARS, train_addition/train.py)",
    composes=True,
    ours={"depth": "the source's LogNormal(2, 0.7) in [1, 100] at eval depth 4, rescaled by K/4: mu = 2 + ln(K/4), "
                   "clip [1, 25K] (mean 2.36 K)",
          "switch-on": "lambda = 0.1 once past 20 % of flt-diag's steps (the source's 2,000 of 10,000, its lr "
                       "warm-up's end)",
          "v": "drawn from a generator seeded by (seed, step, micro-batch), one unit vector over the micro-batch",
          "g": "one loop at the detached normed final state norm(x(K)) (the source: its raw state)"},
    strength="lambda = 0.1 (the source's), (1 - lambda) CE + lambda pen",
    strength_max=10.0,  # lambda = 0.1 S <= 1: beyond, (1 - lambda) would weigh the CE negatively
    penalty=penalty,
    objective=objective,
    loop_count=sample_loops,
)
