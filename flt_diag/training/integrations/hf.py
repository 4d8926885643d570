"""flt-diag's probe as a Hugging Face `transformers` TrainerCallback (extra: hf-trainer).

    from flt_diag.training.integrations.hf import FltDiagCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[FltDiagCallback(blocks="model.layers.*", folder="runs/hf")])

At on_train_begin it watches the Trainer's model; at on_pre_optimizer_step (the Trainer has clipped the
gradients by then: max_grad_norm) it reads the gradients, at on_optimizer_step (before the Trainer's
zero_grad) it records the step, whose loss is the mean of the loss in the step's model outputs; at
on_train_end it writes summary.json (`self.summary`). With stop_on_collapse=True a predicted collapse sets
control.should_training_stop.
"""
from __future__ import annotations

from pathlib import Path

from flt_diag.training.integrations import needs_extra, output_loss
from flt_diag.training.probe import LoopProbe, watch

try:
    import accelerate  # noqa: F401  (the Trainer needs it)
    from transformers import TrainerCallback
except ImportError:
    raise needs_extra("hf", "hf-trainer", "transformers>=4.40 and accelerate") from None


class FltDiagCallback(TrainerCallback):
    """The run folder, verdict and early warning of flt-diag for a transformers Trainer (module docstring).
    `options` are watch()'s (head, loop_boundary, diagnostics, variant, warn, ...)."""

    def __init__(self, blocks="auto", folder: str | Path = "runs/hf", stop_on_collapse: bool = False, **options):
        self.blocks, self.folder, self.options = blocks, folder, dict(options, stop_on_collapse=stop_on_collapse)
        self.options.setdefault("loss", output_loss)
        self.probe: LoopProbe | None = None
        self.summary: dict | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        steps = state.max_steps if state.max_steps and state.max_steps > 0 else None
        self.probe = watch(model, self.blocks, self.folder, steps=steps, seed=args.seed,
                           optimizer=self.options.pop("optimizer", optimizer), **self.options)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.probe.after_backward()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.probe.step(step=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.probe.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.probe is not None:
            self.summary = self.probe.close()
