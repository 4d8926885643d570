"""flt-diag's probe as a Lightning Callback (extra: lightning; usage, the recipe stored and the exit loss's
targets: docs/api.md, "Lightning").

The moments: on_train_start watches the LightningModule (or `module(pl_module)`), on_before_optimizer_step
reads the gradients (before Lightning clips them), on_train_batch_end records the optimizer step the batch
ended with, told by the Trainer's global_step: with accumulate_grad_batches, the step comes with the last
micro-batch, its loss the mean of the micro-batches' (training_step's, before Lightning divides them); a batch
whose training_step returned None is skipped by Lightning and by the probe. Manual optimization
(automatic_optimization = False): each optimizer step training_step takes is recorded (at most one a batch),
its loss what training_step returned, else what it gave manual_backward. on_train_end writes summary.json; on
an exception the hooks go, the rows stay.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from flt_diag.instruments.loop_hooks import ProbeError
from flt_diag.integrations import needs_extra
from flt_diag.storage.file_models import Summary
from flt_diag.integrations.watch import Blocks, LoopProbe, started, watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from flt_diag.integrations.watch import WatchOptions

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    raise needs_extra("lightning", "lightning", "lightning>=2.2") from None


def batch_target(batch) -> torch.Tensor | None:
    """The exit loss's targets in a Lightning batch (docs/api.md, "Lightning"), or None."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        found = batch[1]
    elif isinstance(batch, Mapping):
        found = next((batch[k] for k in ("labels", "targets", "target", "y") if k in batch), None)
    else:
        found = None
    return found if torch.is_tensor(found) else None


def returned_loss(outputs) -> torch.Tensor | None:
    """The loss training_step returned, as Lightning passes it on (a tensor, or a dict's "loss"), or None."""
    found = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return found.detach() if torch.is_tensor(found) else None


class FltDiagCallback(Callback):
    """The run folder, verdict and early warning of flt-diag for a Lightning Trainer (module docstring).
    `options` are watch()'s (head, loop_boundary, diagnostics, variant, warn, ...)."""

    def __init__(self, blocks: Blocks = "auto", folder: str | os.PathLike[str] = "runs/lightning",
                 module: Callable[[Any], torch.nn.Module] | None = None, **options: Unpack[WatchOptions]):
        self.blocks, self.folder, self.module = blocks, folder, module
        self.options: dict = dict(options)
        self.probe: LoopProbe | None = None
        self.summary: Summary | None = None

    def on_train_start(self, trainer, pl_module):
        target = self.module(pl_module) if self.module is not None else pl_module
        steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        schedulers = getattr(trainer, "lr_scheduler_configs", None) or []
        clip = trainer.gradient_clip_val
        given = dict(steps=steps, optimizer=optimizer, scheduler=schedulers[0].scheduler if schedulers else None,
                     grad_clip=float(clip) if clip else None)  # options given to the callback win
        accumulate = int(trainer.accumulate_grad_batches or 1)
        self.manual = not pl_module.automatic_optimization
        self.accumulate = 1 if self.manual else accumulate  # (Lightning divides each micro-batch's loss by it)
        given["grad_scale"] = float(self.accumulate)  # (the activation gradients of one micro-batch's mean loss)
        self.probe = watch(target, self.blocks, self.folder, **{**given, **self.options})
        self.steps_taken = trainer.global_step  # (a resumed fit's steps before it)
        self._reset()

    def _reset(self) -> None:
        self.losses: list[torch.Tensor] = []  # since the last recorded step: training_step's, manual_backward's
        self.backward: list[torch.Tensor] = []
        self.targets: torch.Tensor | None = None  # of the batch whose forward is recorded (its first)
        self.first = True

    def on_before_backward(self, trainer, pl_module, loss):
        if self.manual:
            self.backward.append(loss.detach())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        started(self.probe, "FltDiagCallback").after_backward()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        taken, self.steps_taken = trainer.global_step - self.steps_taken, trainer.global_step
        loss = returned_loss(outputs)
        if taken == 0 and loss is None and not self.manual:  # training_step returned None: Lightning skipped the
            started(self.probe, "FltDiagCallback").skip()  # batch (no optimizer step), and so does the probe
            self.first = True  # (the next batch's forward is recorded in its place)
            return
        if self.first:
            self.targets, self.first = batch_target(batch), False
        if loss is not None:
            self.losses.append(loss * self.accumulate)
        if taken == 0:  # a micro-batch of accumulate_grad_batches, or of training_step's own accumulation
            return
        if taken > 1:
            raise ProbeError(f"batch {batch_idx} took {taken} optimizer steps (automatic_optimization = False, with "
                             "several optimizers or steps in one training_step): the Lightning callback records "
                             "one optimizer step a batch; step once a batch, or watch() in your own loop")
        kept = self.losses or self.backward
        value = torch.stack(kept).float().mean() if kept else None
        probe = started(self.probe, "FltDiagCallback")
        probe.step(loss=value, step=trainer.global_step - 1, targets=self.targets)
        self._reset()
        if probe.should_stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        if self.probe is not None:
            self.summary = self.probe.close()

    def on_exception(self, trainer, pl_module, exception):
        if self.probe is not None:
            self.probe.__exit__(type(exception), exception, exception.__traceback__)
