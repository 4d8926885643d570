"""The public probe: flt-diag's diagnostics, verdict and early warning on any looped nn.Module, trained
by any loop (docs/api.md).

    with flt_diag.watch(model, blocks="auto", folder="runs/mine") as probe:
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            probe.step(loss=loss)          # after each optimizer step
            optimizer.zero_grad()
    print(probe.summary["verdict"])

The probe is a small stand-in for flt-diag's Trainer: the same DiagnosticsCallback (flt_diag.training.
diagnostics, its LoopHooks on the given blocks), the same metrics table (MetricsWriter), the same online
early warning (CollapseWarning) and the same summary (judge.verdict.summarize), so the run folder it
writes is read by `flt-diag summary`, `plot`, `report`, `predict` and `summary --recompute` as any other.

Moments of one step: the first training forward (grad enabled, module in training mode) after the
previous step arms the hooks on a recorded step (should_record); `after_backward()` (optional: gradients
before clipping, parameters before the optimizer step) and `step()` (after the optimizer step: clipped
gradients if they are still there, update ratios, the loss; then the rows). Without `after_backward()`,
`step()` reads the gradients it finds and takes the update ratio against a copy of the parameters kept
at the end of the previous step.

Further records (e.g. the loop dynamics) plug in as training callbacks (`callbacks=`): they get the
Trainer's moments with this probe's stand-in trainer (`.model`, `.log`, `.cfg`, `.run_dir`), and
`probe.hooks` (LoopHooks) offers `listeners` and `on_forward_end`.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import torch

from flt_diag.judge.verdict import summarize, tokens_per_step
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import CONFIG, SUMMARY, MetricsWriter, folder_lock, has_content, load_metrics, write_json
from flt_diag.model.transformer import LoopedTransformer
from flt_diag.training.callbacks import Callback
from flt_diag.training.dynamics_callback import LoopDynamicsCallback
from flt_diag.training.diagnostics import DiagnosticsCallback, ProbeError, should_record
from flt_diag.training.probe_model import (default_head, head_count_of, parameter_groups_of, resolve_blocks,
                                           vocab_size_of)
from flt_diag.training.process import environment
from flt_diag.training.settle import predictor
from flt_diag.training.trainer import StepLog
from flt_diag.training.warning_callback import CollapseWarning
from flt_diag.vocab.config import DiagnosticsConfig, ModelConfig, RunConfig, TrainConfig
from flt_diag.vocab.variants import VARIANTS


class _Host:
    """What the training callbacks read of a Trainer, for a loop flt-diag does not run."""

    def __init__(self, model, run_dir: Path):
        self.model, self.run_dir, self.log = model, run_dir, StepLog()
        self.cfg: RunConfig | None = None
        self.start_step, self.is_main = 0, True
        self.stop_requested: str | None = None
        self.prediction: dict | None = None

    def request_stop(self, reason: str, prediction: dict | None = None) -> None:
        self.stop_requested, self.prediction = reason, prediction


class LoopProbe:
    """Diagnostics attached from outside to `model` (see the module docstring and `watch`)."""

    def __init__(self, model: torch.nn.Module, blocks="auto", folder: str | Path = "runs/probe", *,
                 head: torch.nn.Module | None = None, loss=None, loop_boundary=None, optimizer=None,
                 diagnostics: DiagnosticsConfig | None = None, steps: int | None = None, variant: str = "lt",
                 seed: int = 0, vocab_size: int | None = None, grad_scale: float = 1.0, warn: bool = False,
                 stop_on_collapse: bool = False, predictor_path: str | None = None,
                 callbacks: list[Callback] | None = None, note: str | None = None,
                 unigram_entropy: float | None = None):
        if variant not in VARIANTS:
            raise ProbeError(f"variant={variant!r}: the label stored for the run is one of {', '.join(VARIANTS)}")
        self.model, self.folder = model, Path(folder)
        self.blocks, self.names = resolve_blocks(model, blocks)
        self.head = head if head is not None else default_head(model)
        self.loss_fn, self.optimizer, self.steps, self.variant, self.seed = loss, optimizer, steps, variant, seed
        self.vocab_size, self.note, self.unigram_entropy = vocab_size, note, unigram_entropy
        self.boundary = "manual" if loop_boundary == "manual" else loop_boundary
        warn = warn or stop_on_collapse
        self.dcfg = diagnostics or DiagnosticsConfig()
        self.dcfg = DiagnosticsConfig(**{**self.dcfg.__dict__, "warn": warn, "stop_on_collapse": stop_on_collapse,
                                         "predictor": predictor_path})
        self.groups = parameter_groups_of(model, self.blocks, self.head)
        self.params = [p for ps in self.groups.values() for p in ps]
        self.host = _Host(model, self.folder)
        self.diag = DiagnosticsCallback(self.dcfg, groups=self.groups, grad_scale=grad_scale, hooks=dict(
            blocks=self.blocks, boundary=self.boundary, names=self.names, require_repeat=self.boundary is None))
        self.warning_cb = CollapseWarning(predictor(predictor_path), stop=stop_on_collapse,
                                          say=None if warn else (lambda text: None))  # prints only with warn
        self.callbacks = list(callbacks or [])
        self.dynamics = isinstance(model, LoopedTransformer) and self.dcfg.loop_dynamics  # its loop map is known:
        if self.dynamics:  # the same loop-dynamics records as a run of flt-diag's own (first of the callbacks)
            self.callbacks.insert(0, LoopDynamicsCallback(self.dcfg))
        self.step_index, self.shape, self.loops_seen = 0, None, Counter()
        self.summary: dict | None = None
        self._reset_step()
        self._open(steps)

    # ------------------------------------------------------------------ attach / detach
    def _open(self, steps: int | None) -> None:
        if self.folder.exists() and (not self.folder.is_dir() or has_content(self.folder)):
            raise ProbeError(f"{self.folder} exists and is not empty; give watch() a new folder")
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(folder_lock(self.folder))
        self.writer = MetricsWriter(self.folder)
        try:
            self._handles = [self.model.register_forward_pre_hook(self._begin_forward),
                             self.model.register_forward_hook(self._end_forward)]
            self.diag.on_start(self.host)  # its LoopHooks, registered after the probe's own pre-hook
            for cb in self.callbacks[:1] if self.dynamics else ():  # hooks needed from the first forward on
                cb.on_start(self.host)
            self.hooks = self.diag.hooks
            self.hooks.listeners.append(self._first_shape)
            self.hooks.on_forward_end.append(self._count_loops)
            self._snapshot = self._copy_params() if should_record(0, self.dcfg) else []
        except BaseException:
            self._detach()
            raise

    def _detach(self) -> None:
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []
        if getattr(self, "hooks", None) is not None:
            self.diag.on_end(self.host)
            self.hooks = None
        self._stack.close()

    def __enter__(self) -> "LoopProbe":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the hooks always go; the rows already taken stay in the folder (no summary: not finished)
            with contextlib.suppress(Exception):
                self.writer.flush()
            self._detach()

    # ------------------------------------------------------------------ hooks
    def _reset_step(self) -> None:
        self._began = self._backward_done = False
        self._losses: list[torch.Tensor] = []

    def _training(self, module) -> bool:
        return torch.is_grad_enabled() and module.training

    def _begin_forward(self, module, args):
        if self._training(module) and not self._began:
            self._began = True
            for cb in (self.diag, *self.callbacks):
                cb.before_step(self.host, self.step_index)

    def _end_forward(self, module, args, output):
        if self.loss_fn is not None and self._training(module):
            self._losses.append(self.loss_fn(output).detach().float())

    def _first_shape(self, loop, layer, stream) -> None:
        if self.shape is None:
            self.shape = tuple(stream.shape)

    def _count_loops(self, loops: int) -> None:
        self.loops_seen[loops] += 1
        self.host.log.add(M.LOOPS_RUN, float(loops))

    def end_loop(self, stream: torch.Tensor) -> None:
        """The end of a loop, called from the model's forward (with loop_boundary="manual")."""
        if self.hooks is not None:
            self.hooks.end_loop(stream)

    # ------------------------------------------------------------------ moments
    def _copy_params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def after_backward(self) -> None:
        """After the backward of a step, before clipping and the optimizer step (optional)."""
        if self.hooks is None or self._backward_done:
            return
        self._backward_done = True
        self.diag.after_backward(self.host, self.step_index)
        grads = self._grads()
        if grads:
            self.host.log.add(M.GRAD_NORM, torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        for cb in self.callbacks:
            cb.after_backward(self.host, self.step_index)

    def step(self, loss=None, step: int | None = None) -> list[tuple]:
        """After each optimizer step: records the step (its loss: `loss`, else the mean of what `loss=` of
        watch() read off the step's forwards), writes its rows, checks the early warning. Returns the rows."""
        if self.hooks is None:
            raise ProbeError("this probe is closed; watch() the model again")
        if step is not None:
            self.step_index = int(step)
        s = self.step_index
        late = not self._backward_done  # no after_backward() this step: the moments are read now
        if late:
            self.after_backward()
            self.diag.before = self._snapshot if self.diag.recording else []
        self.diag.after_clip(self.host, s)
        self.diag.after_step(self.host, s)
        for cb in self.callbacks:
            cb.after_clip(self.host, s)
            cb.after_step(self.host, s)
        value = loss if loss is not None else (torch.stack(self._losses).mean() if self._losses else None)
        if value is not None:
            self.host.log.add(M.LOSS, value.detach() if torch.is_tensor(value) else float(value))
        if self.optimizer is not None:
            self.host.log.add(M.LR, float(self.optimizer.param_groups[0]["lr"]))
        rows = self.host.log.collect(s)
        if self.host.cfg is None:
            self._start_run(s)
        self.writer.extend(rows)
        for cb in (self.warning_cb, *self.callbacks):
            cb.on_rows(self.host, s, rows)
            cb.on_step_end(self.host, s)
        if (s + 1) % self.dcfg.flush_every == 0:
            self.writer.flush()
        self._snapshot = self._copy_params() if late and should_record(s + 1, self.dcfg) else []
        self.step_index = s + 1
        self._reset_step()
        return rows

    @property
    def should_stop(self) -> bool:
        """Whether the early warning asked to end the run (watch(..., stop_on_collapse=True))."""
        return self.host.stop_requested is not None

    def warning(self) -> dict | None:
        """The early warning's latest check (step, p_collapse, threshold, evidence), or None before its first;
        printed as it happens with watch(..., warn=True)."""
        return self.warning_cb.last

    # ------------------------------------------------------------------ the run folder
    def _run_config(self, steps: int) -> RunConfig:
        if self.shape is None:
            raise ProbeError("step() came before any recorded training forward of the model: call it after each "
                             "optimizer step, with the model in training mode")
        width = self.shape[-1]
        batch, seq = (self.shape[0], self.shape[1]) if len(self.shape) >= 3 else (1, self.shape[0])
        loops = self.loops_seen.most_common(1)[0][0] if self.loops_seen else 1
        try:
            model = ModelConfig(vocab_size=self.vocab_size or vocab_size_of(self.model, self.head) or 1,
                                n_layer=len(self.blocks), n_embd=width, n_head=head_count_of(self.blocks, width),
                                sequence_len=max(2, seq), variant=self.variant, loops=max(1, loops))
        except ValueError as e:
            raise ProbeError(f"the model's shape cannot be stored: {str(e).splitlines()[0]}") from None
        device = next(iter(self.params)).device if self.params else torch.device("cpu")
        train = TrainConfig(steps=max(1, steps), batch_size=batch, seed=self.seed, data="external", tokenizer=None,
                            device=device.type, eval_every=0, checkpoint_every=0, grad_clip=0)
        return RunConfig(model=model, train=train, diagnostics=self.dcfg)

    def _write_config(self, cfg: RunConfig) -> None:
        device = torch.device(cfg.train.device)
        write_json(self.folder / CONFIG, {
            **cfg.to_dict(), "n_params": sum(p.numel() for p in self.model.parameters()), "env": environment(device),
            "note": self.note or f"{type(self.model).__name__} diagnosed by flt_diag.watch; the train section's "
                                 "recipe fields are flt-diag's defaults, not this model's",
            **({"corpus": {"unigram_entropy": self.unigram_entropy}} if self.unigram_entropy is not None else {}),
            "probe": {"model": type(self.model).__name__, "blocks": self.names,
                      "loops_counted": "from the blocks' calls" if self.boundary is None else "at a loop boundary",
                      "loops_seen": {str(k): n for k, n in sorted(self.loops_seen.items())},
                      "parameter_groups": list(self.groups)}})

    def _start_run(self, s: int) -> None:
        self.host.cfg = self._run_config(self.steps or s + 1)
        self._write_config(self.host.cfg)
        for cb in (self.warning_cb, *self.callbacks[1 if self.dynamics else 0:]):
            cb.on_start(self.host)

    def _summarize(self) -> dict:
        cfg = self._run_config(self.steps or self.step_index)
        return summarize(load_metrics(self.folder), cfg, unigram_entropy=self.unigram_entropy, stop_reason=self.host.stop_requested,
                         prediction=self.host.prediction, tokens_per_step=tokens_per_step(cfg))

    def verdict(self) -> dict:
        """The summary (verdict, evidence, oscillation indices, residual explosion) of the steps so far."""
        if self.host.cfg is None:
            raise ProbeError("no step recorded yet: call step() after each optimizer step")
        self.writer.flush()
        return self._summarize()

    def close(self) -> dict | None:
        """Removes the hooks, writes the rest of the rows, config.json (its final steps and loop count) and
        summary.json; returns the summary (None if no step was recorded)."""
        if self.hooks is None:
            return self.summary
        try:
            self.writer.flush()
            for cb in (self.warning_cb, *self.callbacks):
                cb.on_finish(self.host, self.step_index - 1)
            if self.host.cfg is not None:
                self.host.cfg = self._run_config(self.steps or self.step_index)
                self._write_config(self.host.cfg)
                self.summary = self._summarize()
                write_json(self.folder / SUMMARY, self.summary)
                for cb in self.callbacks:
                    cb.on_summary(self.host, self.summary)
        finally:
            self._detach()
        return self.summary


def watch(model: torch.nn.Module, blocks="auto", folder: str | Path = "runs/probe", **options) -> LoopProbe:
    """Attach flt-diag's diagnostics to a looped model; returns a LoopProbe (a context manager).

    blocks: the modules the forward reuses - a list of modules (in their order within a loop), an
    nn.ModuleList, a module-path pattern ("transformer.h.*"), or "auto" (the largest ModuleList of one
    module class). Loops are counted from the blocks' calls (the k-th call of block i in one forward is
    loop k), or at `loop_boundary=` (a module whose forward ends each loop, or "manual": the model calls
    `probe.end_loop(stream)`). Options: head, loss (output -> loss tensor), optimizer (records its lr),
    diagnostics (a DiagnosticsConfig: dense_steps, every, flush_every), steps, variant (the stored label,
    default "lt"), seed, vocab_size, unigram_entropy (of the training data: the verdict's collapse floor),
    grad_scale, warn, stop_on_collapse, predictor_path, callbacks, note.
    Wrong use is one ProbeError line (a ValueError): BlocksNotFound, NotLooped, BlockCalledTwice."""
    return LoopProbe(model, blocks, folder, **options)
