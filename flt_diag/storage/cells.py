"""A sweep cell: one run of a grid (variant, loops, seed, lr scale; depth for depth maps).
Torch-free, so that tables and figures can name cells without the training code."""
from __future__ import annotations

from dataclasses import dataclass


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
        name = f"{self.variant}_K{self.loops:02d}_seed{self.seed}_lr{self.lr_scale:g}"
        return name if self.depth is None else f"{name}_L{self.depth}"
