"""LoopProbe, the object flt_diag.watch returns (flt_diag.probe.watch: the moments of a step, docs/api.md)."""
from __future__ import annotations

import contextlib
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Union

import torch
from torch import Tensor, nn

from flt_diag.judge.verdict import summarize, tokens_per_step
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import (SUMMARY, MetricsWriter, StorageError, folder_lock, has_content,
                                      load_metrics, write_json)
from flt_diag.instruments.callbacks import Callback
from flt_diag.instruments.dynamics_callback import instruments, watched_model_dynamics
from flt_diag.instruments.records import Row
from flt_diag.probe.folder import Host, evidence_notes, probe_run_config, recipe, write_probe_config
from flt_diag.probe.checks import check_watch, leave_no_trace, lets_go_on_refusal, one_loss, step_arguments
from flt_diag.probe.results import EarlyWarning
from flt_diag.storage.file_models import Summary
from flt_diag.instruments.diagnostics import should_record
from flt_diag.instruments.loop_hooks import NOT_LOOPED_AFTER, LoopHooks, ProbeError
from flt_diag.probe.model import auto_blocks, called_blocks, check_untied, default_head, parameter_groups_of, resolve_blocks
from flt_diag.instruments.warning_callback import CollapseWarning, predictor
from flt_diag.config.run_config import DiagnosticsConfig

if TYPE_CHECKING:
    from typing_extensions import Unpack

Blocks = Union[str, nn.Module, Sequence[nn.Module]]  # "auto", a module-path pattern, the modules, one module
Head = Union[nn.Module, Callable[[Tensor], Tensor]]


class WatchOptions(TypedDict, total=False):
    """watch()'s keyword options, for the callbacks that pass them on (**options: Unpack[WatchOptions])."""

    head: Head | None
    loss: Callable[[Any], Any] | None
    loop_boundary: nn.Module | Literal["manual"] | None
    optimizer: torch.optim.Optimizer | None
    scheduler: object | None
    warmdown: float | None
    grad_clip: float | None
    diagnostics: DiagnosticsConfig | None
    steps: int | None
    variant: str | None
    seed: int
    vocab_size: int | None
    grad_scale: float
    warn: bool
    stop_on_collapse: bool
    predictor_path: str | None
    callbacks: list[Callback] | None
    note: str | None
    unigram_entropy: float | None
    grad_hooks: bool
    loop_step: Callable[[Tensor], Tensor] | None
    targets: Callable[..., Tensor | None] | None


class LoopProbe:
    """Diagnostics attached from outside to `model` (see the module docstring and `watch`)."""

    hooks: LoopHooks | None  # the diagnostics' hooks on the blocks (None: not attached yet, or let go)
    shape: tuple[int, ...] | None  # the first recorded stream's shape (None before the first training forward)
    loops_seen: Counter[int]  # loop count -> the training forwards that ran it

    def __init__(self, model: nn.Module, blocks: Blocks = "auto", folder: str | os.PathLike[str] = "runs/probe",
                 **options: Unpack[WatchOptions]):
        o: dict[str, Any] = {**dict.fromkeys(WatchOptions.__annotations__), "seed": 0, "grad_scale": 1.0,
                             "warn": False, "stop_on_collapse": False, "grad_hooks": False, **options}
        check_watch(model, folder, **o)  # (probe/checks.py: one ProbeError line, nothing made)
        self.model, self.folder = model, Path(folder)
        self.auto = isinstance(blocks, str) and blocks == "auto"  # found at the first training forward
        self.blocks, self.names = ([], []) if self.auto else resolve_blocks(model, blocks)
        head, warn, stop = o["head"], o["warn"] or o["stop_on_collapse"], o["stop_on_collapse"]
        self.given_head = head if isinstance(head, nn.Module) else None  # (a callable head: no parameter group)
        self.head = self.given_head if self.given_head is not None else default_head(model, self.blocks)
        self.loss_fn, self.optimizer, self.steps, self.variant, self.seed = (o[k] for k in (
            "loss", "optimizer", "steps", "variant", "seed"))
        self.vocab_size, self.note, self.unigram_entropy = o["vocab_size"], o["note"], o["unigram_entropy"]
        self.warmdown, self.grad_clip, self.warmdown_from = o["warmdown"], o["grad_clip"], "watch(warmdown=)"
        self.recipe = recipe(*(o[k] for k in ("optimizer", "scheduler", "steps", "grad_clip", "warmdown", "variant")))
        self.boundary = "manual" if o["loop_boundary"] == "manual" else o["loop_boundary"]
        self.dcfg = DiagnosticsConfig(**{**(o["diagnostics"] or DiagnosticsConfig()).__dict__, "warn": warn,
                                         "stop_on_collapse": stop, "predictor": o["predictor_path"]})
        self.grad_scale = o["grad_scale"]
        self.host = Host(model, self.folder)
        # the loop dynamics as flt-diag's runs take them (flt-diag's model), or from head=, targets=, loop_step=
        self.dynamics = watched_model_dynamics(self.dcfg, model, head, o["loop_step"], o["targets"])
        self._build()
        self.warning_cb = CollapseWarning(predictor(o["predictor_path"]), stop=stop,
                                          say=None if warn else (lambda text: None))  # prints only with warn
        self.callbacks = [self.dynamics, *(o["callbacks"] or [])]  # (the loop dynamics first)
        self.step_index, self.shape, self.loops_seen = 0, None, Counter()
        self._auto_tries, self._held = 0, list[Row]()  # (blocks="auto") forwards that reused nothing; their steps' rows
        self.grad_hooks = o["grad_hooks"]  # each gradient read as the backward accumulates it: before any clipping
        self.oscillation_unjudged: str | None = None  # why the gradient norms read are after clipping, if they are
        self.summary: Summary | None = None
        self._reset_step()
        self._open()

    # ------------------------------------------------------------------ attach / detach
    def _build(self) -> None:
        check_untied(self.blocks, self.names)
        self.groups = parameter_groups_of(self.model, self.blocks, self.head)
        self.params = [p for ps in self.groups.values() for p in ps]
        self.diag, _ = instruments(self.dcfg, self.dynamics, groups=self.groups, grad_scale=self.grad_scale,
                                   hooks=dict(blocks=self.blocks, boundary=self.boundary, names=self.names,
                                              require_repeat=NOT_LOOPED_AFTER if self.boundary is None else 0))

    def _attach(self) -> None:
        """The hooks on the blocks (at watch(), or for blocks="auto" at the first training forward)."""
        self.diag.on_start(self.host)  # its LoopHooks, registered after the probe's own pre-hook
        self.hooks = self.diag.hooks
        self.hooks.listeners.append(self._first_shape)
        self.hooks.on_forward_end.append(self._count_loops)
        self.hooks.refuse = self._let_go  # (let go, then raise)
        if self.grad_hooks:
            self._handles += [p.register_post_accumulate_grad_hook(self._read_grad(i))
                              for i, p in enumerate(self.params)]
        if should_record(0, self.dcfg):  # (the update ratio of a step without after_backward(): against these)
            self.diag.keep_before()

    def _find_blocks(self, module, args, kwargs) -> bool:
        """blocks="auto": the blocks this forward reuses (probe/model.py, called_blocks), said on stderr; none after
        a forward that reused nothing (False: the next tries again); the largest ModuleList after NOT_LOOPED_AFTER."""
        found, loops = called_blocks(module, args, kwargs)
        how, fallback = f"called {loops} times in a training forward", not found
        if fallback and self._auto_tries < NOT_LOOPED_AFTER - 1:
            self._auto_tries += 1
            if self._auto_tries == 1:
                print("flt_diag.watch: blocks='auto': no module was called twice in the first training forward (a "
                      "sampled loop count of 1?): chosen at the first that reuses one (the steps before it without "
                      "the loop records); give blocks= to choose", file=sys.stderr, flush=True)
            return False
        if fallback:
            found, how = auto_blocks(module), f"no module was called twice in {NOT_LOOPED_AFTER} training forwards; " \
                                              "the largest ModuleList"
        self.blocks, self.names = [m for _, m in found], [n for n, _ in found]
        if self.given_head is None:  # (the head is outside the blocks)
            self.head = default_head(self.model, self.blocks)
        print(f"flt_diag.watch: blocks='auto' chose {', '.join(self.names)} ({how}); give blocks= to choose",
              file=sys.stderr, flush=True)
        self._build()
        self._attach()
        if fallback and self.hooks is not None:
            self.hooks.require_repeat = 1
        return True

    def _open(self) -> None:
        if self.folder.exists() and (not self.folder.is_dir() or has_content(self.folder)):
            raise ProbeError(f"{self.folder} exists and is not empty; give watch() a new folder")
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(folder_lock(self.folder))
            self.writer = MetricsWriter(self.folder)
        except (StorageError, OSError) as e:  # a link, a .lock that is no file, no permission: one line
            self._stack.close()
            raise ProbeError(str(e) if isinstance(e, StorageError) else f"cannot write {self.folder}: {e}") from None
        try:
            self.hooks = None
            self._handles = [self.model.register_forward_pre_hook(self._begin_forward, with_kwargs=True),
                             self.model.register_forward_hook(self._end_forward)]
            self.dynamics.on_start(self.host)  # its hook, needed from the first forward on (after the probe's)
            if not self.auto:
                self._attach()
        except BaseException:
            self._detach()
            raise

    def _detach(self) -> None:
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []
        self.dynamics.on_end(self.host)
        if getattr(self, "hooks", None) is not None:
            self.diag.on_end(self.host)
            self.hooks = None
        leave_no_trace(self.folder, getattr(self, "writer", None), self.host.cfg is not None)  # (nothing stored)
        self._stack.close()  # the lock, and the folder if the probe made it and it is empty

    def __enter__(self) -> "LoopProbe":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the hooks always go; the rows already taken stay in the folder (no summary: not finished)
            with contextlib.suppress(Exception):
                self.writer.flush()
            self._detach()

    def _let_go(self, error: BaseException) -> BaseException:
        """A refusal raised inside the model's forward (LoopHooks.refuse): the probe lets go first."""
        self.__exit__(type(error), error, None)
        return error

    # ------------------------------------------------------------------ hooks
    def _reset_step(self) -> None:
        self._began = self._backward_done = False
        self._losses: list[torch.Tensor] = []
        self._pre: dict[int, torch.Tensor] = {}  # (grad_hooks) parameter index -> its gradient's norm, unclipped

    def _read_grad(self, i: int):
        def hook(p):  # after the backward accumulated p.grad (the last micro-batch's call is the step's gradient)
            self._pre[i] = torch.linalg.vector_norm(p.grad.detach()).float()
        return hook

    def _training(self, module) -> bool:
        return torch.is_grad_enabled() and module.training

    @lets_go_on_refusal
    def _begin_forward(self, module, args, kwargs):
        if self._training(module) and not self._began:
            found = self.hooks is None and self.auto  # blocks="auto", first training forward: find them now
            if found and not self._find_blocks(module, args, kwargs):  # (none chosen yet: the step without hooks)
                found = False
            self._began = True
            for cb in ((self.diag,) if self.hooks is not None else ()) + tuple(self.callbacks):
                cb.before_step(self.host, self.step_index)
            if found:  # (the LoopHooks' own pre-hook came too late for this forward)
                assert self.hooks is not None  # (_find_blocks attached them)
                self.hooks._start(module, args)

    @lets_go_on_refusal
    def _end_forward(self, module, args, output):
        if self.loss_fn is not None and self._training(module):
            value = one_loss(self.loss_fn(output), "the loss= function of watch()")
            self._losses.append(value.float() if torch.is_tensor(value) else torch.tensor(value))

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
    def after_backward(self) -> None:
        """After the backward of a step, before clipping and the optimizer step (optional)."""
        if not self._handles or self._backward_done:
            return
        self._backward_done = True
        if self.hooks is None:  # (blocks="auto", none chosen yet) the step's total gradient norm only
            if grads := [p.grad for p in self.model.parameters() if p.grad is not None]:
                self.host.log.add(M.GRAD_NORM, torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        pre = None
        if grads and self._pre:  # grad_hooks: the norm before clipping; the per-group figures scaled back to it
            pre = torch.linalg.vector_norm(torch.stack([
                self._pre[i] if i in self._pre else torch.linalg.vector_norm(p.grad.detach()).float()
                for i, p in enumerate(self.params) if p.grad is not None]))
        self.diag.unclipped_norm = pre
        self.diag.after_backward(self.host, self.step_index)
        norm = self.diag.grad_norm  # (read by after_backward on its steps; the same gradients)
        if norm is None and grads:
            norm = pre if pre is not None else torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if norm is not None:
            self.host.log.add(M.GRAD_NORM, norm)
        for cb in self.callbacks:
            cb.after_backward(self.host, self.step_index)

    def step(self, loss: Tensor | float | None = None, step: int | None = None,
             targets: Tensor | None = None) -> list[Row]:
        """After each optimizer step: records the step (its loss: `loss`, else the mean of what `loss=` of
        watch() read off the step's forwards), writes its rows, checks the early warning. Returns the rows.
        `targets`: the step's targets, one per position of the loop-end stream, for the exit loss of watch(head=)
        (docs/api.md, "Loop dynamics on your own model")."""
        if not self._handles:
            raise ProbeError("this probe is closed; watch() the model again")
        s, given, lr = step_arguments(loss, step, self.optimizer, self.step_index, self.host.cfg is not None,
                                      self._began)  # checked before anything of the step is recorded
        self.step_index = s
        late = not self._backward_done  # no after_backward() this step: the moments are read now
        if late:  # (the parameters before this step's update were kept at the end of the last one)
            self.after_backward()
        self.diag.after_clip(self.host, s)
        self.diag.after_step(self.host, s)
        for cb in self.callbacks:
            cb.after_clip(self.host, s)
            cb.after_step(self.host, s)
        value = given if given is not None else (torch.stack(self._losses).mean() if self._losses else None)
        if value is not None:
            self.host.log.add(M.LOSS, value.detach() if torch.is_tensor(value) else float(value))
            if self.dcfg.warn and self.warning_cb.warned_at is None:
                self._check_finite(s, value)
        if lr is not None:
            self.host.log.add(M.LR, lr)
        self.dynamics.at_step(targets)  # the exit loss of the kept loop-end streams (head= without targets=)
        rows = self.host.log.collect(s)
        if self.hooks is None:  # (blocks="auto", none chosen yet: held, written with the first step that has them)
            self._held += rows
            self.step_index = s + 1
            self._reset_step()
            return rows
        if self.host.cfg is None:
            self._start_run(s)
        rows, self._held = self._held + rows, []
        self.writer.extend(rows)
        for cb in (self.warning_cb, *self.callbacks):
            cb.on_rows(self.host, s, rows)
            cb.on_step_end(self.host, s)
        if (s + 1) % self.dcfg.flush_every == 0:
            self.writer.flush()
        if late and should_record(s + 1, self.dcfg):
            self.diag.keep_before()
        self.step_index = s + 1
        self._reset_step()
        return rows

    def skip(self) -> None:
        """The step's batch was skipped, no optimizer step taken (a Lightning training_step that returned None):
        what its forwards recorded is dropped and the next training forward is recorded in its place."""
        if self._handles:
            self.host.log.collect(self.step_index)  # (dropped)
            self._reset_step()

    def _check_finite(self, s: int, value) -> None:
        """With warn / stop_on_collapse: a non-finite loss is the early warning's latest check at once (P(collapse)
        1), printed; with stop_on_collapse it ends the run (the verdict stays the loss rules' own: diverged)."""
        v = float(value.detach().float()) if torch.is_tensor(value) else float(value)
        if math.isfinite(v):
            return
        text = f"the loss is {v} at step {s}, not finite"
        w = self.warning_cb
        w.warned_at = s + 1
        w.last = dict(step=s + 1, p_collapse=1.0, threshold=w.threshold, evidence=text)
        w.say(f"warning: {type(self.model).__name__}: {text}")
        if self.dcfg.stop_on_collapse:
            self.host.request_stop(f"non-finite loss at step {s}")

    @property
    def should_stop(self) -> bool:
        """Whether the early warning asked to end the run (watch(..., stop_on_collapse=True))."""
        return self.host.stop_requested is not None

    def warning(self) -> EarlyWarning | None:
        """The early warning's latest check (step, p_collapse, threshold, evidence), or None before its first;
        printed as it happens with watch(..., warn=True)."""
        return EarlyWarning(**self.warning_cb.last) if self.warning_cb.last is not None else None

    def not_recorded(self) -> dict[str, str]:
        """The records the hooks could not take, and why (e.g. activation gradients under a reentrant checkpoint)."""
        return dict(self.diag.hooks.not_recorded) if getattr(self.diag, "hooks", None) is not None else {}

    # ------------------------------------------------------------------ the run folder
    def _start_run(self, s: int) -> None:
        self.host.cfg = probe_run_config(self, self.steps or s + 1)
        write_probe_config(self, self.host.cfg)
        for cb in (self.warning_cb, *self.callbacks[1:]):  # (the loop dynamics: started at watch())
            cb.on_start(self.host)

    def _summarize(self) -> Summary:
        cfg = probe_run_config(self, self.steps or self.step_index)
        out = summarize(load_metrics(self.folder), cfg, unigram_entropy=self.unigram_entropy, stop_reason=self.host.stop_requested,
                        prediction=self.host.prediction, tokens_per_step=tokens_per_step(cfg))
        notes = evidence_notes(self.warmdown, self.warmdown_from, self.oscillation_unjudged, out.evidence,
                               self.not_recorded())
        return Summary.model_validate({**out.as_written(), "evidence": {**out.evidence.as_written(), **notes}})

    def verdict(self) -> Summary:
        """The summary (verdict, evidence, oscillation indices, residual explosion) of the steps so far."""
        if self.host.cfg is None:
            raise ProbeError("no step recorded yet: call step() after each optimizer step")
        self.writer.flush()
        return self._summarize()

    def close(self) -> Summary | None:
        """Removes the hooks, writes the rest of the rows, config.json (its final steps and loop count) and
        summary.json; returns the summary (None if no step was recorded)."""
        if self.hooks is None and not self._handles:
            return self.summary
        try:
            self.writer.flush()
            for cb in (self.warning_cb, *self.callbacks):
                cb.on_finish(self.host, self.step_index - 1)
            if self.host.cfg is not None:
                self.host.cfg = probe_run_config(self, self.steps or self.step_index)
                write_probe_config(self, self.host.cfg)
                self.summary = self._summarize()
                write_json(self.folder / SUMMARY, self.summary.as_written())
                for cb in self.callbacks:
                    cb.on_summary(self.host, self.summary)
        finally:
            self._detach()
        return self.summary
