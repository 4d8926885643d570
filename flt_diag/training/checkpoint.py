"""The torch files of a run folder: checkpoint.pt (final weights + model config) and resume.pt (mid-run state
for exact resumption), written by the `Checkpoints` callback. Torch files a user may have been sent are read
`weights_only=True` (tensors, numbers, strings, containers: never code), any failure as one StorageError line.

resume.pt: {step (the next step to train), wall_time, model, optimizers: [state_dict per optimizer], callbacks:
{name: state_dict}}, checked against the run that resumes it (flt_diag.storage.files.check_resume_state) before
any of it is loaded. Callbacks are matched by name (`callback_names`): one the resumed run adds (`--warn`)
starts without state, one it drops is ignored. (Older files hold a list, matched by position.)
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from flt_diag.instruments.callbacks import Callback
from flt_diag.training import preemption
from flt_diag.storage.errors import first_line
from flt_diag.storage.file_models import Summary
from flt_diag.storage.files import check_resume_state
from flt_diag.storage.folders import CHECKPOINT, RESUME, StorageError, atomic_path
from flt_diag.storage.safe_files import open_regular


def load(path, map_location="cpu"):
    path = Path(path)
    with open_regular(path) as f:  # a FIFO, a folder in its place: one line, never blocks
        try:
            return torch.load(f, map_location=map_location, weights_only=True)
        except Exception as e:  # unpickling errors, zip errors, refused globals, ...
            raise StorageError(f"unreadable {path}: {first_line(e)}") from None


def save(path, obj) -> None:
    """torch.save through a temporary name (readers see the old file or the new one). torch reports a
    failed write (a full disk) as a RuntimeError; it becomes an OSError naming the file, the partial
    file is removed and the previous one is kept."""
    with atomic_path(Path(path)) as tmp:
        try:
            torch.save(obj, tmp)
        except RuntimeError as e:
            free = os.statvfs(tmp.parent)
            if free.f_bavail * free.f_frsize < tmp.stat().st_size + (1 << 20):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
            raise OSError(errno.EIO, f"torch could not write it ({first_line(e, 100)})", str(path)) from None


def save_weights(path, model, model_config: dict, steps_done: int) -> None:
    """checkpoint.pt: the weights, the model config to rebuild the model, and the steps trained."""
    save(path, {"model": model.state_dict(), "model_config": model_config, "step": steps_done})


def callback_names(callbacks: list) -> list[str]:
    """The name each callback's state is saved under: its class name (`#2`, ... for a repeated class)."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for cb in callbacks:
        name = type(cb).__name__
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def resume_file(run_dir: Path) -> Path | None:
    """<run>/resume.pt if the run has one, else None. A symbolic link there (to a file or to nothing) is refused
    here, before anything trains or is written: flt-diag never writes one, and the run would train until its
    first checkpoint only to be refused writing through it (having rewritten config.json and cut its metrics)."""
    path = Path(run_dir) / RESUME
    if path.is_symlink():
        raise StorageError(f"{path} is a symbolic link; flt-diag resumes only from the resume.pt it wrote there "
                           "(nothing was trained or written): remove the link to restart from step 0, or put the "
                           "real file in its place")
    return path if path.exists() else None


def restore(trainer) -> bool:
    """Load <run>/resume.pt into the trainer: weights, optimizers, callbacks, step and wall time, once
    the whole file has been checked against this run. False (nothing loaded) when the run has none;
    a link there is refused (resume_file)."""
    path = resume_file(trainer.run_dir)
    if path is None:
        return False
    state = load(path, map_location=trainer.device)
    shapes = {k: tuple(v.shape) for k, v in trainer.model.state_dict().items()}
    params = [[tuple(p.shape) for g in o.param_groups for p in g["params"]] for o in trainer.optimizers]
    try:
        state = check_resume_state(state, path, shapes, trainer.cfg.train.steps, params)
    except StorageError as e:
        raise StorageError(f"{e}; delete it to restart the run from step 0") from None
    saved = state.callbacks
    if isinstance(saved, list):  # older files: by position
        saved = dict(zip(callback_names(trainer.callbacks), saved))
    try:
        trainer.model.load_state_dict(state.model)
        for opt, s in zip(trainer.optimizers, state.optimizers, strict=True):
            opt.load_state_dict(s)
        for name, cb in zip(callback_names(trainer.callbacks), trainer.callbacks):
            if name in saved:
                cb.load_state_dict(saved[name])
            elif name == "Probe":  # (a file from before the Probe: its instruments' states at the top level)
                cb.load_state_dict(saved)
        trainer.start_step, trainer.wall_time = state.step, state.wall_time
        return True
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
        raise StorageError(f"{path} does not fit this run ({first_line(e, 200)}); "
                           "delete it to restart the run from step 0") from None


def checkpoint_due(train_cfg, done: int) -> bool:
    """Whether a resume checkpoint is written after `done` steps (never after the last one)."""
    return bool(train_cfg.checkpoint_every) and done % train_cfg.checkpoint_every == 0 and done < train_cfg.steps


class Checkpoints(Callback):
    """resume.pt every `checkpoint_every` steps (rank 0; not after the last step), checkpoint.pt
    when training ends, and resume.pt removed once the summary is written (a run folder with
    summary.json is finished; one without it resumes from resume.pt, or restarts without one)."""

    def on_step_end(self, trainer, step: int) -> None:
        preempted = preemption.requested() and step + 1 < trainer.cfg.train.steps  # (SIGTERM under a lease worker)
        if trainer.is_main and (checkpoint_due(trainer.cfg.train, step + 1) or preempted):
            callbacks = zip(callback_names(trainer.callbacks), trainer.callbacks)
            save(trainer.run_dir / RESUME, dict(
                step=step + 1, wall_time=trainer.elapsed(), model=trainer.model.state_dict(),
                optimizers=[o.state_dict() for o in trainer.optimizers],
                callbacks={name: c.state_dict() for name, c in callbacks}))
        if preempted:
            raise preemption.Preempted(f"preempted after step {step + 1}: resume.pt written")

    def on_finish(self, trainer, step: int) -> None:
        if trainer.is_main:
            save_weights(trainer.run_dir / CHECKPOINT, trainer.model, trainer.cfg.model.to_dict(), step + 1)

    def on_summary(self, trainer, summary: Summary) -> None:
        (trainer.run_dir / RESUME).unlink(missing_ok=True)
