"""Training: one run into one run folder, with callbacks at clear moments.

Moments (Callback): on_start, before_step, after_backward (gradients ready, before clipping),
after_clip (gradients clipped), after_step (optimizer stepped), on_end. Diagnostics are a callback plus hooks
(flt_diag.diagnostics); the loop itself logs only loss, lr, global grad norm and val loss.

Every scalar of a step goes into a StepLog as a device tensor; the StepLog moves them to the
host in one transfer per step.
"""
from __future__ import annotations

import contextlib
import math
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from . import metric_names as M
from .callbacks import Callback
from .config import RunConfig, padded_vocab
from .data import DataError, TokenData, batch_generator, get_batch, load_tokens, stream_batch
from .evaluation import evaluate
from .model import LoopedTransformer
from .optim import build_optimizers, lr_multiplier, muon_momentum, set_lr, set_momentum
from .storage import (CHECKPOINT, CONFIG, PROGRESS, RESUME, SUMMARY, MetricsWriter, StorageError, atomic_path, folder_lock,
                      has_content, load_config, load_metrics, read_json, write_json)

# Fields that may differ when a run folder is reused (they do not change what is computed).
VOLATILE_TRAIN_FIELDS = ("device", "threads", "compile", "eval_every", "checkpoint_every")
VOLATILE_DIAGNOSTICS_FIELDS = ("flush_every", "tensorboard", "wandb", "warn")


class RunConflict(StorageError):
    """The run folder holds a run with a different configuration."""


class StepLog:
    """Scalars of one step, kept on the device until `collect` (one host transfer)."""

    def __init__(self):
        self.keys: list[tuple[str, int, int]] = []
        self.values: list[torch.Tensor] = []

    def add(self, metric: str, value: torch.Tensor | float, loop: int = M.NONE, layer: int = M.NONE) -> None:
        self.keys.append((metric, loop, layer))
        self.values.append(value.detach().float().reshape(()) if torch.is_tensor(value) else torch.tensor(float(value)))

    def collect(self, step: int) -> list[tuple]:
        if not self.values:
            return []
        devices = {v.device for v in self.values}
        target = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
        vals = torch.stack([v.to(target) for v in self.values]).tolist()  # the one sync
        rows = [(step, m, lp, ly, v) for (m, lp, ly), v in zip(self.keys, vals)]
        self.keys, self.values = [], []
        return rows


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {name} requested but there are {torch.cuda.device_count()} GPUs")
    return dev


def environment(device: torch.device) -> dict:
    import numpy, pandas
    env = dict(python=sys.version.split()[0], torch=torch.__version__, numpy=numpy.__version__,
               pandas=pandas.__version__, platform=platform.platform(), host=socket.gethostname(),
               device=str(device), threads=torch.get_num_threads(), world_size=int(os.environ.get("WORLD_SIZE", 1)),
               started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        from importlib.metadata import version
        env["flt_diag"] = version("flt-diag")
    except Exception:
        env["flt_diag"] = "unknown"
    return env


def comparable(cfg_dict: dict) -> dict:
    """The parts of a config that decide what a run computes (verdict thresholds, logging
    mirrors and intervals can change without invalidating a run folder)."""
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg_dict.items()
         if k not in ("env", "corpus", "verdict", "imported_from", "note", "n_params")}
    for k in VOLATILE_TRAIN_FIELDS:
        d["train"].pop(k, None)
    for k in VOLATILE_DIAGNOSTICS_FIELDS:
        d.get("diagnostics", {}).pop(k, None)
    return d


def _differences(a: dict, b: dict) -> list[str]:
    out = []
    for section in sorted(set(a) | set(b)):
        sa, sb = a.get(section), b.get(section)
        if isinstance(sa, dict) and isinstance(sb, dict):
            out += [f"{section}.{k}: {sa.get(k)!r} -> {sb.get(k)!r}" for k in sorted(set(sa) | set(sb))
                    if sa.get(k) != sb.get(k)]
        elif sa != sb:
            out.append(f"{section}: {sa!r} -> {sb!r}")
    return out


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: str | Path, callbacks: list[Callback] | None = None,
                 progress: Callable[[dict], None] | None = None, diagnostics: bool | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.device = resolve_device(cfg.train.device)
        if self.world > 1:
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            if self.device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            # One thread by default: tiny models are bound by per-op overhead, and OpenMP threads
            # that wait for a core slow a step down 100x when other processes share the machine.
            torch.set_num_threads(cfg.train.threads or 1)
            # A collapsing LT drives activation gradients through the loops towards 1e-20 and
            # below; subnormal arithmetic made such steps 3.5x slower (benchmarks/README.md).
            # (The setting holds for the calling thread, so for all compute at one thread.)
            torch.set_flush_denormal(cfg.train.flush_denormal)
        elif cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.train_data = load_tokens(cfg.train.data, cfg.train.tokenizer, "train", cfg.train.max_tokens)
        self.val_data = load_tokens(cfg.train.data, cfg.train.tokenizer, "val", cfg.train.max_tokens)
        for split, data in (("train", self.train_data), ("validation", self.val_data)):
            need = cfg.model.sequence_len + 2
            if len(data) < need:  # found now, not after every step has been trained
                raise DataError(f"the {split} split of {cfg.train.data} has {len(data)} tokens; a sequence of "
                                f"{cfg.model.sequence_len} needs at least {need}")
        cfg.model.vocab_size = padded_vocab(self.train_data.vocab_size)
        torch.manual_seed(cfg.train.seed)
        try:
            self.model = LoopedTransformer(cfg.model).to(self.device)
        except (RuntimeError, MemoryError) as e:  # e.g. a width no memory can hold
            from .model import count_parameters
            raise ValueError(f"cannot allocate the model ({count_parameters(cfg.model):,} parameters) on "
                             f"{self.device}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if cfg.train.precision == "reference":
            from .parallel import reference_precision
            reference_precision(self.model)
        self.model.checkpoint_loops = cfg.train.checkpoint_loops
        use_compile = cfg.train.compile if cfg.train.compile is not None else self.device.type == "cuda"
        if use_compile:
            from .parallel import compile_blocks
            compile_blocks(self.model)
        self.ddp_model = self.model
        if self.world > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizers = build_optimizers(self.model, cfg.train, fused=self.device.type == "cuda")
        self.log = StepLog()
        self.callbacks = list(callbacks or [])
        if diagnostics if diagnostics is not None else cfg.diagnostics.enabled:
            from .diagnostics import DiagnosticsCallback
            self.callbacks.insert(0, DiagnosticsCallback(cfg.diagnostics))
        self.is_main = self.rank == 0
        self.writer: MetricsWriter | None = None
        self.sinks: list = []
        self.start_step = 0
        self.wall_time = 0.0
        self.stop_reason: str | None = None
        self.stop_requested: str | None = None
        self.prediction: dict | None = None
        if cfg.diagnostics.warn or cfg.diagnostics.stop_on_collapse:
            from .early_warning import CollapseWarning, load_predictor
            self.callbacks.append(CollapseWarning(load_predictor(cfg.diagnostics.predictor),
                                                  stop=cfg.diagnostics.stop_on_collapse))

    def request_stop(self, reason: str, prediction: dict | None = None) -> None:
        """End the run after the current step (a callback decided it); the run folder is completed."""
        self.stop_requested, self.prediction = reason, prediction

    # ------------------------------------------------------------------ run folder
    def _prepare_folder(self) -> bool:
        """Create or reuse the run folder. Returns False if the run has already finished.
        Under DDP, rank 0 does this while the other ranks wait, then they read the same state."""
        if not self.is_main:
            torch.distributed.barrier()
            if (self.run_dir / SUMMARY).exists():
                return False
            if (self.run_dir / RESUME).exists():
                self._load_resume()
            return True
        try:
            return self._prepare_folder_main()
        finally:
            if self.world > 1:
                torch.distributed.barrier()

    def _prepare_folder_main(self) -> bool:
        d = self.run_dir
        cfg_dict = self.cfg.to_dict()
        if (d / CONFIG).exists():
            old = load_config(d)
            diff = _differences(comparable(old), comparable(cfg_dict))
            if diff:
                raise RunConflict(f"{d} holds a run with a different config ({'; '.join(diff[:3])}); "
                                  "use another --out or delete the folder")
            if (d / SUMMARY).exists():
                return False
        elif has_content(d):
            raise RunConflict(f"{d} exists, is not empty and is not a run folder; use another --out")
        resumed = (d / RESUME).exists()
        if resumed:  # read (and check) the resume state before anything in the folder changes
            self._load_resume()
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create run folder {d}: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise StorageError(f"cannot write to {d}")
        write_json(d / CONFIG, {**cfg_dict, "n_params": self.n_params, "env": environment(self.device),
                                "corpus": {"train_tokens": len(self.train_data), "val_tokens": len(self.val_data),
                                           "unigram_entropy": self.train_data.unigram_entropy}})
        self.writer = MetricsWriter(d)
        self.sinks = _external_sinks(self.cfg, d)
        # a run that died before its first checkpoint starts afresh; a resumed one drops later rows
        self.writer.truncate_after(self.start_step - 1 if resumed else -1)
        return True

    def _save_resume(self, next_step: int) -> None:
        state = dict(step=next_step, wall_time=self.wall_time, model=self.model.state_dict(),
                     optimizers=[o.state_dict() for o in self.optimizers],
                     callbacks=[c.state_dict() for c in self.callbacks])
        with atomic_path(self.run_dir / RESUME) as tmp:
            torch.save(state, tmp)

    def _load_resume(self) -> None:
        from .checkpoint import load
        state = load(self.run_dir / RESUME, map_location=self.device)
        try:
            self.model.load_state_dict(state["model"])
            for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
                opt.load_state_dict(s)
            for cb, s in zip(self.callbacks, state["callbacks"]):  # callbacks of the caller may differ
                cb.load_state_dict(s)
            self.start_step, self.wall_time = int(state["step"]), float(state["wall_time"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
            raise StorageError(f"{self.run_dir / RESUME} does not fit this run ({str(e).splitlines()[0][:200]}); "
                               "delete it to restart the run from step 0") from None

    def save_checkpoint(self, path: Path, steps_done: int) -> None:
        with atomic_path(path) as tmp:
            torch.save({"model": self.model.state_dict(), "model_config": self.cfg.model.to_dict(),
                        "step": steps_done}, tmp)

    # ------------------------------------------------------------------ training
    def autocast(self):
        """bf16 autocast on CUDA; on CPU only with precision "reference" (so that its path runs anywhere)."""
        if self.device.type == "cuda" or self.cfg.train.precision == "reference":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def describe(self) -> str:
        """One line for the start of a run: the model and its parameter count."""
        m = self.cfg.model
        return (f"{m.variant} K={m.loops}: L={m.n_layer} d={m.n_embd} heads={m.n_head} vocab={m.vocab_size} "
                f"seq={m.sequence_len}, {self.n_params:,} parameters ({self.n_params / 1e6:.1f}M), "
                f"precision {self.cfg.train.precision}, device {self.device}")

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro` of optimizer step `step` on this rank: a function of (seed, step,
        micro, rank) in random sampling, of the position in the corpus in stream sampling."""
        t, T = self.cfg.train, self.cfg.model.sequence_len
        if t.sampling == "stream":
            return stream_batch(self.train_data, t.batch_size, T, (step * t.grad_accum + micro) * self.world + self.rank,
                                self.device)
        return get_batch(self.train_data, t.batch_size, T, batch_generator(t.seed, step, micro, self.rank), self.device)

    def train_step(self, step: int) -> torch.Tensor:
        t = self.cfg.train
        set_lr(self.optimizers, lr_multiplier(step, t.steps, t.warmdown_frac))
        momentum = muon_momentum(step, t)
        has_muon = set_momentum(self.optimizers, momentum)
        for cb in self.callbacks:
            cb.before_step(self, step)
        total = torch.zeros((), device=self.device)
        for micro in range(t.grad_accum):
            x, y = self.batch(step, micro)
            sync = self.world == 1 or micro == t.grad_accum - 1
            with (contextlib.nullcontext() if sync else self.ddp_model.no_sync()), self.autocast():
                _, loss = self.ddp_model(x, y, loss_on=t.loss_on)
            (loss / t.grad_accum).backward()
            total += loss.detach() / t.grad_accum
        if self.world > 1:  # every rank logs (and judges) the same, global mean loss
            torch.distributed.all_reduce(total)
            total /= self.world
        for cb in self.callbacks:
            cb.after_backward(self, step)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if t.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))
        for cb in self.callbacks:
            cb.after_clip(self, step)
        for opt in self.optimizers:
            opt.step()
        for cb in self.callbacks:
            cb.after_step(self, step)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.log.add(M.LOSS, total)
        self.log.add(M.GRAD_NORM, grad_norm)
        self.log.add(M.LR, self.optimizers[0].param_groups[0]["lr"])
        if has_muon:
            self.log.add(M.MOMENTUM, momentum)
        return total

    def fit(self) -> dict:
        """Train (or resume) to the end and return the run's summary. Rank 0 owns the run folder
        (a second process writing the same folder is refused) until the summary is written."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise StorageError(f"{self.run_dir} exists and is a file, not a run folder; use another --out")
        with folder_lock(self.run_dir) if self.is_main else contextlib.nullcontext():
            return self._fit()

    def _fit(self) -> dict:
        from .metrics import summarize

        if not self._prepare_folder():
            return read_json(self.run_dir / SUMMARY)
        t = self.cfg.train
        for cb in self.callbacks:
            cb.on_start(self)
        self.model.train()
        last_report, step = 0.0, self.start_step
        loss_value = float("nan")
        t0 = time.perf_counter()
        try:
            for step in range(self.start_step, t.steps):
                self.train_step(step)
                rows = self.log.collect(step)
                loss_value = next(v for _, m, _, _, v in rows if m == M.LOSS)
                if self.is_main:
                    self.writer.extend(rows)
                    for sink in self.sinks:
                        sink.extend(rows)
                for cb in self.callbacks:
                    cb.on_rows(self, step, rows)
                done = step + 1
                if not math.isfinite(loss_value):
                    self.stop_reason = f"non-finite loss at step {step}"
                    break
                if self.stop_requested:
                    self.stop_reason = self.stop_requested
                    break
                if t.eval_every and done % t.eval_every == 0 and done < t.steps:
                    self._evaluate(step)
                if self.is_main and done % self.cfg.diagnostics.flush_every == 0:
                    self.writer.flush()
                if self.is_main and t.checkpoint_every and done % t.checkpoint_every == 0 and done < t.steps:
                    self.writer.flush()
                    self.wall_time += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    self._save_resume(done)
                now = time.perf_counter()
                if self.is_main and (now - last_report > 1.0 or done == t.steps):
                    last_report = now
                    self._report(done, loss_value, self.wall_time + now - t0)
        finally:
            for cb in self.callbacks:
                cb.on_end(self)
            if self.is_main and self.writer is not None:
                self.writer.flush()
                for sink in self.sinks:
                    sink.close()
        self.wall_time += time.perf_counter() - t0
        if self.stop_reason is None or self.prediction is not None:
            self._evaluate(step)
        if not self.is_main:
            torch.distributed.destroy_process_group()
            return {}
        self.writer.flush()
        self.save_checkpoint(self.run_dir / CHECKPOINT, step + 1)
        summary = summarize(load_metrics(self.run_dir), self.cfg,
                            unigram_entropy=self.train_data.unigram_entropy,
                            wall_time=self.wall_time, stop_reason=self.stop_reason, prediction=self.prediction,
                            tokens_per_step=t.batch_size * t.grad_accum * self.world * self.cfg.model.sequence_len)
        write_json(self.run_dir / SUMMARY, summary)
        (self.run_dir / RESUME).unlink(missing_ok=True)
        self._report(step + 1, loss_value, self.wall_time, final=True)
        if self.world > 1:
            torch.distributed.destroy_process_group()
        return summary

    def _evaluate(self, step: int) -> None:
        t = self.cfg.train
        with self.autocast():
            val = evaluate(self.model, self.val_data, t.batch_size, self.cfg.model.sequence_len,
                           t.eval_batches, self.device)
        if self.is_main:
            self.writer.add(step, M.VAL_LOSS, M.NONE, M.NONE, val)

    def _report(self, step: int, loss: float, elapsed: float, final: bool = False) -> None:
        info = dict(step=step, steps=self.cfg.train.steps, loss=loss, elapsed=elapsed, final=final,
                    steps_per_s=step / elapsed if elapsed > 0 else 0.0)
        write_json(self.run_dir / PROGRESS, info)
        if self.progress is not None:
            self.progress(info)


def _external_sinks(cfg: RunConfig, run_dir: Path) -> list:
    """TensorBoard / Weights & Biases mirrors of the metrics table, when asked for."""
    sinks = []
    if cfg.diagnostics.tensorboard:
        from .external import TensorBoardSink
        sinks.append(TensorBoardSink(run_dir))
    if cfg.diagnostics.wandb:
        from .external import WandbSink
        sinks.append(WandbSink(cfg.diagnostics.wandb, run_dir, cfg.to_dict()))
    return sinks


def train(cfg: RunConfig, run_dir: str | Path, **kwargs) -> dict:
    """Train one run into `run_dir` (resuming it if it was interrupted); returns the summary."""
    return Trainer(cfg, run_dir, **kwargs).fit()
