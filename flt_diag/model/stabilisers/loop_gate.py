"""A learned per-loop gate on the loop's update (flt-diag's own; issue 65's example of a stabiliser in one file).

    x(t) = x_in(t) + g_t * (F(x_in(t)) - x_in(t)),    g_t = sigmoid(a_t),  a_t in R^d learned per loop t,  a = 0 at init

x_in(t) the stream the loop's blocks take (its start), F the L blocks: each loop moves the stream a learned fraction
g_t of the way to what its blocks return, per channel (a damped fixed-point step; g = 1 is the base variant's loop).
flt-diag's choices (no source): the sigmoid keeps g in (0, 1); a = 0, so g = 1/2 at initialisation (not the base
at step 0); a loop beyond the table (eval-loops at more loops than trained) reuses the last row; trained by AdamW at
`--adamw-lr` x `--lr-scale`.
"""
from __future__ import annotations

import functools

from flt_diag.model.stabilisers import Stabiliser


@functools.cache
def gate_class():
    """LoopGate(loops, d), the stabiliser's part (built on first use: torch lazily)."""
    import torch
    import torch.nn as nn

    class LoopGate(nn.Module):
        def __init__(self, loops: int, d: int):
            super().__init__()
            self.a = nn.Parameter(torch.zeros(loops, d))

        @torch.no_grad()
        def reset_parameters(self) -> None:
            nn.init.zeros_(self.a)

        def forward(self, x_in: torch.Tensor, x_out: torch.Tensor, t: int) -> torch.Tensor:
            g = torch.sigmoid(self.a[min(t, self.a.shape[0] - 1)]).to(x_in.dtype)
            return x_in + g * (x_out - x_in)

    return LoopGate


STABILISER = Stabiliser(
    name="loop-gate",
    description="x(t) = x_in + g_t (F(x_in) - x_in), g_t = sigmoid(a_t) per loop and channel, a = 0 at init (on LT)",
    source="flt-diag's own (issue 65: a stabiliser in one file)",
    composes=True,
    ours={"gate": "sigmoid(a_t), a = 0 at init (g = 1/2)", "beyond K": "a loop past the table reuses its last row"},
    part="gate",
    parameters=lambda cfg: gate_class()(cfg.loops, cfg.width),
    update=lambda part, x_in, x_out, t: part(x_in, x_out, t),
)
