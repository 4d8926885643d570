"""The `flt-diag` command line: a thin layer generated from the typed options.

Every training option is a field of a config section (flt_diag.config), every grid option a field of
SweepSpec, MapSpec or MapGrid; each command's parser is generated from those fields, so an option
exists in every command that accepts it (its `commands`), with the same help, and is validated in
one place (`Option.check`). List options take space-separated values (`--loops 3 6 9 12`), commas
(`--loops 3,6`) or repetition. Errors a user can cause print one line (`error: ...`) and exit with
status 2; nothing already written is touched. Ctrl-C exits with 130.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .config import PRESETS, Option, options_for, options_of, sections_from
from .variants import MAX_LOOPS, VARIANT_DESCRIPTIONS

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
    from .stability_map import MapGrid, MapSpec
    from .sweep import SweepSpec
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
    shown = " ".join(map(str, o.default)) if o.many else o.default
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
    from .config import build_config
    from .train import resolve_device

    values = {**values, **{k: v for k, v in grid.items() if v is not None}}
    if values.get("stop_on_collapse"):
        values["warn"] = True
    sections = sections_from(values)
    device = values.get("device") or "auto"
    cuda = device != "cpu" and torch.cuda.is_available()
    if values.get("predictor") is not None or values.get("warn"):
        from .early_warning import load_predictor
        try:
            load_predictor(values.get("predictor"))
        except ValueError as e:
            raise UserError(str(e)) from None
    try:
        cfg = build_config(sections.pop("preset", "auto"), cuda, **sections)
        resolve_device(cfg.train.device)
    except ValueError as e:
        raise UserError(str(e)) from None
    _check_data(cfg.train.data, cfg.train.tokenizer)
    return cfg


def _settled(cfg):
    """The config with its vocabulary from the tokenizer (flt_diag.train.settle), so that a tokenizer
    that cannot be fetched is reported in one line before anything runs."""
    from .data import DataError
    from .train import settle
    try:
        return settle(cfg)
    except DataError as e:
        raise UserError(f"{e} (paper presets use the reference's Qwen3 tokenizer: fetch it once with network "
                        "access, or pass --tokenizer path/to/tokenizer.json)" if "Qwen" in cfg.train.tokenizer
                        else str(e)) from None


def _check_data(data: str, tokenizer: str) -> None:
    from .data import DataError, resolve_corpus
    try:
        resolve_corpus(data)
    except DataError as e:
        raise UserError(str(e)) from None
    if tokenizer.endswith(".json") and not Path(tokenizer).exists():
        raise UserError(f"tokenizer file {tokenizer} does not exist")


# ------------------------------------------------------------------ train

def cmd_train(v: dict) -> int:
    """Train one variant into one run folder, with diagnostics, and print its verdict."""
    cfg = build_run_config(v)
    out = v["out"] or Path("runs") / f"{cfg.model.variant}-K{cfg.model.loops}"
    cfg = _settled(cfg)  # a tokenizer that cannot be loaded: one line now, before the run folder exists
    from .train import Trainer

    trainer = Trainer(cfg, out, progress=_console_progress(cfg.train.steps, f"{cfg.model.variant} K={cfg.model.loops}"))
    if trainer.is_main:
        print(trainer.describe(), flush=True)
    summary = trainer.fit()
    _progress_bar.close()
    if summary:  # empty on DDP ranks other than 0
        _print_run_summary(out, summary)
    return 0


class _ConsoleProgress:
    def __init__(self):
        self.bar = None

    def __call__(self, info: dict) -> None:
        if self.bar is None:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), redirect_stdout=False, redirect_stderr=False)
            self.task = self.bar.add_task(self.label, total=self.total, loss="-")
            self.bar.start()
        self.bar.update(self.task, completed=info["step"], loss=f"{info['loss']:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


_progress_bar = _ConsoleProgress()


def _console_progress(total: int, label: str) -> _ConsoleProgress:
    _progress_bar.total, _progress_bar.label = total, label
    return _progress_bar


def _print_run_summary(out: Path, s: dict) -> None:
    ev = s.get("evidence", {})
    verdict = s["verdict"] + (f" (predicted at step {s['prediction']['step']})" if s.get("prediction") else "")
    print(f"{out}: {verdict} ({ev.get('reason', '')}); final loss {s['final_loss']:.3f}, best "
          f"{s['best_loss']:.3f}, val {s['val_loss']:.3f}; peak final-loop residual norm {s['peak_resid_norm']:.1f}"
          f"{' (EXPLODED)' if s['residual_explosion'] else ''}; grad-norm CV {s['osc_cv']:.2f}")


# ------------------------------------------------------------------ sweeps and maps

def sweep_spec(v: dict):
    """The SweepSpec of run-ablation option values (from the command line or a study file)."""
    from .sweep import SweepSpec
    from .variants import VARIANTS
    grid = dict(variants=v.get("variants") or list(VARIANTS), loops=v.get("loops") or [3, 6, 9, 12],
                seeds=v.get("seeds") or [0], lr_scales=v.get("lr_scale") or [1.0])
    base = build_run_config({k: x for k, x in v.items() if k not in ("loops", "lr_scale")},
                            variant=grid["variants"][0], loops=grid["loops"][0], seed=grid["seeds"][0],
                            lr_scale=grid["lr_scales"][0])
    try:
        return SweepSpec(base, **grid)
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_run_ablation(v: dict) -> int:
    """Train every variant at every loop count (x seeds x lr scales) and summarise how they collapse."""
    from .sweep import cell_status, run_sweep
    spec = sweep_spec(v)
    out = v["out"] or Path("runs") / f"ablation-{spec.base.preset}"
    cells, cell = spec.cells(), v["cell"]
    if _listed_or_picked(cells, v, lambda c: f"{c.index:4d}  {c.name:32s} {cell_status(out, c)}"):
        return 0
    from .model import count_parameters
    n = count_parameters(_settled(spec.base).model)
    m = spec.base.model
    print(f"model: L={m.n_layer} d={m.n_embd} heads={m.n_head}, {n:,} parameters ({n / 1e6:.1f}M) per cell", flush=True)
    df = run_sweep(spec, out, workers=v["workers"], only_cell=cell, show_progress=not v["quiet"])
    _print_table(df)
    print(f"sweep folder: {out}  (plots: flt-diag plot all {out}; report: flt-diag report {out})")
    return _failed_cells(out, cells if cell is None else [cells[cell]])


def _listed_or_picked(items: list, v: dict, line) -> bool:
    """`--list`: print one line per cell (or map line) and say so; `--cell I` must name one of them."""
    if v["list"]:
        for item in items:
            print(line(item))
        return True
    if v["cell"] is not None and not 0 <= v["cell"] < len(items):
        raise UserError(f"--cell must be in 0..{len(items) - 1}, got {v['cell']}")
    return False


def _failed_cells(out: Path, cells) -> int:
    """One line and exit status 1 when any cell of the sweep failed (its error.txt says why)."""
    from .sweep import cell_status
    failed = [c.name for c in cells if cell_status(out, c) == "failed"]
    if failed:
        print(f"error: {len(failed)} of {len(cells)} cells failed ({', '.join(failed[:4])}"
              f"{', ...' if len(failed) > 4 else ''}); see {out}/cells/<cell>/error.txt", file=sys.stderr)
        return 1
    return 0


def map_spec(v: dict):
    """The MapSpec of map option values (from the command line or a study file)."""
    from .stability_map import MapGrid, MapSpec
    from .variants import VARIANTS
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
        from .sweep import cell_config
        for line in spec.lines():  # every probe's config is valid before anything runs
            for value in grid:
                cell_config(base, spec.cell(line, value))
    except ValueError as e:
        raise UserError(str(e)) from None
    return spec


def cmd_map(v: dict) -> int:
    """Where each variant's training breaks: bisection along lr scale or depth, per variant and K."""
    from .stability_map import critical_values, run_map
    from .sweep import auto_workers
    spec = map_spec(v)
    out = v["out"] or Path("runs") / f"map-{spec.axis}-{spec.base.preset}"
    if _listed_or_picked(spec.lines(), v, lambda line: f"{line.index:4d}  {line.name}"):
        return 0
    _settled(spec.base)  # a tokenizer that cannot be loaded: one line now, before any probe
    ratio = v.get("ratio") or 1.41
    print(f"map: {len(spec.lines())} lines x {len(spec.criteria)} criteria; {spec.axis} grid "
          f"{', '.join(f'{x:g}' for x in spec.grid)} (each boundary within x{ratio:g})", flush=True)
    run_map(spec, out, workers=v["workers"] or auto_workers(spec.base.train.device), only_line=v["cell"],
            report=lambda text: print(text, flush=True))
    crit = critical_values(out)
    for criterion, g in crit.groupby("criterion", sort=False):
        print(f"{criterion}: " + "; ".join(f"{r.variant} K={r.loops}: {r.text}" for r in g.itertuples()))
    print(f"map folder: {out}  (figure: flt-diag plot map {out}; report: flt-diag report {out})")
    return 0


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


def cmd_study(v: dict) -> int:
    """Run a named study: the [ablation] (run-ablation options) or [map] (map options) table of a TOML file."""
    command, values = load_study(v["path"])
    values = check_values({**values, **{o.dest: v[o.dest] for o in FOLDER_OPTIONS}}, command_options(command))
    return (cmd_run_ablation if command == "run-ablation" else cmd_map)(values)


# ------------------------------------------------------------------ summaries

def cmd_summary(v: dict) -> int:
    """Print the summary table of a sweep (or the summary of one run)."""
    from .storage import is_sweep, load_summary, run_dirs
    overrides = {o.name: v[o.dest] for o in options_for("summary") if v.get(o.dest) is not None}
    if overrides and not v["recompute"]:
        raise UserError("verdict thresholds need --recompute")
    path = v["path"]
    if v["recompute"]:
        from .metrics import resummarize
        for d in run_dirs(path):
            if load_summary(d) is not None:
                resummarize(d, overrides)
        if is_sweep(path):
            from .sweep import write_summary
            write_summary(path)
    if is_sweep(path):
        from .sweep import sweep_summary
        _print_table(sweep_summary(path))
        return 0
    for d in run_dirs(path):
        s = load_summary(d)
        if s is None:
            print(f"{d}: not finished")
        else:
            _print_run_summary(d, s)
    return 0


def _print_table(df) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ["variant", "loops", "seed", "lr_scale", "verdict", "residual_explosion", "final_loss", "best_loss",
            "val_loss", "peak_resid_norm", "osc_cv", "osc_sign_alternation", "loss_std", "grad_norm_std", "wall_time"]
    table = Table(title="sweep summary")
    for c in cols:
        table.add_column(c.replace("_", " "))
    for _, row in df.iterrows():
        table.add_row(*[f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols])
    Console(width=200).print(table)


# ------------------------------------------------------------------ evaluation, import, early warning

def cmd_eval_loops(v: dict) -> int:
    """Held-out loss and perplexity of each trained checkpoint at every inference loop count."""
    from .train import resolve_device
    try:
        device = str(resolve_device(v["device"]))
    except ValueError as e:
        raise UserError(str(e)) from None
    from .evaluation import eval_loops
    from .storage import CHECKPOINT, StorageError, run_dirs
    if v["data"] is not None:
        _check_data(v["data"], "bytes")
    failed = 0
    for d in run_dirs(v["path"]):
        if not (d / CHECKPOINT).exists():
            print(f"{d}: no final checkpoint yet, skipped")
            continue
        try:
            df = eval_loops(d, v["loops"], batches=v["batches"], data=v["data"], device=device)
        except (StorageError, ValueError, RuntimeError) as e:  # one bad cell does not stop the others
            print(f"{d}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            failed += 1
            continue
        finite = df[df.val_loss.apply(lambda x: x == x and abs(x) != float("inf"))]
        best = finite.loc[finite.val_loss.idxmin()] if len(finite) else None
        print(f"{d}: trained at K={int(df.trained_loops[0])}; "
              + (f"best val loss {best.val_loss:.3f} at {int(best.loops)} loops; " if best is not None else
                 "no finite val loss; ")
              + " ".join(f"{int(k)}:{x:.2f}" for k, x in zip(df.loops, df.val_loss)))
    return 1 if failed else 0


def cmd_import_reference(v: dict) -> int:
    """Import a reference-implementation checkpoint into a run folder."""
    if not v["checkpoint"].exists():
        raise UserError(f"no such checkpoint: {v['checkpoint']}")
    from .reference import import_reference, write_imported_run
    model = import_reference(v["checkpoint"], v["variant"], v["loops"], n_head=v["heads"], vocab_size=v["vocab_size"])
    write_imported_run(model, v["out"], str(v["checkpoint"]))
    print(f"imported {v['checkpoint']} as {model.cfg.variant} (K={model.cfg.loops}) into {v['out']}")
    return 0


def cmd_predict(v: dict) -> int:
    """Early warning: P(collapse) of every cell at step s beside its final verdict, and the agreement."""
    import pandas as pd
    from .early_warning import agreement, load_predictor, predict_sweep
    from .storage import run_dirs
    paths = v["paths"]
    for path in paths:
        run_dirs(path)  # a clear error for a path that is neither a run nor a sweep
    if v["figure"] is not None and v["figure"].suffix not in (".png", ".pdf", ".svg"):
        raise UserError(f"--figure must end in .png, .pdf or .svg, got {v['figure'].name}")
    try:
        model = load_predictor(v["predictor"])
        tables = {s: pd.concat([predict_sweep(path, s, model) for path in paths], ignore_index=True) for s in v["at"]}
    except ValueError as e:
        raise UserError(str(e)) from None
    target = model.get("target", "collapse")
    for s, table in tables.items():
        if table.empty:
            print(f"step {s}: no finished cell has more than {s} steps")
            continue
        for r in table.itertuples():
            print(f"{r.cell:28s} step {s}: P({target}) {r.p_collapse:.2f} -> {'WARN' if r.predicted else 'ok':4s} | "
                  f"final: {r.verdict:9s} {'agree' if r.agree else 'FALSE ALARM' if r.false_alarm else 'MISS'}  "
                  f"[{r.evidence}]")
        a = agreement(table)
        print(f"step {s}: agreement {a['accuracy']:.0%} over {a['cells']} cells ({a['positives']} with target "
              f"{target}); {a['false_alarms']} false alarms, {a['misses']} misses")
    if v["csv"] is not None:
        from .storage import atomic_write_text
        frames = [t.assign(step=s) for s, t in tables.items()]
        atomic_write_text(v["csv"], pd.concat(frames, ignore_index=True).to_csv(index=False))
    if v["figure"] is not None:
        from .early_warning import draw_agreement
        from .figures import save as save_figure
        curve = [dict(step=s, **agreement(t)) for s, t in tables.items() if len(t)]
        name = paths[0].name if len(paths) == 1 else f"{len(paths)} folders"
        print(save_figure(draw_agreement({name: curve}), v["figure"]))
    return 0


def cmd_fit_predictor(v: dict) -> int:
    """Fit the early-warning predictor (one logistic regression per step) on labelled runs."""
    from .early_warning import fit
    from .storage import run_dirs, write_json
    paths, out, at, l2, target = v["paths"], v["out"], v["at"], v["l2"], v["target"]
    for p in paths:
        run_dirs(p)
    command = "flt-diag fit-predictor " + " ".join(map(str, paths)) + f" --out {out} --at " + " ".join(map(str, at)) \
        + (f" --l2 {l2:g}" if l2 != 1.0 else "") + (f" --target {target}" if target != "fails" else "")
    try:
        model = fit(paths, at, l2, command, target)
    except ValueError as e:
        raise UserError(str(e)) from None
    write_json(out, model)
    for s, m in model["models"].items():
        print(f"step {s}: {m['runs']} runs ({m['positives']} with target {model['target']}), training accuracy "
              f"{m['train_accuracy']:.0%}; " + ", ".join(f"{f} {c:+.2f}" for f, c in zip(model["features"], m["coef"])))
    print(f"predictor: {out}")
    return 0


def cmd_variants(v: dict) -> int:
    """List the five variants and what each does in loops t >= 2."""
    for name, text in VARIANT_DESCRIPTIONS.items():
        print(f"{name:6s} {text}")
    return 0


# ------------------------------------------------------------------ plots and report

def cmd_plot(v: dict) -> int:
    from .figures import plot
    for p in plot(v["figure"], v["path"], v["out"], tuple(v["format"])):
        print(p)
    return 0


def cmd_report(v: dict) -> int:
    """One self-contained HTML report: table, every figure, spec and environment."""
    from .report import write_report
    print(write_report(v["path"], v["out"]))
    return 0


# ------------------------------------------------------------------ the parser

def _positional(name: str, kind: type, help: str, many: bool = False) -> tuple:
    return name, dict(type=kind, help=help, **({"nargs": "+"} if many else {}))


RUN_OR_SWEEP = "A sweep folder or a run folder (also while it is running)."

# command -> (function, positional arguments, options)
COMMANDS: dict[str, tuple] = {
    "train": (cmd_train, [], lambda: command_options("train")),
    "run-ablation": (cmd_run_ablation, [], lambda: command_options("run-ablation")),
    "map": (cmd_map, [], lambda: command_options("map")),
    "study": (cmd_study, [_positional("path", Path, "A study file from experiments/ (TOML).")],
              lambda: FOLDER_OPTIONS),
    "summary": (cmd_summary, [_positional("path", Path, "A sweep or run folder.")], lambda: [
        cli_opt("--recompute", bool, "Recompute every finished run's verdict and figures from its stored metrics "
                "(e.g. with new verdict thresholds).", False), *options_for("summary")]),
    "eval-loops": (cmd_eval_loops, [_positional("path", Path, "A finished run folder or a sweep folder.")], lambda: [
        cli_opt("--loops", int, "Inference loop counts.", list(range(1, 17)), many=True, low=1, high=MAX_LOOPS,
                optional=False),
        cli_opt("--batches", int, "Validation batches per count [default: the run's eval batches].", low=1),
        cli_opt("--data", str, "Evaluate on another corpus (e.g. wikitext2) [default: the run's]."),
        cli_opt("--device", str, "cpu, cuda or cuda:N.", "cpu", optional=False)]),
    "import-reference": (cmd_import_reference, [_positional("checkpoint", Path, "State dict (.pt) in the reference "
                                                            "(nanochat) layout.")], lambda: [
        cli_opt("--out", Path, "Run folder to create (usable by eval-loops).", optional=False),
        cli_opt("--variant", str, "LT, LT_i, LT_ia, FLT_res, FLT (or lt, ..., flt) [default: model_type of the "
                "meta_*.json beside the checkpoint]."),
        cli_opt("--loops", int, "Loop count the checkpoint was trained with [default: K of the meta_*.json].",
                low=1),
        cli_opt("--heads", int, "Attention heads (if no meta json).", low=1),
        cli_opt("--vocab-size", int, "True (unpadded) vocabulary size.", low=1)]),
    "predict": (cmd_predict, [_positional("paths", Path, "Sweep or run folders of finished runs.", many=True)],
                lambda: [
        cli_opt("--at", int, "Step(s) at which to predict.", [300], many=True, low=1, optional=False),
        cli_opt("--predictor", Path, "Predictor JSON from `flt-diag fit-predictor` [default: the packaged one]."),
        cli_opt("--csv", Path, "Also write the per-cell table (all steps) here."),
        cli_opt("--figure", Path, "Also draw agreement, false alarms and misses against the step (.png/.pdf/.svg).")]),
    "fit-predictor": (cmd_fit_predictor, [_positional("paths", Path, "Sweep or run folders of finished runs (the "
                                                      "training set).", many=True)], lambda: [
        cli_opt("--out", Path, "Predictor JSON to write (flt_diag/early_warning.json is the packaged one).",
                optional=False),
        cli_opt("--at", int, "Steps to fit a model at.", [100, 200, 300, 500], many=True, low=1, optional=False),
        cli_opt("--l2", float, "L2 penalty of the logistic regression.", 1.0, above=0, optional=False),
        cli_opt("--target", str, "fails (final verdict unstable, collapsed or diverged) or collapse (collapsed or "
                "diverged).", "fails", choices=("fails", "collapse"), optional=False)]),
    "variants": (cmd_variants, [], lambda: []),
    "report": (cmd_report, [_positional("path", Path, "A sweep or map folder.")], lambda: [
        cli_opt("--out", Path, "HTML file [default: <sweep>/report.html].")]),
}


def build_parser() -> Parser:
    from .figures import FIGURES
    parser = Parser(prog="flt-diag", description="Train looped-transformer variants, record why they collapse, "
                    "and plot it.", formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (func, positionals, options) in COMMANDS.items():
        doc = func.__doc__.strip().splitlines()[0]
        usage = f"flt-diag {name} {' '.join(p[0].upper() for p in positionals)} [options]".replace("  ", " ")
        sub = subs.add_parser(name, help=doc, description=doc, usage=usage)
        for pname, kwargs in positionals:
            sub.add_argument(pname, **kwargs)
        add_options(sub, options())
        sub.set_defaults(_func=func, _options=options)
    plot = subs.add_parser("plot", help="Figures from run, sweep or map folders (PNG and PDF).",
                           description="Figures from run, sweep or map folders (PNG and PDF).")
    figures = plot.add_subparsers(dest="figure", metavar="FIGURE", parser_class=Parser)
    for name, fig in [*FIGURES.items(), ("all", None)]:
        help = fig.help if fig is not None else "Every figure that has data."
        f = figures.add_parser(name, help=help, description=help)
        f.add_argument("path", type=Path, help=RUN_OR_SWEEP)
        options = [cli_opt("--out", Path, "Folder for the figures [default: <path>/figures]."),
                   cli_opt("--format", str, "Formats.", ["png", "pdf"], many=True, choices=("png", "pdf", "svg"),
                           optional=False)]
        add_options(f, options)
        f.set_defaults(_func=cmd_plot, _options=lambda options=options: options)
    return parser


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


# ------------------------------------------------------------------ entry point

def run(argv: list[str]) -> int:
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if getattr(args, "_func", None) is None:  # `flt-diag plot` without a figure
        from .figures import FIGURES
        raise UserError(f"plot needs a figure: {', '.join([*FIGURES, 'all'])} (flt-diag plot --help)")
    values = check_values(vars(args), args._options())
    return args._func(values)


def main(argv: list[str] | None = None) -> int:
    from .data import DataError
    from .storage import StorageError

    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        _progress_bar.close()
        print("interrupted; finished work is kept (re-run the same command to resume)", file=sys.stderr)
        return 130
    except (UserError, StorageError, DataError, ValueError, FileNotFoundError, PermissionError) as e:
        if os.environ.get("FLT_DIAG_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a path that is a file, ...: files in flight were removed (atomic_path)
        if os.environ.get("FLT_DIAG_DEBUG"):
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or type(e).__name__}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
