"""The Jacobian penalty as DEQ's language model trains with it (Bai et al., arXiv 2106.14342; `locuslab/deq`,
DEQ-Sequence/wt103_deq_transformer_reg.sh, train_transformer.py, models/deq_transformer.py, lib/jacobian.py).

    loss = CE + gamma(step) * |v^T J_g(h)|^2 / n   on a step with probability 0.35,   CE on the others

one Gaussian probe v ~ N(0, I) (deq_transformer.py line ~370 calls jac_loss_estimate(new_z1s, z1s, vecs=1); lib/
jacobian.py lines 7-27 sum |v^T J|^2 over the probes and divide by their number and by n = prod(z0.shape), here
B x T x d), an unbiased estimate of |J|_F^2 / n. g is one loop at the detached final state (_penalty.py; the
penalty is jacobian_fro.py's with one probe). The step draws whether it takes the penalty once, for every
micro-batch alike (train_transformer.py line ~452: `np.random.uniform(0, 1) < args.jac_loss_freq`, 0.35 in the
script's line 37). gamma follows the script's schedule over its 300,000 steps (max_step), mapped onto flt-diag's
`steps` in proportion (step s of S stands for the source's step 300,000 s / S):

    no penalty before the source's step 32,000 (pretrain_steps: its unrolled pretraining, where jac_loss is 0,
    deq_transformer.py lines ~341-351), then gamma = 1.9 + 0.1 * floor(source step / 35,000)

(jac_loss_weight 1.9, raised by 0.1 every jac_incremental = 35,000 steps past the pretraining, train_transformer.py
lines ~565-568: 1.9 to 2.7 by the end). The recorded `loss` is the CE alone; the penalty is `stabiliser_penalty`,
recorded on the steps that take it. Zero strength: gamma = 0.

flt-diag's choices (`ours`): the proportional mapping of the source's step counts; the Bernoulli draw from a
generator seeded by (seed, step) (the source: numpy's global generator); the probe from one seeded by (seed, step,
micro-batch). `jacobian-fro` (round one) keeps its own form: gamma = 0.1 on every step, two probes.
"""
from __future__ import annotations

from flt_diag.model.stabilisers import Stabiliser
from flt_diag.model.stabilisers.jacobian_fro import penalty as hutchinson

GAMMA, STEP_GAMMA, FREQ, PROBES = 1.9, 0.1, 0.35, 1  # jac_loss_weight, its increment, jac_loss_freq, vecs
SOURCE_STEPS, PRETRAIN, INCREMENT = 300_000, 32_000, 35_000  # max_step, pretrain_steps, jac_incremental


def penalised(step: int, steps: int) -> bool:
    """Whether `step` (from 0) of `steps` is past the source's pretraining (its step >= 32,000 of 300,000)."""
    return step * SOURCE_STEPS >= PRETRAIN * steps


def gamma(step: int, steps: int) -> float:
    """1.9 + 0.1 per 35,000 of the source's steps (its step 300,000 step / steps)."""
    return GAMMA + STEP_GAMMA * ((step * SOURCE_STEPS) // (INCREMENT * steps))


def penalty_on(step: int, steps: int, generator) -> bool:
    """The step takes the penalty: past the pretraining, and u < 0.35 for one u ~ U(0, 1) drawn every step."""
    import torch
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    return penalised(step, steps) and u < FREQ


def penalty(model, generator):
    """|v^T J|^2 / n for one v ~ N(0, I) at the last training forward's final state."""
    return hutchinson(model, generator, probes=PROBES)


def objective(ce, pen, step: int, steps: int, strength: float = 1.0):
    """CE + strength * gamma(step) * pen (0: the base's CE alone)."""
    return ce + strength * gamma(step, steps) * pen


STABILISER = Stabiliser(
    name="jacobian-fro-source",
    description="DEQ's LM recipe: loss + g |v^T J|^2 / n, one probe, on a step with probability 0.35, g = 1.9 "
                "rising by 0.1 per 35k of 300k steps after the first 32k (on LT)",
    source="DEQ Jacobian regularisation, arXiv 2106.14342 (locuslab/deq, DEQ-Sequence/wt103_deq_transformer_reg.sh, "
           "lib/jacobian.py)",
    composes=True,
    ours={"schedule": "the source's 300,000 steps mapped onto --steps in proportion (no penalty in the first 32/300, "
                      "+0.1 per 35/300)",
          "draws": "the step's Bernoulli from a generator seeded by (seed, step), the probe by (seed, step, "
                   "micro-batch) (the source: numpy's and torch's global generators)"},
    strength="gamma = 1.9 (the source's jac_loss_weight, and its +0.1 increments): gamma(step) x S",
    penalty=penalty,
    objective=objective,
    penalty_on=penalty_on,
)
