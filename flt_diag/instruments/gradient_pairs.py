"""Two consecutive steps' gradients compared per parameter group laid end to end (the cosine and sign-flip records
of flt_diag.instruments.diagnostics), with no parameter-sized temporary: a fresh one costs a page fault per page
on a CPU (the probe's step at d=256: 29 ms with them, 9 ms without; benchmarks/README.md)."""
from __future__ import annotations

import torch


def segment_squares(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Squared Euclidean norm of each consecutive segment of the flat x: (len(sizes),)."""
    return torch.stack([torch.dot(part, part) for part in x.split(sizes)])


def pair_sums(g: torch.Tensor, prev: torch.Tensor, sizes: list[int] | None, work: torch.Tensor,
              prev_squares: torch.Tensor | None = None) -> torch.Tensor:
    """[g.prev, |g|^2, |prev|^2, flipped coordinates, coordinates] of two flat gradients: shape (5,),
    or (5, len(sizes)) with one column per segment of `sizes` (the parameter groups, laid end to end).
    `work`: a buffer of g's size and dtype, overwritten (it holds g * prev, then its signs). `prev_squares`:
    |prev|^2 per segment if known already (the previous step's |g|^2), else taken here."""
    parts = [g.numel()] if sizes is None else sizes
    torch.mul(g, prev, out=work)
    dots = [w.sum() for w in work.split(parts)]
    work.lt_(0)  # 1 where the signs differ (neither zero), else 0
    flips = [w.sum() for w in work.split(parts)]
    prev_sq = segment_squares(prev, parts) if prev_squares is None else prev_squares.to(g.dtype)
    sums = torch.stack([torch.stack(dots), segment_squares(g, parts), prev_sq, torch.stack(flips),
                        torch.tensor(parts, device=g.device, dtype=g.dtype)])
    return sums[:, 0] if sizes is None else sums


def consecutive_stats(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine between consecutive gradients, and the share of coordinates whose sign flipped
    (g_i * prev_i < 0: a coordinate that is zero in either step does not count as flipped),
    from `pair_sums` (per group, or summed over groups for the global figures). The norms are multiplied after
    their square roots: the product of two squared norms of ~1e-20 underflows float32 (and of ~1e20 overflows),
    which gave cosines far outside [-1, 1] (or 0); a gradient that is zero in either step gives 0, a non-finite one
    NaN (as the division gives it)."""
    dot, sq_g, sq_prev, flips, n = sums.unbind()
    norms = sq_g.sqrt() * sq_prev.sqrt()
    cos = torch.where(norms == 0, 0.0, dot / norms)
    return cos.clamp(-1.0, 1.0), flips / n
