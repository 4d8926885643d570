"""A run's identity (variant, loops, seed, lr scale; its depth and width), defined once: the cells of a sweep and
the probes and lines of a map, the runs of tables, pooled folders and summaries, the predictor's fit set.
Torch-free, so that tables and figures can name cells without the training code."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


def exact(x: float) -> str:
    """`x` as `%g` when that reads back as `x` (1 -> "1", 0.5 -> "0.5"), else as repr (1.0000001)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


@dataclass(frozen=True)
class RunId:
    """What makes two runs the same experiment (pooled folders count it once; the fit's cross-validation holds it
    out): variant, loops K, seed, lr scale, depth L (depth) and width d (width). In a grid it is a cell, `index`
    its place there (no part of the identity): a sweep's cell (depth None: the base config's), a map's probe
    (depth set on the depth axis only) or a map's line (no lr scale: every value of the axis)."""
    variant: str | None  # None: a flt_diag.watch run of a model of one's own
    loops: int
    seed: int
    lr_scale: float | None = None
    depth: int | None = None
    width: int | None = None
    index: int = field(default=-1, compare=False)

    @property
    def name(self) -> str:
        """The folder name of a cell, variant_Kkk_seedS_lrX[_LN] (a line's: variant_Kkk_seedS): X is the lr scale
        written exactly (`%g` where that reads back as the same number, as every earlier name; else the shortest
        round-trip repr), so distinct scales never share a folder; N the depth where the cell sets it (an identity
        `read` from a run always has one: name its folder by its path, not by this)."""
        name = f"{self.variant}_K{self.loops:02d}_seed{self.seed}"
        name += "" if self.lr_scale is None else f"_lr{exact(self.lr_scale)}"
        return name if self.depth is None else f"{name}_L{self.depth}"

    @classmethod
    def read(cls, *parts) -> RunId:
        """The identity that `parts` hold, each field under its name there (depth as depth, width as width; the
        first part that has it): a config's model and train sections, a summary, a row of the fit-examples table.
        Read from what the run stored, never from its folder's name."""
        found = {f: v for part in reversed(parts) for f, name in STORED.items()
                 if (v := getattr(part, name, None)) is not None}
        return cls(**{"variant": None, **found})

    def row(self) -> dict:
        """The identity as a table's columns (IDENTITY)."""
        return {k: getattr(self, k) for k in IDENTITY}


IDENTITY = tuple(f.name for f in fields(RunId) if f.compare)  # a table's identity columns
STORED = dict(zip(IDENTITY, ("variant", "loops", "seed", "lr_scale", "depth", "width")))  # each as files name it
