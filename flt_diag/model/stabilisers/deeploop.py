"""DeepLoop: DeepNorm's post-norm residual at the unrolled depth (DeepLoop, arXiv 2607.13491; DeepNorm, Wang et
al., arXiv 2203.00555).

    x <- norm(alpha x + F(norm(x))),   alpha = (2N)^(1/2);   init: v, o, up, down weights times beta = (8N)^(-1/2)

N = K L, the unrolled depth. These are DeepLoop's constants as issue 56 states them (the square root); DeepNorm's own
decoder-only constants are the fourth root, alpha = (2N)^(1/4) and beta = (8N)^(-1/4) (DeepNet, Table 1): DeepLoop
damps each loop's update more than DeepNorm would at the same N (at K = 12, L = 2: alpha 6.9 against 2.6).
flt-diag's choices: the sublayer
keeps its pre-norm input (norm(x) of a post-normed x changes it by rounding only), so that alpha = 1 and beta = 1
is the block's post-norm form exactly (Huginn's sandwich norm: huginn.py); o and down start at zero in every
flt-diag variant (the reference's initialisation), so beta leaves them at zero: it scales v and up.
"""
from __future__ import annotations

import math

import torch


def alpha(loops: int, n_layer: int) -> float:
    return math.sqrt(2 * loops * n_layer)


def beta(loops: int, n_layer: int) -> float:
    return (8 * loops * n_layer) ** -0.5


@torch.no_grad()
def scale_init(blocks, b: float) -> None:
    """Multiply the value, output and MLP weights of every block by b (DeepNorm's beta)."""
    for block in blocks:
        for lin in (block.attn.v, block.attn.o, block.mlp.up, block.mlp.down):
            lin.weight.mul_(b)
