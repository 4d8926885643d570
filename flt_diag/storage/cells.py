"""A sweep cell: one run of a grid (variant, loops, seed, lr scale; depth for depth maps).
Torch-free, so that tables and figures can name cells without the training code."""
from __future__ import annotations

from dataclasses import dataclass


def exact(x: float) -> str:
    """`x` as `%g` when that reads back as `x` (1 -> "1", 0.5 -> "0.5"), else as repr (1.0000001)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


@dataclass(frozen=True)
class Cell:
    index: int
    variant: str
    loops: int
    seed: int
    lr_scale: float
    depth: int | None = None  # n_layer of this cell (depth maps); None = the base config's

    @property
    def name(self) -> str:
        """variant_Kkk_seedS_lrX[_LN]: X is the lr scale written exactly (`%g` where that reads back as the
        same number, as every earlier name; else the shortest round-trip repr), so distinct scales never
        share a folder."""
        name = f"{self.variant}_K{self.loops:02d}_seed{self.seed}_lr{exact(self.lr_scale)}"
        return name if self.depth is None else f"{name}_L{self.depth}"
