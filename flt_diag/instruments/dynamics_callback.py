"""The loop-dynamics records of a training run (flt_diag.instruments.loop_dynamics), attached from outside
the model. Definitions, cost and switches: DESIGN.md §3, "Loop dynamics".

On recorded steps (flt_diag.instruments.diagnostics.should_record) and with `--loop-dynamics`: the
fixed-point residual of every loop, and on those that are multiples of `--exit-loss-every` (10) the
exit loss of every loop, computed in a forward hook on `model.loop_end` from the loop-end states the training
forward computes anyway (a second forward with keep="all" would cost a third of a step; the hook costs
one norm per loop, and one head matmul per loop where the exit loss is due). Only the first forward of
a step is armed, as for LoopHooks: further micro-batches, evaluation and the recomputation of
activation checkpointing (which runs `_loop`, not the model's forward) record nothing.

Every `--dynamics-every` steps: loop-map gain and spectral radius, and the per-loop gradient agreement;
every `--sharpness-every` steps: the sharpness; all on the first `--dynamics-batch` sequences of the
step's first micro-batch, after the backward (the weights the step's gradient was taken at), on rank 0
only (the rank that writes; no collective is involved), eagerly (compiled blocks run under
torch.compiler's force_eager stance) and in fp32 outside autocast. They use a generator of their own
(seeded by the step), leave nothing on any .grad and do not change the model's mode, so the training
trajectory is the same with or without them (tested).
"""
from __future__ import annotations

import torch

from flt_diag.storage import metric_names as M
from flt_diag.instruments.callbacks import Callback
from flt_diag.instruments.diagnostics import should_record
from flt_diag.instruments import loop_dynamics as D
from flt_diag.model.transformer import norm
from flt_diag.config.run_config import DiagnosticsConfig


def due(step: int, every: int) -> bool:
    """Whether an every-N record is taken at `step` (0 = never)."""
    return every > 0 and step % every == 0


class LoopDynamicsCallback(Callback):
    def __init__(self, cfg: DiagnosticsConfig):
        self.cfg = cfg
        self.handles: list = []
        self._armed = self._active = False
        self.batch: tuple | None = None

    def on_start(self, trainer) -> None:
        model = trainer.model
        self.head = D.model_head(model)
        self.handles = [model.register_forward_pre_hook(self._start, with_kwargs=True),
                        model.register_forward_hook(self._stop),
                        model.loop_end.register_forward_hook(self._loop_end)]

    def on_end(self, trainer) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._armed = self._active = False

    def _costly(self, step: int) -> bool:
        return due(step, self.cfg.dynamics_every) or due(step, self.cfg.sharpness_every)

    def before_step(self, trainer, step: int) -> None:
        self.log = trainer.log
        self.cheap = self.cfg.loop_dynamics and should_record(step, self.cfg)
        self.exit = self.cheap and due(step, self.cfg.exit_loss_every)
        self._armed = self.cheap or (self._costly(step) and trainer.is_main)
        self.batch = None

    def _start(self, module, args, kwargs):
        self._active, self._armed = self._armed, False
        if not self._active:
            return
        idx = args[0] if args else kwargs.get("idx")
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        self.targets = targets.detach() if torch.is_tensor(targets) else None
        self.batch = (idx.detach(), self.targets)
        self.loop, self.h_prev = 0, None

    def _stop(self, module, args, output):
        self._active, self.h_prev = False, None

    def _loop_end(self, module, args, output):
        if not (self._active and self.cheap):
            return
        self.loop += 1
        with torch.no_grad():
            h = norm(output.detach().float())
            if self.exit and self.targets is not None:
                self.log.add(M.EXIT_LOSS, D.exit_loss(h, self.head, self.targets), self.loop, M.NONE)
            if self.exit:
                cosine, rank = D.stream_similarity(h)
                self.log.add(M.TOKEN_COSINE, cosine, self.loop, M.NONE)
                self.log.add(M.EFFECTIVE_RANK, rank, self.loop, M.NONE)
            if self.h_prev is not None:
                self.log.add(M.FIXED_POINT_RESIDUAL, D.fixed_point_residual(h, self.h_prev), self.loop, M.NONE)
        self.h_prev = h

    def after_backward(self, trainer, step: int) -> None:
        if not (trainer.is_main and self.batch is not None and self._costly(step)) or self.batch[1] is None:
            return
        b = self.cfg.dynamics_batch
        idx, targets = self.batch[0][:b], self.batch[1][:b]
        model, log = trainer.model, trainer.log
        loss_on = trainer.cfg.train.loss_on if getattr(trainer, "cfg", None) is not None else "end"  # (a probe: the end loop)
        gen = torch.Generator(device=idx.device).manual_seed(step)
        with torch.autocast(idx.device.type, enabled=False):
            if due(step, self.cfg.dynamics_every) and model.cfg.loops > 1:
                stats = D.loop_map_stats(model, idx, self.cfg.dynamics_iters, self.cfg.krylov_dim,
                                         self.cfg.perturbation_dirs, gen)
                loops = range(2, model.cfg.loops + 1)
                for metric, values in stats.items():
                    log.add_vector([(metric, t, M.NONE) for t in loops], values)
                cos = D.loop_gradient_agreement(model, idx, targets, loss_on)  # (K, L)
                log.add_vector([(M.LOOP_GRAD_COSINE, t + 1, layer + 1) for t in range(cos.shape[0])
                                for layer in range(cos.shape[1])], cos.flatten())
            if due(step, self.cfg.sharpness_every):
                log.add(M.SHARPNESS, D.sharpness(model, idx, targets, self.cfg.dynamics_iters, loss_on, gen))
        self.batch = None
