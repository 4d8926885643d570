"""Residual scaling by the unrolled depth (arXiv 2606.18524).

    x <- x + s * F(norm(x)),   s = lambda / (K sqrt(L))     (every attention and MLP branch of every block)

with K the loops and L the blocks: the update a loop adds shrinks with the depth it is repeated over, so the
stream's growth over K loops stays bounded at initialisation. flt-diag's choice: lambda = 1; K is the configured
loop count (also under a sampled loop count). `--strength S` multiplies lambda (s = S / (K sqrt(L)); S = 0 turns
every branch off, so it is no base variant: s = 1, the base bit for bit, is S = K sqrt(L)).
"""
from __future__ import annotations

import math

from flt_diag.model.stabilisers import Stabiliser

LAMBDA = 1.0


def branch_scale(loops: int, n_layer: int, lam: float = LAMBDA) -> float:
    return lam / (loops * math.sqrt(n_layer))


STABILISER = Stabiliser(
    name="residual-scale",
    description="every residual branch scaled by 1 / (K sqrt(L)) (on LT)",
    source="arXiv 2606.18524",
    composes=True,
    ours={"lambda": "1", "K": "the configured loop count, also under a sampled one"},
    strength="lambda = 1 (ours) of s = lambda / (K sqrt(L))",
    block=lambda cfg: {"scale": branch_scale(cfg.loops, cfg.depth, LAMBDA * cfg.strength)},
)
