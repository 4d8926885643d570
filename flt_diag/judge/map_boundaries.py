"""Reading a stability-map folder (torch-free): the criteria, the lines, the bracket each line's
finished probes give, and the boundary tables (`boundaries`, `critical_values`, `critical_table`) that
the report, the figure and `flt-diag map` print. The search that runs the probes is
flt_diag/grids/stability_map.py."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pandas as pd

from flt_diag.storage.cells import RunId
from flt_diag.storage.file_models import MapSpecFile, Summary
from flt_diag.storage.folders import CELLS, ERROR, StorageError, cell_path, load_spec, load_summary, run_state
from flt_diag.storage.predictor_names import COLLAPSE
from flt_diag.storage.run_activity import activity
from flt_diag.config.variants import VARIANTS


AXES = {"lr": "lr scale", "depth": "depth L"}


CRITERIA: dict[str, Callable[[Summary], bool]] = {  # (residual_explosion_any: since v2's peak over every loop)
    "training": lambda s: s.verdict != "stable",
    "collapse": lambda s: s.verdict in COLLAPSE,
    "explosion": lambda s: bool(s.residual_explosion if s.residual_explosion_any is None else s.residual_explosion_any)
    or s.verdict == "diverged",
}


MAP_CSV = "map.csv"


def log_median(values) -> float:
    """The median of boundaries (positive grid values) on the log scale a map's axis is read on: 2 ** median of
    log2; with an even count the geometric middle of the middle two (16 and 128 give 45.3, not 72)."""
    return float(2 ** pd.Series(values, dtype=float).map(math.log2).median())


def map_lines(spec) -> list[RunId]:
    """The lines of a map (`spec`: grids.stability_map.MapSpec, or a map's sweep.json read back): identities
    without an lr scale."""
    grid = [(k, s, v) for s in spec.seeds for k in spec.loops for v in spec.variants]
    return [RunId(v, k, s, index=i) for i, (k, s, v) in enumerate(grid)]


def probe_cell(spec, line: RunId, value: float) -> RunId:
    """The sweep cell of a line's probe at one axis value."""
    if spec.axis == "lr":
        return replace(line, lr_scale=float(value), index=-1)
    return replace(line, lr_scale=float(spec.base.train.lr_scale), depth=int(value), index=-1)


def bracket(known: dict[int, bool], n: int) -> tuple[int, int, bool]:
    """(a, b, monotone) from the known outcomes {grid index: broke}: a = the highest index that held
    below the lowest that broke (b; n if none broke). monotone is False when some index above b held."""
    broken = [i for i, bad in known.items() if bad]
    b = min(broken) if broken else n
    held = [i for i, bad in known.items() if not bad and i < b]
    a = max(held) if held else -1
    monotone = not any(not bad and i > b for i, bad in known.items())
    return a, b, monotone


def probe_path(out: Path, name: str) -> Path:
    """Where a probe's run is: its cell folder in a map folder, or its record in the map's archive
    (`flt-diag archive` keeps a map as sweep.json and one `<cell>.parquet` per finished probe; a map resumed from
    its archive holds the archived probes so: flt_diag.storage.folders.cell_path)."""
    return cell_path(out, name)


def probe_outcomes(spec, out: Path, line: RunId, criterion: str) -> dict[int, bool]:
    """Outcomes of the line's finished probes under one criterion, from their summary.json."""
    summaries = {i: load_summary(probe_path(out, probe_cell(spec, line, value).name)) for i, value in enumerate(spec.grid)}
    return {i: CRITERIA[criterion](s) for i, s in summaries.items() if s is not None}


def spec_from_folder(out: Path) -> MapSpecFile:
    spec = load_spec(out)  # checked (flt_diag.storage.files): a map folder without criteria is one line
    if not isinstance(spec, MapSpecFile):
        raise StorageError(f"{out} is a sweep folder, not a stability map (made by `flt-diag map`)")
    return spec


def boundaries(out: Path) -> pd.DataFrame:
    """One row per (line, criterion): the bracket found so far, from the finished probes alone.

    status: "found" (boundary in (last_ok, first_broken]), "below grid" (broke at the lowest value),
    "above grid" (held at the highest), "open" (search unfinished), "non-monotone"."""
    spec = spec_from_folder(out)
    grid = spec.grid
    rows = []
    for line in map_lines(spec):
        for criterion in spec.criteria:
            known = probe_outcomes(spec, out, line, criterion)
            a, b, monotone = bracket(known, len(grid))
            failed = any(run_state(probe_path(out, probe_cell(spec, line, v).name)) == "failed" for v in grid)
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
                             axis=spec.axis, last_ok=last_ok, first_broken=first_broken, boundary=boundary,
                             status=status, probes=len(known)))
    return pd.DataFrame(rows, columns=["variant", "loops", "seed", "criterion", "axis", "last_ok", "first_broken",
                                       "boundary", "status", "probes"])


def unfinished(out: Path, lines: list[RunId] | None = None) -> str | None:
    """Why the map's search is not complete (one line), or None: the lines (all, or `lines`) where a probe is busy
    (another process holds it: which, since when), where a probe failed (its error.txt says why) or where the search
    stopped short without even that record (a failure that could not be written, e.g. on a full disk). A map that
    is not complete exits non-zero."""
    table = boundaries(out)
    stuck = table[table.status.isin(["failed", "open"])]
    spec = spec_from_folder(out)
    names = sorted({RunId(r.variant, r.loops, r.seed).name for r in stuck.itertuples()})
    if lines is not None:
        names = [n for n in names if n in {line.name for line in lines}]
    if not names:
        return None
    busy = {}
    for line in (line for line in map_lines(spec) if line.name in names):
        for value in spec.grid:
            a = activity(probe_path(out, probe_cell(spec, line, value).name))
            if a.state == "running":
                busy[line.name] = f"{line.name}'s probe at {spec.axis} {value:g} is busy, {a.detail()}"
    total = len(lines) if lines is not None else len(map_lines(spec))
    failed = [n for n in names if n not in busy]
    said = [f"{len(busy)} of {total} map lines are busy in another process ({'; '.join(list(busy.values())[:2])}"
            f"{'; ...' if len(busy) > 2 else ''}): wait for it, or stop it"] if busy else []
    if failed:
        said.append(f"{len(failed)} of {total} map lines did not finish their search ({', '.join(failed[:4])}"
                    f"{', ...' if len(failed) > 4 else ''}): a probe failed; see {out}/{CELLS}/<cell>/{ERROR} where it "
                    "exists")
    return "; ".join(said)


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
        rows.append(dict(criterion=criterion, variant=variant, loops=loops, median=found.median(), low=found.min(),
                         high=found.max(), seeds=len(g), text=text))  # (NaN where none was found)
    return pd.DataFrame(rows)


def critical_table(out: Path) -> pd.DataFrame:
    """The critical values as a text table: one row per variant, one column per (criterion, K)."""
    crit = critical_values(out)
    if crit.empty:
        return pd.DataFrame()
    axis = spec_from_folder(out).axis
    crit = crit.assign(column=[f"{c} at K={k} ({AXES[axis]})" for c, k in zip(crit.criterion, crit.loops)])
    table = crit.pivot(index="variant", columns="column", values="text")
    order = [v for v in VARIANTS if v in table.index]
    table = table.reindex(order + [v for v in table.index if v not in order])[list(dict.fromkeys(crit.column))]
    return table.reset_index().rename(columns={"variant": "Variant"})
