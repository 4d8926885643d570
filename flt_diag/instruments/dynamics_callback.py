"""The loop-dynamics records (flt_diag.instruments.loop_dynamics) as one instrument that flt-diag's Trainer and
flt_diag.watch both stand on. What is recorded when, its cost and switches: DESIGN.md §3, "Loop dynamics"; on a
model flt-diag did not write: docs/api.md, "Loop dynamics on your own model".

`instruments()` builds what both run on every step: the diagnostics, whose LoopHooks feed each recorded
loop-end stream to LoopDynamicsCallback.loop_end (a new record per loop: its function in loop_dynamics.py, its
metric name, one call in `loop_end`). The every-N records go through a loop map after the backward, on rank 0,
in fp32 outside autocast, with a generator of their own, leaving nothing on any .grad (the training trajectory
is the same with or without them). By the model: ModelLoopMap for flt-diag's (h(t) = its final norm of the
stream, its head, the forward's targets); StepLoopMap for any other (the raw stream, head= and targets= as
given, the user's loop_step=).
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from flt_diag.storage import metric_names as M
from flt_diag.instruments.callbacks import Callback, Host
from flt_diag.instruments.diagnostics import DiagnosticsCallback, should_record
from flt_diag.instruments import loop_dynamics as D
from flt_diag.instruments.loop_hooks import per_token_norms
from flt_diag.instruments.sharpness import sharpness
from flt_diag.model.transformer import LoopedTransformer, norm
from flt_diag.config.run_config import DiagnosticsConfig


def identity(h: torch.Tensor) -> torch.Tensor:
    """h(t) = the loop-end stream itself (any model flt-diag did not write)."""
    return h


def due(step: int, every: int) -> bool:
    """Whether an every-N record is taken at `step` (0 = never)."""
    return every > 0 and step % every == 0


class ModelLoopMap:
    """flt-diag's own model: loop_map_stats at its own states of the step's first micro-batch (`begin`: the
    forward's idx, targets), the per-loop gradient agreement, and the sharpness."""

    def __init__(self, model: LoopedTransformer):
        self.model, self.batch = model, None

    def due(self, step: int, cfg: DiagnosticsConfig, recording: bool) -> bool:
        return due(step, cfg.dynamics_every) or due(step, cfg.sharpness_every)

    def begin(self, args: tuple, kwargs: dict) -> None:
        idx = args[0] if args else kwargs.get("idx")
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        self.batch = (idx.detach(), targets.detach()) if torch.is_tensor(targets) else None

    def loop_end(self, h: torch.Tensor) -> None: ...

    def record(self, host: Host, step: int, cfg: DiagnosticsConfig, say: Callable[[str, str], None]) -> None:
        batch, self.batch = self.batch, None
        if batch is None:
            return
        b, model, log = cfg.dynamics_batch, self.model, host.log
        idx, targets = batch[0][:b], batch[1][:b]
        loss_on = host.cfg.train.loss_on if host.cfg is not None else "end"  # (a probe: the end loop)
        gen = torch.Generator(device=idx.device).manual_seed(step)
        with torch.autocast(idx.device.type, enabled=False):
            if due(step, cfg.dynamics_every) and model.cfg.loops > 1:
                stats = D.loop_map_stats(model, idx, cfg.dynamics_iters, cfg.krylov_dim, cfg.perturbation_dirs, gen)
                loops = range(2, model.cfg.loops + 1)
                for metric, values in stats.items():
                    log.add_vector([(metric, t, M.NONE) for t in loops], values)
                cos = D.loop_gradient_agreement(model, idx, targets, loss_on)  # (K, L)
                log.add_vector([(M.LOOP_GRAD_COSINE, t + 1, layer + 1) for t in range(cos.shape[0])
                                for layer in range(cos.shape[1])], cos.flatten())
            if due(step, cfg.sharpness_every):
                log.add(M.SHARPNESS, sharpness(model, idx, targets, cfg.dynamics_iters, loss_on, gen))


class StepLoopMap:
    """A model flt-diag did not write: the user's `loop_step` (h(t-1) -> h(t)) at the step's recorded loop-end
    streams, under torch.no_grad, the global random state restored after (a loop_step that draws, e.g. dropout,
    leaves the training's draws unchanged). One that fails there is said once, and records no more."""

    def __init__(self, loop_step: Callable[[torch.Tensor], torch.Tensor]):
        self.loop_step: Callable | None = loop_step
        self.states: list[torch.Tensor] = []

    def due(self, step: int, cfg: DiagnosticsConfig, recording: bool) -> bool:
        return recording and self.loop_step is not None and due(step, cfg.dynamics_every)

    def begin(self, args: tuple, kwargs: dict) -> None:
        self.states = []

    def loop_end(self, h: torch.Tensor) -> None:
        self.states.append(h)

    def record(self, host: Host, step: int, cfg: DiagnosticsConfig, say: Callable[[str, str], None]) -> None:
        states, self.states = self.states, []
        if len(states) < 2 or self.loop_step is None:
            return
        if len({s.shape for s in states}) > 1:
            say("loop-map", "the loop-end streams change shape from loop to loop: no loop-map records")
            return
        states = [s[:cfg.dynamics_batch] if s.dim() == 3 else s for s in states]
        device = states[0].device
        gen = torch.Generator(device=device).manual_seed(step)
        devices = [device.index or 0] if device.type == "cuda" else []
        try:  # (math attention etc.: D.transparent; the fused kernels are not differentiated twice)
            with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False), \
                    torch.no_grad(), D.transparent():
                stats = D.loop_map_records(self.loop_step, states, cfg.dynamics_iters, cfg.krylov_dim,
                                           cfg.perturbation_dirs, gen)
        except (RuntimeError, NotImplementedError) as e:  # the user's loop map failed under autograd: say so once,
            self.loop_step = None                          # record none from now on, and let the training go on
            say("loop-map", f"loop_step= failed under double backward ({type(e).__name__}: "
                f"{(str(e).splitlines() or [''])[0][:160]}): no loop-map records from here on")
            return
        loops = range(2, len(states) + 1)
        for metric, values in stats.items():
            host.log.add_vector([(metric, t, M.NONE) for t in loops], values)


LoopMap = ModelLoopMap | StepLoopMap
KEEP_FOR_SIMILARITY = 1 << 20  # elements: a loop end's first dynamics_batch sequences up to this size are copied and
BATCH_SIMILARITY = 1 << 22  # taken together at the forward's end, this many elements a call (larger: at the loop end)


class LoopDynamicsCallback(Callback):
    """The records of DESIGN.md §3, "Loop dynamics": `loop_end(loop, stream)` is fed each recorded loop-end stream; a
    forward pre-hook on the model (from on_start) reads the step's targets and the loop map's inputs off the
    first forward after before_step; `at_step(targets)` (probe.step(targets=)) scores the streams kept for it."""

    def __init__(self, cfg: DiagnosticsConfig, loop_map: LoopMap | None = None, head: Callable | None = None,
                 targets: Callable | None = None, final: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.cfg, self.loop_map, self.head, self.targets_of = cfg, loop_map, head, targets
        self.final = identity if final is None else final  # h(t) from the loop-end stream
        self.handles: list = []
        self.said: set[str] = set()
        self.recording = self.exit = self.mapping = self._armed = False
        self._reset()

    def _reset(self) -> None:
        self.h_prev: torch.Tensor | None = None
        self.prev_norms: torch.Tensor | None = None  # ||h_prev|| per token
        self.steps: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (loop, ||h - h_prev||, ||h_prev||) per token
        self.similar: list[tuple[int, torch.Tensor]] = []  # (loop, its first dynamics_batch sequences), copied
        self.kept: list[tuple[int, torch.Tensor]] = []  # (loop, stream) awaiting step(targets=) for the exit loss
        self.targets: torch.Tensor | None = None

    def on_start(self, trainer: Host) -> None:
        self.handles = [trainer.model.register_forward_pre_hook(self._begin, with_kwargs=True)]

    def on_end(self, trainer: Host) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._armed = False

    def _say(self, what: str, text: str) -> None:
        if what not in self.said:
            self.said.add(what)
            print(f"flt_diag.watch: {text}", file=sys.stderr, flush=True)

    def before_step(self, trainer: Host, step: int) -> None:
        self.log = trainer.log
        self.recording = self.cfg.loop_dynamics and should_record(step, self.cfg)
        self.exit = self.recording and due(step, self.cfg.exit_loss_every)
        self.mapping = self.loop_map is not None and trainer.is_main and self.loop_map.due(step, self.cfg,
                                                                                          self.recording)
        self._armed = self.mapping or (self.exit and self.head is not None and self.targets_of is not None)
        self._reset()

    def _begin(self, module, args, kwargs) -> None:
        if not self._armed:
            return
        self._armed = False
        if self.exit and self.head is not None and self.targets_of is not None:
            t = self.targets_of(*args, **kwargs)
            self.targets = t.detach() if torch.is_tensor(t) else None
        if self.mapping:
            assert self.loop_map is not None  # (mapping: there is one)
            self.loop_map.begin(args, kwargs)

    def _fits(self, h: torch.Tensor) -> bool:
        if h.dim() == 3:
            return True
        self._say("shape", f"a loop-end stream of shape {tuple(h.shape)} is not (batch, seq, dim): token_cosine, "
                           "effective_rank and exit_loss are not recorded for it")
        return False

    def _exit_loss(self, loop: int, h: torch.Tensor, targets: torch.Tensor) -> None:
        if tuple(targets.shape) != tuple(h.shape[:-1]):
            self._say("targets", f"targets of shape {tuple(targets.shape)} do not fit the loop-end stream "
                                 f"{tuple(h.shape)} (one target per position): exit_loss is not recorded")
            return
        assert self.head is not None  # (scored only with a head)
        self.log.add(M.EXIT_LOSS, D.exit_loss(h, self.head, targets.to(h.device)), loop, M.NONE)

    def loop_end(self, loop: int, stream: torch.Tensor) -> None:
        """The records of one recorded loop's end (LoopHooks.on_loop_end)."""
        if not self.recording:
            return
        with torch.no_grad():
            h = self.final(stream.detach())
            if self.exit and self._fits(h):
                if self.head is not None and self.targets is not None:
                    self._exit_loss(loop, h, self.targets)
                elif self.head is not None and self.targets_of is None:
                    self.kept.append((loop, h))
                first = h[:self.cfg.dynamics_batch]  # (the loop map's sequences)
                if first.numel() <= KEEP_FOR_SIMILARITY:  # taken for all loops at once at the forward's end
                    self.similar.append((loop, first.to(torch.float32, copy=True)))  # (one copy, any dtype)
                else:
                    cosine, rank = D.stream_similarity(first)
                    self.log.add(M.TOKEN_COSINE, cosine, loop, M.NONE)
                    self.log.add(M.EFFECTIVE_RANK, rank, loop, M.NONE)
            hf = h.float()
            norms = per_token_norms(stream) if self.final is identity and stream.dtype == torch.float32 \
                else torch.linalg.vector_norm(hf, dim=-1)  # (the hooks' own norms of this loop end, if taken)
            if self.h_prev is not None and self.h_prev.shape == h.shape:
                assert self.prev_norms is not None  # (kept with h_prev)
                self.steps.append((loop, torch.linalg.vector_norm(hf - self.h_prev.float(), dim=-1), self.prev_norms))
            elif self.h_prev is not None:
                self._say("residual", f"the loop-end stream changed shape ({tuple(self.h_prev.shape)} -> "
                                      f"{tuple(h.shape)}): no fixed_point_residual there")
            self.prev_norms = norms
        self.h_prev = h
        if self.mapping:
            assert self.loop_map is not None  # (mapping: there is one)
            self.loop_map.loop_end(h)

    def forward_end(self, loops: int) -> None:
        """The fixed-point residuals of the recorded forward (LoopHooks.on_forward_end), from the per-token norms
        its loop ends left: D.fixed_point_residual of each pair of consecutive loop-end streams, the ratio and the
        mean over tokens taken once for all loops (a few operations a forward, not a few a loop); then the similarity
        of the kept loop ends. A forward that raises before its end leaves none of these (cleared at the next step)."""
        self._similarity()
        steps, self.steps = self.steps, []
        if not steps:
            return
        keys = [(M.FIXED_POINT_RESIDUAL, loop, M.NONE) for loop, _, _ in steps]
        if len({num.shape for _, num, _ in steps}) == 1:
            num, den = torch.stack([n for _, n, _ in steps]), torch.stack([d for _, _, d in steps])
            self.log.add_vector(keys, (num / den.clamp_min(1e-30)).reshape(len(steps), -1).mean(1))
        else:  # (the batch or the sequence changed between loops: one at a time)
            self.log.add_vector(keys, torch.stack([(n / d.clamp_min(1e-30)).mean() for _, n, d in steps]))

    def _similarity(self) -> None:
        """Token cosine and effective rank of the loop ends kept for them: one D.similarity_per_sequence call for
        each run of loops whose kept streams have one shape, up to BATCH_SIMILARITY elements at a time."""
        kept, self.similar = self.similar, []
        while kept:
            shape, n = kept[0][1].shape, 0
            while n < len(kept) and kept[n][1].shape == shape and (
                    n == 0 or (n + 1) * kept[0][1].numel() <= BATCH_SIMILARITY):  # (one at least)
                n += 1
            chunk, kept = kept[:n], kept[n:]
            cosine, rank = D.similarity_per_sequence(torch.cat([h for _, h in chunk]) if n > 1 else chunk[0][1])
            for metric, values in ((M.TOKEN_COSINE, cosine), (M.EFFECTIVE_RANK, rank)):
                self.log.add_vector([(metric, loop, M.NONE) for loop, _ in chunk], values.reshape(n, -1).mean(1))

    def at_step(self, targets: torch.Tensor | None = None) -> None:
        """probe.step(targets=): the exit loss of the streams kept for it."""
        if self.kept and torch.is_tensor(targets):
            with torch.no_grad():
                for loop, h in self.kept:
                    self._exit_loss(loop, h, targets.detach())
        elif self.kept and targets is None:
            self._say("no-targets", "head= is given but no targets: give probe.step(targets=) or watch(targets=) "
                                    "for exit_loss")
        self._reset()

    def after_backward(self, trainer: Host, step: int) -> None:
        if self.mapping:
            assert self.loop_map is not None  # (mapping: there is one)
            self.mapping = False
            self.loop_map.record(trainer, step, self.cfg, self._say)


def own_model_dynamics(cfg: DiagnosticsConfig, model: LoopedTransformer) -> LoopDynamicsCallback:
    """flt-diag's own model (the module docstring's first case)."""
    def targets(idx, targets=None, *args, **kwargs):
        return targets
    return LoopDynamicsCallback(cfg, ModelLoopMap(model), D.model_head(model), targets, lambda h: norm(h.float()))


def watched_model_dynamics(cfg: DiagnosticsConfig, model: torch.nn.Module, head: Callable | None = None,
                           loop_step: Callable | None = None, targets: Callable | None = None) -> LoopDynamicsCallback:
    """flt_diag.watch: flt-diag's own model as in its runs (with loop_dynamics on: off, nothing is recorded at all);
    any other model, the module docstring's second case."""
    if isinstance(model, LoopedTransformer) and cfg.loop_dynamics:
        return own_model_dynamics(cfg, model)
    return LoopDynamicsCallback(cfg, StepLoopMap(loop_step) if loop_step is not None else None, head, targets)


def instruments(cfg: DiagnosticsConfig, dynamics: LoopDynamicsCallback,
                **diagnostics) -> tuple[DiagnosticsCallback, LoopDynamicsCallback]:
    """The instruments of every step, in the order they run: the diagnostics (`diagnostics`: DiagnosticsCallback's
    groups, hooks, grad_scale, for a model flt-diag did not write), whose hooks feed the loop dynamics."""
    return DiagnosticsCallback(cfg, loop_end=[dynamics.loop_end], forward_end=[dynamics.forward_end],
                               **diagnostics), dynamics
