"""From the typed options to parsers, configs and specs.

Every training option is a field of a config section (flt_diag.config), every grid option a field of
SweepSpec, MapSpec or MapGrid (`opt(...)` metadata: help, flag, bounds, choices, commands). This
module turns those fields into argparse options (`add_options`), checks parsed values
(`check_values`, i.e. `Option.check`), builds a run's config and a sweep's or map's spec from option
values (from the command line or a study file: `load_study`), and writes the README's option table
(`options_markdown`). flt_diag.cli.commands holds the commands.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from flt_diag.config import PRESETS, Option, options_for, options_of, sections_from

SECTION_TITLES = {"run": "preset", "model": "model", "train": "training", "diagnostics": "diagnostics",
                  "verdict": "verdict thresholds", "sweep": "sweep grid", "map": "map grid", "cli": "this command"}


class UserError(Exception):
    """A mistake in the user's input: reported as one line."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (UserError) instead of usage text + exit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)  # `--step` is not silently `--steps`

    def error(self, message):
        raise UserError(message)


def cli_opt(flag: str, kind: type, help: str, default=None, *, many=False, low=None, high=None, above=None,
            choices=None, optional=True) -> Option:
    """An option of one command that is not a config field (output folder, workers, ...)."""
    return Option("cli", flag[2:].replace("-", "_"), flag, kind, optional, many, default, help,
                  tuple(choices) if choices else None, low, high, above, None, frozenset())


def _grid_options():
    from flt_diag.grids.stability_map import MapGrid, MapSpec
    from flt_diag.grids.sweep import SweepSpec
    return {"run-ablation": options_of(SweepSpec, "sweep"),
            "map": options_of(MapSpec, "map") + options_of(MapGrid, "map")}


def _split(kind: type, flag: str):
    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
    return convert


class ListAction(argparse.Action):
    """nargs='+' with commas allowed (`--loops 3,6 9`) and repetition adding to the list."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = []
        for v in values:
            parts = v.split(",")
            if any(not p.strip() for p in parts):
                raise UserError(f"{option_string}: empty value in {v!r}")
            try:
                items += [self.convert(p.strip()) for p in parts]
            except argparse.ArgumentTypeError as e:
                raise UserError(f"argument {option_string}: {e}") from None
        setattr(namespace, self.dest, (getattr(namespace, self.dest) or []) + items)


def _default_text(o: Option) -> str:
    if o.kind is bool and o.default is None:
        return ""
    shown = " ".join(map(str, o.default)) if o.many and o.default is not None else o.default
    presets = [f"{name} {p[o.section][o.name]}" for name, p in PRESETS.items()
               if o.section in p and o.name in p[o.section]]
    if "[default" in o.help or o.default is None and not presets:
        return ""
    if len(presets) == len(PRESETS):
        return f" [default by preset: {', '.join(presets)}]"
    return f" [default: {shown}" + (f"; preset {', '.join(presets)}" if presets else "") + "]"


def add_option(group, o: Option) -> None:
    kwargs = dict(dest=o.dest, default=None, help=o.help + _default_text(o))
    if o.kind is bool:  # config switches get --x/--no-x; a command's own switches are plain flags
        action = "store_true" if o.section == "cli" else argparse.BooleanOptionalAction
        group.add_argument(o.flag, action=action, **kwargs)
        return
    metavar = {int: "N", float: "X", str: "TEXT", Path: "PATH"}[o.kind]
    if o.choices and o.many:
        metavar, kwargs["help"] = "NAME", f"{kwargs['help']} Choices: {', '.join(o.choices)}."
    elif o.choices:
        metavar = "{" + ",".join(o.choices) + "}"
    if o.many:
        action = group.add_argument(o.flag, nargs="+", action=ListAction, metavar=metavar, **kwargs)
        action.convert = _split(o.kind, o.flag) if o.kind in (int, float) else o.kind
    else:
        group.add_argument(o.flag, type=_split(o.kind, o.flag) if o.kind in (int, float) else o.kind,
                           metavar=metavar, **kwargs)


def add_options(parser, options: list[Option]) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for o in options:
        if o.section not in groups:
            groups[o.section] = parser.add_argument_group(SECTION_TITLES.get(o.section, o.section))
        add_option(groups[o.section], o)


def check_values(values: dict, options: list[Option]) -> dict:
    """Validate the given values of `options` (one line on the first bad one); defaults filled in
    for the command-level options."""
    out = dict(values)
    for o in options:
        v = values.get(o.dest)
        if v is None:
            if o.section == "cli":
                out[o.dest] = o.default
            continue
        problem = o.check(v)
        if problem:
            raise UserError(problem)
    return out


# ------------------------------------------------------------------ the commands' own options

OUT_RUN = cli_opt("--out", Path, "Run folder [default: runs/<variant>-K<loops>]. An unfinished run in it is resumed.")
OUT_SWEEP = cli_opt("--out", Path, "Sweep folder [default: runs/ablation-<preset>]. Re-running resumes it.")
OUT_MAP = cli_opt("--out", Path, "Map folder [default: runs/map-<axis>-<preset>]. Re-running resumes it.")
WORKERS = cli_opt("--workers", int, "Cells (lines for maps) in parallel processes; 0 = auto (one per CPU core, each "
                  "with one thread; one per GPU on a multi-GPU machine).", 0, low=0, optional=False)
LIST = cli_opt("--list", bool, "Print the cells (index, name, status) and exit.", False)
CELL = cli_opt("--cell", int, "Run only cell (map: line) I, for job arrays.", low=0)
QUIET = cli_opt("--quiet", bool, "No progress bar.", False)
FOLDER_OPTIONS = [WORKERS, LIST, CELL, QUIET]

COMMAND_OPTIONS: dict[str, list[Option]] = {
    "train": [OUT_RUN],
    "run-ablation": [OUT_SWEEP, *FOLDER_OPTIONS],
    "map": [OUT_MAP, *FOLDER_OPTIONS],
}


def command_options(command: str) -> list[Option]:
    """Every option of `train`, `run-ablation` or `map`: grid, config, then the command's own."""
    return _grid_options().get(command, []) + options_for(command) + COMMAND_OPTIONS[command]


# ------------------------------------------------------------------ configs from option values

def build_run_config(values: dict, **grid):
    """The RunConfig of option values (Option.dest -> value, None = not given) with the grid's
    fields of one cell (variant, loops, seed, lr_scale); every problem is one UserError line."""
    import torch
    from flt_diag.config import build_config
    from flt_diag.training.trainer import resolve_device

    values = {**values, **{k: v for k, v in grid.items() if v is not None}}
    if values.get("stop_on_collapse"):
        values["warn"] = True
    sections = sections_from(values)
    device = values.get("device") or "auto"
    cuda = device != "cpu" and torch.cuda.is_available()
    if values.get("predictor") is not None or values.get("warn"):
        from flt_diag.analysis.early_warning import load_predictor
        try:
            load_predictor(values.get("predictor"))
        except ValueError as e:
            raise UserError(str(e)) from None
    try:
        cfg = build_config(sections.pop("preset", "auto"), cuda, **sections)
        resolve_device(cfg.train.device)
    except ValueError as e:
        raise UserError(str(e)) from None
    check_data(cfg.train.data, cfg.train.tokenizer, cfg)
    return cfg


def settled(cfg):
    """The config with its vocabulary from the tokenizer (flt_diag.training.trainer.settle), so that a tokenizer
    that cannot be fetched is reported in one line before anything runs."""
    from flt_diag.data.corpus import DataError
    from flt_diag.training.trainer import settle
    try:
        return settle(cfg)
    except DataError as e:
        raise UserError(f"{e} (paper presets use the reference's Qwen3 tokenizer: fetch it once with network "
                        "access, or pass --tokenizer path/to/tokenizer.json)" if "Qwen" in cfg.train.tokenizer
                        else str(e)) from None


def check_data(data: str, tokenizer: str, cfg=None) -> None:
    from flt_diag.data.corpus import DataError
    from flt_diag.data.sources import check_source
    try:
        check_source(data, tokenizer, cfg)  # with the run's config, a task's dials against its --seq-len
    except DataError as e:
        raise UserError(str(e)) from None
    if tokenizer.endswith(".json") and not Path(tokenizer).exists():
        raise UserError(f"tokenizer file {tokenizer} does not exist")


# ------------------------------------------------------------------ grid specs and study files

def sweep_spec(v: dict):
    """The SweepSpec of run-ablation option values (from the command line or a study file)."""
    from flt_diag.grids.sweep import SweepSpec
    from flt_diag.model.variants import VARIANTS
    grid = dict(variants=v.get("variants") or list(VARIANTS), loops=v.get("loops") or [3, 6, 9, 12],
                seeds=v.get("seeds") or [0], lr_scales=v.get("lr_scale") or [1.0])
    base = build_run_config({k: x for k, x in v.items() if k not in ("loops", "lr_scale")},
                            variant=grid["variants"][0], loops=grid["loops"][0], seed=grid["seeds"][0],
                            lr_scale=grid["lr_scales"][0])
    try:
        return SweepSpec(base, **grid)
    except ValueError as e:
        raise UserError(str(e)) from None


def map_spec(v: dict):
    """The MapSpec of map option values (from the command line or a study file)."""
    from flt_diag.grids.stability_map import MapGrid, MapSpec
    from flt_diag.model.variants import VARIANTS
    grid_values = {k: v[k] for k in ("lo", "hi", "ratio") if v.get(k) is not None}
    try:
        axis = v.get("axis") or "lr"
        grid = MapGrid(**grid_values).values(axis)
    except ValueError as e:
        raise UserError(str(e)) from None
    lines = dict(variants=v.get("variants") or list(VARIANTS), loops=v.get("loops") or [6, 12],
                 seeds=v.get("seeds") or [0])
    base = build_run_config({k: x for k, x in v.items() if k != "loops"}, variant=lines["variants"][0],
                            loops=lines["loops"][0], seed=lines["seeds"][0],
                            lr_scale=grid[0] if axis == "lr" else None)
    try:
        spec = MapSpec(base, **lines, axis=axis, grid=grid, criteria=v.get("criteria") or ["training", "explosion"])
        from flt_diag.grids.sweep import cell_config
        for line in spec.lines():  # every probe's config is valid before anything runs
            for value in grid:
                cell_config(base, spec.cell(line, value))
    except ValueError as e:
        raise UserError(str(e)) from None
    return spec


STUDY_TABLES = {"ablation": "run-ablation", "map": "map"}


def load_study(path: Path) -> tuple[str, dict]:
    """A study file -> (command, option values): its one [ablation] or [map] table, whose keys are
    the command's option names (`lr_scale`, `seq_len`, ...), checked like command-line options."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        spec = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"no such study file: {path}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a readable study file ({type(e).__name__})") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
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
        if o.kind is Path and isinstance(value, str):
            value = Path(value)
        if o.many and not isinstance(value, list):
            value = [value]
        if o.kind is float and (isinstance(value, int) and not isinstance(value, bool)):
            value = float(value)
        elif o.kind is float and o.many and isinstance(value, list):
            value = [float(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in value]
        values[o.dest] = value
    check_values(values, list(known.values()))
    return command, values


def options_markdown() -> str:
    """The README's table of every option of train, run-ablation and map (and summary's thresholds),
    generated from the same definitions as the parser; a test keeps the README equal to it."""
    rows, seen = ["| option | commands | default | meaning |", "|---|---|---|---|"], {}
    for command in ("run-ablation", "map", "train"):
        for o in command_options(command):
            key = (o.flag, o.help)
            seen.setdefault(key, (o, []))[1].append(command)
    for o in options_for("summary"):
        seen[(o.flag, o.help)][1].append("summary --recompute")
    for (flag, _), (o, commands) in seen.items():
        name = f"`{flag}`" + (f" / `--no-{flag[2:]}`" if o.kind is bool and o.section != "cli" else "")
        default = _default_text(o).strip()[1:-1].replace("default: ", "").replace("default by preset: ", "")
        rows.append(f"| {name} | {', '.join(commands)} | {default or '-'} | {o.help.replace('|', '/')} |")
    return "\n".join(rows)
