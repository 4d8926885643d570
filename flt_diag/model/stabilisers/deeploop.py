"""DeepLoop: DeepNorm's post-norm residual at the unrolled depth (DeepLoop, arXiv 2607.13491; DeepNorm, Wang et
al., arXiv 2203.00555).

    x <- norm(alpha x + F(norm(x))),   alpha = (2N)^(1/2);   init: v, o, up, down weights times beta = (8N)^(-1/2)

N = K L, the unrolled depth. These are DeepLoop's constants as issue 56 states them (the square root); DeepNorm's own
decoder-only constants are the fourth root, alpha = (2N)^(1/4) and beta = (8N)^(-1/4) (DeepNet, Table 1): DeepLoop
damps each loop's update more than DeepNorm would at the same N (at K = 12, L = 2: alpha 6.9 against 2.6).
flt-diag's choices: the sublayer
keeps its pre-norm input (norm(x) of a post-normed x changes it by rounding only), so that alpha = 1 and beta = 1
is the block's post-norm form exactly (Huginn's sandwich norm: huginn.py; `--strength 0`, since the strength
multiplies the exponent e = 1/2 of both); o and down start at zero in every
flt-diag variant (the reference's initialisation), so beta leaves them at zero: it scales v and up.
"""
from __future__ import annotations

import math

from flt_diag.model.stabilisers import Stabiliser


EXPONENT = 0.5  # DeepLoop's e of alpha = (2N)^e, beta = (8N)^-e; `--strength S` makes it S / 2


def alpha(loops: int, n_layer: int, strength: float = 1.0) -> float:
    return (2 * loops * n_layer) ** (EXPONENT * strength)


def beta(loops: int, n_layer: int, strength: float = 1.0) -> float:
    return (8 * loops * n_layer) ** -(EXPONENT * strength)


def scale_init(blocks, b: float) -> None:
    """Multiply the value, output and MLP weights of every block by b (DeepNorm's beta)."""
    import torch
    with torch.no_grad():
        for block in blocks:
            for lin in (block.attn.v, block.attn.o, block.mlp.up, block.mlp.down):
                lin.weight.mul_(b)


STABILISER = Stabiliser(
    name="deeploop",
    description="post-norm DeepNorm residual norm(a x + F(x)), a = (2KL)^(1/2), init beta = (8KL)^(-1/2) (on LT)",
    source="DeepLoop, arXiv 2607.13491 (DeepNorm: arXiv 2203.00555)",
    ours={"pre-norm": "the sublayer keeps its pre-norm input", "beta": "scales v and up (o, down start at zero)"},
    strength="the exponent e = 1/2 (the source's) of alpha = (2KL)^e and beta = (8KL)^-e",
    block=lambda cfg: {"post_norm": True, "alpha": alpha(cfg.loops, cfg.depth, cfg.strength)},
    init=lambda model: scale_init(model.blocks, beta(model.cfg.loops, model.cfg.depth, model.cfg.strength)),
)
