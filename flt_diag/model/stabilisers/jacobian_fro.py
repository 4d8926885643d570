"""The Jacobian penalty of deep equilibrium models (Bai et al., arXiv 2106.14342; `locuslab/deq`,
lib/jacobian.py), at the looped model's final state.

    loss = CE + gamma * |J_g(h)|_F^2 / n,   |J|_F^2 ~ (1/m) sum_i |v_i^T J|^2,  v_i ~ N(0, I),  m = 2 probes

g one loop at the detached final state h = h(K) (_penalty.py), n = the state's size (B x T x d), as the source
normalises its Hutchinson estimate (an unbiased estimate of the Frobenius norm: E[|v^T J|^2] = |J|_F^2).

flt-diag's choices: gamma = 0.1 (the source tunes it per task between 0.1 and a few; 0.1 keeps the term below a
tenth of the CE at initialisation on the tiny preset); the probes come from a generator seeded by (seed, step).
The recorded `loss` is the CE alone; the penalty is recorded as `stabiliser_penalty`. Zero strength: gamma = 0.
"""
from __future__ import annotations

from flt_diag.model.stabilisers import Stabiliser
from flt_diag.model.stabilisers._penalty import differentiable, final_loop_map, vjp

GAMMA, PROBES = 0.1, 2


def penalty(model, generator, probes: int = PROBES):
    """The Hutchinson estimate of |J|_F^2 / n at the last training forward's final state."""
    import torch
    g, h = final_loop_map(model)
    with differentiable(model), torch.enable_grad():
        y = g(h)
        total = torch.zeros((), device=h.device)
        for _ in range(probes):
            v = torch.randn(h.shape, generator=generator, dtype=h.dtype).to(h.device)
            total = total + vjp(y, h, v, create_graph=True).square().sum()
        return total / (probes * h.numel())


def objective(ce, pen, step: int, steps: int, strength: float = 1.0):
    """CE + strength * gamma * pen: --strength multiplies gamma (0: the base's CE alone)."""
    return ce + strength * GAMMA * pen


STABILISER = Stabiliser(
    name="jacobian-fro",
    description="loss + g |J|_F^2 / n of one loop at the final state, Hutchinson with 2 probes (on LT)",
    source="DEQ Jacobian regularisation, arXiv 2106.14342 (locuslab/deq, lib/jacobian.py)",
    composes=True,
    ours={"gamma": "0.1 (the source tunes 0.1 to a few per task; its LM script's 1.9: jacobian-fro-source)",
          "probes": "2 (lib/jacobian.py's default; the LM model passes 1), drawn from a generator seeded by (seed, step)",
          "frequency": "every step (the source's LM script: a step with probability 0.35)"},
    strength="gamma = 0.1 (ours; the source's LM value 1.9)",
    penalty=penalty,
    objective=objective,
)
