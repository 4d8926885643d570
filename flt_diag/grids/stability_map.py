"""The stability map: for every variant and loop count, where training breaks along one axis.

A *line* is one (variant, loops K, seed). Along it, the axis (the lr scale, or the depth L) takes
the values of a geometric grid lo, lo*r, lo*r^2, ... <= hi; the map looks for the first grid value at
which a *criterion* breaks, by bisection: with a = the highest index known to hold and b = the lowest
known to break (initially -1 and n), it probes (a + b) // 2 until b - a = 1. A boundary therefore
costs about log2(n + 1) runs and is known to within one grid ratio r: it lies in (grid[a], grid[b]]
and is reported as their geometric mean. Outcomes are assumed monotone along the axis; a line whose
finished probes contradict that is reported as "non-monotone" rather than hidden.

Criteria (from each probe's summary.json):
    training   the verdict is not `stable` (unstable, collapsed or diverged)
    collapse   the verdict is `collapsed` or `diverged`
    explosion  a residual norm of any loop exploded (`residual_explosion_any`), or the run diverged

Every probe is an ordinary run folder in the sweep folder's cells/ (named like a sweep cell, with
`_L<depth>` on the depth axis), so `summary`, `report`, `plot` and resuming all work on it. The
search state is never stored: it is replayed from the finished cells, so a killed map resumes where
it stopped and no probe runs twice. Lines are independent: `--workers` runs lines in parallel and a
job array gives each task one line (`--cell I`).

The boundary table and the figure are pure functions of the folder (`boundaries`, `critical_values`,
`draw_map`); this module imports no torch.
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from flt_diag.grids.cells import Cell
from flt_diag.config import check, opt
from flt_diag.model.variants import MAX_LOOPS, VARIANTS
from flt_diag.settle import comparable
from flt_diag.analysis.storage import CELLS, ERROR, StorageError, atomic_path, folder_lock, load_spec, load_summary

AXES = {"lr": "lr scale", "depth": "depth L"}
CRITERIA: dict[str, Callable[[dict], bool]] = {
    "training": lambda s: s.get("verdict") != "stable",
    "collapse": lambda s: s.get("verdict") in ("collapsed", "diverged"),
    "explosion": lambda s: bool(s.get("residual_explosion_any", s.get("residual_explosion"))) or s.get("verdict") == "diverged",
}
MAP_CSV = "map.csv"
MAX_GRID = 66  # values of one grid (lo times up to 64 powers of the ratio, and hi): no study needs more


def geometric_grid(lo: float, hi: float, ratio: float, integer: bool = False) -> list[float]:
    """lo, lo*r, lo*r^2, ... up to hi (hi itself is the last value); integers rounded and made unique."""
    if not (lo > 0 and hi >= lo and ratio > 1 and math.isfinite(hi) and math.isfinite(ratio)):
        raise ValueError(f"the grid needs 0 < lo <= hi and ratio > 1 (got lo={lo}, hi={hi}, ratio={ratio})")
    n = int(math.floor(math.log(hi / lo) / math.log(ratio) + 1e-9))
    if n + 2 > MAX_GRID:
        raise ValueError(f"the grid from {lo} to {hi} by x{ratio} has {n + 1} values; at most {MAX_GRID - 1}")
    values = [lo * ratio ** i for i in range(n + 1)]
    if values[-1] < hi * (1 - 1e-9):
        values.append(hi)
    if integer:
        values = sorted({int(round(v)) for v in values})
    else:
        values = [float(f"{v:.4g}") for v in values]
    return values


@dataclass(frozen=True)
class Line:
    index: int
    variant: str
    loops: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}_K{self.loops:02d}_seed{self.seed}"


@dataclass
class MapGrid:
    """The axis values a map searches: lo, lo*r, lo*r^2, ... <= hi (see geometric_grid)."""

    lo: float = opt(0.5, "Lowest axis value of the grid.", above=0)
    hi: float = opt(16.0, "Highest axis value of the grid.", above=0)
    ratio: float = opt(1.41, "Grid ratio: the tolerance of every boundary.", above=1)

    def __post_init__(self):
        check(self)

    def values(self, axis: str) -> list[float]:
        return geometric_grid(self.lo, self.hi, self.ratio, integer=axis == "depth")


@dataclass
class MapSpec:
    """What a map searches: lines (variants x loops x seeds), one axis and its grid, the criteria.
    `base` is the RunConfig of line 0 (the axis field and each line's fields are replaced per probe)."""

    base: object
    variants: list[str] = opt(list(VARIANTS), "Variants [default: all five].", choices=VARIANTS)
    loops: list[int] = opt([6, 12], "Loop counts K (the x axis of the map).", low=1, high=MAX_LOOPS)
    seeds: list[int] = opt([0], "Seeds: each boundary is reported with its spread.", low=0)
    axis: str = opt("lr", "lr (lr scale) or depth (L blocks, width fixed).", choices=AXES)
    grid: list[float] = field(default_factory=lambda: MapGrid().values("lr"))
    criteria: list[str] = opt(["training", "explosion"], "training (verdict not stable), collapse (collapsed or "
                              "diverged), explosion (a residual norm of any loop exploded).", choices=CRITERIA)

    def __post_init__(self):
        check(self)  # every option field against its bounds and choices (flt_diag.config)
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {', '.join(AXES)}, got {self.axis!r}")
        for c in self.criteria:
            if c not in CRITERIA:
                raise ValueError(f"unknown criterion {c!r}; choose from {', '.join(CRITERIA)}")
        for name, values in (("variants", self.variants), ("loops", self.loops), ("seeds", self.seeds),
                             ("criteria", self.criteria), ("grid values", self.grid)):
            if not values:
                raise ValueError(f"the list of {name} is empty")
            if len(set(values)) != len(values):
                raise ValueError(f"the list of {name} has duplicates: {values}")
        if list(self.grid) != sorted(self.grid):
            raise ValueError("the grid must be ascending")

    def lines(self) -> list[Line]:
        grid = [(k, s, v) for s in self.seeds for k in self.loops for v in self.variants]
        return [Line(i, v, k, s) for i, (k, s, v) in enumerate(grid)]

    @property
    def base_lr_scale(self) -> float:
        return float(self.base.train.lr_scale)

    def cell(self, line: Line, value: float) -> Cell:
        """The sweep cell of a probe at one axis value."""
        if self.axis == "lr":
            return Cell(-1, line.variant, line.loops, line.seed, float(value))
        return Cell(-1, line.variant, line.loops, line.seed, self.base_lr_scale, depth=int(value))

    def to_dict(self) -> dict:
        return dict(kind="map", variants=self.variants, loops=self.loops, seeds=self.seeds, axis=self.axis,
                    grid=list(self.grid), criteria=self.criteria, base=comparable(self.base.to_dict()))


# --------------------------------------------------------------------------- the search

def bracket(known: dict[int, bool], n: int) -> tuple[int, int, bool]:
    """(a, b, monotone) from the known outcomes {grid index: broke}: a = the highest index that held
    below the lowest that broke (b; n if none broke). monotone is False when some index above b held."""
    broken = [i for i, bad in known.items() if bad]
    b = min(broken) if broken else n
    held = [i for i, bad in known.items() if not bad and i < b]
    a = max(held) if held else -1
    monotone = not any(not bad and i > b for i, bad in known.items())
    return a, b, monotone


def search(n: int, outcome: Callable[[int], bool | None], known: dict[int, bool] | None = None) -> dict:
    """Bisection over grid indices 0..n-1. `outcome(i)` runs (or reads) probe i and says whether it
    broke (None: the probe failed, and the search of this line stops). Returns the bracket."""
    known = dict(known or {})
    a, b, monotone = bracket(known, n)
    while b - a > 1:
        mid = (a + b) // 2
        result = outcome(mid)
        if result is None:
            return dict(a=a, b=b, monotone=monotone, failed=mid)
        known[mid] = result
        a, b, monotone = bracket(known, n)
    return dict(a=a, b=b, monotone=monotone, failed=None)


def probe_outcomes(spec: MapSpec, out: Path, line: Line, criterion: str) -> dict[int, bool]:
    """Outcomes of the line's finished probes under one criterion, from their summary.json."""
    known = {}
    for i, value in enumerate(spec.grid):
        s = load_summary(Path(out) / CELLS / spec.cell(line, value).name)
        if s is not None:
            known[i] = CRITERIA[criterion](s)
    return known


def search_line(spec: MapSpec, out: Path, line: Line, runner: Callable, report: Callable[[str], None] = print) -> None:
    """Search every criterion along one line, running the probes that are missing with
    `runner(base_dict, cell, out_str)` (flt_diag.grids.sweep.run_cell for real runs)."""
    out = Path(out)
    base = spec.base.to_dict()
    for criterion in spec.criteria:
        def outcome(i: int) -> bool | None:
            cell = spec.cell(line, spec.grid[i])
            d = out / CELLS / cell.name
            if load_summary(d) is None:
                result = runner(base, cell, str(out))
                report(f"{line.name}: {spec.axis} {spec.grid[i]:g} -> {result}")
            s = load_summary(d)
            return None if s is None else CRITERIA[criterion](s)

        search(len(spec.grid), outcome, probe_outcomes(spec, out, line, criterion))


# --------------------------------------------------------------------------- the folder

def prepare_map_folder(spec: MapSpec, out: Path) -> None:
    """Create the map folder, or check that an existing one holds the same map."""
    from flt_diag.grids.sweep import prepare_spec_folder
    grid_fields = {"model": ("variant", "loops") + (("n_layer",) if spec.axis == "depth" else ()),
                   "train": ("seed",) + (("lr_scale",) if spec.axis == "lr" else ())}
    prepare_spec_folder(Path(out), spec.to_dict(), "map", grid_fields)


def spec_from_folder(out: Path) -> dict:
    spec = load_spec(out)  # checked (flt_diag.analysis.files): a map folder without criteria is one line
    if spec.get("kind") != "map":
        raise StorageError(f"{out} is a sweep folder, not a stability map (made by `flt-diag map`)")
    return spec


def _line_search_worker(spec_dict: dict, line: Line, out: str) -> str:
    from flt_diag.config import RunConfig
    from flt_diag.grids.sweep import run_cell
    spec = _spec_from_dict(spec_dict, RunConfig.from_dict(spec_dict["base_full"]))
    search_line(spec, Path(out), line, run_cell, report=lambda text: print(text, flush=True))
    return line.name


def _spec_from_dict(d: dict, base) -> MapSpec:
    return MapSpec(base, d["variants"], d["loops"], d["seeds"], d["axis"], d["grid"], d["criteria"])


def run_map(spec: MapSpec, out: Path, workers: int = 1, only_line: int | None = None,
            runner: Callable | None = None, report: Callable[[str], None] = print) -> pd.DataFrame:
    """Search every line (or just `only_line`), then write map.csv and the sweep summary."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StorageError(f"{out} exists and is a file, not a map folder; use another --out")
    with (folder_lock(out, "map") if only_line is None else nullcontext()):
        return _run_map(spec, out, workers, only_line, runner, report)


def _run_map(spec, out, workers, only_line, runner, report) -> pd.DataFrame:
    from flt_diag.grids.sweep import die_with_parent, only, run_cell, write_summary
    prepare_map_folder(spec, out)
    lines = only(spec.lines(), only_line, " (one per line)")
    if runner is not None or workers <= 1 or len(lines) <= 1:
        for line in lines:
            search_line(spec, out, line, runner or run_cell, report)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        spec_dict = {**spec.to_dict(), "base_full": spec.base.to_dict()}
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=die_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            for name in pool.map(_line_search_worker, [spec_dict] * len(lines), lines, [str(out)] * len(lines)):
                report(f"{name}: searched")
    write_summary(out)
    table = boundaries(out)
    with atomic_path(out / MAP_CSV) as tmp:
        table.to_csv(tmp, index=False)
    return table


# --------------------------------------------------------------------------- results (no torch)

def boundaries(out: Path) -> pd.DataFrame:
    """One row per (line, criterion): the bracket found so far, from the finished probes alone.

    status: "found" (boundary in (last_ok, first_broken]), "below grid" (broke at the lowest value),
    "above grid" (held at the highest), "open" (search unfinished), "non-monotone"."""
    spec = spec_from_folder(out)
    grid = spec["grid"]
    rows = []
    fake = _FolderSpec(spec)
    for line in fake.lines():
        for criterion in spec["criteria"]:
            known = probe_outcomes(fake, out, line, criterion)
            a, b, monotone = bracket(known, len(grid))
            failed = any((Path(out) / CELLS / fake.cell(line, v).name / ERROR).exists() for v in grid)
            if not monotone:
                status = "non-monotone"
            elif b - a > 1:
                status = "failed" if failed else "open"
            elif b == 0:
                status = "below grid"
            elif a == len(grid) - 1:
                status = "above grid"
            else:
                status = "found"
            last_ok = grid[a] if a >= 0 else math.nan
            first_broken = grid[b] if b < len(grid) else math.nan
            boundary = math.sqrt(last_ok * first_broken) if status == "found" else math.nan
            rows.append(dict(variant=line.variant, loops=line.loops, seed=line.seed, criterion=criterion,
                             axis=spec["axis"], last_ok=last_ok, first_broken=first_broken, boundary=boundary,
                             status=status, probes=len(known)))
    return pd.DataFrame(rows, columns=["variant", "loops", "seed", "criterion", "axis", "last_ok", "first_broken",
                                       "boundary", "status", "probes"])


def unfinished(out: Path, lines: list[Line] | None = None) -> str | None:
    """Why the map's search is not complete (one line), or None: the lines (all, or `lines`) where a
    probe failed (its error.txt says why) or the search stopped short without even that record (a
    failure that could not be written, e.g. on a full disk). A map that is not complete exits non-zero."""
    table = boundaries(out)
    stuck = table[table.status.isin(["failed", "open"])]
    names = sorted({Line(0, r.variant, r.loops, r.seed).name for r in stuck.itertuples()})
    if lines is not None:
        names = [n for n in names if n in {line.name for line in lines}]
    if not names:
        return None
    total = len(lines) if lines is not None else len(_FolderSpec(spec_from_folder(out)).lines())
    return (f"{len(names)} of {total} map lines did not finish their search ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}): a probe failed; see {out}/{CELLS}/<cell>/{ERROR} where it exists")


class _FolderSpec(MapSpec):
    """A MapSpec read back from sweep.json, without torch (its base stays the stored dict)."""

    def __init__(self, d: dict):
        super().__init__(d["base"], d["variants"], d["loops"], d["seeds"], d["axis"], d["grid"], d["criteria"])

    @property
    def base_lr_scale(self) -> float:
        return float(self.base["train"]["lr_scale"])


def critical_values(out: Path) -> pd.DataFrame:
    """Per (criterion, variant, loops): the boundary over seeds (median, min, max) as a table row,
    with a text cell such as "2.8 [2-4]" or "> 16" that the report and README print."""
    b = boundaries(out)
    rows = []
    for (criterion, variant, loops), g in b.groupby(["criterion", "variant", "loops"], sort=False):
        found = g[g.status == "found"].boundary
        above, below = (g.status == "above grid").sum(), (g.status == "below grid").sum()
        if len(found) == len(g):
            text = f"{found.median():.3g}" + (f" [{found.min():.3g}-{found.max():.3g}]" if len(g) > 1 else "")
        elif above == len(g):
            text = f"> {g.last_ok.max():g}"
        elif below == len(g):
            text = f"< {g.first_broken.min():g}"
        else:
            text = ", ".join(f"{bd:.3g}" if st == "found" else st for st, bd in zip(g.status, g.boundary))
        rows.append(dict(criterion=criterion, variant=variant, loops=loops, median=found.median() if len(found) else math.nan,
                         low=found.min() if len(found) else math.nan, high=found.max() if len(found) else math.nan,
                         seeds=len(g), text=text))
    return pd.DataFrame(rows)


def critical_table(out: Path) -> pd.DataFrame:
    """The critical values as a text table: one row per variant, one column per (criterion, K)."""
    crit = critical_values(out)
    if crit.empty:
        return pd.DataFrame()
    axis = spec_from_folder(out)["axis"]
    crit = crit.assign(column=[f"{c} at K={k} ({AXES[axis]})" for c, k in zip(crit.criterion, crit.loops)])
    table = crit.pivot(index="variant", columns="column", values="text")
    order = [v for v in ("lt", "lt-ii", "lt-ai", "fla", "flt") if v in table.index]
    table = table.reindex(order + [v for v in table.index if v not in order])[list(dict.fromkeys(crit.column))]
    return table.reset_index().rename(columns={"variant": "Variant"})
