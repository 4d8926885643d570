"""A sweep's or a map's spec from the typed options of run-ablation or map (from the command line or a
study file): the base config settled once with the grid's first cell (docs/DESIGN.md §7, "Settling");
`settled=False` (for `--list`, which runs nothing) checks every option but loads no tokenizer.
"""
from __future__ import annotations

from pathlib import Path
from typing import cast

from flt_diag.cli.options import FolderOptions, MapOptions, Param, RunAblationOptions, command_args, command_options
from flt_diag.config.option_fields import ConfigError, check, dest, form
from flt_diag.grids.stability_map import MapSpec
from flt_diag.grids.sweep import SweepSpec, cell_config
from flt_diag.training.settle import run_config, unsettled_config


def sweep_spec(o: RunAblationOptions, settled: bool = True) -> SweepSpec:
    """The SweepSpec of run-ablation's options."""
    config = run_config if settled else unsettled_config
    base = config(o.config, variant=o.variants[0], loops=o.loops[0], seed=o.seeds[0], lr_scale=o.lr_scale[0])
    return SweepSpec(base, o.variants, o.loops, o.seeds, o.lr_scale)


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


def study_options(command: str) -> list[Param]:
    """The options a study table of `command` takes (its command's, but --workers, --list, ...)."""
    return [p for p in command_options(command) if p[1] not in FolderOptions.model_fields]


def load_study(path: Path, **folder) -> tuple[str, RunAblationOptions | MapOptions]:
    """A study file -> (command, its typed options, with the `folder` options given beside the file), each
    value checked against its field as on the command line (a bad one: "<file>: [table] key <problem>"). One
    value of a list option is a list of one; a path is text in the file."""
    from flt_diag.storage.errors import BadFile
    from flt_diag.storage.files import load_study as load_table
    table, values = load_table(path, {t: [dest(n, f) for _, n, f in study_options(c)] for t, c in STUDY_TABLES.items()})
    command = STUDY_TABLES[table]

    def where(name, info) -> str:
        return f"{path}: [{table}] {dest(name, info)}"
    try:
        for _, n, f in study_options(command):
            x, kind = values.get(dest(n, f)), form(f)
            x = [x] if kind.many and x is not None and not isinstance(x, list) else x
            if kind.kind is Path and x is not None:  # (text in the file)
                x = [*map(Path, check(list[str], x, where(n, f)))] if kind.many else Path(check(str, x, where(n, f)))
            values[dest(n, f)] = x
        args = command_args(command, {**values, **folder}, where)
    except ConfigError as e:  # (a file's problem: the file's error)
        raise BadFile(str(e)) from None
    except RecursionError:  # a value nested too deep for the validator
        raise BadFile(f"{path}: [{table}] holds a value nested too deep to be an option") from None
    if isinstance(args, MapOptions):
        try:
            args.values(args.axis)  # its grid, derived from lo, hi and ratio: the file's problem too
        except ValueError as e:
            raise BadFile(f"{path}: [{table}] {e}") from None
    return command, cast("RunAblationOptions | MapOptions", args)
