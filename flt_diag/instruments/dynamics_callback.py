"""The loop-dynamics records (flt_diag.instruments.loop_dynamics) as one instrument that flt-diag's Trainer and
flt_diag.watch both stand on. What is recorded when, its cost and switches: DESIGN.md §3, "Loop dynamics"; on a
model flt-diag did not write: docs/api.md, "Loop dynamics on your own model".

The Probe (flt_diag.integrations.probe) builds what both run on every step: the diagnostics, whose LoopHooks
feed each recorded loop-end stream to LoopDynamicsCallback.loop_end (the loop map's states on a model flt-diag did
not write). The exit loss, the fixed-point residual and the streams' similarity are record files (flt_diag.records:
exit_loss.py, fixed_point_residual.py, token_similarity.py), as a new per-loop record is; this instrument hands the
diagnostics the head and targets their context carries. The every-N records go through a loop map after the
backward, on rank 0, in fp32 outside autocast, with a generator of their own, leaving nothing on any .grad (the
training trajectory is the same with or without them), one path for every model: on a LoopedModel (flt-diag's own:
the protocol of flt_diag.instruments.looped) its loop-end state, loop step and targets; on any other the raw stream
and the user's loop_step=. Every record here is taken through the run's record guard (flt_diag.instruments.guard),
and what the user's loop_step= returns is checked at the record (flt_diag.instruments.record_checks): one that
cannot be taken is said once and skipped, the training goes on.
"""
from __future__ import annotations

from typing import Callable

import torch

from flt_diag.storage import metric_names as M
from flt_diag.instruments.callbacks import Host
from flt_diag.instruments.diagnostics import should_record
from flt_diag.instruments.guard import Instrument, Unrecordable, recording, why_of
from flt_diag.instruments import loop_dynamics as D
from flt_diag.instruments.record_checks import checked_step
from flt_diag.instruments.sharpness import sharpness
from flt_diag.instruments.looped import LoopedModel, LoopStep
from flt_diag.config.run_config import DiagnosticsConfig


LOOP_MAP = (M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN, M.LOOP_PERTURBATION_GROWTH)


def identity(h: torch.Tensor) -> torch.Tensor:
    """h(t) = the loop-end stream itself (any model flt-diag did not write)."""
    return h


def due(step: int, every: int) -> bool:
    """Whether an every-N record is taken at `step` (0 = never)."""
    return every > 0 and step % every == 0


class LoopDynamicsCallback(Instrument):
    """The records of DESIGN.md §3, "Loop dynamics" that are no record files (DESIGN.md §7, "A record is one file",
    says why): `loop_end(loop, stream)` is fed each recorded loop-end stream (the loop map's states on a model
    flt-diag did not write); a forward pre-hook on the model (from on_start) reads the loop map's inputs off the
    first forward after before_step. `head` and `targets_of` (the model's loop_head and loop_targets, or head= and
    targets=) are handed to the diagnostics, the records' context (the exit loss: flt_diag.records.exit_loss).

    The every-N loop-map records, one path for every model, after the backward (`after_backward`). On a LoopedModel
    (`model`: flt-diag's own, the protocol of flt_diag.instruments.looped; its head, targets and loop-end state too):
    the loop map at its own states of the step's first micro-batch (the forward's idx and its targets), with the
    per-loop gradient agreement and the sharpness. On any other: the user's `loop_step` (h(t-1) -> h(t)) at the
    step's recorded loop-end streams, under torch.no_grad, the global random state restored after (a loop_step that
    draws, e.g. dropout, leaves the training's draws unchanged); one that fails there, or returns what is no next
    stream (record_checks.checked_step), is said once and records no more. Both write their records through `_add`."""

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
        if self.model is not None:  # (every N steps, recorded or not)
            mapping = self.snapshot_due(step)
        else:
            mapping = self.recording and self.loop_step is not None and due(step, self.cfg.dynamics_every)
        self.mapping = trainer.is_main and mapping
        self._armed = self.mapping
        self._reset()

    def _due(self, step: int, every: int) -> bool:
        return due(step, every) or (every > 0 and step in self.extra)

    def takes_snapshots(self) -> bool:
        """Whether the run takes loop-map snapshots (own model, dynamics_every or sharpness_every set)."""
        return self.model is not None and (self.cfg.dynamics_every > 0 or self.cfg.sharpness_every > 0)

    def snapshot_due(self, step: int) -> bool:
        """Whether the loop-map records (and the sharpness) are taken at `step`."""
        return self._due(step, self.cfg.dynamics_every) or self._due(step, self.cfg.sharpness_every)

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
        """The every-N records (class docstring), each through the guard (one that fails leaves the others)."""
        if not self.mapping:
            return
        self.mapping = False
        loss_on = trainer.recipe.loss_on if trainer.recipe is not None else "end"  # (a probe: the end loop)
        batch, states, self.batch, self.states = self.batch, self.states, None, []
        if self.model is not None and batch is not None:
            self._own(trainer.log, step, batch, loss_on)
        elif self.model is None and len(states) >= 2 and self.loop_step is not None:
            self.records.take(LOOP_MAP, self._given, trainer.log, step, states)

    def _own(self, log, step: int, batch, loss_on: str) -> None:
        model, cfg, records, b = self.model, self.cfg, self.records, self.cfg.dynamics_batch
        assert model is not None  # (_own: the protocol's model)
        idx, targets = batch[0][:b], batch[1][:b]
        gen = torch.Generator(device=idx.device).manual_seed(step)
        with torch.autocast(idx.device.type, enabled=False):
            if self._due(step, cfg.dynamics_every) and LoopStep.of(model, idx).loops > 1:
                records.take(LOOP_MAP, lambda: self._add(log, D.loop_map_stats(
                    model, idx, cfg.dynamics_iters, cfg.krylov_dim, cfg.perturbation_dirs, gen)))
                records.take((M.LOOP_GRAD_COSINE,), self._agreement, log, idx, targets, loss_on)
            if self._due(step, cfg.sharpness_every):
                records.take((M.SHARPNESS,), lambda: log.add(M.SHARPNESS, sharpness(
                    model, idx, targets, cfg.dynamics_iters, loss_on, gen)))

    def _agreement(self, log, idx: torch.Tensor, targets: torch.Tensor, loss_on: str) -> None:
        assert self.model is not None  # (_own: the protocol's model)
        cos = D.loop_gradient_agreement(self.model, idx, targets, loss_on)  # (K, L)
        log.add_vector([(M.LOOP_GRAD_COSINE, t + 1, layer + 1) for t in range(cos.shape[0])
                        for layer in range(cos.shape[1])], cos.flatten())

    def _given(self, log, step: int, states: list[torch.Tensor]) -> None:
        cfg = self.cfg
        if len({s.shape for s in states}) > 1:
            raise Unrecordable("the loop-end streams change shape from loop to loop: no loop-map records there")
        states = [s[:cfg.dynamics_batch] if s.dim() == 3 else s for s in states]
        device = states[0].device
        gen = torch.Generator(device=device).manual_seed(step)
        devices = [device.index or 0] if device.type == "cuda" else []
        assert self.loop_step is not None  # (record: there is one)
        try:  # (math attention etc.: D.transparent; the fused kernels are not differentiated twice)
            with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False), \
                    torch.no_grad(), D.transparent():
                stats = D.loop_map_records(checked_step(self.loop_step), states, cfg.dynamics_iters, cfg.krylov_dim,
                                           cfg.perturbation_dirs, gen)
        except Exception as e:  # the user's loop map failed, or gave no next stream: said once (the guard), no
            self.loop_step = None  # record from now on, and the training goes on
            why = why_of(e) if isinstance(e, Unrecordable) else f"loop_step= failed under double backward ({why_of(e)})"
            raise Unrecordable(f"{why}: no loop-map records from here on") from None
        self._add(log, stats)

    @staticmethod
    def _add(log, stats: dict[str, torch.Tensor]) -> None:
        """The loop map's records, metric -> values of loops 2..K."""
        for metric, values in stats.items():
            log.add_vector([(metric, t, M.NONE) for t in range(2, len(values) + 2)], values)


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

