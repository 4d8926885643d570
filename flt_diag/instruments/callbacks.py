"""Training callbacks: side concerns attached to the Trainer at clear moments (torch-free base).

Moments, in the order of a step: before_step, after_backward (gradients ready, before clipping),
after_clip (gradients clipped), after_step (optimizer stepped), on_rows (scalars are on the host:
rows of (step, metric, loop, layer, value); the step's own, and the evaluation's val_loss), then
on_step_end (the step is complete and the run goes on: periodic work).
Once per run: on_start (after the run folder is ready and a resumed run's state is loaded),
on_finish (training ended without an error - every step done, or a stop - and before on_end),
on_end (always, also on an error or Ctrl-C), on_summary (rank 0, once summary.json is written).
A callback may ask the run to end after the current step with `trainer.request_stop(reason, ...)`.
State for exact resumption: state_dict / load_state_dict (saved in resume.pt).

The side concerns every run has (metrics table, external mirrors, evaluation, resume checkpoints,
progress) are callbacks too; the Trainer appends them after the caller's (`Trainer.callbacks`).
"""
from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Protocol

from flt_diag.storage.folders import PROGRESS, MetricsWriter, write_json
from flt_diag.config.run_config import RunConfig
from flt_diag.judge.verdict import Recipe

if TYPE_CHECKING:  # (types only: this base imports no torch)
    import torch

    from flt_diag.instruments.records import StepLog
    from flt_diag.storage.file_models import Summary


class Host(Protocol):
    """What the shared callbacks (diagnostics, loop dynamics, early warning) read of the loop they run in:
    flt-diag's Trainer and the probe's stand-in (flt_diag.probe.folder.Host) both are one, structurally
    (tests/typing/hosts.py); a Protocol, so that instruments import nothing of training/ or probe/. Read-only:
    a callback asks for the end of the run only through `request_stop`. The instruments read `recipe` (what the
    verdict reads too), a caller's callback may read `cfg`; on the probe both are None until its first step is
    recorded (a callback reading them before on_start checks for None)."""

    @property
    def model(self) -> "torch.nn.Module": ...
    @property
    def cfg(self) -> RunConfig | None: ...
    @property
    def recipe(self) -> Recipe | None: ...
    @property
    def run_dir(self) -> Path: ...
    @property
    def log(self) -> "StepLog": ...  # the step's metric log (add, add_vector), collected into rows
    @property
    def is_main(self) -> bool: ...  # rank 0 (the probe: always)
    @property
    def start_step(self) -> int: ...  # the first step of this session (> 0: a resumed run)

    def request_stop(self, reason: str, prediction: dict | None = None) -> None: ...


class Callback:
    def on_start(self, trainer: Host) -> None: ...
    def before_step(self, trainer: Host, step: int) -> None: ...
    def after_backward(self, trainer: Host, step: int) -> None: ...
    def after_clip(self, trainer: Host, step: int) -> None: ...
    def after_step(self, trainer: Host, step: int) -> None: ...
    def on_rows(self, trainer: Host, step: int, rows: Sequence[tuple]) -> None: ...
    def on_step_end(self, trainer: Host, step: int) -> None: ...
    def on_finish(self, trainer: Host, step: int) -> None: ...
    def on_end(self, trainer: Host) -> None: ...
    def on_summary(self, trainer: Host, summary: "Summary") -> None: ...
    def state_dict(self) -> dict: return {}
    def load_state_dict(self, state: dict) -> None: ...


def checkpoint_due(train_cfg, done: int) -> bool:
    """Whether a resume checkpoint is written after `done` steps (never after the last one)."""
    return bool(train_cfg.checkpoint_every) and done % train_cfg.checkpoint_every == 0 and done < train_cfg.steps


class MetricsTable(Callback):
    """The run folder's metrics table (rank 0): every row, flushed as a Parquet part every
    `flush_every` steps and before each resume checkpoint (so that resume.pt never points past the
    stored rows), and at the end. A resumed run first drops the rows after its checkpoint."""

    def __init__(self) -> None:
        self.writer: MetricsWriter | None = None

    def on_start(self, trainer) -> None:
        if trainer.is_main:
            self.writer = MetricsWriter(trainer.run_dir)
            self.writer.truncate_after(trainer.start_step - 1)

    def on_rows(self, trainer, step, rows) -> None:
        if self.writer is not None:
            self.writer.extend(rows)

    def on_step_end(self, trainer, step) -> None:
        done = step + 1
        if self.writer is not None and (done % trainer.cfg.diagnostics.flush_every == 0
                                        or checkpoint_due(trainer.cfg.train, done)):
            self.writer.flush()

    def on_end(self, trainer) -> None:
        if self.writer is not None:
            self.writer.flush()


class Progress(Callback):
    """progress.json (rank 0) at most once a second and at the last step, and the caller's
    `report(info)` with the same dict: step, steps, loss, elapsed, final, steps_per_s."""

    def __init__(self, report: Callable[[dict], None] | None = None, every_s: float = 1.0):
        self.report, self.every_s, self.last = report, every_s, 0.0

    def on_step_end(self, trainer, step) -> None:
        now, done = time.perf_counter(), step + 1
        if trainer.is_main and (now - self.last > self.every_s or done == trainer.cfg.train.steps):
            self.last = now
            self._send(trainer, done, trainer.elapsed())

    def on_summary(self, trainer, summary) -> None:
        self._send(trainer, trainer.steps_done, trainer.wall_time, final=True)

    def _send(self, trainer, step: int, elapsed: float, final: bool = False) -> None:
        info = dict(step=step, steps=trainer.cfg.train.steps, loss=trainer.last_loss, elapsed=elapsed, final=final,
                    steps_per_s=step / elapsed if elapsed > 0 else 0.0)
        write_json(trainer.run_dir / PROGRESS, info)
        if self.report is not None:
            self.report(info)
