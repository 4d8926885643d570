"""LoopProbe, the object flt_diag.watch returns (flt_diag.integrations.watch: the moments of a step, docs/api.md): its
hooks on the model and its run folder here, the moments of a step in flt_diag.integrations.moments, watch()'s options in
flt_diag.integrations.options. Every record is taken through the run's record guard (flt_diag.instruments.guard)."""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flt_diag.judge.verdict import summarize
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import (SUMMARY, MetricsWriter, StorageError, folder_lock, has_content, not_a_folder,
                                      load_metrics, write_json)
from flt_diag.instruments.callbacks import Callback
from flt_diag.instruments.dynamics_callback import watched_model_dynamics
from flt_diag.integrations.probe import Probe
from flt_diag.instruments.guard import recording
from flt_diag.instruments.records import Row
from flt_diag.integrations.folder import Host, as_read, evidence_notes, probe_recipe, recipe, tokens_per_step, write_probe_config
from flt_diag.integrations.checks import check_watch, leave_no_trace, lets_go_on_refusal, one_loss
from flt_diag.integrations.moments import ProbeMoments
from flt_diag.integrations.options import Blocks, Head, WatchOptions
from flt_diag.storage.file_models import Summary
from flt_diag.instruments.diagnostics import should_record
from flt_diag.instruments.loop_hooks import NOT_LOOPED_AFTER, LoopHooks, ProbeError
from flt_diag.integrations.model import auto_blocks, called_blocks, check_untied, default_head, parameter_groups_of, resolve_blocks
from flt_diag.instruments.warning_callback import collapse_warning
from flt_diag.config.run_config import DiagnosticsConfig

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Blocks", "Head", "LoopProbe", "WatchOptions"]  # (watch()'s options: flt_diag.integrations.options)


class LoopProbe(ProbeMoments):
    """Diagnostics attached from outside to `model` (see the module docstring and `watch`)."""

    hooks: LoopHooks | None  # the diagnostics' hooks on the blocks (None: not attached yet, or let go)
    shape: tuple[int, ...] | None  # the first recorded stream's shape (None before the first training forward)
    loops_seen: Counter[int]  # loop count -> the training forwards that ran it

    def __init__(self, model: nn.Module, blocks: Blocks = "auto", folder: str | os.PathLike[str] = "runs/probe",
                 **options: Unpack[WatchOptions]):
        o: dict[str, Any] = {**dict.fromkeys(WatchOptions.__annotations__), "grad_scale": 1.0,
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
        self.boundary = o["loop_boundary"]  # (None: the loops counted from the blocks' calls)
        self.dcfg = DiagnosticsConfig(**{**(o["diagnostics"] or DiagnosticsConfig()).__dict__, "warn": warn,
                                         "stop_on_collapse": stop, "predictor": o["predictor_path"]})
        self.grad_scale = o["grad_scale"]
        self.host = Host(model, self.folder)
        # the instruments, as flt-diag's Trainer runs them (flt_diag.integrations.probe); the loop dynamics as
        # flt-diag's runs take them (flt-diag's model), or from head=, targets=, loop_step=
        self.probe = Probe(self.dcfg, watched_model_dynamics(self.dcfg, model, head, o["loop_step"], o["targets"]),
                           collapse_warning(self.dcfg, always=True))
        self._build()
        self.callbacks: list[Callback] = list(o["callbacks"] or [])
        self.step_index, self.shape, self.loops_seen = 0, None, Counter()
        self._auto_tries, self._held = 0, list[Row]()  # (blocks="auto") forwards that reused nothing; their steps' rows
        self.grad_hooks = o["grad_hooks"]  # each gradient read as the backward accumulates it: before any clipping
        self.oscillation_unjudged: str | None = None  # why the gradient norms read are after clipping, if they are
        self.summary: Summary | None = None
        self._reset_step()
        self._open()

    # ------------------------------------------------------------------ attach / detach
    def _build(self) -> None:
        check_untied(self.model, self.blocks, self.names)
        self.groups = parameter_groups_of(self.model, self.blocks, self.head)
        self.params = [p for ps in self.groups.values() for p in ps]
        self.diag = self.probe.build(self.groups, grad_scale=self.grad_scale, hooks=dict(
            blocks=self.blocks, boundary=self.boundary, names=self.names,
            require_repeat=NOT_LOOPED_AFTER if self.boundary is None else 0))

    def _attach(self) -> None:
        """The hooks on the blocks (at watch(), or for blocks="auto" at the first training forward)."""
        self.probe.start(self.host, self.diag)  # its LoopHooks, registered after the probe's own pre-hook
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
        if (it := not_a_folder(self.folder)) is not None:
            raise ProbeError(f"{self.folder} is {it}, not a folder; give watch() a new folder")
        if has_content(self.folder):
            raise ProbeError(f"{self.folder} exists and is not empty; give watch() a new folder")
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(folder_lock(self.folder, root=self.folder))  # (the folder itself may be a link)
            self.writer = MetricsWriter(self.folder)
        except (StorageError, OSError) as e:  # a link, a .lock that is no file, no permission: one line
            self._stack.close()
            raise ProbeError(str(e) if isinstance(e, StorageError) else f"cannot write {self.folder}: {e}") from None
        try:
            self.hooks = None
            self._handles = [self.model.register_forward_pre_hook(self._begin_forward, with_kwargs=True),
                             self.model.register_forward_hook(self._end_forward)]
            self.probe.start(self.host, self.probe.dynamics)  # its hook, needed from the first forward on (after ours)
            if not self.auto:
                self._attach()
        except BaseException:
            self._detach()
            raise

    def _detach(self) -> None:
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []
        self.probe.on_end(self.host)
        self.hooks = None
        leave_no_trace(self.folder, getattr(self, "writer", None), self.host.recipe is not None)  # (nothing stored)
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
    def _training(self, module) -> bool:
        return torch.is_grad_enabled() and module.training

    @lets_go_on_refusal
    def _begin_forward(self, module, args, kwargs):
        if self._training(module) and not self._began:
            found = self.hooks is None and self.auto  # blocks="auto", first training forward: find them now
            if found and not self._find_blocks(module, args, kwargs):  # (none chosen yet: the step without hooks)
                found = False
            self._began = True
            for cb in (self.probe, *self.callbacks):
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

    @recording(M.LOOPS_RUN)
    def _count_loops(self, loops: int) -> None:
        self.loops_seen[loops] += 1
        self.host.log.add(M.LOOPS_RUN, float(loops))

    def end_loop(self, stream: torch.Tensor) -> None:
        """The end of a loop, called from the model's forward (with loop_boundary="manual")."""
        if self.hooks is not None:
            self.hooks.end_loop(stream)

    # ------------------------------------------------------------------ the run folder
    def _summarize(self) -> Summary:
        out = summarize(load_metrics(self.folder), as_read(probe_recipe(self, self.steps or self.step_index)),
                        unigram_entropy=self.unigram_entropy, stop_reason=self.host.stop_requested,
                        prediction=self.host.prediction, tokens_per_step=tokens_per_step(self))
        notes = evidence_notes(self.warmdown, self.warmdown_from, self.oscillation_unjudged, out.evidence,
                               self.not_recorded())
        return Summary.model_validate({**out.as_written(), "evidence": {**out.evidence.as_written(), **notes}})

    def verdict(self) -> Summary:
        """The summary (verdict, evidence, oscillation indices, residual explosion) of the steps so far."""
        if self.host.recipe is None:
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
            for cb in (self.probe, *self.callbacks):
                cb.on_finish(self.host, self.step_index - 1)
            if self.host.recipe is not None:
                self.host.recipe = probe_recipe(self, self.steps or self.step_index)
                write_probe_config(self, self.steps or self.step_index)
                self.summary = self._summarize()
                write_json(self.folder / SUMMARY, self.summary.as_written())
                for cb in (self.probe, *self.callbacks):
                    cb.on_summary(self.host, self.summary)
        finally:
            self._detach()
        return self.summary
