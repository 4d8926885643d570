"""A learned loop-index embedding (parameter-golf PR 319; TMLT, arXiv 2410.01405).

    x_start(t) <- x_start(t) + e_t,    e_t in R^d learned, initialised to 0, t = 1 ... K_max

added to the stream at every loop's start (loop 1 included, after the variant has set the start), so the shared
blocks can tell the loops apart. K_max = K (the variant's loop count is fixed).
A loop beyond the table (an evaluation at more loops than trained, `flt-diag eval-loops`; the loss terms' extra
loop at h(K)) reuses the last row, e_{K_max}: flt-diag's choice (the sources train and test at K); the vector is
cast to the stream's dtype (bf16 under reference precision).
Zero strength is e = 0 (the initialisation: the base variant bit for bit at step 0).
"""
from __future__ import annotations

import functools

from flt_diag.model.stabilisers import Stabiliser


@functools.cache
def embedding_class():
    """LoopEmbedding(max_loops, d), the stabiliser's part (built on first use: torch lazily)."""
    import torch
    import torch.nn as nn

    class LoopEmbedding(nn.Module):
        def __init__(self, max_loops: int, d: int):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(max_loops, d))

        @torch.no_grad()
        def reset_parameters(self) -> None:
            nn.init.zeros_(self.weight)

        def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
            if t < 0:
                raise ValueError(f"loop index {t} (loops count from 0)")
            return x + self.weight[min(t, self.weight.shape[0] - 1)].to(x.dtype)

    return LoopEmbedding


STABILISER = Stabiliser(
    name="loop-embed",
    description="a learned loop-index vector, zero-initialised, added at each loop's start (on LT)",
    source="parameter-golf PR 319; TMLT, arXiv 2410.01405",
    composes=True,
    ours={"beyond K": "a loop past the table reuses its last row e_K (the sources train and test at K)"},
    part="loop_embed",
    parameters=lambda cfg: embedding_class()(cfg.loops, cfg.width),
    enter=lambda part, x, t: part(x, t),
)
