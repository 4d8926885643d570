"""The loop dynamics of a looped model flt-diag did not write, for flt_diag.watch (docs/api.md, "Loop dynamics
on your own model"). flt-diag's own model gets flt_diag.instruments.dynamics_callback instead.

From the loop-end streams the probe's LoopHooks already see (`on_loop_end`: a boundary's output, the stream
given to `end_loop`, or the last block's output), on recorded steps, in the hook (no extra forward):
  * fixed_point_residual of loop t >= 2 (one subtraction and two norms);
  * token_cosine and effective_rank of every loop, on the recorded steps that are multiples of
    exit_loss_every (one (T, T) Gram matrix and one SVD of (T, d) per sequence);
  * with `head=` (stream -> logits) and targets: exit_loss of every loop on those same steps (one head
    matmul per loop), computed in the hook where the targets are known at the forward (watch's `targets=`),
    else at `probe.step(targets=)` from the loop-end streams kept for it;
  * with `loop_step=` (h_prev -> h_next): every dynamics_every steps (on a recorded step), after the backward,
    loop_gain, loop_spectral_radius, loop_spectral_residual, loop_mean_gain (at h(t-1), recorded under loop t
    = 2..K) and loop_perturbation_growth, on the first dynamics_batch sequences, under torch.no_grad outside
    autocast, with a generator seeded by the step and the global random state restored after (a loop_step
    that draws, e.g. dropout, leaves the training's draws unchanged); nothing is left on any .grad.
The stream is the model's raw loop-end stream (no final norm is applied: give a head that applies it). Records
are (loop, layer=-1), under flt-diag's metric names. A stream that is not (batch, seq, dim) skips the records that
need that shape, said once on stderr.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from flt_diag.storage import metric_names as M
from flt_diag.instruments import loop_dynamics as D
from flt_diag.instruments.callbacks import Callback
from flt_diag.instruments.diagnostics import should_record
from flt_diag.instruments.dynamics_callback import due
from flt_diag.instruments.records import StepLog
from flt_diag.config.run_config import DiagnosticsConfig

LOOP_MAP = (M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN)


class ProbeDynamics(Callback):
    """The records above; `attach(hooks)` puts them on a LoopHooks, `begin(args, kwargs)` is called at the start
    of each armed forward, `at_step(log, targets)` in probe.step() before the rows are collected."""

    def __init__(self, cfg: DiagnosticsConfig, head: Callable | None = None, loop_step: Callable | None = None,
                 targets: Callable | None = None):
        self.cfg, self.head, self.loop_step, self.targets_of = cfg, head, loop_step, targets
        self.said: set[str] = set()
        self.recording = self.exit = self.costly = False
        self.log: StepLog | None = None  # the step's, from before_step on
        self._reset()

    def _reset(self) -> None:
        self.h_prev: torch.Tensor | None = None
        self.kept: list[tuple[int, torch.Tensor]] = []  # (loop, stream) awaiting step(targets=) for the exit loss
        self.states: list[torch.Tensor] = []  # the loop-end streams of a step whose loop map is due
        self.targets: torch.Tensor | None = None

    def attach(self, hooks) -> None:
        hooks.on_loop_end.append(self._loop_end)

    def _say(self, what: str, text: str) -> None:
        if what not in self.said:
            self.said.add(what)
            print(f"flt_diag.watch: {text}", file=sys.stderr, flush=True)

    def before_step(self, trainer, step: int) -> None:
        self.log = trainer.log
        self.recording = self.cfg.loop_dynamics and should_record(step, self.cfg)
        self.exit = self.recording and due(step, self.cfg.exit_loss_every)
        self.costly = self.recording and self.loop_step is not None and due(step, self.cfg.dynamics_every)
        self._reset()

    def begin(self, args: tuple, kwargs: dict) -> None:
        """The start of the step's training forward: its targets, where watch(targets=) reads them off its inputs."""
        if self.recording and self.exit and self.head is not None and self.targets_of is not None:
            t = self.targets_of(*args, **kwargs)
            self.targets = t.detach() if torch.is_tensor(t) else None

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
        assert self.log is not None and self.head is not None  # (scored only with head=, while recording)
        self.log.add(M.EXIT_LOSS, D.exit_loss(h, self.head, targets.to(h.device)), loop, M.NONE)

    def _loop_end(self, loop: int, stream: torch.Tensor) -> None:
        if not self.recording:
            return
        assert self.log is not None  # (recording: before_step set it)
        h = stream.detach()
        with torch.no_grad():
            if self.h_prev is not None:
                if self.h_prev.shape == h.shape:
                    self.log.add(M.FIXED_POINT_RESIDUAL, D.fixed_point_residual(h, self.h_prev), loop, M.NONE)
                else:
                    self._say("residual", f"the loop-end stream changed shape ({tuple(self.h_prev.shape)} -> "
                                          f"{tuple(h.shape)}): no fixed_point_residual there")
            if self.exit and self._fits(h):
                cosine, rank = D.stream_similarity(h)
                self.log.add(M.TOKEN_COSINE, cosine, loop, M.NONE)
                self.log.add(M.EFFECTIVE_RANK, rank, loop, M.NONE)
                if self.head is not None:
                    if self.targets is not None:
                        self._exit_loss(loop, h, self.targets)
                    elif self.targets_of is None:
                        self.kept.append((loop, h))
        self.h_prev = h
        if self.costly:
            self.states.append(h)

    def at_step(self, log, targets=None) -> None:
        """probe.step(targets=): the exit loss of the streams kept for it."""
        if self.kept and torch.is_tensor(targets):
            with torch.no_grad():
                for loop, h in self.kept:
                    self._exit_loss(loop, h, targets.detach())
        elif self.kept and targets is None:
            self._say("no-targets", "head= is given but no targets: give probe.step(targets=) or watch(targets=) "
                                    "for exit_loss")
        self._reset()

    def after_backward(self, trainer, step: int) -> None:
        states, self.states = self.states, []
        if not (self.costly and len(states) >= 2):
            return
        assert self.loop_step is not None  # (costly: only with loop_step=)
        if len({s.shape for s in states}) > 1:
            self._say("loop-map", "the loop-end streams change shape from loop to loop: no loop-map records")
            return
        b = self.cfg.dynamics_batch
        states = [s[:b] if s.dim() == 3 else s for s in states]
        device = states[0].device
        gen = torch.Generator(device=device).manual_seed(step)
        devices = [device.index or 0] if device.type == "cuda" else []
        try:  # (math attention etc.: D.transparent; torch's fast CPU attention has no forward-mode AD)
            with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False), \
                    torch.no_grad(), D.transparent():
                rows = []
                for h in states[:-1]:
                    rho, res = D.spectral_radius(self.loop_step, h, self.cfg.krylov_dim, gen)
                    rows.append((D.loop_map_gain(self.loop_step, h, self.cfg.dynamics_iters, gen), rho, res,
                                 D.mean_gain(self.loop_step, h, self.cfg.perturbation_dirs, gen)))
                growth = D.perturbation_growth(self.loop_step, states, self.cfg.perturbation_dirs, gen)
        except (RuntimeError, NotImplementedError) as e:  # the user's loop map failed under torch.func: say so once,
            self.loop_step = None                          # record none from now on, and let the training go on
            self._say("loop-map", f"loop_step= failed under torch.func jvp/vjp ({type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:160]}): no loop-map records from here on")
            return
        loops = range(2, len(states) + 1)
        for i, metric in enumerate(LOOP_MAP):
            trainer.log.add_vector([(metric, t, M.NONE) for t in loops],
                                   torch.stack([r[i].to(device).float() for r in rows]))
        trainer.log.add_vector([(M.LOOP_PERTURBATION_GROWTH, t, M.NONE) for t in loops], growth.float())
