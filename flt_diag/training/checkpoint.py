"""The torch files of a run folder, in one place: checkpoint.pt (final weights + model config) and
resume.pt (mid-run state for exact resumption), written by the `Checkpoints` callback.

Reading torch files a user may have been sent (checkpoint.pt, resume.pt, reference checkpoints):
always `weights_only=True` - tensors, numbers, strings and containers, never code - and any failure
(missing, truncated, corrupt, crafted) as one StorageError line.

resume.pt: {step (the next step to train), wall_time, model, optimizers: [state_dict per optimizer],
callbacks: [state_dict per Trainer callback, in order]}. Callbacks are matched by position, and a
list shorter or longer than the run's is fine (the built-in side concerns come last and keep no state).
"""
from __future__ import annotations

from pathlib import Path

import torch

from flt_diag.training.callbacks import Callback, checkpoint_due
from flt_diag.analysis.storage import CHECKPOINT, RESUME, StorageError, atomic_path


def load(path, map_location="cpu"):
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise StorageError(f"missing {path}") from None
    except Exception as e:  # unpickling errors, zip errors, refused globals, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"unreadable {path}: {first}") from None


def save(path, obj) -> None:
    """torch.save through a temporary name (readers see the old file or the new one)."""
    with atomic_path(Path(path)) as tmp:
        torch.save(obj, tmp)


def save_weights(path, model, model_config: dict, steps_done: int) -> None:
    """checkpoint.pt: the weights, the model config to rebuild the model, and the steps trained."""
    save(path, {"model": model.state_dict(), "model_config": model_config, "step": steps_done})


def save_resume(trainer, next_step: int) -> None:
    save(trainer.run_dir / RESUME, dict(
        step=next_step, wall_time=trainer.elapsed(), model=trainer.model.state_dict(),
        optimizers=[o.state_dict() for o in trainer.optimizers], callbacks=[c.state_dict() for c in trainer.callbacks]))


def restore(trainer) -> None:
    """Load <run>/resume.pt into the trainer: weights, optimizers, callbacks, step and wall time."""
    path = trainer.run_dir / RESUME
    state = load(path, map_location=trainer.device)
    try:
        trainer.model.load_state_dict(state["model"])
        for opt, s in zip(trainer.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)
        for cb, s in zip(trainer.callbacks, state["callbacks"]):  # callbacks of the caller may differ
            cb.load_state_dict(s)
        trainer.start_step, trainer.wall_time = int(state["step"]), float(state["wall_time"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise StorageError(f"{path} does not fit this run ({str(e).splitlines()[0][:200]}); "
                           "delete it to restart the run from step 0") from None


class Checkpoints(Callback):
    """resume.pt every `checkpoint_every` steps (rank 0; not after the last step), checkpoint.pt
    when training ends, and resume.pt removed once the summary is written (a run folder with
    summary.json is finished; one without it resumes from resume.pt, or restarts without one)."""

    def on_step_end(self, trainer, step: int) -> None:
        if trainer.is_main and checkpoint_due(trainer.cfg.train, step + 1):
            save_resume(trainer, step + 1)

    def on_finish(self, trainer, step: int) -> None:
        if trainer.is_main:
            save_weights(trainer.run_dir / CHECKPOINT, trainer.model, trainer.cfg.model.to_dict(), step + 1)

    def on_summary(self, trainer, summary: dict) -> None:
        (trainer.run_dir / RESUME).unlink(missing_ok=True)
