"""The training callback of the diagnostics (DESIGN.md §3): on recorded steps (`should_record`) it arms the
loop hooks (flt_diag.instruments.loop_hooks) and reads the parameter and gradient records from flat buffers;
under DDP parameter gradients are read after the all-reduce and rank 0 writes. Its moments and hooks run through
the run's record guard (flt_diag.instruments.guard).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from flt_diag.storage import metric_names as M
from flt_diag.instruments.guard import Instrument, recording
from flt_diag.instruments.gradient_pairs import consecutive_stats, pair_sums, segment_squares
from flt_diag.instruments.loop_hooks import LoopHooks
from flt_diag.instruments.looped import LoopedModel
from flt_diag.instruments.record_checks import take_finish, take_record
from flt_diag.instruments.records import StepLog
from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.records import Record, RecordContext, all_records
from flt_diag.records._streams import alias_norms


def should_record(step: int, cfg: DiagnosticsConfig) -> bool:
    """Every step of the first `dense_steps`, then every `every` steps."""
    return cfg.diagnostics and (step < cfg.dense_steps or (step - cfg.dense_steps) % cfg.record_every == 0)


PER_GROUP = "/<group>"  # (a record name of not_recorded: the metric of every parameter group)


class DiagnosticsCallback(Instrument):
    """Records everything of DESIGN.md §3 on recorded steps (`should_record`). The per-group figures come from
    flat buffers (the groups' gradients, or parameters, laid end to end) by a few vector operations: a recorded
    step costs the same handful of kernel launches whatever the number of groups or parameters, and allocates
    no parameter-sized tensor (gradient_pairs)."""

    RECORDS = {"after_backward": (M.GRAD_NORM + PER_GROUP, M.GRAD_COSINE, M.SIGN_FLIP),
               "after_clip": (M.GRAD_NORM_CLIPPED + PER_GROUP,),
               "after_step": (M.UPDATE_RATIO + PER_GROUP, M.PARAM_NORM + PER_GROUP)}

    def __init__(self, cfg: DiagnosticsConfig, groups: dict[str, list], hooks: dict | None = None,
                 grad_scale: float | None = None, loop_end: tuple | list = (), head: Callable | None = None,
                 targets: Callable | None = None):
        """`groups` (the parameter groups: flt-diag's model's parameter_groups, or those of any looped model under
        flt_diag.watch), `hooks` (LoopHooks keyword arguments) and `grad_scale` (default the run's grad_accum);
        `loop_end`: fn(loop, stream), fed each recorded loop-end stream (LoopHooks.on_loop_end: the loop dynamics'
        loop-map states), before the records of moment loop_end (flt_diag.records). `head` and `targets` (a
        function of the forward's arguments): the records' context's (RecordContext; on flt-diag's own model its
        loop_head and loop_targets); a head without targets: the targets come at the step (`at_step`)."""
        self.cfg, self.loop_end = cfg, list(loop_end)
        self.head, self.targets_of = head, targets
        self.given_groups, self.hook_options, self.grad_scale = groups, dict(hooks or {}), grad_scale
        self.prev_flat: torch.Tensor | None = None  # the previous step's flat gradient (one of `buffers`, or loaded)
        self.prev_layout: tuple[list[str], list[int]] = ([], [])  # its groups and their sizes
        self.prev_step = -2
        self.prev_squares: torch.Tensor | None = None  # prev_flat's squared norm per group (this step's, then)
        self.views: dict[tuple, list[torch.Tensor]] = {}  # (_flatten) a buffer's views shaped as the gradients
        self.buffers: list[torch.Tensor] = []  # the flat gradients of this step and the previous one, a work buffer
        self.before_flat: torch.Tensor | None = None  # the parameters before the optimizer step, laid end to end
        self.before: list[torch.Tensor] = []  # its views, shaped as the parameters
        self.have_before = False
        self.key_lists: dict[tuple, list[tuple[str, int, int]]] = {}
        self.recording = False
        self.taken: list[Record] = []  # the records switched on (flt_diag.records); `due`: those this step takes
        self.due: list[Record] = []
        self.unclipped_norm: torch.Tensor | None = None  # (the probe) the step's total gradient norm before clipping
        self.grad_norm: torch.Tensor | None = None  # the total gradient norm after_backward read (before clipping)
        self._seen: tuple[list, list[int], torch.Tensor] | None = None  # its gradients, their versions, group squares
        self.log: StepLog | None = None  # (records of moment loop_end) the step log, and h(t) of a loop-end stream
        self.final: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.context: RecordContext | None = None  # (records of context=True) the step, cfg and the step's batch
        self.batch_due = False  # the step's recorded forward is still to give its batch (_keep_batch)
        self.handles: list = []

    def on_start(self, trainer) -> None:
        self.groups = self.given_groups
        self.params = [p for ps in self.groups.values() for p in ps]
        self.param_sizes = [sum(p.numel() for p in ps) for ps in self.groups.values()]
        self.taken = [r for r in all_records() if getattr(self.cfg, r.switch) and r.schedule == "recorded"]  # (switched
        # on; flt_diag.records: those of schedule every_n, moment loop_map, are the loop dynamics' own)
        self.hooks = LoopHooks(trainer.model, trainer.log.add, records=self.records, **self.hook_options,
                               block_records=[r for r in self.taken if r.moment == "after_block"])
        self.hooks.on_loop_end += self.loop_end  # (the loop dynamics' own first: their line on a stream that is not
        ends = [r for r in self.taken if r.moment == "loop_end"]  # (batch, seq, dim) names the records' metrics too)
        if ends:  # (flt_diag.records, moment loop_end: each loop end of a recorded forward)
            self.log = trainer.log
            self.final = trainer.model.loop_state if isinstance(trainer.model, LoopedModel) else None
            self.hooks.on_loop_end.append(recording(*(m for r in ends for m in r.metrics))(
                lambda loop, stream: self._loop_end(loop, stream)))
            if any(r.finish and r.finish_at == "forward" for r in ends):
                self.hooks.on_forward_end.append(recording(*(m for r in ends if r.finish for m in r.metrics))(
                    lambda loops: self._forward_end(loops)))
        self.model = trainer.model
        if isinstance(trainer.model, LoopedModel) and self.head is None and self.targets_of is None:
            self.head, self.targets_of = trainer.model.loop_head, trainer.model.loop_targets
        if any(r.context for r in self.taken):
            self.handles.append(trainer.model.register_forward_pre_hook(self.records.hook(
                tuple(m for r in self.taken if r.context for m in r.metrics), self._keep_batch), with_kwargs=True))
        self.hooks.grad_scale = trainer.recipe.grad_accum if self.grad_scale is None else self.grad_scale
        if isinstance(trainer.model, LoopedModel):
            self.hooks.detached = trainer.model.detached_loops
        self.hooks.__enter__()

    def before_step(self, trainer, step: int) -> None:
        self.recording = should_record(step, self.cfg)
        self.hooks.due = self.due = [r for r in self.taken if self.recording and r.due(self.cfg, step)]
        self.hooks.arm(self.recording)
        self.context = self.hooks.context = RecordContext(step, self.cfg, head=self.head, targets_at_step=(
            self.head is not None and self.targets_of is None))
        self.batch_due = bool(self.handles) and any(r.context for r in self.due)

    def _keep_batch(self, module, args: tuple, kwargs: dict) -> None:
        """The batch of the step's first recorded forward, into the records' context (RecordContext: idx its first
        argument or idx=, targets `targets` of them, else None; an error of the user's targets= is kept as the
        targets, raised in the record that checks them: flt_diag.records._targets)."""
        if not self.batch_due or self.context is None:
            return
        self.batch_due = False
        idx = args[0] if args else kwargs.get("idx")
        try:
            targets = self.targets_of(*args, **kwargs) if self.targets_of is not None else None
        except Exception as e:  # (the record that takes them says it)
            targets = e
        self.context = self.hooks.context = dataclasses.replace(self.context, idx=idx, targets=targets)

    def _take(self, moment: str, trainer) -> None:
        """The records due this step (before_step) that are taken at `moment` (flt_diag.records), each guarded."""
        for record in (r for r in self.due if r.moment == moment):  # (its values checked inside its own guard)
            self.records.take(tuple(record.metrics), take_record, record, trainer.log.add, (trainer.model,),
                              self.hooks.states, M.NONE, M.NONE, self.context)

    def _loop_end(self, loop: int, stream: torch.Tensor) -> None:
        """The records of moment loop_end due this step, each through its own guard, at (loop,): given the
        loop-end state h (the model's loop_state of the stream, on a LoopedModel; else the stream)."""
        due = [r for r in self.due if r.moment == "loop_end"]
        assert self.log is not None  # (on_start: there are records of moment loop_end)
        if due:
            with torch.no_grad():
                h = self.final(stream.detach()) if self.final is not None else stream.detach()
            if self.final is None:  # (h is the stream: its per-token norms, if the hooks took them, are h's)
                alias_norms(h, stream)
        self.records.take_all((tuple(r.metrics), take_record, (r, self.log.add, (loop, h), self.hooks.states, loop,
                                                             M.NONE, self.context)) for r in due)  # (one line for
        # records failing alike: the guard's)

    def _forward_end(self, loops: int) -> None:
        """The `finish` of each record of moment loop_end due this step that has one at the forward's end, each
        through its own guard."""
        assert self.log is not None  # (on_start: there are records of moment loop_end)
        for record in (r for r in self.due if r.moment == "loop_end" and r.finish and r.finish_at == "forward"):
            self.records.take(tuple(record.metrics), take_finish, record, self.log.add, loops, self.hooks.states)

    def at_step(self, targets=None) -> None:
        """At the step's end (probe.step(targets=)): the `finish` of each record due this step whose finish is at
        the step, given the step's `targets` (its context's), each through its own guard."""
        if self.log is None or self.context is None:
            return
        context = dataclasses.replace(self.context, targets=targets)
        for record in (r for r in self.due if r.moment == "loop_end" and r.finish and r.finish_at == "step"):
            self.records.take(tuple(record.metrics), take_finish, record, self.log.add, 0, self.hooks.states, context)

    def _keys(self, metric: str, names) -> list[tuple[str, int, int]]:
        key = (metric, tuple(names))  # (the same few lists every recorded step: built once)
        if key not in self.key_lists:
            self.key_lists[key] = [(m, M.NONE, layer) for m, layer in (M.group_key(metric, name) for name in names)]
        return self.key_lists[key]

    def _gradients(self) -> tuple[list, list[str], list[int]]:
        """The gradients there are, in group order; the groups that have any, and their sizes."""
        grads, names, sizes = [], [], []
        for name, ps in self.groups.items():
            gs = [p.grad for p in ps if p.grad is not None]
            if gs:
                grads += gs
                names.append(name)
                sizes.append(sum(g.numel() for g in gs))
        return grads, names, sizes

    def after_backward(self, trainer, step: int) -> None:
        self._take("after_backward", trainer)
        self.grad_norm = self._seen = None
        need_next = should_record(step + 1, self.cfg)
        if not (self.recording or need_next):
            return
        grads, names, sizes = self._gradients()
        if not grads:
            return
        flat, _, work = self._buffers(sum(sizes), grads[0].device, flat_dtype(grads))
        self._flatten(grads, flat)
        layout = (names, sizes)
        have_prev = self.recording and self.prev_step == step - 1 and self.prev_layout == layout \
            and self.prev_flat is not None  # (a resumed state of another model: not used)
        if have_prev:
            assert self.prev_flat is not None  # (have_prev)
            prev_squares = self.prev_squares if self.prev_squares is not None and \
                self.prev_squares.device == flat.device else None  # (a loaded state: taken anew)
            sums = pair_sums(flat, self.prev_flat.to(flat.device, flat.dtype), sizes, work, prev_squares)  # (5, groups)
            squares = sums[1]
        else:
            squares = segment_squares(flat, sizes)
        self._seen = grads, [g._version for g in grads], squares  # (after_clip: the same gradients, unclipped?)
        total = squares.sum().sqrt()
        scale = None if self.unclipped_norm is None else self.unclipped_norm / total.clamp_min(1e-30)
        self.grad_norm = total if scale is None else self.unclipped_norm
        if self.recording:
            log = trainer.log
            log.add_vector(self._keys(M.GRAD_NORM, names), squares.sqrt() if scale is None else squares.sqrt() * scale)
            if have_prev:  # (cosines and sign flips do not change with the gradient's scale)
                cos, flip = consecutive_stats(torch.cat([sums, sums.sum(1, keepdim=True)], 1))  # (the groups, all)
                log.add_vector(self._keys(M.GRAD_COSINE, names) + [(M.GRAD_COSINE, M.NONE, M.NONE)], cos)
                log.add_vector(self._keys(M.SIGN_FLIP, names) + [(M.SIGN_FLIP, M.NONE, M.NONE)], flip)
            if not self.have_before:  # (the probe keeps them at the end of the step before, when it must)
                self.keep_before()
        if need_next:  # this step's flat gradient is the next one's previous: the two buffers swap
            self.prev_flat, self.prev_layout, self.prev_step, self.prev_squares = flat, layout, step, squares
            self.buffers[:2] = self.buffers[1::-1]
        else:
            self.prev_flat, self.prev_layout, self.prev_step, self.prev_squares = None, ([], []), -2, None

    def _buffers(self, n: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """Three flat buffers kept from step to step, so that a recorded step allocates no parameter-sized tensor
        (see gradient_pairs); made anew for another size, device or dtype (the previous gradient, if one of them,
        stays in prev_flat)."""
        if not self.buffers or (self.buffers[0].numel(), self.buffers[0].device, self.buffers[0].dtype) != \
                (n, device, dtype):
            self.buffers = [torch.empty(n, device=device, dtype=dtype) for _ in range(3)]
            self.views.clear()  # (their views would keep the old buffers alive)
        return self.buffers

    def _flatten(self, grads: list, flat: torch.Tensor) -> None:
        """The gradients laid end to end into `flat`: one foreach copy into views of it shaped as the gradients
        (kept per buffer and shapes: a recorded step makes no view of its own)."""
        key = (flat.data_ptr(), flat.numel(), tuple(g.shape for g in grads))
        views = self.views.get(key)
        if views is None:
            if len(self.views) > 8:  # (a layout that changes from step to step: its views do not pile up)
                self.views.clear()
            views = self.views[key] = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
        with torch.no_grad():
            torch._foreach_copy_(views, grads)

    def keep_before(self) -> None:
        """The parameters as they are now (before the optimizer step), into a flat buffer kept from step to step
        (`before`: its views, shaped as the parameters); after_step takes the update ratio against them."""
        self.records.take(self.RECORDS["after_step"], self._keep_before)

    def _keep_before(self) -> None:
        params = self.params
        if not params:
            return
        if self.before_flat is None or self.before_flat.dtype != flat_dtype(params) or len(self.before) != len(
                params) or any(b.shape != p.shape or b.device != p.device for b, p in zip(self.before, params)):
            self.before_flat = torch.empty(sum(p.numel() for p in params), device=params[0].device,
                                           dtype=flat_dtype(params))
            self.before = [v.view_as(p) for v, p in zip(self.before_flat.split([p.numel() for p in params]), params)]
        with torch.no_grad():
            torch._foreach_copy_(self.before, params)
        self.have_before = True

    def after_clip(self, trainer, step: int) -> None:
        """Per-group gradient norms after clipping (the reference's grad_norm/block_XX/attn|mlp,
        grad_norm/embed, grad_norm/lm_head), beside the pre-clipping ones of `after_backward`. The squares
        after_backward took, if the gradients are the same tensors, unchanged since (no clipping happened)."""
        self._take("after_clip", trainer)
        if not self.recording:
            return
        grads, names, sizes = self._gradients()
        if not grads:
            return
        seen = self._seen
        if seen is not None and len(seen[0]) == len(grads) and all(
                a is b and a._version == v for a, b, v in zip(seen[0], grads, seen[1])):
            squares = seen[2]
        else:
            flat = self._buffers(sum(sizes), grads[0].device, flat_dtype(grads))[2]
            self._flatten(grads, flat)
            squares = segment_squares(flat, sizes)
        trainer.log.add_vector(self._keys(M.GRAD_NORM_CLIPPED, names), squares.sqrt())

    def after_step(self, trainer, step: int) -> None:
        self._take("after_step", trainer)
        if not self.recording or not self.have_before or self.before_flat is None:
            return
        weight = segment_squares(self.before_flat, self.param_sizes).sqrt()
        with torch.no_grad():
            torch._foreach_sub_(self.before, self.params)  # (before - after: the update, whose norm is taken)
        delta = segment_squares(self.before_flat, self.param_sizes).sqrt()
        trainer.log.add_vector(self._keys(M.UPDATE_RATIO, self.groups), delta / weight.clamp_min(1e-30))
        trainer.log.add_vector(self._keys(M.PARAM_NORM, self.groups), weight)
        self.have_before = False

    def on_end(self, trainer) -> None:
        self.hooks.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def state_dict(self) -> dict:
        names, sizes = self.prev_layout
        prev = {} if self.prev_flat is None else \
            {k: v.to("cpu", copy=True) for k, v in zip(names, self.prev_flat.split(sizes))}  # (views of a buffer)
        return {"prev": prev, "prev_step": self.prev_step}

    def load_state_dict(self, state: dict) -> None:
        prev, prev_step = state["prev"], state["prev_step"]
        if not (isinstance(prev, dict) and all(torch.is_tensor(v) and v.dim() == 1 for v in prev.values())
                and isinstance(prev_step, int)):
            raise ValueError("the diagnostics state holds no flat gradient per group and step")
        self.prev_flat = torch.cat(list(prev.values())) if prev else None  # (moved to the gradients' device on use)
        self.prev_layout = (list(prev), [v.numel() for v in prev.values()])
        self.prev_step = prev_step if prev else -2
        self.prev_squares = None


def flat_dtype(tensors) -> torch.dtype:
    """The dtype of a flat buffer of `tensors`: float32, or float64 where one of them is."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
