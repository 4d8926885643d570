"""Training: one run into one run folder. `Trainer` is the loop; everything else is a callback.

The loop: for each step, `train_step()` (forward/backward per micro-batch, clipping, optimizer step; the step's
scalars kept in a StepLog as device tensors, moved to the host in one transfer), then the callbacks' `on_rows`
and `on_step_end`. The callbacks, in order: the instruments and the collapse warning (`probe`: the Probe that
flt_diag.watch's LoopProbe holds too, flt_diag.integrations.probe), the caller's, evaluation, the metrics table,
TensorBoard / W&B mirrors, resume.pt / checkpoint.pt and progress. The Trainer itself owns config.json (written
first) and summary.json (written last). It takes a settled config (flt_diag.training.settle) as given, and refuses
one that was not settled.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Callable, cast

import torch

from flt_diag.storage import metric_names as M
from flt_diag.storage.errors import first_line
from flt_diag.storage.file_models import Summary
from flt_diag.judge.verdict import Recipe, summarize, tokens_per_step, with_not_recorded
from flt_diag.instruments.callbacks import Callback
from flt_diag.training.run_callbacks import MetricsTable, Progress
from flt_diag.training.decided_stop import DecidedStop, with_decision
from flt_diag.training.checkpoint import Checkpoints, restore
from flt_diag.config.run_config import RunConfig
from flt_diag.data.batches import batch_generator, get_batch, stream_batch
from flt_diag.data.corpus import DataError, TokenData
from flt_diag.data.sources import describe, load_split
from flt_diag.data.tasks import TaskData
from flt_diag.training.evaluation import Evaluation
from flt_diag.training.external import ExternalSinks
from flt_diag.model.transformer import LoopedTransformer, ModelConfig, count_parameters, parameter_groups
from flt_diag.instruments.records import Row, StepLog, environment
from flt_diag.training.process import run_cpu_settings, start_process
from flt_diag.instruments.dynamics_callback import own_model_dynamics
from flt_diag.instruments.warning_callback import collapse_warning
from flt_diag.integrations.probe import Probe
from flt_diag.training.compile_precision import compile_blocks, compile_wanted, drop_queued_compiles, reference_precision
from flt_diag.training.stabiliser_step import (micro_depths, objective, sampled_loops, stabiliser_env, step_loops,
                                               step_metrics)
from flt_diag.training.optim import build_optimizers, lr_multiplier, muon_momentum, set_lr, set_momentum
from flt_diag.storage.folders import (CONFIG, METRICS, SUMMARY, StorageError, folder_lock, has_content, load_config, load_metrics,
                      load_summary, refuse_not_a_folder, write_json)
from flt_diag.training.settle import check_settled, comparable, differences


class RunConflict(StorageError):
    """The run folder holds a run with a different configuration."""


def _load_splits(t, seq_len: int) -> tuple[TokenData | TaskData, TokenData | TaskData]:
    splits = [load_split(t, seq_len, split) for split in ("train", "val")]
    for name, data in zip(("train", "validation"), splits):
        if isinstance(data, TokenData) and len(data) < seq_len + 2:  # found now, not after every step has been trained
            raise DataError(f"the {name} split of {t.data} has {len(data)} tokens; a sequence of "
                            f"{seq_len} needs at least {seq_len + 2}")
    return splits[0], splits[1]


class Trainer:
    """One run into `run_dir`: `fit()` trains it (or resumes it) to the end and returns its summary.

    For benchmarks and tests, the pieces of `fit` are public: `start()` (run folder ready, callbacks
    started), `run_step(step)` (one optimizer step; returns its rows), `end()` (callbacks ended).
    `cfg` is a settled config (flt_diag.training.settle.settle or run_config), taken as given and not changed.
    `model` builds the model from its ModelConfig instead of LoopedTransformer (e.g. the benchmarks'
    unrolled reference); it is built under the run's seed and then placed, compiled and given the
    optimizer recipe like the default one."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, callbacks: list[Callback] | None = None,
                 progress: Callable[[dict], None] | None = None, diagnostics: bool | None = None,
                 model: Callable[[ModelConfig], torch.nn.Module] | None = None, root: str | Path | None = None):
        self.run_dir, self.cfg, self.recipe = Path(run_dir), cfg, Recipe.of(cfg)  # (recipe: what the instruments read)
        self.root = Path(root) if root is not None else None  # the folder the command was given (a sweep)
        self.train_data, self.val_data = _load_splits(cfg.train, cfg.model.seq_len)
        check_settled(cfg, self.train_data.vocab_size)  # a guard: the Trainer settles nothing itself
        self.device, self.rank, self.world = start_process(cfg)
        self.is_main = self.rank == 0
        with run_cpu_settings(cfg, self.device):  # (the caller's back after: training/process.py)
            self.model = self._build_model(model or LoopedTransformer)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.ddp_model: torch.nn.Module = self.model
        if self.world > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(  # (a sampled loop count of 1 leaves a loop
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,  # start unused)
                find_unused_parameters=sampled_loops(self.model))
        self.optimizers = build_optimizers(self.model, cfg.train, fused=self.device.type == "cuda")
        self.log = StepLog()
        # the instruments, through the probe that flt_diag.watch runs too; then the caller's callbacks and the side
        # concerns of every run (their order is the order of their work in a moment)
        d, instrumented = cfg.diagnostics, diagnostics if diagnostics is not None else cfg.diagnostics.diagnostics
        self.probe = Probe(d, own_model_dynamics(d, self.model) if instrumented else None, collapse_warning(d))
        if instrumented:
            self.probe.build(parameter_groups(self.model))
        self.callbacks: list[Callback] = [self.probe, *(callbacks or []), DecidedStop(d.stop_when_decided),
                                          Evaluation(), MetricsTable(), ExternalSinks(), Checkpoints(),
                                          Progress(progress)]
        self.start_step = self.steps_done = 0
        self.wall_time = 0.0
        self.last_loss = math.nan
        self.stop_reason: str | None = None
        self.stop_requested: str | None = None
        self.prediction: dict | None = None
        self._t0: float | None = None

    def _build_model(self, factory) -> LoopedTransformer:  # (or a module with its attributes: `model`'s)
        torch.manual_seed(self.cfg.train.seed)
        try:
            model = factory(self.cfg.model).to(self.device)
        except (RuntimeError, MemoryError) as e:  # e.g. a width no memory can hold
            raise ValueError(f"cannot allocate the model ({count_parameters(self.cfg.model):,} parameters) on "
                             f"{self.device}: {first_line(e)}") from None
        t = self.cfg.train
        if t.precision == "reference":
            reference_precision(model)
        model.checkpoint_loops = t.checkpoint_loops
        model.grad_loops = t.grad_loops or model.grad_loops  # (Huginn's default: ceil(K/4); --grad-loops wins)
        model.embed.weight.requires_grad_(not t.freeze_embedding)  # frozen: no gradient, so no optimizer update
        if compile_wanted(t.compile, self.device.type, t.steps):
            compile_blocks(model)
        return model

    def request_stop(self, reason: str, prediction: dict | None = None) -> None:
        """End the run after the current step (a callback decided it); the run folder is completed."""
        self.stop_requested, self.prediction = reason, prediction

    def elapsed(self) -> float:
        """Training seconds so far, over every session of a resumed run."""
        return self.wall_time + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def call(self, moment: str, *args) -> None:
        """Every callback's `moment` (flt_diag.instruments.callbacks.Callback), in the callbacks' order; e.g.
        `call("on_rows", step, rows)`: rows (step, metric, loop, layer, value) to the table, the mirrors, ..."""
        for cb in self.callbacks:
            getattr(cb, moment)(self, *args)

    # ------------------------------------------------------------------ run folder
    def start(self) -> bool:
        """Make the run folder ready (create it, or check and reuse it; load resume.pt), then start
        the callbacks. False if the folder holds a finished run (there is nothing to train).
        Under DDP, rank 0 does the folder while the other ranks wait, then they read the same state."""
        if not self.is_main:
            torch.distributed.barrier()
            ready = not (self.run_dir / SUMMARY).exists()
            if ready:
                restore(self)  # (none there: nothing loaded; a link there: refused)
        else:
            try:
                ready = self._open_folder()
            finally:
                if self.world > 1:
                    torch.distributed.barrier()
        if ready:
            try:
                self.call("on_start")
            except BaseException:
                if self.is_main and self._fresh:  # a refused start leaves the new folder as it was: empty
                    with contextlib.suppress(OSError):
                        (self.run_dir / CONFIG).unlink(missing_ok=True)
                        (self.run_dir / METRICS).rmdir()
                raise
            if self.is_main and not self._fresh:  # a resume rewrites config.json only once nothing refused it
                self._write_config()
            self.model.train()
            self._t0 = time.perf_counter()
        return ready

    def _open_folder(self) -> bool:
        d = self.run_dir
        cfg_dict = self.cfg.to_dict()
        self._fresh = not (d / CONFIG).exists()  # a new run writes config.json first; a resume after its checks
        if not self._fresh:
            diff = differences(comparable(load_config(d).as_written()), comparable(cfg_dict))
            if diff:
                raise RunConflict(f"{d} holds a run with a different config ({'; '.join(diff[:3])}); "
                                  "use another --out or delete the folder")
            if (d / SUMMARY).exists():
                return False
        elif has_content(d):
            raise RunConflict(f"{d} exists, is not empty and is not a run folder; use another --out")
        restore(self)  # read (and check) any resume state, a link there refused, before anything in the folder changes
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create run folder {d}: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise StorageError(f"cannot write to {d}")
        if self._fresh:
            self._write_config()
        return True

    def _write_config(self) -> None:
        write_json(self.run_dir / CONFIG, {**self.cfg.to_dict(), "n_params": self.n_params,
                                           "env": {**environment(self.device), **stabiliser_env(self.model)},
                                           "corpus": describe(self.train_data, self.val_data)})

    def end(self) -> None:
        """End the callbacks (hooks removed, files flushed and closed)."""
        self.call("on_end")

    # ------------------------------------------------------------------ training
    def autocast(self):
        """bf16 autocast on CUDA; on CPU only with precision "reference" (so that its path runs anywhere)."""
        if self.device.type == "cuda" or self.cfg.train.precision == "reference":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def describe(self) -> str:
        """One line for the start of a run: the model and its parameter count."""
        m = self.cfg.model
        return (f"{m.variant} K={m.loops}: L={m.depth} d={m.width} heads={m.heads} vocab={m.vocab_size} "
                f"seq={m.seq_len}, {self.n_params:,} parameters ({self.n_params / 1e6:.1f}M), "
                f"precision {self.cfg.train.precision}, device {self.device}")

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro` of optimizer step `step` on this rank: a function of (seed, step,
        micro, rank) in random sampling, of the position in the corpus in stream sampling."""
        t, T = self.cfg.train, self.cfg.model.seq_len
        if t.sampling == "stream":
            data = cast(TokenData, self.train_data)  # (a task is never streamed: TrainConfig refuses it)
            return stream_batch(data, t.batch_size, T, (step * t.grad_accum + micro) * self.world + self.rank,
                                self.device)
        return get_batch(self.train_data, t.batch_size, T, batch_generator(t.seed, step, micro, self.rank), self.device)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step (callbacks at before_step, after_backward, after_clip, after_step);
        its scalars go to `self.log`. Returns the loss (the global mean under DDP), on the device."""
        t = self.cfg.train
        set_lr(self.optimizers, lr_multiplier(step, t.steps, t.warmdown_frac))
        momentum = muon_momentum(step, t)
        has_muon = set_momentum(self.optimizers, momentum)
        self.call("before_step", step)
        total = torch.zeros((), device=self.device)
        loops = step_loops(self.model, t.seed, step)  # a stabiliser's sampled loop count; None: K
        runs = []  # each micro-batch's mean loop count, where a stabiliser samples one per sequence
        for micro in range(t.grad_accum):
            x, y = self.batch(step, micro)
            sync = self.world == 1 or micro == t.grad_accum - 1
            wrapped = cast(torch.nn.parallel.DistributedDataParallel, self.ddp_model)  # (not sync: world > 1, wrapped)
            depths = micro_depths(self.model, t.seed, step, micro, x.shape[0])  # (n, k) per sequence; None: none
            runs += [] if depths is None else [float((depths[0] + depths[1]).double().mean())]
            with (contextlib.nullcontext() if sync else wrapped.no_sync()), self.autocast():
                _, loss = self.ddp_model(x, y, loss_on=t.loss_on, loops=loops,
                                         **({} if depths is None else {"depths": depths}))
                target, penalty = objective(self.model, loss, t.seed, step, micro, t.steps)
            (target / t.grad_accum).backward()
            total += loss.detach() / t.grad_accum
            if penalty is not None and micro == 0:
                self.log.add(M.STABILISER_PENALTY, penalty)
        if loops is not None or runs:  # (per sequence: the batch mean of r_i)
            self.log.add(M.LOOPS_RUN, float(loops) if loops is not None else sum(runs) / len(runs))
        for metric, value in step_metrics(self.model).items():  # a stabiliser's own (Parcae's rho)
            self.log.add(metric, value)
        if self.world > 1:  # every rank logs (and judges) the same, global mean loss
            torch.distributed.all_reduce(total)
            total /= self.world
        self.call("after_backward", step)
        params = [p for p in self.model.parameters() if p.grad is not None]  # (so p.grad below is a Tensor)
        if t.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([cast(torch.Tensor, p.grad) for p in params])))
        self.call("after_clip", step)
        for opt in self.optimizers:
            opt.step()
        self.call("after_step", step)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.log.add(M.LOSS, total)
        self.log.add(M.GRAD_NORM, grad_norm)
        self.log.add(M.LR, self.optimizers[0].param_groups[0]["lr"])
        if has_muon:
            self.log.add(M.MOMENTUM, momentum)
        return total

    def run_step(self, step: int) -> list[Row]:
        """`train_step`, then the step's rows on the host (one transfer; a sync on CUDA)."""
        self.train_step(step)
        return self.log.collect(step)

    def fit(self) -> Summary | dict:  # ({}: on DDP ranks other than 0)
        """Train (or resume) to the end and return the run's summary. Rank 0 owns the run folder
        (a second process writing the same folder is refused) until the summary is written."""
        refuse_not_a_folder(self.run_dir, "a run folder", "use another --out")  # (a link to a folder: the user's)
        # no link at any depth below the given folder (a sweep's cells/ or cell folder), then none inside
        # (a run folder given on its own may itself be a link, the user's choice: only links inside are foreign)
        root = self.root if self.root is not None else self.run_dir
        # the run's threads and subnormal flush while it trains, the caller's as they were after (also when two
        # Trainers were made before either fits)
        with run_cpu_settings(self.cfg, self.device), \
                folder_lock(self.run_dir, root=root) if self.is_main else contextlib.nullcontext():
            try:
                return self._fit()
            except KeyboardInterrupt:  # (Ctrl-C while torch.compile waits for its kernels: none more is built)
                drop_queued_compiles()
                raise

    def _fit(self) -> Summary | dict:
        if not self.start():
            return cast(Summary, load_summary(self.run_dir))  # (checked: a finished run folder from elsewhere)
        step = self.start_step
        try:
            for step in range(self.start_step, self.cfg.train.steps):
                rows = self.run_step(step)
                self.steps_done, self.last_loss = step + 1, next(v for _, m, _, _, v in rows if m == M.LOSS)
                self.call("on_rows", step, rows)
                if not math.isfinite(self.last_loss):
                    self.stop_reason = f"non-finite loss at step {step}"
                elif self.stop_requested:
                    self.stop_reason = self.stop_requested
                if self.stop_reason:
                    break
                self.call("on_step_end", step)
            self.wall_time = self.elapsed()
            self._t0 = None
            self.call("on_finish", step)
        finally:
            self.end()
        if not self.is_main:
            torch.distributed.destroy_process_group()
            return {}
        summary = summarize(load_metrics(self.run_dir), self.recipe, unigram_entropy=self.train_data.unigram_entropy,
                            wall_time=self.wall_time, stop_reason=self.stop_reason, prediction=self.prediction,
                            tokens_per_step=tokens_per_step(self.cfg, self.world))
        summary = with_decision(with_not_recorded(summary, self.callbacks), self.callbacks)
        write_json(self.run_dir / SUMMARY, summary)
        self.call("on_summary", summary)
        if self.world > 1:
            torch.distributed.destroy_process_group()
        return summary


def train(cfg: RunConfig, run_dir: str | Path, **kwargs) -> Summary | dict:
    """Train one run of a settled config into `run_dir` (resuming it if it was interrupted); returns the summary."""
    return Trainer(cfg, run_dir, **kwargs).fit()
