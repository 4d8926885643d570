"""A sweep's or a map's spec from the typed options of run-ablation or map (from the command line or a
study file): the base config settled once with the grid's first cell (docs/DESIGN.md §7, "Settling");
`settled=False` (for `--list`, which runs nothing) checks every option but loads no tokenizer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import create_model

from flt_diag.cli.options import FOLDER_OPTIONS, MapOptions, RunAblationOptions, command_args, command_options
from flt_diag.config.option_fields import Option, Options, like
from flt_diag.grids.stability_map import MapSpec
from flt_diag.grids.sweep import SweepSpec, cell_config
from flt_diag.training.settle import run_config, unsettled_config


def sweep_spec(o: RunAblationOptions, settled: bool = True) -> SweepSpec:
    """The SweepSpec of run-ablation's options."""
    config = run_config if settled else unsettled_config
    base = config(o.config, variant=o.variants[0], loops=o.loops[0], seed=o.seeds[0], lr_scale=o.lr_scales[0])
    return SweepSpec(base, o.variants, o.loops, o.seeds, o.lr_scales)


def map_spec(o: MapOptions, settled: bool = True) -> MapSpec:
    """The MapSpec of map's options; every probe's config is checked."""
    grid = o.values(o.axis)
    config = run_config if settled else unsettled_config
    base = config(o.config, variant=o.variants[0], loops=o.loops[0], seed=o.seeds[0],
                  lr_scale=grid[0] if o.axis == "lr" else None)
    spec = MapSpec(base, o.variants, o.loops, o.seeds, o.axis, grid, o.criteria)
    for line in spec.lines():
        for value in grid:
            cell_config(base, spec.cell(line, value))
    return spec


STUDY_TABLES = {"ablation": "run-ablation", "map": "map"}


def study_options(command: str) -> list:
    """The options a study table of `command` takes (its command's, but --workers, --list, ...)."""
    return [o for o in command_options(command) if o not in FOLDER_OPTIONS]


def study_tables() -> dict[str, type]:
    """A study file's tables and the model of the options each takes, named as users type them, each optional;
    a path is text (as a TOML file holds it)."""
    def field(o: Option) -> tuple:
        kind, info = like(o.info, required=False)
        return Optional[(list[str] if o.many else str) if o.kind is Path else kind], info
    return {table: create_model("Given", __base__=Options, **{o.dest: field(o) for o in study_options(command)})
            for table, command in STUDY_TABLES.items()}


def load_study(path: Path, **folder) -> tuple[str, RunAblationOptions | MapOptions]:
    """A study file -> (command, its typed options, with the `folder` options given beside the file), checked
    like command-line options (flt_diag.storage.files.load_study)."""
    from flt_diag.storage.files import load_study as load_checked
    table, values = load_checked(path, study_tables())
    command = STUDY_TABLES[table]
    paths = {o.dest: o.many for o in study_options(command) if o.kind is Path}  # (text in the file)
    values = {k: x if k not in paths or x is None else [Path(v) for v in x] if paths[k] else Path(x)
              for k, x in values.items()}
    return command, command_args(command, {**values, **folder})
