"""Parcae as its source trains it: the injection of parcae.py with the source's per-sequence sampled depth and
truncated backpropagation (Parcae, arXiv 2604.12946; `sandyresearch/parcae`, parcae_lm/models/parcae/parcae.py,
`_sample_batch_depths` lines ~478-535 and `iterate_forward` lines ~245-356; the small configuration
parcae_lm/configs/parcae/parcae-small-140m.py: sampling_scheme "poisson-truncated-full", recurrent_iteration_method
"per-sequence", mean_recurrence 8, mean_backprop_depth 4).

Per training forward, for every sequence i of the batch (the source's "poisson-truncated-full"):

    r_i = max(1, Poisson(K)),   k_i = min(r_i, s),   n_i = r_i - k_i,   s = ceil(K / 2)

then max(n) loops under no_grad, in which sequence i's state moves only while the loop's index is below n_i
(x <- where(step < n_i, loop(x), x)), then max(k) loops with the gradient, sequence i moving while the index is
below k_i (flt_diag.model.per_sequence). Sequence i thus runs r_i loops and its gradient flows through its last
k_i only. Its first loop is the base's loop 1 (a plain pass from norm(E)), every later one starts from the
injection x_start = Abar * x(t-1) + dt * B norm(E) (parcae.py), whatever global loop it falls in (a sequence with
n_i = 0 starts at the first loop with the gradient). Evaluation runs K loops, no sampling (the source evaluates at
mean_recurrence with no gradient). The step's `loops_run` is the batch mean of r_i (the mean over its micro-batches).

flt-diag's choices (`ours`): mean_recurrence = K and s = ceil(K / 2) (the source's 4 of 8; `--grad-loops` sets s,
0 keeps the default); the draws come from flt-diag's generator seeded by (seed, step, micro-batch), the same on
every rank (the source seeds 514229 + step, times rank + 1 unless lockstep_n); loop 1 starts from norm(E), as
flt-diag's LT does (the source starts from a random state, state_init "like-init", and injects in every loop).
Everything else is parcae.py's: its initialisation, its optimizer, its --strength (-ln Abar at init).
"""
from __future__ import annotations

import math

from flt_diag.model.stabilisers import Stabiliser
from flt_diag.model.stabilisers.parcae import STABILISER as PARCAE


def backprop_loops(K: int) -> int:
    """s = ceil(K / 2): the source's mean_backprop_depth 4 of mean_recurrence 8."""
    return math.ceil(K / 2)


def sample_depths(K: int, s: int, batch: int, generator):
    """(n, k), each (batch,) long: r = max(1, Poisson(K)), k = min(r, s), n = r - k (s = 0: k = r, every loop
    with the gradient)."""
    import torch
    r = torch.poisson(torch.full((batch,), float(K), dtype=torch.float64), generator=generator).clamp_min(1)
    k = r.clamp(max=s) if s > 0 else r
    return (r - k).long(), k.long()


STABILISER = Stabiliser(
    name="parcae-source",
    description="parcae's injection, trained as its source: r ~ max(1, Poisson(K)) loops per sequence, gradient "
                "through the last min(r, ceil(K/2))",
    source="Parcae, arXiv 2604.12946 (sandyresearch/parcae, parcae_lm/models/parcae/parcae.py; "
           "configs/parcae/parcae-small-140m.py)",
    ours={**PARCAE.ours,
          "depth": "mean_recurrence = K, s = ceil(K/2) loops with gradient (the source's 4 of 8; --grad-loops sets s)",
          "draws": "per sequence from a generator seeded by (seed, step, micro-batch), the same on every rank (the "
                   "source: 514229 + step)",
          "loop 1": "a sequence's first loop starts from norm(E) (the source: a random state, injected every loop)"},
    strength=PARCAE.strength,
    part=PARCAE.part,
    parameters=PARCAE.parameters,
    start=PARCAE.start,
    metrics=PARCAE.metrics,
    grad_loops=backprop_loops,
    depths=sample_depths,
)
