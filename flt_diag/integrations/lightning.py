"""flt-diag's probe as a Lightning Callback (extra: lightning; usage, the recipe stored and the exit loss's
targets: docs/api.md, "Lightning").

The moments: on_train_start watches the LightningModule (or `module(pl_module)`), on_before_optimizer_step
reads the gradients (before Lightning clips them), on_train_batch_end records the step with the loss
training_step returned (None: Lightning skipped the batch, and so does the probe; one step per batch, no
gradient accumulation), on_train_end writes summary.json; on an exception the hooks go, the rows stay.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from flt_diag.integrations import needs_extra, output_loss
from flt_diag.storage.file_models import Summary
from flt_diag.probe.watch import Blocks, LoopProbe, watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from flt_diag.probe.watch import WatchOptions

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
        self.probe = watch(target, self.blocks, self.folder, **{**given, **self.options})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.probe.after_backward()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if outputs is None or isinstance(outputs, dict) and not outputs:  # training_step returned None: Lightning
            self.probe.skip()                                             # skipped the batch (no optimizer step)
            return
        self.probe.step(loss=output_loss(outputs), step=trainer.global_step - 1, targets=batch_target(batch))
        if self.probe.should_stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        if self.probe is not None:
            self.summary = self.probe.close()

    def on_exception(self, trainer, pl_module, exception):
        if self.probe is not None:
            self.probe.__exit__(type(exception), exception, exception.__traceback__)
