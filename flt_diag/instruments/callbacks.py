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

The side concerns of flt-diag's own runs (metrics table, external mirrors, evaluation, resume checkpoints,
progress) are callbacks too, in flt_diag/training/; the Trainer appends them after the caller's (`Trainer.callbacks`).
"""
from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from flt_diag.judge.verdict import Recipe

if TYPE_CHECKING:  # (types only: this base imports no torch)
    import torch

    from flt_diag.instruments.records import StepLog
    from flt_diag.storage.file_models import Summary


class Host(Protocol):
    """What the shared callbacks (diagnostics, loop dynamics, early warning) read of the loop they run in:
    flt-diag's Trainer and the probe's stand-in (flt_diag.integrations.folder.Host) both are one, structurally
    (tests/typing/hosts.py); a Protocol, so that instruments import nothing of training/ or probe/. Read-only:
    a callback asks for the end of the run only through `request_stop`. The instruments read `recipe` (what the
    verdict reads too; on the probe only what the user gave or the probe observed, never a run config of
    flt-diag's defaults); on the probe it is None until its first step is recorded (a callback reading it
    before on_start checks for None)."""

    @property
    def model(self) -> "torch.nn.Module": ...
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
