"""A learned loop-index embedding (parameter-golf PR 319; TMLT, arXiv 2410.01405).

    x_start(t) <- x_start(t) + e_t,    e_t in R^d learned, initialised to 0, t = 1 ... K_max

added to the stream at every loop's start (loop 1 included, after the variant has set the start), so the shared
blocks can tell the loops apart. K_max = K, or 2K for a variant with a sampled loop count (its largest draw).
Zero strength is e = 0 (the initialisation: the base variant bit for bit at step 0).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class LoopEmbedding(nn.Module):
    def __init__(self, max_loops: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(max_loops, d))

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        if not 0 <= t < self.weight.shape[0]:
            raise ValueError(f"loop {t + 1} has no loop embedding (this model has {self.weight.shape[0]})")
        return x + self.weight[t]
