"""The loop-dynamics records (flt_diag.instruments.loop_dynamics) as one instrument that flt-diag's Trainer and
flt_diag.watch both stand on. What is recorded when, its cost and switches: DESIGN.md §3, "Loop dynamics"; on a
model flt-diag did not write: docs/api.md, "Loop dynamics on your own model".

The Probe (flt_diag.integrations.probe) builds what both run on every step: the diagnostics, whose LoopHooks
feed each recorded loop-end stream to LoopDynamicsCallback.loop_end (the loop map's states on a model flt-diag did
not write). Every loop-dynamics record is a record file (flt_diag.records): the exit loss, the fixed-point residual
and the streams' similarity (moment loop_end, taken by the diagnostics; this instrument hands them the head and
targets their context carries), and the every-N ones, the loop map, the per-loop gradient agreement and the sharpness
(loop_map.py, loop_map_agreement.py, sharpness.py: moment loop_map, schedule every_n), taken here. What is this
instrument's own: their schedule (every N steps, recorded or not, and a decided stop's extra step), the step's batch
kept by a forward pre-hook, the loop-end streams kept at loop_end, and the step's loop map (LoopMap) their context
carries, which computes after the backward, on rank 0, in fp32 outside autocast, with a generator of its own,
leaving nothing on any .grad (the training trajectory is the same with or without them), one path for every model:
on a LoopedModel (flt-diag's own: the protocol of flt_diag.instruments.looped) its loop-end state, loop step and
targets; on any other the raw stream and the user's loop_step=. Every record here is taken through the run's record
guard (flt_diag.instruments.guard), and what the user's loop_step= returns is checked at the record
(flt_diag.instruments.record_checks): one that cannot be taken is said once and skipped, the training goes on.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from flt_diag.records import Record, RecordContext, all_records
from flt_diag.storage import metric_names as M
from flt_diag.instruments.callbacks import Host
from flt_diag.instruments.diagnostics import should_record
from flt_diag.instruments.guard import Instrument, Unrecordable, recording, why_of
from flt_diag.instruments import loop_dynamics as D
from flt_diag.instruments.record_checks import checked_step, take_loop_map
from flt_diag.instruments.sharpness import sharpness
from flt_diag.instruments.looped import LoopedModel, LoopStep
from flt_diag.config.run_config import DiagnosticsConfig


LOOP_MAP = (M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN, M.LOOP_PERTURBATION_GROWTH)


def identity(h: torch.Tensor) -> torch.Tensor:
    """h(t) = the loop-end stream itself (any model flt-diag did not write)."""
    return h


class LoopMap:
    """The step's loop map, what the records of moment loop_map compute through (`ctx.loop_map`; flt_diag.records:
    loop_map.py, loop_map_agreement.py, sharpness.py), each at the step's first micro-batch (its first
    `dynamics_batch` sequences), in fp32 outside autocast, with one generator seeded by the step (drawn from in the
    order the records are taken), after the backward, writing to no .grad. On flt-diag's own model (`owner.model`,
    `batch` its idx and targets): `stats()` (the loop map's records, metric -> values of loops 2..K), `agreement()`
    (the per-loop gradient agreement, (K, L)) and `sharpness()`. On any other: `stats()` only, by the user's
    loop_step at the recorded loop-end `states` (the owner's `loop_step`, dropped where it fails: said once, the loop
    map records no more). Each gives None where the model has no such record (K = 1, no loop_step=, a model flt-diag
    did not write)."""

    def __init__(self, owner: LoopDynamicsCallback, step: int, batch: tuple[torch.Tensor, torch.Tensor] | None,
                 states: list[torch.Tensor], loss_on: str):
        self.owner, self.cfg, self.model, self.step, self.states, self.loss_on = \
            owner, owner.cfg, owner.model, step, states, loss_on
        self.idx = self.targets = self.gen = None
        if self.model is not None and batch is not None:
            self.idx, self.targets = batch[0][:self.cfg.dynamics_batch], batch[1][:self.cfg.dynamics_batch]
            self.gen = torch.Generator(device=self.idx.device).manual_seed(step)
        self._loops: int | None = None

    def _own(self) -> tuple[LoopedModel, torch.Tensor] | None:
        return (self.model, self.idx) if self.model is not None and self.idx is not None else None

    def _looped(self) -> tuple[LoopedModel, torch.Tensor] | None:
        """The model and idx where the loop map exists there (flt-diag's own model, K > 1)."""
        own = self._own()
        if own is not None and self._loops is None:
            with torch.autocast(own[1].device.type, enabled=False):
                self._loops = LoopStep.of(*own).loops
        return own if own is not None and self._loops is not None and self._loops > 1 else None

    def stats(self) -> dict[str, torch.Tensor] | None:
        if self.model is None:
            return self._given() if len(self.states) >= 2 and self.owner.loop_step is not None else None
        if (looped := self._looped()) is None:
            return None
        cfg = self.cfg
        with torch.autocast(looped[1].device.type, enabled=False):
            return D.loop_map_stats(*looped, cfg.dynamics_iters, cfg.krylov_dim, cfg.perturbation_dirs, self.gen)

    def agreement(self) -> torch.Tensor | None:
        if (looped := self._looped()) is None or self.targets is None:
            return None
        with torch.autocast(looped[1].device.type, enabled=False):
            return D.loop_gradient_agreement(*looped, self.targets, self.loss_on)

    def sharpness(self) -> torch.Tensor | None:
        if (own := self._own()) is None or self.targets is None:
            return None
        with torch.autocast(own[1].device.type, enabled=False):
            return sharpness(*own, self.targets, self.cfg.dynamics_iters, self.loss_on, self.gen)

    def _given(self) -> dict[str, torch.Tensor]:
        cfg, owner = self.cfg, self.owner
        if len({s.shape for s in self.states}) > 1:
            raise Unrecordable("the loop-end streams change shape from loop to loop: no loop-map records there")
        states = [s[:cfg.dynamics_batch] if s.dim() == 3 else s for s in self.states]
        device = states[0].device
        gen = torch.Generator(device=device).manual_seed(self.step)
        devices = [device.index or 0] if device.type == "cuda" else []
        assert owner.loop_step is not None  # (stats: there is one)
        try:  # (math attention etc.: D.transparent; the fused kernels are not differentiated twice)
            with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False), \
                    torch.no_grad(), D.transparent():
                return D.loop_map_records(checked_step(owner.loop_step), states, cfg.dynamics_iters, cfg.krylov_dim,
                                          cfg.perturbation_dirs, gen)
        except Exception as e:  # the user's loop map failed, or gave no next stream: said once (the guard), no
            owner.loop_step = None  # record from now on, and the training goes on
            why = why_of(e) if isinstance(e, Unrecordable) else f"loop_step= failed under double backward ({why_of(e)})"
            raise Unrecordable(f"{why}: no loop-map records from here on") from None


class LoopDynamicsCallback(Instrument):
    """The instrument of DESIGN.md §3, "Loop dynamics": `loop_end(loop, stream)` is fed each recorded loop-end
    stream (the loop map's states on a model flt-diag did not write); a forward pre-hook on the model (from on_start)
    keeps the step's batch off the first forward after before_step. `head` and `targets_of` (the model's loop_head
    and loop_targets, or head= and targets=) are handed to the diagnostics, the records' context (the exit loss:
    flt_diag.records.exit_loss).

    It takes the records of moment loop_map (flt_diag.records, schedule every_n: the loop map, the per-loop gradient
    agreement, the sharpness, and any of the user's own), each through the run's record guard, after the backward
    (`after_backward`), on rank 0, given the step's loop map (LoopMap) in their context. On a LoopedModel (`model`:
    flt-diag's own, the protocol of flt_diag.instruments.looped; its head, targets and loop-end state too): every N
    steps of each record's switch, recorded or not, and at the steps a decided stop asks for (`snapshot_at`), at the
    step's first micro-batch (the forward's idx and its targets). On any other: on the recorded steps with
    loop_dynamics on, at the step's recorded loop-end streams, through the user's `loop_step` (h(t-1) -> h(t)) under
    torch.no_grad, the global random state restored after (a loop_step that draws, e.g. dropout, leaves the
    training's draws unchanged); one that fails there, or returns what is no next stream (record_checks.checked_step),
    is said once and records no more."""

    RECORDS = {"after_backward": LOOP_MAP}

    def __init__(self, cfg: DiagnosticsConfig, model: LoopedModel | None = None, head: Callable | None = None,
                 targets: Callable | None = None, loop_step: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.cfg, self.model, self.loop_step = cfg, model, loop_step
        self.head: Callable | None = model.loop_head if model is not None else head
        self.targets_of: Callable | None = model.loop_targets if model is not None else targets
        self.final = model.loop_state if model is not None else identity  # h(t) from the loop-end stream
        self.handles: list = []
        self.recording = self.mapping = self._armed = False
        self.extra: set[int] = set()  # steps of a snapshot asked for besides the every-N ones (snapshot_at)
        self.taken = [r for r in all_records() if r.schedule == "every_n" and getattr(cfg, r.switch)]  # (switched on)
        self.due: list[Record] = []  # those this step takes
        self.record_states: dict[Record, Any] = {}  # (a record that keeps a state: its state)
        self._reset()

    def _reset(self) -> None:
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None  # (a LoopedModel) the loop map's idx, targets
        self.states: list[torch.Tensor] = []  # (any other) the loop-end streams the loop map is taken at

    def on_start(self, trainer: Host) -> None:
        self.handles = [trainer.model.register_forward_pre_hook(
            self.records.hook(LOOP_MAP, self._begin), with_kwargs=True)]

    def on_end(self, trainer: Host) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._armed = False

    def before_step(self, trainer: Host, step: int) -> None:
        self.log = trainer.log
        self.recording = self.cfg.loop_dynamics and should_record(step, self.cfg)
        on = self.model is not None or self.recording  # (own model: every N steps, recorded or not)
        self.due = [r for r in self.taken if on and self._due(r, step)]
        self.mapping = trainer.is_main and bool(self.due)
        self._armed = self.mapping
        self._reset()

    def _due(self, record: Record, step: int) -> bool:
        every = getattr(self.cfg, record.switch)
        return every > 0 and (step % every == 0 or step in self.extra)

    def takes_snapshots(self) -> bool:
        """Whether the run takes loop-map snapshots (own model, dynamics_every, sharpness_every or the switch of
        another record of moment loop_map set)."""
        return self.model is not None and bool(self.taken)

    def snapshot_due(self, step: int) -> bool:
        """Whether a record of moment loop_map (the loop map, the sharpness) is taken at `step`."""
        return any(self._due(r, step) for r in self.taken)

    def snapshot_at(self, step: int) -> None:
        """Take the every-N records at `step` too (a run that stops there: flt_diag.training.decided_stop)."""
        self.extra.add(step)

    def _begin(self, module, args, kwargs) -> None:
        if not self._armed:
            return
        self._armed = False
        if self.model is not None:
            self._keep_batch(args, kwargs)

    def _keep_batch(self, args: tuple, kwargs: dict) -> None:
        assert self.model is not None  # (the protocol's model)
        idx, targets = args[0] if args else kwargs.get("idx"), self.model.loop_targets(*args, **kwargs)
        self.batch = (idx.detach(), targets.detach()) if torch.is_tensor(idx) and torch.is_tensor(targets) else None

    @recording(*LOOP_MAP)
    def loop_end(self, loop: int, stream: torch.Tensor) -> None:
        """A recorded loop's end (LoopHooks.on_loop_end): on a model flt-diag did not write, the loop-end states the
        loop map is taken at."""
        if self.recording and self.mapping and self.model is None:
            with torch.no_grad():
                self.states.append(self.final(stream.detach()))

    def after_backward(self, trainer: Host, step: int) -> None:
        """The records of moment loop_map due this step (class docstring), each through the guard (one that fails
        leaves the others)."""
        if not self.mapping:
            return
        self.mapping = False
        loss_on = trainer.recipe.loss_on if trainer.recipe is not None else "end"  # (a probe: the end loop)
        batch, states, self.batch, self.states = self.batch, self.states, None, []
        if self.model is not None and batch is None:
            return
        loop_map = LoopMap(self, step, batch, states, loss_on)
        context: RecordContext = RecordContext(step, self.cfg, idx=loop_map.idx, targets=loop_map.targets,
                                               loop_map=loop_map)
        for record in self.due:
            self.records.take(tuple(record.metrics), take_loop_map, record, trainer.log.add, self.record_states, context)


def own_model_dynamics(cfg: DiagnosticsConfig, model: LoopedModel) -> LoopDynamicsCallback:
    """A LoopedModel, flt-diag's own (the module docstring's first case)."""
    return LoopDynamicsCallback(cfg, model)


def watched_model_dynamics(cfg: DiagnosticsConfig, model: torch.nn.Module, head: Callable | None = None,
                           loop_step: Callable | None = None, targets: Callable | None = None) -> LoopDynamicsCallback:
    """flt_diag.watch: flt-diag's own model as in its runs (with loop_dynamics on: off, nothing is recorded at all);
    any other model, the module docstring's second case."""
    if isinstance(model, LoopedModel) and cfg.loop_dynamics:
        return own_model_dynamics(cfg, model)
    return LoopDynamicsCallback(cfg, head=head, targets=targets, loop_step=loop_step)

