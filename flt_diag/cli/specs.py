"""A sweep's or a map's spec from option values (from the command line or a study file).

The base config of the grid is settled once (flt_diag.settle.run_config) with the grid's first cell;
SweepSpec and MapSpec take it as given and check every cell before anything runs. `settled=False`
(for `--list`, which runs nothing) checks every option but loads no tokenizer.
"""
from __future__ import annotations

from pathlib import Path

from flt_diag.cli.options import FOLDER_OPTIONS, UserError, check_values, command_options
from flt_diag.grids.stability_map import MapGrid, MapSpec
from flt_diag.grids.sweep import SweepSpec, cell_config
from flt_diag.model.variants import VARIANTS
from flt_diag.settle import run_config, unsettled_config

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


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


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"no such study file: {path}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a readable study file ({type(e).__name__})") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None


def _as_option_value(o, value):
    """A TOML value as the command line would give it (lists for list options, floats for floats)."""
    if o.kind is Path and isinstance(value, str):
        value = Path(value)
    if o.many and not isinstance(value, list):
        value = [value]
    if o.kind is float:
        def number(x):
            return float(x) if isinstance(x, int) and not isinstance(x, bool) else x
        value = [number(x) for x in value] if isinstance(value, list) else number(value)
    return value


def load_study(path: Path) -> tuple[str, dict]:
    """A study file -> (command, option values): its one [ablation] or [map] table, whose keys are
    the command's option names (`lr_scale`, `seq_len`, ...), checked like command-line options."""
    spec = _read_toml(path)
    tables = [t for t in STUDY_TABLES if t in spec]
    if len(tables) != 1 or not isinstance(spec[tables[0]], dict):
        raise UserError(f"{path}: needs exactly one [ablation] or [map] table")
    command = STUDY_TABLES[tables[0]]
    known = {o.dest: o for o in command_options(command) if o not in FOLDER_OPTIONS}
    values = {}
    for key, value in spec[tables[0]].items():
        o = known.get(key.replace("-", "_"))
        if o is None:
            raise UserError(f"{path}: unknown option {key!r} in [{tables[0]}] (the options of `flt-diag {command}`)")
        values[o.dest] = _as_option_value(o, value)
    check_values(values, list(known.values()))
    return command, values
