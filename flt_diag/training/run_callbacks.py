"""The side concerns of every flt-diag run as Trainer callbacks (flt_diag.instruments.callbacks: the moments): the
metrics table and the progress (resume checkpoints: flt_diag.training.checkpoint; evaluation; external mirrors)."""
from __future__ import annotations

import time
from typing import Callable

from flt_diag.instruments.callbacks import Callback
from flt_diag.training.checkpoint import checkpoint_due
from flt_diag.storage.folders import PROGRESS, MetricsWriter, write_json


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
