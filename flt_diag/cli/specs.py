"""A sweep's or a map's spec from option values (from the command line or a study file).

The base config of the grid is settled once (flt_diag.training.settle.run_config) with the grid's first cell;
SweepSpec and MapSpec take it as given and check every cell before anything runs. `settled=False`
(for `--list`, which runs nothing) checks every option but loads no tokenizer.
"""
from __future__ import annotations

from pathlib import Path

from flt_diag.cli.options import FOLDER_OPTIONS, command_options
from flt_diag.vocab.grid_options import MapGrid
from flt_diag.grids.stability_map import MapSpec
from flt_diag.grids.sweep import SweepSpec, cell_config
from flt_diag.vocab.variants import VARIANTS
from flt_diag.training.settle import run_config, unsettled_config

def sweep_spec(v: dict, settled: bool = True) -> SweepSpec:
    """The SweepSpec of run-ablation option values."""
    grid = dict(variants=v.get("variants") or list(VARIANTS), loops=v.get("loops") or [3, 6, 9, 12],
                seeds=v.get("seeds") or [0], lr_scales=v.get("lr_scale") or [1.0])
    config = run_config if settled else unsettled_config
    base = config({k: x for k, x in v.items() if k not in ("loops", "lr_scale")}, variant=grid["variants"][0],
                  loops=grid["loops"][0], seed=grid["seeds"][0], lr_scale=grid["lr_scales"][0])
    return SweepSpec(base, **grid)


def map_spec(v: dict, settled: bool = True) -> MapSpec:
    """The MapSpec of map option values; every probe's config is checked."""
    axis = v.get("axis") or "lr"
    grid = MapGrid(**{k: v[k] for k in ("lo", "hi", "ratio") if v.get(k) is not None}).values(axis)
    lines = dict(variants=v.get("variants") or list(VARIANTS), loops=v.get("loops") or [6, 12],
                 seeds=v.get("seeds") or [0])
    config = run_config if settled else unsettled_config
    base = config({k: x for k, x in v.items() if k != "loops"}, variant=lines["variants"][0], loops=lines["loops"][0],
                  seed=lines["seeds"][0], lr_scale=grid[0] if axis == "lr" else None)
    spec = MapSpec(base, **lines, axis=axis, grid=grid, criteria=v.get("criteria") or ["training", "explosion"])
    for line in spec.lines():
        for value in grid:
            cell_config(base, spec.cell(line, value))
    return spec


STUDY_TABLES = {"ablation": "run-ablation", "map": "map"}


def study_tables() -> dict[str, list]:
    """A study file's tables and the options each takes (its command's, but --workers, --list, ...)."""
    return {table: [o for o in command_options(command) if o not in FOLDER_OPTIONS]
            for table, command in STUDY_TABLES.items()}


def load_study(path: Path) -> tuple[str, dict]:
    """A study file -> (command, option values): its one [ablation] or [map] table, whose keys are
    the command's option names (`lr_scale`, `seq_len`, ...), checked like command-line options
    (flt_diag.storage.files.load_study: a bad value is one line naming the file and the key)."""
    from flt_diag.storage.files import load_study as load_checked
    table, values = load_checked(path, study_tables())
    return STUDY_TABLES[table], values
