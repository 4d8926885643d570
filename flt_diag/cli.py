"""The `flt-diag` command line.

List options take space-separated values (`--loops 3 6 9 12`), repeated options
(`--loops 3 --loops 6`) or commas (`--loops 3,6`). Errors a user can cause print one line
(`error: ...`) and exit with status 2; nothing already written is touched.
"""
from __future__ import annotations

import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

try:  # typer >= 0.20 vendors click; older releases use the click package
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train looped-transformer variants, record why they collapse, and plot it.")
plot_app = typer.Typer(no_args_is_help=True, help="Figures from run or sweep folders (PNG and PDF).")
app.add_typer(plot_app, name="plot")

# The options that take several values, per command (elsewhere the same names take one value, and a
# second value is an error, never silently the last one).
LIST_OPTIONS = {
    "run-ablation": {"--loops", "--variants", "--seeds", "--lr-scale"},
    "map": {"--loops", "--variants", "--seeds", "--criteria"},
    "eval-loops": {"--loops"},
    "predict": {"--at"},
    "fit-predictor": {"--at"},
}
NUMBER = re.compile(r"^-?\d+(\.\d*)?([eE][-+]?\d+)?$")


class UserError(Exception):
    """A mistake in the user's input: reported as one line."""


def expand_list_options(argv: list[str]) -> list[str]:
    """`--loops 3 6 9` -> `--loops 3 --loops 6 --loops 9` (also splits `--loops 3,6`), for the
    list options of the command in argv (see LIST_OPTIONS)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    lists = LIST_OPTIONS.get(command, set())
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in lists:
            values = [inline] if eq else []
            i += 1
            while not eq and i < len(argv) and (not argv[i].startswith("-") or NUMBER.match(argv[i])):
                values.append(argv[i])
                i += 1
            if not values:
                out.append(name)  # let click report the missing value
            for v in values:
                parts = v.split(",")
                if any(not p.strip() for p in parts):
                    raise UserError(f"{name}: empty value in {v!r}")
                for part in parts:
                    out += [name, part]
            continue
        out.append(arg)
        i += 1
    return out


# ------------------------------------------------------------------ shared options

def _variant_names() -> list[str]:
    from .model import VARIANTS
    return list(VARIANTS)


def _check_variants(variants: list[str]) -> list[str]:
    known = _variant_names()
    for v in variants:
        if v not in known:
            raise UserError(f"unknown variant {v!r}; choose from {', '.join(known)}")
    return variants


def _check_loops(loops: list[int]) -> list[int]:
    from .model import MAX_LOOPS
    for k in loops:
        if not 1 <= k <= MAX_LOOPS:
            raise UserError(f"loops must be in 1..{MAX_LOOPS}, got {k}")
    return loops


class LossOn(str, Enum):
    end = "end"
    all = "all"
    last_third = "last-third"


class Optimizer(str, Enum):
    muon = "muon"
    adamw = "adamw"


PresetOpt = typer.Option("auto", "--preset", help="tiny (CPU, minutes), small (one GPU), paper-small, "
                                                  "paper-base, or auto (tiny on CPU, small on GPU).")
StepsOpt = typer.Option(None, "--steps", min=1, help="Optimizer steps [default: 2000].")
MomentumWarmupOpt = typer.Option(None, "--momentum-warmup", min=0, help="Steps over which Muon's momentum rises "
                                 "linearly from 0.85 to 0.95, as the reference's [default: 300]; 0 = 0.95 throughout.")
PrecisionOpt = typer.Option(None, "--precision", help="fp32 (fp32 weights and residual stream; bf16 autocast on "
                            "GPU) or reference (bf16 embedding, rotary tables and stream, as the reference "
                            "trains on GPU; CPU autocast on CPU) [default: fp32].")
SamplingOpt = typer.Option(None, "--sampling", help="random (random windows) or stream (the corpus in order, "
                           "as the reference reads it) [default: random].")
WarnOpt = typer.Option(False, "--warn", help="Print a warning, with its evidence, the first time the early-warning "
                       "predictor puts P(collapse) at or above its threshold.")
StopOpt = typer.Option(False, "--stop-on-collapse", help="End the run there (verdict collapsed, predicted at step "
                       "s); the run folder stays complete. Implies --warn.")
PredictorOpt = typer.Option(None, "--predictor", help="Predictor JSON from `flt-diag fit-predictor` "
                            "[default: the one shipped with flt-diag].")
RotaryDtypeOpt = typer.Option(None, "--rotary-dtype", help="float32 or bfloat16 (the reference's tables) "
                              "[default: float32].")


def _build(preset: str, *, variant: str, loops: int, steps: Optional[int], seed: int = 0, lr_scale: float = 1.0,
           optimizer=None, loss_on=None, batch_size=None, grad_accum=None, seq_len=None, depth=None,
           width=None, heads=None, data=None, tokenizer=None, max_tokens=None, device="auto", compile=None,
           checkpoint_loops=False, threads=None, diagnostics=True, attention_stats=False, dense_steps=None,
           record_every=None, tensorboard=False, wandb=None, eval_every=None, checkpoint_every=None,
           momentum_warmup=None, precision=None, sampling=None, rotary_dtype=None, warn=False,
           stop_on_collapse=False, predictor=None):
    import torch
    from .config import build_config

    cuda = device != "cpu" and torch.cuda.is_available()
    model = dict(variant=variant, loops=loops, sequence_len=seq_len, n_head=heads, rotary_dtype=rotary_dtype)
    if depth is not None:
        from .config import PRESETS, resolve_preset
        p = PRESETS[resolve_preset(preset, cuda)]["model"]
        aspect = p["n_embd"] // p["n_layer"]
        model.update(n_layer=depth, n_embd=width or aspect * depth,
                     n_head=heads or max(1, (width or aspect * depth) // (p["n_embd"] // p["n_head"])))
    elif width is not None:
        model.update(n_embd=width)
    train = dict(steps=steps if steps is not None else 2000, seed=seed, lr_scale=lr_scale,
                 optimizer=optimizer.value if optimizer else None, loss_on=loss_on.value if loss_on else None,
                 batch_size=batch_size, grad_accum=grad_accum, data=data, tokenizer=tokenizer,
                 max_tokens=max_tokens, device=device, compile=compile, checkpoint_loops=checkpoint_loops,
                 threads=threads, eval_every=eval_every, checkpoint_every=checkpoint_every,
                 momentum_warmup=momentum_warmup, precision=precision, sampling=sampling)
    diag = dict(enabled=diagnostics, attention=attention_stats, dense_steps=dense_steps, every=record_every,
                tensorboard=tensorboard, wandb=wandb, warn=warn or stop_on_collapse, stop_on_collapse=stop_on_collapse,
                predictor=str(predictor) if predictor else None)
    if predictor is not None or warn or stop_on_collapse:
        from .early_warning import load_predictor
        try:
            load_predictor(predictor)
        except ValueError as e:
            raise UserError(str(e)) from None
    try:
        cfg = build_config(preset, cuda, model=model, train=train, diagnostics=diag)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    _check_data(cfg.train.data, cfg.train.tokenizer)
    from .train import resolve_device
    try:
        resolve_device(cfg.train.device)
    except ValueError as e:
        raise UserError(str(e)) from None
    return cfg


def _vocab_for(cfg) -> int:
    """The (padded) vocabulary a run of this config will have; loads the tokenizer, so that one that
    cannot be fetched is reported in one line before anything runs."""
    from .config import padded_vocab
    from .data import DataError, get_tokenizer
    try:
        return padded_vocab(get_tokenizer(cfg.train.tokenizer).vocab_size)
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

@app.command()
def train(
    variant: str = typer.Option("flt", "--variant", help="lt, lt-ii, lt-ai, fla or flt (DESIGN.md §2)."),
    loops: int = typer.Option(12, "--loops", help="Loops K: how often the L blocks are reused."),
    preset: str = PresetOpt,
    steps: Optional[int] = StepsOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder [default: runs/<variant>-K<loops>]. "
                                       "An unfinished run in it is resumed."),
    seed: int = typer.Option(0, "--seed", help="Seed of initialisation and batches."),
    lr_scale: float = typer.Option(1.0, "--lr-scale", help="Multiplies every learning rate."),
    optimizer: Optional[Optimizer] = typer.Option(None, "--optimizer", help="muon (reference recipe) or adamw."),
    loss_on: Optional[LossOn] = typer.Option(None, "--loss-on", help="Loss on the final loop (end), the mean "
                                             "over all loops (all) or over the last third."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Sequences per micro-batch."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", min=1, help="Micro-batches per step."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=2, help="Tokens per sequence."),
    depth: Optional[int] = typer.Option(None, "--depth", min=1, help="Size dial: L blocks; width follows the "
                                        "preset's aspect ratio unless --width is given."),
    width: Optional[int] = typer.Option(None, "--width", min=2, help="Model width d."),
    heads: Optional[int] = typer.Option(None, "--heads", min=1, help="Attention heads."),
    data: Optional[str] = typer.Option(None, "--data", help="stdlib (offline default), fineweb-edu, wikitext2, "
                                       "or a .txt/.jsonl/.parquet file or folder."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="bytes, a Hugging Face tokenizer name, "
                                            "or a tokenizer.json path."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=2, help="Cap on training tokens read."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the blocks "
                                           "[default: on CUDA only]."),
    checkpoint_loops: bool = typer.Option(False, "--checkpoint-loops", help="Activation checkpointing per loop "
                                          "(memory flat in K)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads."),
    no_diagnostics: bool = typer.Option(False, "--no-diagnostics", help="Record only loss, lr, grad norm."),
    attention_stats: bool = typer.Option(False, "--attention-stats", help="Also record max attention logit "
                                         "and attention entropy per (loop, layer)."),
    dense_steps: Optional[int] = typer.Option(None, "--dense-steps", min=0, help="Record every step up to here "
                                              "[default: 2000] ..."),
    record_every: Optional[int] = typer.Option(None, "--record-every", min=1, help="... then every N steps "
                                               "[default: 10]."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", min=0, help="Steps between validation "
                                             "losses [default: 250]."),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", min=0, help="Steps between "
                                                   "resume checkpoints [default: 500]."),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also log to <run>/tensorboard."),
    wandb: Optional[str] = typer.Option(None, "--wandb", help="Also log to this W&B project."),
    momentum_warmup: Optional[int] = MomentumWarmupOpt,
    precision: Optional[str] = PrecisionOpt,
    sampling: Optional[str] = SamplingOpt,
    rotary_dtype: Optional[str] = RotaryDtypeOpt,
    warn: bool = WarnOpt,
    stop_on_collapse: bool = StopOpt,
    predictor: Optional[Path] = PredictorOpt,
):
    """Train one variant into one run folder, with diagnostics, and print its verdict."""
    _check_variants([variant])
    _check_loops([loops])
    cfg = _build(preset, variant=variant, loops=loops, steps=steps, seed=seed, lr_scale=lr_scale,
                 optimizer=optimizer, loss_on=loss_on, batch_size=batch_size, grad_accum=grad_accum,
                 seq_len=seq_len, depth=depth, width=width, heads=heads, data=data, tokenizer=tokenizer,
                 max_tokens=max_tokens, device=device, compile=compile, checkpoint_loops=checkpoint_loops,
                 threads=threads, diagnostics=not no_diagnostics, attention_stats=attention_stats,
                 dense_steps=dense_steps, record_every=record_every, tensorboard=tensorboard, wandb=wandb,
                 eval_every=eval_every, checkpoint_every=checkpoint_every, momentum_warmup=momentum_warmup,
                 precision=precision, sampling=sampling, rotary_dtype=rotary_dtype, warn=warn,
                 stop_on_collapse=stop_on_collapse, predictor=predictor)
    out = out or Path("runs") / f"{variant}-K{loops}"
    _vocab_for(cfg)  # a tokenizer that cannot be loaded: one line now, before the run folder exists
    from .train import Trainer

    trainer = Trainer(cfg, out, progress=_console_progress(cfg.train.steps, f"{variant} K={loops}"))
    if trainer.is_main:
        print(trainer.describe(), flush=True)
    summary = trainer.fit()
    _progress_bar.close()
    if summary:  # empty on DDP ranks other than 0
        _print_run_summary(out, summary)


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


# ------------------------------------------------------------------ sweeps

@app.command("run-ablation")
def run_ablation(
    loops: List[int] = typer.Option([3, 6, 9, 12], "--loops", help="Loop counts, space-separated."),
    variants: List[str] = typer.Option(None, "--variants", help="Variants [default: all five]."),
    seeds: List[int] = typer.Option([0], "--seeds", help="Seeds."),
    lr_scale: List[float] = typer.Option([1.0], "--lr-scale", help="Learning-rate multipliers (an lr x loops map)."),
    preset: str = PresetOpt,
    steps: Optional[int] = StepsOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep folder [default: runs/ablation-<preset>]."),
    workers: int = typer.Option(0, "--workers", min=0, help="Cells in parallel processes; 0 = auto (one per "
                                "CPU core, each with one thread; one per GPU on a multi-GPU machine)."),
    list_cells: bool = typer.Option(False, "--list", help="Print the cells (index, name, status) and exit."),
    cell: Optional[int] = typer.Option(None, "--cell", help="Run only cell I (for job arrays)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Sequences per micro-batch."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", min=1, help="Micro-batches per step."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=2, help="Tokens per sequence."),
    depth: Optional[int] = typer.Option(None, "--depth", min=1, help="Size dial: L blocks."),
    width: Optional[int] = typer.Option(None, "--width", min=2, help="Model width d."),
    heads: Optional[int] = typer.Option(None, "--heads", min=1, help="Attention heads."),
    data: Optional[str] = typer.Option(None, "--data", help="Corpus (see `train --help`)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer (see `train --help`)."),
    optimizer: Optional[Optimizer] = typer.Option(None, "--optimizer", help="muon or adamw."),
    loss_on: Optional[LossOn] = typer.Option(None, "--loss-on", help="end, all or last-third."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda."),
    checkpoint_loops: bool = typer.Option(False, "--checkpoint-loops", help="Activation checkpointing per loop."),
    no_diagnostics: bool = typer.Option(False, "--no-diagnostics", help="Record only loss, lr, grad norm."),
    attention_stats: bool = typer.Option(False, "--attention-stats", help="Also record attention statistics."),
    momentum_warmup: Optional[int] = MomentumWarmupOpt,
    precision: Optional[str] = PrecisionOpt,
    sampling: Optional[str] = SamplingOpt,
    rotary_dtype: Optional[str] = RotaryDtypeOpt,
    warn: bool = WarnOpt,
    stop_on_collapse: bool = StopOpt,
    predictor: Optional[Path] = PredictorOpt,
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
):
    """Train every variant at every loop count (x seeds x lr scales) and summarise how they collapse."""
    variants = _check_variants(variants or _variant_names())
    _check_loops(loops)
    for s in lr_scale:
        if s <= 0:
            raise UserError(f"lr scale must be > 0, got {s}")
    from .sweep import SweepSpec, cell_status, run_sweep

    base = _build(preset, variant=variants[0], loops=loops[0], steps=steps, batch_size=batch_size,
                  grad_accum=grad_accum, seq_len=seq_len, depth=depth, width=width, heads=heads, data=data,
                  tokenizer=tokenizer, optimizer=optimizer, loss_on=loss_on, device=device,
                  checkpoint_loops=checkpoint_loops, diagnostics=not no_diagnostics, attention_stats=attention_stats,
                  momentum_warmup=momentum_warmup, precision=precision, sampling=sampling, rotary_dtype=rotary_dtype,
                  warn=warn, stop_on_collapse=stop_on_collapse, predictor=predictor)
    try:
        spec = SweepSpec(base, variants, loops, seeds, lr_scale)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = out or Path("runs") / f"ablation-{base.preset}"
    if list_cells:
        for c in spec.cells():
            print(f"{c.index:4d}  {c.name:32s} {cell_status(out, c)}")
        return
    if cell is not None and not 0 <= cell < len(spec.cells()):
        raise UserError(f"--cell must be in 0..{len(spec.cells()) - 1}, got {cell}")
    from .model import count_parameters, ModelConfig
    n = count_parameters(ModelConfig(**{**base.model.to_dict(), "vocab_size": _vocab_for(base)}))
    print(f"model: L={base.model.n_layer} d={base.model.n_embd} heads={base.model.n_head}, {n:,} parameters "
          f"({n / 1e6:.1f}M) per cell", flush=True)
    df = run_sweep(spec, out, workers=workers, only_cell=cell, show_progress=not quiet)
    _print_table(df)
    print(f"sweep folder: {out}  (plots: flt-diag plot all {out}; report: flt-diag report {out})")
    cells = spec.cells() if cell is None else [spec.cells()[cell]]
    _exit_if_failed(out, cells)


def _exit_if_failed(out: Path, cells) -> None:
    """One line and exit status 1 when any cell of the sweep failed (its error.txt says why)."""
    from .sweep import cell_status
    failed = [c.name for c in cells if cell_status(out, c) == "failed"]
    if failed:
        print(f"error: {len(failed)} of {len(cells)} cells failed ({', '.join(failed[:4])}"
              f"{', ...' if len(failed) > 4 else ''}); see {out}/cells/<cell>/error.txt", file=sys.stderr)
        raise typer.Exit(1)


@app.command()
def study(
    path: Path = typer.Argument(..., help="A study file from experiments/ (TOML)."),
    workers: int = typer.Option(0, "--workers", min=0, help="Cells in parallel processes; 0 = auto."),
    list_cells: bool = typer.Option(False, "--list", help="Print the cells and exit."),
    cell: Optional[int] = typer.Option(None, "--cell", help="Run only cell I (for job arrays)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
):
    """Run a named study: the [ablation] (run-ablation options) or [map] (map options) table of a TOML file."""
    argv = study_argv(path) + ["--workers", str(workers)] + (["--list"] if list_cells else []) \
        + (["--cell", str(cell)] if cell is not None else []) + (["--quiet"] if quiet else [])
    code = main(argv)
    if code:
        raise typer.Exit(code)


@app.command("map")
def stability_map(
    variants: List[str] = typer.Option(None, "--variants", help="Variants [default: all five]."),
    loops: List[int] = typer.Option([6, 12], "--loops", help="Loop counts (the x axis of the map)."),
    seeds: List[int] = typer.Option([0], "--seeds", help="Seeds: each boundary is reported with its spread."),
    axis: str = typer.Option("lr", "--axis", help="lr (lr scale) or depth (L blocks, width fixed)."),
    lo: float = typer.Option(0.5, "--lo", help="Lowest axis value of the grid."),
    hi: float = typer.Option(16.0, "--hi", help="Highest axis value of the grid."),
    ratio: float = typer.Option(1.41, "--ratio", help="Grid ratio: the tolerance of every boundary (> 1)."),
    criteria: List[str] = typer.Option(["training", "explosion"], "--criteria", help="training (verdict not "
                                       "stable), collapse (collapsed or diverged), explosion (any loop)."),
    preset: str = PresetOpt,
    steps: Optional[int] = StepsOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="Map folder [default: runs/map-<axis>-<preset>]."),
    workers: int = typer.Option(0, "--workers", min=0, help="Lines (variant x K x seed) searched in parallel "
                                "processes; 0 = auto (one per CPU core)."),
    list_cells: bool = typer.Option(False, "--list", help="Print the lines (index, name) and exit."),
    cell: Optional[int] = typer.Option(None, "--cell", help="Search only line I (for job arrays)."),
    lr_scale: float = typer.Option(1.0, "--lr-scale", help="lr scale of every probe on the depth axis."),
    depth: Optional[int] = typer.Option(None, "--depth", min=1, help="L of every probe on the lr axis."),
    width: Optional[int] = typer.Option(None, "--width", min=2, help="Model width d (fixed along the axis)."),
    heads: Optional[int] = typer.Option(None, "--heads", min=1, help="Attention heads."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Sequences per micro-batch."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=2, help="Tokens per sequence."),
    data: Optional[str] = typer.Option(None, "--data", help="Corpus (see `train --help`)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer (see `train --help`)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda."),
    momentum_warmup: Optional[int] = MomentumWarmupOpt,
):
    """Where each variant's training breaks: bisection along lr scale or depth, per variant and K."""
    variants = _check_variants(variants or _variant_names())
    _check_loops(loops)
    from .stability_map import AXES, MapSpec, geometric_grid, run_map
    if axis not in AXES:
        raise UserError(f"--axis must be one of {', '.join(AXES)}, got {axis!r}")
    try:
        grid = geometric_grid(lo, hi, ratio, integer=axis == "depth")
    except ValueError as e:
        raise UserError(str(e)) from None
    if lr_scale <= 0 or not lr_scale < float("inf"):
        raise UserError(f"lr scale must be > 0 and finite, got {lr_scale}")
    base = _build(preset, variant=variants[0], loops=loops[0], steps=steps, lr_scale=lr_scale, depth=depth,
                  width=width, heads=heads, batch_size=batch_size, seq_len=seq_len, data=data, tokenizer=tokenizer,
                  device=device, momentum_warmup=momentum_warmup)
    try:
        spec = MapSpec(base, variants, loops, seeds, axis, grid, list(criteria))
        from .sweep import cell_config
        for line in spec.lines():  # every probe's config is valid before anything runs
            for value in grid:
                cell_config(base, spec.cell(line, value))
    except ValueError as e:
        raise UserError(str(e)) from None
    out = out or Path("runs") / f"map-{axis}-{base.preset}"
    if list_cells:
        for line in spec.lines():
            print(f"{line.index:4d}  {line.name}")
        return
    _vocab_for(base)  # a tokenizer that cannot be loaded: one line now, before any probe
    from .sweep import auto_workers
    print(f"map: {len(spec.lines())} lines x {len(criteria)} criteria; {axis} grid {', '.join(f'{v:g}' for v in grid)} "
          f"(each boundary within x{ratio:g})", flush=True)
    run_map(spec, out, workers=workers or auto_workers(base.train.device), only_line=cell,
            report=lambda text: print(text, flush=True))
    from .stability_map import critical_values
    crit = critical_values(out)
    for criterion, g in crit.groupby("criterion", sort=False):
        print(f"{criterion}: " + "; ".join(f"{r.variant} K={r.loops}: {r.text}" for r in g.itertuples()))
    print(f"map folder: {out}  (figure: flt-diag plot map {out}; report: flt-diag report {out})")


def study_argv(path: Path) -> list[str]:
    """The run-ablation arguments of a study file."""
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
    tables = [t for t in ("ablation", "map") if t in spec]
    if len(tables) != 1:
        raise UserError(f"{path}: needs exactly one [ablation] or [map] table")
    argv = ["run-ablation" if tables[0] == "ablation" else "map"]
    for key, value in spec[tables[0]].items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not False:
            argv += [flag, str(value)]
    return argv


@app.command()
def summary(
    path: Path = typer.Argument(..., help="A sweep or run folder."),
    recompute: bool = typer.Option(False, "--recompute", help="Recompute every finished run's verdict and "
                                   "figures from its stored metrics (e.g. with new thresholds)."),
    smooth_window: Optional[int] = typer.Option(None, "--smooth-window", min=1, help="Verdict: steps of the "
                                                "loss smoothing [default: 50]."),
    rebound_abs: Optional[float] = typer.Option(None, "--rebound-abs", min=0, help="Verdict: climb threshold, "
                                                "nats [default: 0.25]."),
    recovery_abs: Optional[float] = typer.Option(None, "--recovery-abs", min=0, help="Verdict: recovery "
                                                 "tolerance, nats [default: 0.1]."),
    explosion_ratio: Optional[float] = typer.Option(None, "--explosion-ratio", min=0, help="Residual "
                                                    "explosion above ratio * sqrt(d) [default: 100]."),
    osc_cv_threshold: Optional[float] = typer.Option(None, "--osc-cv-threshold", min=0, help="Verdict: unstable "
                                                     "above this grad-norm CV over the dense steps [default: 3]."),
):
    """Print the summary table of a sweep (or the summary of one run)."""
    from .storage import is_sweep, load_summary, run_dirs
    overrides = {k: v for k, v in dict(smooth_window=smooth_window, rebound_abs=rebound_abs,
                                       recovery_abs=recovery_abs, explosion_ratio=explosion_ratio,
                                       osc_cv_threshold=osc_cv_threshold).items()
                 if v is not None}
    for k, v in overrides.items():
        if v != v or v == float("inf"):
            raise UserError(f"--{k.replace('_', '-')} must be finite, got {v}")
    if overrides and not recompute:
        raise UserError("verdict thresholds need --recompute")
    if recompute:
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
        return
    for d in run_dirs(path):
        s = load_summary(d)
        if s is None:
            print(f"{d}: not finished")
        else:
            _print_run_summary(d, s)


def _print_table(df) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ["variant", "loops", "seed", "lr_scale", "verdict", "residual_explosion", "final_loss", "best_loss",
            "val_loss", "peak_resid_norm", "osc_cv", "osc_sign_alternation", "loss_std", "grad_norm_std", "wall_time"]
    table = Table(title="sweep summary")
    for c in cols:
        table.add_column(c.replace("_", " "))
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            v = row[c]
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    Console(width=200).print(table)


# ------------------------------------------------------------------ evaluation, import

@app.command("eval-loops")
def eval_loops_cmd(
    path: Path = typer.Argument(..., help="A finished run folder or a sweep folder."),
    loops: List[int] = typer.Option(list(range(1, 17)), "--loops", help="Inference loop counts [default: 1..16]."),
    batches: Optional[int] = typer.Option(None, "--batches", min=1, help="Validation batches per count."),
    data: Optional[str] = typer.Option(None, "--data", help="Evaluate on another corpus (e.g. wikitext2)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
):
    """Held-out loss and perplexity of each trained checkpoint at every inference loop count."""
    _check_loops(loops)
    from .train import resolve_device
    try:
        device = str(resolve_device(device))
    except ValueError as e:
        raise UserError(str(e)) from None
    from .evaluation import eval_loops
    from .storage import CHECKPOINT, StorageError, run_dirs
    if data is not None:
        _check_data(data, "bytes")
    failed = 0
    for d in run_dirs(path):
        if not (d / CHECKPOINT).exists():
            print(f"{d}: no final checkpoint yet, skipped")
            continue
        try:
            df = eval_loops(d, loops, batches=batches, data=data, device=device)
        except (StorageError, ValueError, RuntimeError) as e:  # one bad cell does not stop the others
            print(f"{d}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            failed += 1
            continue
        finite = df[df.val_loss.apply(lambda v: v == v and abs(v) != float("inf"))]
        best = finite.loc[finite.val_loss.idxmin()] if len(finite) else None
        print(f"{d}: trained at K={int(df.trained_loops[0])}; "
              + (f"best val loss {best.val_loss:.3f} at {int(best.loops)} loops; " if best is not None else
                 "no finite val loss; ")
              + " ".join(f"{int(k)}:{v:.2f}" for k, v in zip(df.loops, df.val_loss)))
    if failed:
        raise typer.Exit(1)


@app.command("import-reference")
def import_reference_cmd(
    checkpoint: Path = typer.Argument(..., help="State dict (.pt) in the reference (nanochat) layout."),
    variant: Optional[str] = typer.Option(None, "--variant", help="LT, LT_i, LT_ia, FLT_res, FLT (or lt, ..., "
                                          "flt) [default: model_type of the meta_*.json beside the checkpoint]."),
    loops: Optional[int] = typer.Option(None, "--loops", help="Loop count the checkpoint was trained with "
                                        "[default: K of the meta_*.json]."),
    out: Path = typer.Option(..., "--out", help="Run folder to create (usable by eval-loops)."),
    heads: Optional[int] = typer.Option(None, "--heads", min=1, help="Attention heads (if no meta json)."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", min=1, help="True (unpadded) vocab size."),
):
    """Import a reference-implementation checkpoint into a run folder."""
    if loops is not None:
        _check_loops([loops])
    if not checkpoint.exists():
        raise UserError(f"no such checkpoint: {checkpoint}")
    from .reference import import_reference, write_imported_run
    model = import_reference(checkpoint, variant, loops, n_head=heads, vocab_size=vocab_size)
    write_imported_run(model, out, str(checkpoint))
    print(f"imported {checkpoint} as {model.cfg.variant} (K={model.cfg.loops}) into {out}")


@app.command()
def predict(
    paths: List[Path] = typer.Argument(..., help="Sweep or run folders of finished runs."),
    at: List[int] = typer.Option([300], "--at", help="Step(s) at which to predict, space-separated."),
    predictor: Optional[Path] = PredictorOpt,
    csv: Optional[Path] = typer.Option(None, "--csv", help="Also write the per-cell table (all steps) here."),
    figure: Optional[Path] = typer.Option(None, "--figure", help="Also draw agreement, false alarms and misses "
                                          "against the step (PNG/PDF/SVG by the suffix)."),
):
    """Early warning: P(collapse) of every cell at step s beside its final verdict, and the agreement."""
    from .early_warning import agreement, load_predictor, predict_sweep
    from .storage import run_dirs
    import pandas as pd
    for path in paths:
        run_dirs(path)  # a clear error for a path that is neither a run nor a sweep
    try:
        model = load_predictor(predictor)
        tables = {s: pd.concat([predict_sweep(path, s, model) for path in paths], ignore_index=True) for s in at}
    except ValueError as e:
        raise UserError(str(e)) from None
    for s, table in tables.items():
        if table.empty:
            print(f"step {s}: no finished cell has more than {s} steps")
            continue
        target = model.get("target", "collapse")
        for r in table.itertuples():
            print(f"{r.cell:28s} step {s}: P({target}) {r.p_collapse:.2f} -> {'WARN' if r.predicted else 'ok':4s} | "
                  f"final: {r.verdict:9s} {'agree' if r.agree else 'FALSE ALARM' if r.false_alarm else 'MISS'}  "
                  f"[{r.evidence}]")
        a = agreement(table)
        print(f"step {s}: agreement {a['accuracy']:.0%} over {a['cells']} cells ({a['positives']} with target "
              f"{target}); {a['false_alarms']} false alarms, {a['misses']} misses")
    if csv is not None:
        from .storage import atomic_write_text
        frames = [t.assign(step=s) for s, t in tables.items()]
        atomic_write_text(csv, pd.concat(frames, ignore_index=True).to_csv(index=False))
    if figure is not None:
        from .early_warning import draw_agreement
        from .plotting import save
        if figure.suffix not in (".png", ".pdf", ".svg"):
            raise UserError(f"--figure must end in .png, .pdf or .svg, got {figure.name}")
        curve = [dict(step=s, **agreement(t)) for s, t in tables.items() if len(t)]
        name = paths[0].name if len(paths) == 1 else f"{len(paths)} folders"
        print(save(draw_agreement({name: curve}), figure))


@app.command("fit-predictor")
def fit_predictor(
    paths: List[Path] = typer.Argument(..., help="Sweep or run folders of finished runs (the training set)."),
    out: Path = typer.Option(..., "--out", help="Predictor JSON to write (flt_diag/early_warning.json is the "
                             "packaged one)."),
    at: List[int] = typer.Option([100, 200, 300, 500], "--at", help="Steps to fit a model at."),
    l2: float = typer.Option(1.0, "--l2", help="L2 penalty of the logistic regression (> 0)."),
    target: str = typer.Option("fails", "--target", help="fails (final verdict unstable, collapsed or diverged) "
                               "or collapse (collapsed or diverged)."),
):
    """Fit the early-warning predictor (one logistic regression per step) on labelled runs."""
    from .early_warning import fit
    from .storage import run_dirs, write_json
    if not l2 > 0 or l2 == float("inf"):
        raise UserError(f"--l2 must be > 0 and finite, got {l2}")
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
        print(f"step {s}: {m['runs']} runs ({m['positives']} with target {model['target']}), training accuracy {m['train_accuracy']:.0%}; "
              + ", ".join(f"{f} {c:+.2f}" for f, c in zip(model["features"], m["coef"])))
    print(f"predictor: {out}")


@app.command()
def variants():
    """List the five variants and what each does in loops t >= 2."""
    from .model import VARIANT_DESCRIPTIONS
    for name, text in VARIANT_DESCRIPTIONS.items():
        print(f"{name:6s} {text}")


# ------------------------------------------------------------------ plots and report

def _plot(kind: str, path: Path, out: Optional[Path], formats: List[str]) -> None:
    from .plotting import plot
    for f in formats:
        if f not in ("png", "pdf", "svg"):
            raise UserError(f"format must be png, pdf or svg, got {f!r}")
    for p in plot(kind, path, out, tuple(formats)):
        print(p)


PathArg = typer.Argument(..., help="A sweep folder or a run folder (also while it is running).")
OutOpt = typer.Option(None, "--out", help="Folder for the figures [default: <path>/figures].")
FormatOpt = typer.Option(["png", "pdf"], "--format", help="png, pdf, svg (repeatable).")


@plot_app.command("residuals")
def plot_residuals(path: Path = PathArg, out: Optional[Path] = OutOpt, format: List[str] = FormatOpt):
    """Residual norm per loop against step (one panel per variant x loops), and loop x layer heatmaps."""
    _plot("residuals", path, out, format)
    _plot("heatmap", path, out, format)


@plot_app.command("gradients")
def plot_gradients(path: Path = PathArg, out: Optional[Path] = OutOpt, format: List[str] = FormatOpt):
    """Grad-norm traces with oscillation indices, per-loop gradient norms, consecutive cosine."""
    _plot("gradients", path, out, format)


@plot_app.command("loss")
def plot_loss(path: Path = PathArg, out: Optional[Path] = OutOpt, format: List[str] = FormatOpt):
    """Training loss (smoothed) and validation loss."""
    _plot("loss", path, out, format)


@plot_app.command("collapse")
def plot_collapse(path: Path = PathArg, out: Optional[Path] = OutOpt, format: List[str] = FormatOpt):
    """Variant x loops grid coloured by verdict, annotated with final loss."""
    _plot("collapse", path, out, format)


@plot_app.command("loops")
def plot_loops(path: Path = PathArg, out: Optional[Path] = OutOpt, format: List[str] = FormatOpt):
    """Test-time loop curves (run `flt-diag eval-loops` first)."""
    _plot("loops", path, out, format)


@plot_app.command("map")
def plot_map(path: Path = PathArg, out: Optional[Path] = OutOpt, format: List[str] = FormatOpt):
    """Stability map (from `flt-diag map`): the boundary per variant over K, region that trains shaded."""
    _plot("map", path, out, format)


@plot_app.command("all")
def plot_all(path: Path = PathArg, out: Optional[Path] = OutOpt, format: List[str] = FormatOpt):
    """Every figure that has data."""
    _plot("all", path, out, format)


@app.command()
def report(path: Path = typer.Argument(..., help="A sweep folder."),
           out: Optional[Path] = typer.Option(None, "--out", help="HTML file [default: <sweep>/report.html].")):
    """One self-contained HTML report: table, every figure, spec and environment."""
    from .report import write_report
    print(write_report(path, out))


# ------------------------------------------------------------------ entry point

def main(argv: list[str] | None = None) -> int:
    from .data import DataError
    from .storage import StorageError

    try:
        args = expand_list_options(list(sys.argv[1:] if argv is None else argv))
        code = app(args=args, prog_name="flt-diag", standalone_mode=False)
        if code == 130:  # click turns Ctrl-C into a return value of 130 outside standalone mode
            raise KeyboardInterrupt
        if isinstance(code, int) and code:  # a typer.Exit(code) inside a command (e.g. study)
            return code
    except click_exc.NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx else "", file=sys.stderr)
        return 2
    except click_exc.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        _progress_bar.close()
        print("interrupted; finished work is kept (re-run the same command to resume)", file=sys.stderr)
        return 130
    except typer.Exit as e:
        return e.exit_code
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
