"""Two consecutive steps' gradients compared per parameter group laid end to end (the cosine and sign-flip records
of flt_diag.instruments.diagnostics), with no parameter-sized temporary: a fresh one costs a page fault per page
on a CPU (the probe's step at d=256: 29 ms with them, 9 ms without; benchmarks/README.md)."""
from __future__ import annotations

import torch


def segment_squares(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Squared Euclidean norm of each consecutive segment of the flat x: (len(sizes),)."""
    return torch.stack([torch.dot(part, part) for part in x.split(sizes)])


def pair_sums(g: torch.Tensor, prev: torch.Tensor, sizes: list[int] | None = None,
              work: torch.Tensor | None = None) -> torch.Tensor:
    """[g.prev, |g|^2, |prev|^2, flipped coordinates, coordinates] of two flat gradients: shape (5,),
    or (5, len(sizes)) with one column per segment of `sizes` (the parameter groups, laid end to end).
    `work`: a buffer of g's size and dtype to hold g * prev (else one is allocated)."""
    parts = [g.numel()] if sizes is None else sizes
    work = torch.empty_like(g) if work is None else work
    columns = []
    for gs, ps, ws in zip(g.split(parts), prev.split(parts), work.split(parts)):
        torch.mul(gs, ps, out=ws).clamp_(max=0).sign_()  # -1 where the signs differ (neither zero), else 0
        columns.append(torch.stack([torch.dot(gs, ps), torch.dot(gs, gs), torch.dot(ps, ps), -ws.sum()]))
    sums = torch.stack(columns, -1)
    out = torch.cat([sums, torch.tensor([[float(k) for k in parts]], device=g.device, dtype=sums.dtype)])
    return out[:, 0] if sizes is None else out


def consecutive_stats(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine between consecutive gradients, and the share of coordinates whose sign flipped
    (g_i * prev_i < 0: a coordinate that is zero in either step does not count as flipped),
    from `pair_sums` (per group, or summed over groups for the global figures)."""
    dot, sq_g, sq_prev, flips, n = sums.unbind()
    return dot / (sq_g * sq_prev).sqrt().clamp_min(1e-30), flips / n
