"""The stability map: for every variant and loop count, where training breaks along one axis.

A *line* is one (variant, loops K, seed); along it the map bisects a geometric grid of one axis (the lr scale,
or the depth L) for the first value at which a criterion breaks (`search`). The criteria, the bracket, the
resumable search and `--probe-ends`: docs/DESIGN.md section 5. Every probe is an ordinary run folder in the
sweep folder's cells/ (named like a sweep cell, with `_L<depth>` on the depth axis). Lines are independent:
`--workers` runs lines in parallel and a job array gives each task one line (`--cell I`).

The boundary tables, the criteria and the lines: flt_diag/judge/map_boundaries.py (torch-free); this module
runs the search.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import pandas as pd

from flt_diag.judge.line_prior import line_prior, start_probes
from flt_diag.judge.map_boundaries import (CRITERIA, MAP_CSV, boundaries, bracket, map_lines,
                                           probe_cell, probe_outcomes)
from flt_diag.storage.cells import RunId
from flt_diag.storage.folders import CELLS, atomic_path, folder_lock, load_summary, refuse_not_a_folder
from flt_diag.config.run_config import RunConfig, with_overrides
from flt_diag.config.grid_options import MapLinesGrid
from flt_diag.grids.campaign import CampaignOptions, archiving, prepare_spec_folder
from flt_diag.grids.sweep import cell_config, only, run_cell, write_summary
from flt_diag.grids.worker_pool import interruptible, spawn_pool, task
from flt_diag.training.settle import comparable


class MapSpec(MapLinesGrid):
    """What a map searches (its fields: flt_diag.config.grid_options.MapLinesGrid): lines (variants x loops x
    seeds), one axis and its grid, the criteria. `base` is the RunConfig of line 0 (the axis field and
    each line's fields are replaced per probe). Every field is validated (pydantic) when it is made."""

    def __init__(self, base: RunConfig, *given, **named):
        names = ("variants", "loops", "seeds", "axis", "grid", "criteria")
        super().__init__(base=base, **dict(zip(names, given)), **named)

    def lines(self) -> list[RunId]:
        return map_lines(self)

    def searched_lines(self) -> list[RunId]:
        """The lines this map searches (all; a map pooled with a baseline: the new ones, flt_diag.grids.baseline)."""
        return self.lines()

    def cell(self, line: RunId, value: float):
        return probe_cell(self, line, value)

    def cell_config(self, cell: RunId) -> RunConfig:
        """The probe's own config: the base with the line's fields and the axis value (its lr scale or depth)."""
        return cell_config(self.base, cell)

    def to_dict(self) -> dict:
        return dict(kind="map", variants=self.variants, loops=self.loops, seeds=self.seeds, axis=self.axis,
                    grid=list(self.grid), criteria=self.criteria, base=comparable(self.base.to_dict()))


# --------------------------------------------------------------------------- the search


def search(n: int, outcome: Callable[[int], bool | None], known: dict[int, bool] | None = None,
           probe_ends: bool = False, prior: int | None = None) -> dict:
    """Bisection over grid indices 0..n-1. `outcome(i)` runs (or reads) probe i and says whether it
    broke (None: the probe failed, and the search of this line stops). Returns the bracket.

    probe_ends: first probe indices 0 and n-1 (where not known), so that a line that breaks at the low
    end and holds at the high end shows up as non-monotone; plain bisection would start in the middle
    and, finding it held, never look below it. prior: the first-broken index that earlier lines of the
    variant found (flt_diag.judge.line_prior): it and the index below are probed first, where still
    inside the bracket; the bisection goes on from the bracket they leave."""
    known = dict(known or {})

    def result(failed: int | None) -> dict:
        return dict(zip(("a", "b", "monotone"), bracket(known, n)), failed=failed)

    for i in ((0, n - 1) if probe_ends else ()):
        if i not in known:
            broke = outcome(i)
            if broke is None:
                return result(failed=i)
            known[i] = broke
    # Where the low end broke, bisect the rest of the grid as if it had held: a value above it that
    # holds then makes the line non-monotone (the bracket below), instead of ending the search at once.
    searched = {**known, 0: False} if probe_ends and known.get(0) else dict(known)
    a, b, _ = bracket(searched, n)
    for i in start_probes(prior):
        if a < i < b:
            broke = outcome(i)
            if broke is None:
                return result(failed=i)
            known[i] = searched[i] = broke
            a, b, _ = bracket(searched, n)
    while b - a > 1:
        mid = (a + b) // 2
        broke = outcome(mid)
        if broke is None:
            return result(failed=mid)
        known[mid] = searched[mid] = broke
        a, b, _ = bracket(searched, n)
    return result(failed=None)


def search_line(spec: MapSpec, out: Path, line: RunId, runner: Callable, report: Callable[[str], None] = print,
                probe_ends: bool = False, run_to_end: bool = False) -> None:
    """Search every criterion along one line, running the probes that are missing with
    `runner(probe_config, cell, out_str)` (flt_diag.grids.sweep.run_cell for real runs). Each probe ends once
    the map's criteria are decided (stop_when_decided), unless `run_to_end`; each criterion's search starts
    where the variant's earlier lines found its boundary (line_prior)."""
    out = Path(out)
    stop = None if run_to_end else list(spec.criteria)
    for criterion in spec.criteria:
        def outcome(i: int) -> bool | None:
            cell = spec.cell(line, spec.grid[i])
            d = out / CELLS / cell.name
            if load_summary(d) is None:
                result = runner(with_overrides(spec.cell_config(cell), diagnostics=dict(stop_when_decided=stop)),
                                cell, str(out))
                decided = getattr(load_summary(d), "decided_at", None)
                report(f"{line.name}: {spec.axis} {spec.grid[i]:g} -> {result}"
                       + (f" (decided at step {decided})" if decided is not None else ""))
            s = load_summary(d)
            return None if s is None else CRITERIA[criterion](s)

        search(len(spec.grid), outcome, probe_outcomes(spec, out, line, criterion), probe_ends,
               line_prior(spec, out, line, criterion))


# --------------------------------------------------------------------------- the folder

def prepare_map_folder(spec: MapSpec, out: Path, options: CampaignOptions = CampaignOptions()) -> None:
    """Create the map folder, or check that an existing one holds the same map and code."""
    grid_fields = {"model": ("variant", "loops") + (("depth",) if spec.axis == "depth" else ()),
                   "train": ("seed",) + (("lr_scale",) if spec.axis == "lr" else ())}
    prepare_spec_folder(Path(out), spec.to_dict(), "map", grid_fields, spec.base.train.device, options)


def _line_search_worker(spec: MapSpec, line: RunId, out: str, probe_ends: bool = False,
                        run_to_end: bool = False, runner: Callable = run_cell) -> str:
    with task():  # (the spec arrives pickled, as validated in the parent: it is not validated again)
        search_line(spec, Path(out), line, runner, report=lambda text: print(text, flush=True),
                    probe_ends=probe_ends, run_to_end=run_to_end)
    return line.name


def run_map(spec: MapSpec, out: Path, workers: int = 1, only_line: int | None = None,
            runner: Callable | None = None, report: Callable[[str], None] = print,
            probe_ends: bool = False, run_to_end: bool = False,
            options: CampaignOptions = CampaignOptions()) -> pd.DataFrame:
    """Search every line (or just `only_line`), then write map.csv and the sweep summary.
    probe_ends (see `search`) and run_to_end (see `search_line`) are how the search runs, not what the map
    is: a map folder searched without them can be resumed with them, and its finished probes count. `options`:
    the campaign's (resume under other code, archive each probe as it finishes)."""
    out = Path(out)
    refuse_not_a_folder(out, "a map folder", "use another --out")
    with (folder_lock(out, "map", root=out) if only_line is None else nullcontext()):  # (out may be a link)
        prepare_map_folder(spec, out, options)
        lines = only(spec.searched_lines(), only_line, " (one per line)")
        probe = archiving(runner or run_cell, options)
        if runner is not None or workers <= 1 or len(lines) <= 1:
            for line in lines:
                search_line(spec, out, line, probe, report, probe_ends, run_to_end)
        else:
            pool = spawn_pool(workers)
            with interruptible(pool):  # Ctrl-C (or kill -INT of this process alone) stops the workers too
                for name in pool.map(_line_search_worker, [spec] * len(lines), lines, [str(out)] * len(lines),
                                     [probe_ends] * len(lines), [run_to_end] * len(lines), [probe] * len(lines)):
                    report(f"{name}: searched")
        write_summary(out)
        table = boundaries(out)
        with atomic_path(out / MAP_CSV) as tmp:
            table.to_csv(tmp, index=False)
        return table
