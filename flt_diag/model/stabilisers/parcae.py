"""Parcae's loop start (Parcae, arXiv 2604.12946; `sandyresearch/parcae`, parcae_lm/modules/injection.py).

    x_start(t) = Abar * x(t-1) + dt * (B norm(E)),   Abar = exp(-dt * exp(A_log)),   dt = softplus(dt_raw)

per channel (Abar, dt in R^d, B in R^{d x d}); x(t-1) is the un-normalised stream at the end of loop t-1 (Parcae
carries the raw state, where LT carries h(t-1) = norm(x(t-1))). Since exp(A_log) > 0 and dt > 0, every Abar is in
(0, 1): the spectral radius of the state's linear part, rho(Abar) = max Abar, is below 1 by construction; the
Trainer records it every step (metric `injection_rho`).

Initialisation (the source's): A_log = 0 and dt_raw = softplus^-1(-ln 0.447), so Abar = 0.447 in every channel;
B = I. The three take no weight decay (flt-diag's recipe has none anywhere) and are trained by AdamW at
`--adamw-lr` x `--lr-scale` (flt-diag's choice: the source trains them with its AdamW groups; Muon would
orthogonalise B's update away from the identity).

Zero strength: with Abar = 1 and B = 0 the loop start is x(t-1) exactly (LT carrying the raw stream).
`--strength S` multiplies -ln Abar at init (Abar = 0.447 ** S; S = 0: Abar = 1 and dt = 0, which then stays 0:
softplus's gradient at -inf is 0).
"""
from __future__ import annotations

import functools
import math

from flt_diag.model.stabilisers import Stabiliser

ABAR_INIT = 0.447


@functools.cache
def injection_class():
    """ParcaeInjection(d), the stabiliser's part (a class built on first use: this file imports torch lazily)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class ParcaeInjection(nn.Module):
        def __init__(self, d: int, strength: float = 1.0):
            super().__init__()
            self.strength = strength  # --strength S: -ln Abar at init is S x the source's -ln 0.447
            self.A_log = nn.Parameter(torch.zeros(d))
            self.dt = nn.Parameter(torch.zeros(d))
            self.B = nn.Linear(d, d, bias=False)
            self.reset_parameters()

        @torch.no_grad()
        def reset_parameters(self) -> None:
            dt = -math.log(ABAR_INIT) * self.strength  # exp(-dt * exp(0)) = 0.447 ** S
            self.A_log.zero_()
            self.dt.fill_(math.log(math.expm1(dt)) if dt > 0 else -math.inf)  # softplus^-1(dt) (S = 0: dt = 0)
            nn.init.eye_(self.B.weight)

        def decay(self) -> tuple[torch.Tensor, torch.Tensor]:
            """(Abar, dt), each (d,)."""
            dt = F.softplus(self.dt)
            return torch.exp(-dt * torch.exp(self.A_log)), dt

        def forward(self, x_prev: torch.Tensor, e_normed: torch.Tensor) -> torch.Tensor:
            """x_prev: (B, T, d) raw stream; e_normed: (B, T, d) norm(E)."""
            abar, dt = self.decay()
            return (abar * x_prev + dt * self.B(e_normed)).to(x_prev.dtype)  # (bf16 under reference precision)

        def rho(self) -> torch.Tensor:
            """rho(Abar) = max over channels (the recurrence's spectral radius), no gradient."""
            with torch.no_grad():
                return self.decay()[0].max()

    return ParcaeInjection


STABILISER = Stabiliser(
    name="parcae",
    description="loop t starts from A*x(t-1) + dt*B*norm(E), A = exp(-dt exp(A_log)) < 1 per channel (on LT)",
    source="Parcae, arXiv 2604.12946 (sandyresearch/parcae, parcae_lm/modules/injection.py)",
    ours={"optimizer": "A_log, dt and B trained by AdamW at --adamw-lr x --lr-scale (the source: its AdamW groups)",
          "depth": "K loops every step, the gradient through all (the source samples a Poisson depth per sequence and "
                   "backpropagates through 4 of 8: parcae-source)"},
    part="injection",
    strength="-ln Abar at init, Abar = 0.447 (the source's): Abar = 0.447 ** S",
    parameters=lambda cfg: injection_class()(cfg.width, cfg.strength),
    start=lambda part, x, e: part(x, e),
    metrics=lambda part: {"injection_rho": part.rho()},
)
