"""Which command takes which option: the one place that knows the commands' names and arguments.

Every training option is a field of a config section (flt_diag.vocab.config) and every grid option a field
of SweepGrid, MapLinesGrid or MapGrid (flt_diag.vocab.grid_options), each with its help, flag, bounds and choices; the commands' own
options (output folders, workers, ...) are made here with `cli_opt`. `command_options(command)` lists
a command's options in help order: the typer command line (flt_diag.cli.app), the study files
(flt_diag.cli.specs) and the option table (docs/cli.md, flt_diag.cli.table) are generated from it.
`check_values` checks given values with `Option.check`, the check the config sections run when built.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from flt_diag.judge import early_warning as EW
from flt_diag.results import predictor_fit as FIT
from flt_diag.vocab.config import OPTIONS, PRESETS, Option, options_of
from flt_diag.vocab.grid_options import MapGrid, MapLinesGrid, SweepGrid
from flt_diag.vocab.variants import MAX_LOOPS

SECTION_TITLES = {"run": "preset", "model": "model", "train": "training", "diagnostics": "diagnostics",
                  "verdict": "verdict thresholds", "sweep": "sweep grid", "map": "map grid", "cli": "this command"}


class UserError(Exception):
    """A mistake in the user's input: reported as one line."""


class Positional(NamedTuple):
    """A positional argument of a command."""

    name: str
    kind: type
    help: str
    many: bool = False


def cli_opt(flag: str, kind: type, help: str, default=None, *, many=False, low=None, high=None, above=None,
            choices=None, optional=True) -> Option:
    """An option of one command that is not a config field (output folder, workers, ...).
    `optional=False` with no default: the command needs it."""
    return Option("cli", flag[2:].replace("-", "_"), flag, kind, optional, many, default, help,
                  tuple(choices) if choices else None, low, high, above, None)


# ------------------------------------------------------------------ config and grid options

TRAINING_COMMANDS = ("train", "run-ablation", "map")
SET_BY_SETTLING = {("model", "vocab_size")}  # the tokenizer's (flt_diag.training.settle), never given
ONE_RUN = {("model", "variant"), ("model", "loops"), ("train", "seed")}  # the grids take lists instead
GRID_OPTIONS = {"run-ablation": options_of(SweepGrid, "sweep"),
                "map": options_of(MapLinesGrid, "map") + options_of(MapGrid, "map")}


def config_options(command: str) -> list[Option]:
    """The config fields `command` takes: all of them for a training command (less what its grid
    sets per cell), the verdict thresholds for `summary`, none for the others."""
    if command == "summary":
        return [o for o in OPTIONS if o.section == "verdict"]
    if command not in TRAINING_COMMANDS:
        return []
    skip = SET_BY_SETTLING | (ONE_RUN if command != "train" else set()) | \
        ({("train", "lr_scale")} if command == "run-ablation" else set())  # its grid's --lr-scale is a list
    return [o for o in OPTIONS if (o.section, o.name) not in skip]


# ------------------------------------------------------------------ the commands' own options

OUT_RUN = cli_opt("--out", Path, "Run folder [default: runs/<variant>-K<loops>]. An unfinished run in it is resumed.")
OUT_SWEEP = cli_opt("--out", Path, "Sweep folder [default: runs/ablation-<preset>]. Re-running resumes it.")
OUT_MAP = cli_opt("--out", Path, "Map folder [default: runs/map-<axis>-<preset>]. Re-running resumes it.")
WORKERS = cli_opt("--workers", int, "Cells (lines for maps) in parallel processes; 0 = auto (one per CPU core, each "
                  "with one thread; one per GPU on a multi-GPU machine).", 0, low=0, optional=False)
LIST = cli_opt("--list", bool, "Print the cells (index, name, status) and exit.", False)
CELL = cli_opt("--cell", int, "Run only cell (map: line) I, for job arrays.", low=0)
QUIET = cli_opt("--quiet", bool, "No progress bar.", False)
PROBE_ENDS = cli_opt("--probe-ends", bool, "First probe both ends of the grid on every line, so that a boundary that "
                     "is not monotone along the axis (training breaks at the low end, holds higher up) is reported "
                     "as non-monotone instead of being missed (up to 2 more probes per line).", False)
FOLDER_OPTIONS = [WORKERS, LIST, CELL, QUIET]

FIT_PREDICTOR = [
    cli_opt("--out", Path, "Predictor JSON to write (flt_diag/judge/early_warning.json is the packaged one).",
            optional=False),
    cli_opt("--at", int, "Steps to fit a model at.", [100, 200, 300, 500], many=True, low=1, optional=False),
    cli_opt("--l2", float, "L2 penalty of the logistic regression.", 1.0, above=0, optional=False),
    cli_opt("--target", str, "fails (final verdict not stable: unstable, stalled, collapsed or diverged), collapse (collapsed or "
            "diverged) or climbs (fails, or the loss climbed and recovered: the verdict's transient_rebound).",
            "fails", choices=tuple(EW.TARGETS), optional=False),
    cli_opt("--features", str, f"Features the model uses [default: {' '.join(FIT.DEFAULT_FEATURES)}].",
            many=True, choices=EW.FEATURES),
    cli_opt("--class-weight", str, "balanced (each class weighs half of the fit, whatever share of the runs "
            "fails) or none (each run weighs 1).", "balanced", choices=FIT.CLASS_WEIGHTS, optional=False),
    cli_opt("--cross-validate", bool, "Also report leave-one-cell-out agreement at each step (every run "
            "predicted by a model fitted without its cell) and store it in the predictor JSON.", False),
    cli_opt("--examples-out", Path, "Also write the fit set as one table (CSV: per run and step, its identity, "
            "verdict, loss-climb evidence and features); a .csv among the paths is read back in place of "
            "folders, its runs relabelled by the current verdict.")]

PREDICT = [
    cli_opt("--at", int, "Step(s) at which to predict.", [300], many=True, low=1, optional=False),
    cli_opt("--predictor", Path, "Predictor JSON(s) from `flt-diag fit-predictor`; several are compared on the "
            "same runs [default: the packaged one].", many=True),
    cli_opt("--csv", Path, "Also write the per-cell table (all steps; a predictor column) here."),
    cli_opt("--figure", Path, "Also draw agreement, false alarms and misses against the step (.png/.pdf/.svg)."),
    cli_opt("--online", bool, "Instead of fixed steps, replay what --warn says over each whole run: the first "
            "warning step (checks every 25 steps), its P and evidence, the largest P, beside the final verdict; "
            "and, on the same runs, the first warnings of Lightning's SpikeDetection and llm-foundry's "
            "KillLossSpike (their rules, default settings).",
            False)]

EVAL_LOOPS = [
    cli_opt("--loops", int, "Inference loop counts [default: 1 .. 2K, K the loops each run was trained with].",
            many=True, low=1, high=MAX_LOOPS),
    cli_opt("--batches", int, "Validation batches per count [default: the run's eval batches].", low=1),
    cli_opt("--data", str, "Evaluate on another corpus (e.g. wikitext2) [default: the run's]."),
    cli_opt("--device", str, "cpu, cuda or cuda:N.", "cpu", optional=False)]

IMPORT_REFERENCE = [
    cli_opt("--out", Path, "Run folder to create (usable by eval-loops).", optional=False),
    cli_opt("--variant", str, "LT, LT_i, LT_ia, FLT_res, FLT (or lt, ..., flt) [default: model_type of the "
            "meta_*.json beside the checkpoint]."),
    cli_opt("--loops", int, "Loop count the checkpoint was trained with [default: K of the meta_*.json].", low=1),
    cli_opt("--heads", int, "Attention heads (if no meta json).", low=1),
    cli_opt("--vocab-size", int, "True (unpadded) vocabulary size.", low=1)]

PLOT = [cli_opt("--out", Path, "Folder for the figures [default: <path>/figures, of the first path]."),
        cli_opt("--format", str, "Formats.", ["png", "pdf"], many=True, choices=("png", "pdf", "svg"), optional=False)]

OWN_OPTIONS: dict[str, list[Option]] = {
    "train": [OUT_RUN],
    "run-ablation": [OUT_SWEEP, *FOLDER_OPTIONS],
    "map": [OUT_MAP, PROBE_ENDS, *FOLDER_OPTIONS],
    "study": FOLDER_OPTIONS,
    "summary": [cli_opt("--recompute", bool, "Recompute every finished run's verdict and figures from its stored "
                        "metrics (e.g. with new verdict thresholds).", False),
                cli_opt("--sensitivity", bool, "Print the verdict's sensitivity table: on the stored runs, each "
                        "threshold x0.5 and x1.5 one at a time, the verdicts and flags that change (writes nothing "
                        "to the folders).", False),
                cli_opt("--sensitivity-csv", Path, "Also write the sensitivity table to this CSV file.")],
    "eval-loops": EVAL_LOOPS,
    "import-reference": IMPORT_REFERENCE,
    "predict": PREDICT,
    "fit-predictor": FIT_PREDICTOR,
    "variants": [],
    "report": [cli_opt("--out", Path, "HTML file [default: <sweep>/report.html].")],
    "plot": PLOT,  # every figure's
}

RUN_OR_SWEEP = "A sweep folder or a run folder (also while it is running)."
POSITIONALS: dict[str, list[Positional]] = {
    "study": [Positional("path", Path, "A study file from experiments/ (TOML).")],
    "summary": [Positional("paths", Path, "A sweep or run folder; or several sweep folders of one setting, "
                                          "pooled (e.g. more seeds run later into folders of their own).",
                           many=True)],
    "eval-loops": [Positional("path", Path, "A finished run folder or a sweep folder.")],
    "import-reference": [Positional("checkpoint", Path, "State dict (.pt) in the reference (nanochat) layout.")],
    "predict": [Positional("paths", Path, "Sweep or run folders of finished runs.", many=True)],
    "fit-predictor": [Positional("paths", Path, "Sweep or run folders of finished runs, or fit-examples tables "
                                 "(.csv, from --examples-out): the training set.", many=True)],
    "report": [Positional("paths", Path, "A sweep or map folder; or several sweep folders of one setting, pooled.",
                          many=True)],
    "plot": [Positional("paths", Path, RUN_OR_SWEEP + " Several sweep folders of one setting are pooled (more "
                        "seeds run later into folders of their own).", many=True)],
}


def command_options(command: str) -> list[Option]:
    """Every option of a command in help order: its grid's, the config's, then its own."""
    return GRID_OPTIONS.get(command, []) + config_options(command) + OWN_OPTIONS[command]


def check_values(values: dict, options: list[Option]) -> dict:
    """Validate the given values of `options` (one UserError line on the first bad one); the
    command's own options that were not given get their defaults."""
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


def default_text(o: Option) -> str:
    """` [default: ...]` for the help (each preset's where presets set the field), or "" where the
    help says it itself or there is none."""
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
