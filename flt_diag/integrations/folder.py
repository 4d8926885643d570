"""The run folder of a probe (flt_diag.integrations.watch): config.json holds only what was given or observed -
the model's shape as the hooks saw it, the loops it ran, the steps, batch and device, the seed, warm-down and
gradient clipping where given, and under `probe.recipe` the optimizer (its class and each parameter group's lr,
betas, weight_decay, momentum as at watch()), the scheduler's class, the steps, the gradient clipping and the
warm-down where known (None: not known / none). No flt-diag recipe field it was not given (seed, lr scale, data,
evaluation): a reader of the folder takes those as flt_diag.storage.file_models.RunConfigFile says.
`self` is the LoopProbe. `Host`: what the training callbacks read of a Trainer, for a loop flt-diag does not run."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from flt_diag.judge.verdict import MIN_DIFFERENCES, Recipe
from flt_diag.storage.errors import first_line
from flt_diag.storage.folders import CONFIG, write_json
from flt_diag.instruments.loop_hooks import ProbeError
from flt_diag.integrations.model import head_count_of, vocab_size_of
from flt_diag.instruments.records import StepLog, environment
from flt_diag.config.option_fields import check
from flt_diag.config.run_config import ModelConfig, TrainConfig

HYPERPARAMETERS = ("lr", "betas", "weight_decay", "momentum")
MODEL_FIELDS = ("vocab_size", "depth", "width", "heads", "seq_len", "variant", "loops")
TRAIN_FIELDS = ("steps", "batch_size", "device")  # observed; seed, warmdown_frac, grad_clip: where given


def _plain(x):
    return float(x) if torch.is_tensor(x) and x.numel() == 1 else [_plain(v) for v in x] if isinstance(x, (list, tuple)) \
        else x if isinstance(x, (int, float, str, bool)) or x is None else repr(x)


def recipe(optimizer, scheduler, steps, grad_clip, warmdown, variant) -> dict:
    """probe.recipe of config.json, read at watch() (the parameter groups before the first step)."""
    groups = [{k: _plain(g[k]) for k in HYPERPARAMETERS if k in g} for g in getattr(optimizer, "param_groups", [])]
    return {"optimizer": type(optimizer).__name__ if optimizer is not None else None, "param_groups": groups,
            "scheduler": type(scheduler).__name__ if scheduler is not None else None, "steps": steps,
            "grad_clip": grad_clip, "warmdown": warmdown, "variant": variant}


def probe_model(self) -> ModelConfig:
    """The model's shape as the hooks saw it (config.json's `model`), checked as flt-diag's own model config is."""
    if self.shape is None:
        raise ProbeError("step() came before any recorded training forward of the model: call it after each "
                         "optimizer step, with the model in training mode")
    width = self.shape[-1]
    seq = self.shape[1] if len(self.shape) >= 3 else self.shape[0]
    loops = self.loops_seen.most_common(1)[0][0] if self.loops_seen else 1
    try:
        return ModelConfig(vocab_size=self.vocab_size or vocab_size_of(self.model, self.head) or 1,
                           depth=len(self.blocks), width=width, heads=head_count_of(self.blocks, width),
                           seq_len=max(2, seq), variant=self.variant, loops=max(1, loops))
    except ValueError as e:
        raise ProbeError(f"the model's shape cannot be stored: {first_line(e)}") from None


def observed_train(self, steps: int) -> dict:
    """config.json's `train`: the steps, batch and device observed, each checked against its TrainConfig field,
    and the seed, warm-down and gradient clipping where given (no recipe field the watch was not given)."""
    assert self.shape is not None  # (probe_model first)
    device = next(iter(self.params)).device if self.params else torch.device("cpu")
    observed = {"steps": max(1, steps), "batch_size": self.shape[0] if len(self.shape) >= 3 else 1,
                "device": device.type}
    given = {"seed": self.seed, "warmdown_frac": self.warmdown, "grad_clip": self.grad_clip}
    train = observed | {k: v for k, v in given.items() if v is not None}
    try:
        return {k: check(TrainConfig.model_fields[k].rebuild_annotation(), v, k, TrainConfig.model_fields[k])
                for k, v in train.items()}
    except ValueError as e:
        raise ProbeError(f"the run cannot be stored: {first_line(e)}") from None


def probe_recipe(self, steps: int) -> Recipe:
    """What the verdict and the instruments read of the watched run: its shape, steps, warm-down and the
    records' dense steps; the loss on the end loop, one micro-batch a step (all flt_diag.watch sees: the loss
    of each step); no seed or lr scale unless given (none is made up)."""
    m, t = probe_model(self), observed_train(self, steps)
    return Recipe(steps=t["steps"], loops=m.loops, width=m.width, depth=m.depth, dense_steps=self.dcfg.dense_steps,
                  warmdown_frac=t.get("warmdown_frac", 0.0), variant=m.variant, seed=self.seed)


def as_read(recipe: Recipe) -> Recipe:
    """The recipe with the identity a reader of the folder takes where the watch was given none (summary.json's
    seed and lr scale: flt_diag.storage.file_models.RunConfigFile reads a watch run's config.json so)."""
    field = TrainConfig.model_fields
    return dataclasses.replace(recipe, seed=field["seed"].default if recipe.seed is None else recipe.seed,
                               lr_scale=field["lr_scale"].default if recipe.lr_scale is None else recipe.lr_scale)


def tokens_per_step(self) -> int:
    """Tokens of one step (batch x sequence as the hooks saw them)."""
    return observed_train(self, 1)["batch_size"] * probe_model(self).seq_len


def write_probe_config(self, steps: int) -> None:
    m, train = probe_model(self), observed_train(self, steps)
    model = {k: v for k, v in m.to_dict().items() if k in MODEL_FIELDS and (k != "variant" or self.variant is not None)}
    write_json(self.folder / CONFIG, {
        "model": model, "train": train, "diagnostics": self.dcfg.to_dict(),
        "n_params": sum(p.numel() for p in self.model.parameters()), "env": environment(torch.device(train["device"])),
        "note": self.note or f"{type(self.model).__name__} diagnosed by flt_diag.watch; its recipe: probe.recipe",
        **({"corpus": {"unigram_entropy": self.unigram_entropy}} if self.unigram_entropy is not None else {}),
        "probe": {"model": type(self.model).__name__, "blocks": self.names, "recipe": {**self.recipe, "steps": train["steps"]},
                  "loops_counted": "from the blocks' calls" if self.boundary is None else "at a loop boundary",
                  "loops_seen": {str(k): n for k, n in sorted(self.loops_seen.items())},
                  "parameter_groups": list(self.groups), "not_recorded": self.not_recorded()}})


class Host:
    """What the training callbacks read of a Trainer, for a loop flt-diag does not run."""

    def __init__(self, model, run_dir: Path):
        self.model, self.run_dir, self.log = model, run_dir, StepLog()
        self.recipe: Recipe | None = None  # (what the instruments read: set at the first recorded step)
        self.start_step, self.is_main = 0, True
        self.stop_requested: str | None = None
        self.prediction: dict | None = None

    def request_stop(self, reason: str, prediction: dict | None = None) -> None:
        self.stop_requested, self.prediction = reason, prediction


def evidence_notes(warmdown, warmdown_from: str, unjudged: str | None, evidence, not_recorded: dict) -> dict:
    """What a watch run's summary adds to the verdict's evidence: the warm-down it assumed, why the oscillation was
    not judged (gradients read after a clipping, or no window of rule 4b before the warm-down), the records the
    hooks could not take."""
    notes: dict = {"warmdown": f"the last {warmdown:.0%} of the steps ({warmdown_from}): the oscillation is judged "
                               "before it" if warmdown else "none given: the oscillation is judged over every step "
                               "(no warm-down is assumed; give watch(warmdown=) for one)"}
    if unjudged:  # the gradient norms are after a clipping: their oscillation says nothing
        notes["oscillation"] = f"not judged: {unjudged}"
    elif not evidence.osc_windows_judged:  # (a warm-down over every step, or a run too short for one window)
        notes["oscillation"] = (f"not judged: no window of {MIN_DIFFERENCES} consecutive recorded gradient norms "
                                f"before step {evidence.osc_span_end}, the warm-down's start" +
                                (f" (a warm-down of the last {warmdown:.0%} of the steps leaves too few before it: give "
                                 "watch(warmdown=) a shorter one)" if warmdown and
                                 (evidence.osc_span_end or 0) <= MIN_DIFFERENCES else " (too few recorded steps)"))
    if not_recorded:
        notes["not_recorded"] = not_recorded
    return notes
