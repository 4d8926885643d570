"""Two consecutive steps' gradients compared in a few vector operations, per parameter group laid end to end
(the cosine and sign-flip records of flt_diag.instruments.diagnostics)."""
from __future__ import annotations

import torch


def segment_sums(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Sums of the consecutive segments of x (lengths `sizes`) along its last dim: (..., len(sizes))."""
    return torch.stack([part.sum(-1) for part in x.split(sizes, -1)], -1)


def pair_sums(g: torch.Tensor, prev: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """[g.prev, |g|^2, |prev|^2, flipped coordinates, coordinates] of two flat gradients: shape (5,),
    or (5, len(sizes)) with one column per segment of `sizes` (the parameter groups, laid end to end)."""
    parts = [g.numel()] if sizes is None else sizes
    prod = g * prev
    sums = torch.stack([segment_sums(x, parts) for x in (prod, g.square(), prev.square(), (prod < 0).float())])
    out = torch.cat([sums, torch.tensor([[float(k) for k in parts]], device=g.device)])
    return out[:, 0] if sizes is None else out


def consecutive_stats(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine between consecutive gradients, and the share of coordinates whose sign flipped
    (g_i * prev_i < 0: a coordinate that is zero in either step does not count as flipped),
    from `pair_sums` (per group, or summed over groups for the global figures)."""
    dot, sq_g, sq_prev, flips, n = sums.unbind()
    return dot / (sq_g * sq_prev).sqrt().clamp_min(1e-30), flips / n
