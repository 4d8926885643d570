"""The options of the grids: what a sweep (`run-ablation`) and a stability map (`map`) run over, declared once
(the CLI, study files and sweep.json's loader read them; flt_diag.grids.sweep.SweepSpec and
flt_diag.grids.stability_map.MapSpec add behaviour, no fields). Torch-free.
"""
from __future__ import annotations

import math

from typing import Annotated, Literal, get_args

from pydantic import AliasChoices, Field

from flt_diag.config.option_fields import MAX_NUMBER, Ascending, Distinct, Items, Options, opt, with_fact
from flt_diag.config.run_config import MAX_SEED, Criterion, ModelConfig, RunConfig, TrainConfig
from flt_diag.config.variants import MAX_LOOPS, PAPER_VARIANTS, Variant

MapAxis = Literal["lr", "depth"]  # what a map varies: the lr scale, or the number L of distinct blocks
MAP_AXES, MAP_CRITERIA = get_args(MapAxis), get_args(Criterion)
# The config fields a sweep's grid sets per cell (their fields say grid="sweep"): a folder's stored base is
# compared without them (its base is cell 0's config; earlier versions stored seed 0 and lr scale 1 there),
# and sweeps pooled by `summary` may differ in them.
SWEEP_GRID_FIELDS = {"model": with_fact(ModelConfig, "grid", "sweep"), "train": with_fact(TrainConfig, "grid", "sweep")}
Loops = Annotated[int, Field(ge=1, le=MAX_LOOPS)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
MAX_AXIS = 2.0**20  # an lr scale (or depth) beyond a million times the recipe's is no study's: refused by its field
MAX_GRID = 66  # values of one map grid (lo times up to 64 powers of the ratio, and hi): no study needs more


def geometric_grid(lo: float, hi: float, ratio: float, integer: bool = False) -> list[float]:
    """lo, lo*r, lo*r^2, ... up to hi (hi itself is the last value); integers rounded and made unique."""
    if not (lo > 0 and hi >= lo and ratio > 1 and math.isfinite(hi) and math.isfinite(ratio)):
        raise ValueError(f"the grid needs 0 < lo <= hi and ratio > 1 (got lo={lo}, hi={hi}, ratio={ratio})")
    # The count in log space: hi / lo (and lo * ratio^n) may overflow where lo, hi and ratio are finite.
    span = math.log(hi / lo) if math.isfinite(hi / lo) else math.log(hi) - math.log(lo)
    steps = span / math.log(ratio) + 1e-9
    if steps + 2 > MAX_GRID:
        raise ValueError(f"the grid from {lo:g} to {hi:g} by x{ratio} has {math.floor(steps) + 1:.4g} values; "
                         f"at most {MAX_GRID - 1} (raise --ratio or narrow --lo .. --hi)")
    n = math.floor(steps)
    values = [lo * ratio ** i if i * math.log(ratio) < 700 else math.exp(math.log(lo) + i * math.log(ratio))
              for i in range(n + 1)]
    if values[-1] < hi * (1 - 1e-9):
        values.append(hi)
    if integer:
        values = sorted({int(round(v)) for v in values})
    else:
        values = [float(f"{v:.4g}") for v in values]
    return values


class SweepAxes(Options):
    """The grid of a sweep: every variant x loop count x seed x lr scale is one cell."""

    variants: Items[Variant] = opt(list(PAPER_VARIANTS), "Variants [default: the paper's five; all: flt-diag variants].")
    loops: Items[Loops] = opt([3, 6, 9, 12], "Loop counts K.")
    seeds: Items[Seed] = opt([0], "Seeds.")
    lr_scale: Items[Annotated[float, Field(gt=0, le=MAX_NUMBER)]] = opt(  # (sweep.json of earlier versions: lr_scales)
        [1.0], "Learning-rate multipliers (an lr x loops map).", validation_alias=AliasChoices("lr_scale", "lr_scales"))


class SweepGrid(SweepAxes):
    """A sweep's grid and `base`, the RunConfig the cells share (flt_diag.grids.sweep.SweepSpec makes it
    cell 0's)."""

    base: RunConfig


class MapGrid(Options):
    """The axis values a map searches: lo, lo*r, lo*r^2, ... <= hi (see geometric_grid)."""

    lo: float = opt(0.5, "Lowest axis value of the grid.", gt=0, le=MAX_AXIS)
    hi: float = opt(16.0, "Highest axis value of the grid.", gt=0, le=MAX_AXIS)
    ratio: float = opt(1.41, "Grid ratio: the tolerance of every boundary.", gt=1)

    def values(self, axis: str) -> list[float]:
        return geometric_grid(self.lo, self.hi, self.ratio, integer=axis == "depth")


class MapAxes(Options):
    """What a map searches: lines (variants x loops x seeds), one axis, the criteria."""

    variants: Items[Variant] = opt(list(PAPER_VARIANTS), "Variants [default: the paper's five; all: flt-diag variants].")
    loops: Items[Loops] = opt([6, 12], "Loop counts K (the x axis of the map).")
    seeds: Items[Seed] = opt([0], "Seeds: each boundary is reported with its spread.")
    axis: MapAxis = opt("lr", "lr (lr scale) or depth (L blocks, width fixed).")
    criteria: Items[Criterion] = opt(["training", "explosion"], "training (verdict not stable), collapse (stalled, "
                                     "collapsed or diverged), explosion (a residual norm of any loop exploded).")


class MapLinesGrid(MapAxes):
    """A map's lines and axis, the grid of axis values (ascending, distinct) and `base`, the RunConfig of
    line 0 (flt_diag.grids.stability_map.MapSpec replaces the axis field and each line's fields per probe)."""

    base: RunConfig
    grid: Annotated[list[int | float], Field(min_length=1, max_length=MAX_GRID), Distinct, Ascending] = \
        Field(default_factory=lambda: MapGrid().values("lr"))
