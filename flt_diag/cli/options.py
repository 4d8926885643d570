"""Which command takes which option: the one place that knows the commands' names and arguments (docs/DESIGN.md
§7, "Options"). Each command's own options are a pydantic model here (`TrainOptions`, `MapOptions`, ...); the
config options it takes are the config sections' fields themselves. `command_options(command)` lists them in
help order as (section, field name, pydantic field): the typer command line, the study files and docs/cli.md
read them; `command_args` validates given values field by field into the model (one line naming the flag).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Literal, Optional

from pydantic import Field
from pydantic.fields import FieldInfo

from flt_diag.cli.cluster_options import ClusterOptions
from flt_diag.results.fit_settings import FitSettings
from flt_diag.config.run_config import MAX_VOCAB, MAX_WIDTH, PRESETS, SECTIONS, PresetOption
from flt_diag.config.variants import MAX_LOOPS
from flt_diag.config.grid_options import Loops, MapAxes, MapGrid, SweepAxes
from flt_diag.config.option_fields import MAX_NUMBER, Items, Options, arg, check, default, dest, fact, flag, form, opt

SECTION_TITLES = {"run": "preset", "model": "model", "train": "training", "diagnostics": "diagnostics",
                  "verdict": "verdict thresholds", "sweep": "sweep grid", "map": "map grid", "cli": "this command"}


class UserError(Exception):
    """A mistake in the user's input: reported as one line."""


# ------------------------------------------------------------------ config and grid options

Param = tuple[str, str, FieldInfo]  # (section, field name, field): one option, read from its model
CONFIG: dict[str, type[Options]] = {"run": PresetOption, **SECTIONS}  # the config options by section ("run": the preset)
TRAINING_COMMANDS = ("train", "run-ablation", "map")
GRID_OF = {"run-ablation": "sweep", "map": "map"}  # the grid each grid command runs


def fields(cls, section: str) -> list[Param]:
    """The fields of model `cls` that are options (those with help), in declaration order."""
    return [(section, name, info) for name, info in cls.model_fields.items() if info.description]


GRID_OPTIONS = {"run-ablation": fields(SweepAxes, "sweep"), "map": fields(MapAxes, "map") + fields(MapGrid, "map")}


def config_options(command: str) -> list[Param]:
    """The config fields `command` takes: a training command all but the settled ones and its grid's; `summary`
    the verdict thresholds; the others none."""
    if command == "summary":
        return fields(CONFIG["verdict"], "verdict")
    if command not in TRAINING_COMMANDS:
        return []
    grid = GRID_OF.get(command)
    return [(s, n, f) for section, cls in CONFIG.items() for s, n, f in fields(cls, section)
            if not fact(f, "settled") and grid not in (fact(f, "grid") or ())]


# ------------------------------------------------------------------ each command's typed options

RUN_OR_SWEEP = "A sweep folder or a run folder (also while it is running)."
RUNS = "Sweep or run folders of finished runs."


class Given(Options):
    """Options of a command that takes config options too: `config`, those given (by flag name, each checked
    against its field; what settling builds on: flt_diag.training.settle.run_config)."""

    config: dict = Field(default_factory=dict)


class FolderOptions(ClusterOptions):
    workers: int = opt(0, "Cells (lines for maps) in parallel processes; 0 = auto (one per CPU core, each with one "
                       "thread; one per GPU on a multi-GPU machine).", ge=0)
    list_cells: bool = opt(False, "Print the cells (index, name, status) and exit.", alias="list")
    cell: Optional[int] = opt(None, "Run only cell (map: line) I, for job arrays.", ge=0, le=MAX_NUMBER)
    quiet: bool = opt(False, "No progress bar.")
    archive_to: Optional[Path] = opt(None, "Archive each run into <DIR>/<folder name>/ the moment it finishes (a "
                                     "record written once, as `flt-diag archive` writes it); a folder started with "
                                     "it resumes from what that archive holds (its records count as finished runs), "
                                     "e.g. on a fresh machine.")
    allow_code_change: bool = opt(False, "Resume a folder started by other code (another commit, other uncommitted "
                                  "changes, another flt-diag or torch version); without it that is refused. The "
                                  "change is recorded in the folder's sweep.json.")
    snapshot: bool = opt(False, "Run from a snapshot of the pinned code: at the first start the clean checkout's "
                         "commit is written out (flt_diag/ of `git archive`) into <out>/.code/<commit>/, and every "
                         "process of the campaign imports flt_diag from there, so the checkout may change (even be "
                         "checked out at another commit) while it runs. A folder that records a snapshot always runs "
                         "from it (made again from its commit where deleted); with --allow-code-change, a new snapshot "
                         "of the checkout replaces it.")
    snapshot_dir: Optional[Path] = opt(None, "With --snapshot (implied): write the snapshot into this folder instead "
                                       "of <out>/.code/<commit>/.")


class TrainOptions(Given):
    out: Optional[Path] = opt(None, "Run folder [default: runs/<variant>-K<loops>]. An unfinished run in it is resumed.")


class RunAblationOptions(SweepAxes, FolderOptions, Given):
    out: Optional[Path] = opt(None, "Sweep folder [default: runs/ablation-<preset>]. Re-running resumes it.")


class MapOptions(MapAxes, MapGrid, FolderOptions, Given):
    out: Optional[Path] = opt(None, "Map folder [default: runs/map-<axis>-<preset>]. Re-running resumes it.")
    probe_ends: bool = opt(False, "First probe both ends of the grid on every line, so that a boundary that is not "
                           "monotone along the axis (training breaks at the low end, holds higher up) is reported as "
                           "non-monotone instead of being missed (up to 2 more probes per line).")
    run_to_end: bool = opt(False, "Train every probe to its last step, even once the map's criteria are decided "
                           "(by default a probe ends at the step its criteria became certain: DESIGN.md §5).")
    baseline: Optional[Path] = opt(None, "An archived map (of `flt-diag archive` or --archive-to) to extend: its spec "
                                   "is reused exactly (give only --variants, the new ones, and folder options), "
                                   "its probes are re-run as canaries first, and --out holds old and new lines pooled.")
    accept_baseline_drift: bool = opt(False, "With --baseline: pool even where a canary disagrees with the archive "
                                      "(recorded in sweep.json).")


class StudyOptions(FolderOptions):
    paths: list[Path] = arg("A study file from experiments/ (TOML); or several, run one after another in the order "
                            "given with the same folder options (a campaign's stages or slices in one command: each "
                            "file checked before any runs, the next started when one finishes, the first that fails "
                            "ends the command with its status).", many=True)


class StatusOptions(Options):
    path: Path = arg("A sweep or map folder (also while it runs), or its archive; or a folder holding several (a "
                     "campaign's studies or stages): a line of counts for each.")


class SummaryOptions(Given):
    paths: list[Path] = arg("A sweep or run folder; or several sweep folders of one setting, pooled (e.g. more "
                            "seeds run later into folders of their own); or several run folders, side by side (a "
                            "row each).", many=True)
    recompute: bool = opt(False, "Recompute every finished run's verdict and figures from its stored metrics (e.g. "
                          "with new verdict thresholds).")
    sensitivity: bool = opt(False, "Print the verdict's sensitivity table: on the stored runs, each threshold x0.5 "
                            "and x1.5 one at a time, the verdicts and flags that change (writes nothing to the folders).")
    sensitivity_csv: Optional[Path] = opt(None, "Also write the sensitivity table to this CSV file.")


class EvalLoopsOptions(Options):
    path: Path = arg("A finished run folder or a sweep folder.")
    loops: Optional[Items[Loops]] = opt(None, "Inference loop counts [default: 1 .. 2K, K the loops each run was "
                                        "trained with].")
    batches: Optional[int] = opt(None, "Validation batches per count [default: the run's eval batches].", ge=1, le=MAX_NUMBER)
    data: Optional[str] = opt(None, "Evaluate on another corpus (e.g. wikitext2) [default: the run's].")
    device: str = opt("cpu", "cpu, cuda or cuda:N.")


class ImportReferenceOptions(Options):
    checkpoint: Path = arg("State dict (.pt) in the reference (nanochat) layout.")
    out: Path = opt(..., "Run folder to create (usable by eval-loops).")
    variant: Optional[str] = opt(None, "LT, LT_i, LT_ia, FLT_res, FLT (or lt, ..., flt) [default: model_type of the "
                                 "meta_*.json beside the checkpoint].")
    loops: Optional[int] = opt(None, "Loop count the checkpoint was trained with [default: K of the meta_*.json].",
                               ge=1, le=MAX_LOOPS)
    heads: Optional[int] = opt(None, "Attention heads (if no meta json).", ge=1, le=MAX_WIDTH)
    vocab_size: Optional[int] = opt(None, "True (unpadded) vocabulary size.", ge=1, le=MAX_VOCAB)
    tokenizer: Optional[str] = opt(None, "The tokenizer the reference was trained with (a tokenizer.json path or hub "
                                   "name), for eval-loops [default: bytes for a 256-token vocabulary; else none, "
                                   "which eval-loops asks for].")


class PredictOptions(Options):
    paths: list[Path] = arg(RUNS, many=True)
    at: Items[Annotated[int, Field(ge=1, le=MAX_NUMBER)]] = opt([300], "Step(s) at which to predict.")
    predictor: Optional[Items[Path]] = opt(None, "Predictor JSON(s) from `flt-diag fit-predictor`; several are "
                                           "compared on the same runs [default: the packaged one].")
    csv: Optional[Path] = opt(None, "Also write the per-cell table (all steps; a predictor column) here.")
    figure: Optional[Path] = opt(None, "Also draw agreement, false alarms and misses against the step "
                                 "(.png/.pdf/.svg).")
    online: bool = opt(False, "Instead of fixed steps, replay what --warn says over each whole run: the first warning "
                       "step (checks every 25 steps), its P and evidence, the largest P, beside the final verdict; "
                       "and, on the same runs, the first warnings of Lightning's SpikeDetection and llm-foundry's "
                       "KillLossSpike (their rules, default settings).")


class FitPredictorOptions(FitSettings):
    paths: list[Path] = arg("Sweep or run folders of finished runs, or fit-examples tables (.csv, from "
                            "--examples-out): the training set.", many=True)
    out: Path = opt(..., "Predictor JSON to write (flt_diag/judge/early_warning.json is the packaged one).")
    cross_validate: bool = opt(False, "Also report leave-one-cell-out agreement at each step (every run predicted by "
                               "a model fitted without its cell) and store it in the predictor JSON.")
    examples_out: Optional[Path] = opt(None, "Also write the fit set as one table (CSV: per run and step, its "
                                       "identity, verdict, loss-climb evidence and features); a .csv among the "
                                       "paths is read back in place of folders, its runs relabelled by the "
                                       "current verdict as far as the table's evidence allows (not v3's "
                                       "oscillation rule: that needs the folders).")


class ArchiveOptions(Options):
    paths: list[Path] = arg("Finished run folders, or sweep or map folders (their finished cells).", many=True)
    to: Path = opt(..., "Archive folder: a sweep S becomes <to>/S/ (sweep.json + one .parquet record per cell), a "
                   "run R becomes <to>/R.parquet. Not inside a run, sweep or map folder or an archived sweep.")
    replace: bool = opt(False, "Replace what another source archived there (another run of the same name, another "
                        "sweep or map of the same name: its records are removed); without it that is refused. The "
                        "same runs archived again refresh their own records either way.")


class ReportOptions(Options):
    paths: list[Path] = arg("A sweep or map folder; or several sweep folders of one setting, pooled; or several run "
                            "folders, side by side.", many=True)
    out: Optional[Path] = opt(None, "HTML file [default: <sweep>/report.html].")


class PlotOptions(Options):
    paths: list[Path] = arg(RUN_OR_SWEEP + " Several sweep folders of one setting are pooled (more seeds run later "
                            "into folders of their own); several run folders are drawn side by side (a line each).",
                            many=True)
    out: Optional[Path] = opt(None, "Folder for the figures [default: <path>/figures, of the first path].")
    format: Items[Literal["png", "pdf", "svg"]] = opt(["png", "pdf"], "Formats.")
    figure: str = "all"  # (not an option: the `plot` subcommand's name)


ARGS: dict[str, type[Options]] = {
    "train": TrainOptions, "run-ablation": RunAblationOptions, "map": MapOptions, "study": StudyOptions,
    "status": StatusOptions, "summary": SummaryOptions, "eval-loops": EvalLoopsOptions, "import-reference": ImportReferenceOptions,
    "predict": PredictOptions, "fit-predictor": FitPredictorOptions, "variants": Options,
    "report": ReportOptions, "plot": PlotOptions, "archive": ArchiveOptions}
FOLDER_OPTIONS = fields(FolderOptions, "cli")


def _refuse_record_options_named_like_a_commands() -> None:
    """A record option named like a command's own option (--workers, --out, a grid's --seeds ...) would make that
    command's parameters clash: one line naming the record (run_config refuses those named like a config field)."""
    from flt_diag.records import refuse_options_named
    refuse_options_named({n for cls in ARGS.values() for n in cls.model_fields}
                         | {n for g in GRID_OPTIONS.values() for _, n, _ in g})


_refuse_record_options_named_like_a_commands()


def own_options(command: str) -> list[Param]:
    """The options a command declares itself (its grid's and its positionals left out)."""
    grid = {n for _, n, _ in GRID_OPTIONS.get(command, [])}
    own = [p for p in fields(ARGS[command], "cli") if not fact(p[2], "positional") and p[1] not in grid]
    return sorted(own, key=lambda p: p[1] in FolderOptions.model_fields)  # --out first, --workers ... last


POSITIONALS: dict[str, list[Param]] = {c: ps for c, cls in ARGS.items()
                                       if (ps := [p for p in fields(cls, "cli") if fact(p[2], "positional")])}


def command_options(command: str) -> list[Param]:
    """Every option of a command in help order: its grid's, the config's, then its own."""
    return GRID_OPTIONS.get(command, []) + config_options(command) + own_options(command)


def command_args(command: str, values: dict, where: Callable[[str, FieldInfo], str] = flag) -> Options:
    """The typed options of `command` from given values (by the names users type; None: not given; and fields
    of the model that are no option, such as plot's figure), each checked against its field (a bad one: one
    line naming it by `where`), its config options in `config`."""
    cls, config, own = ARGS[command], dict[str, object](), dict[str, object]()
    for s, n, f in config_options(command) + fields(cls, "cli"):
        if (x := values.get(dest(n, f))) is not None:
            (own if s == "cli" else config)[dest(n, f)] = check(f.rebuild_annotation(), x, where(n, f), f)
    fixed = {k: values[k] for k in cls.model_fields if values.get(k) is not None and k not in own and k != "config"}
    return cls.of(**own, **fixed, **({"config": config} if config_options(command) else {}))


def default_text(section: str, name: str, info: FieldInfo) -> str:
    """` [default: ...]` for the help (each preset's where presets set the field), or "" where the
    help says it itself or there is none."""
    value, kind = default(info), form(info)
    if kind.kind is bool and value is None:
        return ""
    shown = " ".join(map(str, value)) if kind.many and value is not None else value
    presets = [f"{p_name} {p[section][name]}" for p_name, p in PRESETS.items() if name in p.get(section, {})]
    if "[default" in (info.description or "") or value is None and not presets:
        return ""
    if len(presets) == len(PRESETS):
        return f" [default by preset: {', '.join(presets)}]"
    return f" [default: {shown}" + (f"; preset {', '.join(presets)}" if presets else "") + "]"
