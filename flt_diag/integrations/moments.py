"""The moments of a step on a LoopProbe (flt_diag.integrations.loop_probe): after_backward(), step(), skip(), and what
they read (the early warning, the records not taken). Every record they take goes through the run's record guard
(flt_diag.instruments.guard, `records`): one that cannot be taken is said once on stderr, skipped and named in
the summary's not_recorded; the training step never sees its error. A mix-in of LoopProbe: the attributes below
are LoopProbe's."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import MetricsWriter
from flt_diag.instruments.diagnostics import should_record
from flt_diag.instruments.guard import Records
from flt_diag.instruments.loop_hooks import ProbeError, gradient_norm
from flt_diag.instruments.records import Row
from flt_diag.instruments.warning_callback import CollapseWarning
from flt_diag.integrations.checks import step_arguments
from flt_diag.integrations.folder import Host, probe_recipe, write_probe_config
from flt_diag.integrations.results import EarlyWarning
from flt_diag.judge.verdict import Recipe
from flt_diag.config.run_config import DiagnosticsConfig

if TYPE_CHECKING:
    from flt_diag.instruments.callbacks import Callback
    from flt_diag.instruments.diagnostics import DiagnosticsCallback
    from flt_diag.instruments.loop_hooks import LoopHooks
    from flt_diag.integrations.probe import Probe


class ProbeMoments:
    """after_backward(), step(), skip() of a LoopProbe, and what they read."""

    model: nn.Module
    host: Host
    probe: Probe  # the instruments, run as flt-diag's Trainer runs them
    diag: DiagnosticsCallback  # (the probe's)
    hooks: LoopHooks | None
    params: list[nn.Parameter]
    callbacks: list[Callback]  # the caller's
    writer: MetricsWriter
    dcfg: DiagnosticsConfig
    optimizer: torch.optim.Optimizer | None
    steps: int | None
    step_index: int
    _handles: list
    _held: list[Row]

    @property
    def warning_cb(self) -> CollapseWarning:
        """The early warning (a LoopProbe always has one: it prints only with warn)."""
        assert self.probe.warning is not None
        return self.probe.warning

    @property
    def records(self) -> Records:
        """The run's record guard (shared by the diagnostics, the loop dynamics, the early warning and the probe)."""
        return self.probe.records

    def _reset_step(self) -> None:
        self._began = self._backward_done = False
        self._losses: list[torch.Tensor] = []
        self._pre: dict[int, torch.Tensor] = {}  # (grad_hooks) parameter index -> its gradient's norm, unclipped

    def _read_grad(self, i: int):
        """The gradient hook of parameter i (grad_hooks=True), guarded: it runs inside the user's backward."""
        def hook(p):  # after the backward accumulated p.grad (the last micro-batch's call is the step's gradient)
            self._pre[i] = gradient_norm(p.grad, 1.0).float()
        return self.records.hook((M.GRAD_NORM,), hook)

    def _mean_loss(self) -> Tensor | None:
        """The mean of what loss= of watch() read off the step's forwards (None: none)."""
        return torch.stack(self._losses).mean() if self._losses else None

    def _total_norm(self, grads: list[Tensor]) -> Tensor:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def after_backward(self) -> None:
        """After the backward of a step, before clipping and the optimizer step (optional)."""
        if not self._handles or self._backward_done:
            return
        self._backward_done = True
        take = self.records.take
        if self.hooks is None:  # (blocks="auto", none chosen yet) the step's total gradient norm only
            if grads := [p.grad for p in self.model.parameters() if p.grad is not None]:
                take((M.GRAD_NORM,), lambda: self.host.log.add(M.GRAD_NORM, self._total_norm(grads)))
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        pre = None
        if grads and self._pre:  # grad_hooks: the norm before clipping; the per-group figures scaled back to it
            pre = take((M.GRAD_NORM,), lambda: torch.linalg.vector_norm(torch.stack([
                self._pre[i] if i in self._pre else torch.linalg.vector_norm(p.grad.detach()).float()
                for i, p in enumerate(self.params) if p.grad is not None])))
        self.diag.unclipped_norm = pre
        self.probe.after_backward(self.host, self.step_index)
        norm = self.diag.grad_norm  # (read by after_backward on its steps; the same gradients)
        if norm is None and grads:
            norm = pre if pre is not None else take((M.GRAD_NORM,), self._total_norm, grads)
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
        s, given, lr = step_arguments(loss, step, self.optimizer, self.step_index, self.host.recipe is not None,
                                      self._began)  # checked before anything of the step is recorded
        self.step_index = s
        late = not self._backward_done  # no after_backward() this step: the moments are read now
        if late:  # (the parameters before this step's update were kept at the end of the last one)
            self.after_backward()
        for cb in (self.probe, *self.callbacks):
            cb.after_clip(self.host, s)
            cb.after_step(self.host, s)
        value = given if given is not None else self.records.take((M.LOSS,), self._mean_loss)
        if value is not None:
            self.host.log.add(M.LOSS, value.detach() if torch.is_tensor(value) else float(value))
            if self.dcfg.warn and self.warning_cb.warned_at is None:
                self._check_finite(s, value)
        if lr is not None:
            self.host.log.add(M.LR, lr)
        self.probe.at_step(targets)  # the exit loss of the kept loop-end streams (head= without targets=)
        rows = self.host.log.collect(s)
        if self.hooks is None:  # (blocks="auto", none chosen yet: held, written with the first step that has them)
            self._held += rows
            self.step_index = s + 1
            self._reset_step()
            return rows
        if self.host.recipe is None:
            self._start_run(s)
        rows, self._held = self._held + rows, []
        self.writer.extend(rows)
        for cb in (self.probe, *self.callbacks):
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
        """The records that could not be taken, and why (the record guard's: a record that raised, a value of the
        wrong kind, shape or range from head=, targets=, loop_step=, activation gradients under a reentrant
        checkpoint)."""
        return dict(self.records.not_recorded)

    def _start_run(self, s: int) -> None:
        self.host.recipe = probe_recipe(self, self.steps or s + 1)
        write_probe_config(self, self.steps or s + 1)
        self.probe.start(self.host, self.probe.warning)  # (the loop dynamics: at watch(); the diagnostics: attached)
        for cb in self.callbacks:
            cb.on_start(self.host)
