"""flt-diag's probe as a Hugging Face `transformers` TrainerCallback (extra: hf-trainer; usage, the gradients
read before the Trainer's clip, the recipe and the exit loss's targets: docs/api.md, "Hugging Face Trainer").

The moments: on_train_begin watches the Trainer's model (with grad_hooks=True where it clips, but not under
fp16), on_pre_optimizer_step reads the gradients, on_optimizer_step (before the Trainer's zero_grad) records the
step, with the mean of the loss in the step's model outputs; on_train_end writes summary.json. The Trainer tells
its callbacks of no exception, so on_init_end wraps the train() of the Trainer being built (Trainer(callbacks=
[...]): found up the call stack): an exception leaving it (the model, compute_loss, the data collator, Ctrl-C)
lets go of the hooks and the folder's lock first. For a callback added later (add_callback), the model's forward
is wrapped while the probe watches (a raise in it does the same); after one elsewhere, the next train(), close(),
or watch() of the model does (probe/checks.py, release_stale_probes).
"""
from __future__ import annotations

import functools
import os
import sys
from types import FrameType
from typing import TYPE_CHECKING

import torch

from flt_diag.integrations import needs_extra, output_loss
from flt_diag.storage.file_models import Summary
from flt_diag.integrations.watch import Blocks, LoopProbe, started, watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from flt_diag.integrations.watch import WatchOptions

try:
    import accelerate  # type: ignore[import-untyped]  # noqa: F401  (the Trainer needs it; accelerate ships no types)
    from transformers import Trainer, TrainerCallback
except ImportError:
    raise needs_extra("hf", "hf-trainer", "transformers>=4.40 and accelerate") from None


def warmdown(args, steps: int | None) -> float | None:
    """The final share of the steps the Trainer's schedule decays the lr over (docs/api.md), or None."""
    kind = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if not steps or kind not in ("linear", "cosine", "polynomial", "cosine_with_min_lr", "warmup_stable_decay"):
        return None
    decay = (args.lr_scheduler_kwargs or {}).get("num_decay_steps", 0) if kind == "warmup_stable_decay" else \
        steps - args.get_warmup_steps(steps)
    return min(1.0, decay / steps) or None


def labels_of(causal: bool, *args, **kwargs) -> torch.Tensor | None:
    """The exit loss's targets from the forward's `labels` (shifted by one for a causal LM), or None."""
    labels = kwargs.get("labels")
    if not torch.is_tensor(labels) or not causal:
        return labels if torch.is_tensor(labels) else None
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], -1)


def building_trainer() -> Trainer | None:
    """The transformers Trainer whose __init__ calls its callbacks' on_init_end now (up the call stack), or None."""
    frame: FrameType | None = sys._getframe(1)
    try:
        while frame is not None:
            found = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
            if isinstance(found, Trainer):
                return found
            frame = frame.f_back
        return None
    finally:
        del frame  # (no frame kept alive)


class FltDiagCallback(TrainerCallback):
    """The run folder, verdict and early warning of flt-diag for a transformers Trainer (module docstring).
    `options` are watch()'s (head, loop_boundary, diagnostics, variant, warn, ...)."""

    def __init__(self, blocks: Blocks = "auto", folder: str | os.PathLike[str] = "runs/hf",
                 **options: Unpack[WatchOptions]):
        self.blocks, self.folder = blocks, folder
        self.options: dict = dict(options)
        self.options.setdefault("loss", output_loss)
        self.probe: LoopProbe | None = None
        self.summary: Summary | None = None
        self._guarded: tuple | None = None  # (model, its own forward attribute or None, the wrapper)

    def on_init_end(self, args, state, control, **kwargs):
        trainer = building_trainer()
        if trainer is not None:
            setattr(trainer, "train", self._closing(trainer.train))  # (an attribute over the method)

    def _closing(self, fn):
        """fn wrapped: an exception leaving it (the Trainer's train(), the model's forward) lets go of the probe
        (module docstring), then goes on."""
        @functools.wraps(fn)  # (a forward's signature stays the model's: the Trainer reads it)
        def guarded(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                self.close(e)
                raise
        return guarded

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self.close()  # a probe left open by a train() that raised outside the model's forward
        steps = state.max_steps if state.max_steps and state.max_steps > 0 else None
        clips = bool(args.max_grad_norm and args.max_grad_norm > 0)  # the Trainer clips before any callback:
        given = dict(steps=steps, seed=args.seed, optimizer=optimizer,  # the gradients are read in the backward
                     grad_hooks=clips and not args.fp16,                # (not of fp16's scaled loss)
                     scheduler=lr_scheduler, grad_clip=float(args.max_grad_norm or 0), warmdown=warmdown(args, steps),
                     targets=functools.partial(labels_of, type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))))
        self.probe = watch(model, self.blocks, self.folder, **{**given, **self.options})  # options given win
        if "warmdown" not in self.options and given["warmdown"]:
            self.probe.warmdown_from = f"the Trainer's {args.lr_scheduler_type} schedule"
        if clips and not self.probe.grad_hooks:
            self.probe.oscillation_unjudged = (f"the gradients were read after the Trainer clipped them "
                                               f"(max_grad_norm {args.max_grad_norm})")
        own = model.__dict__.get("forward")  # the model's forward wrapped while the probe watches (module docstring)
        model.forward = guarded = self._closing(model.forward)
        self._guarded = (model, own, guarded)

    def close(self, error: BaseException | None = None) -> None:
        """Let go of the model and the folder now (after a train() that raised: its rows stay, no summary);
        nothing to do after a train() that finished."""
        if self._guarded is not None:
            model, own, guarded = self._guarded
            self._guarded = None
            if model.__dict__.get("forward") is guarded:  # (not if something wrapped it again since)
                if own is None:
                    del model.forward
                else:
                    model.forward = own
        probe = self.probe
        if probe is not None and (probe.hooks is not None or probe._handles):  # still watching
            error = error or RuntimeError("train() did not reach on_train_end")
            probe.__exit__(type(error), error, None)  # hooks removed, lock freed, rows kept, no summary

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        started(self.probe, "FltDiagCallback").after_backward()

    def on_optimizer_step(self, args, state, control, **kwargs):
        started(self.probe, "FltDiagCallback").step(step=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if started(self.probe, "FltDiagCallback").should_stop:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.probe is not None:
            self.summary = self.probe.close()
        self.close()
