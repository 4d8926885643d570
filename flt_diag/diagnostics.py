"""Diagnostics attached from outside the model: forward hooks, tensor (backward) hooks, and a
training callback. Definitions: DESIGN.md §3 and flt_diag.metric_names.

`LoopHooks` is a context manager that always removes its hooks. A forward of the model arms it
once (`arm()`); during that forward every block output is recorded under (loop, layer), where
the loop counter advances at `model.loop_end`. A block reused K times therefore yields K records.
Forwards that were not armed - further micro-batches, evaluation, and the recomputation that
activation checkpointing runs during backward - record nothing, so nothing is counted twice.

Supported: eager CPU/GPU, activation checkpointing (non-reentrant), torch.compile of the blocks
(flt_diag.parallel.compile_blocks keeps hooks outside compiled code), and DDP (hooks see the
local micro-batch of each rank; parameter gradients are read after the all-reduce; rank 0 writes).
"""
from __future__ import annotations

import math

import torch

from . import metric_names as M
from .callbacks import Callback
from .config import DiagnosticsConfig
from .model import LoopedTransformer, parameter_groups


def should_record(step: int, cfg: DiagnosticsConfig) -> bool:
    """Every step of the first `dense_steps`, then every `every` steps."""
    return cfg.enabled and (step < cfg.dense_steps or (step - cfg.dense_steps) % cfg.every == 0)


class LoopHooks:
    """Per-(loop, layer) residual norms, gradients w.r.t. block outputs, attention statistics.

    `log(metric, value_tensor, loop, layer)` receives every record (values stay on the device).
    `grad_scale` multiplies the recorded activation gradients (the trainer passes grad_accum so
    that they are gradients of the micro-batch's mean loss)."""

    def __init__(self, model: LoopedTransformer, log, act_grads: bool = True, attention: bool = False):
        self.model, self.log = model, log
        self.act_grads, self.attention = act_grads, attention
        self.grad_scale = 1.0
        self.handles: list = []
        self._armed = False
        self._active = False
        self.loop = 0

    def arm(self, on: bool = True) -> None:
        """Record during the next forward of the model only."""
        self._armed = on

    def __enter__(self) -> "LoopHooks":
        m = self.model
        self.handles.append(m.register_forward_pre_hook(self._start))
        self.handles.append(m.register_forward_hook(self._stop))
        self.handles.append(m.loop_end.register_forward_hook(self._loop_end))
        for i, block in enumerate(m.blocks):
            self.handles.append(block.register_forward_hook(self._block_hook(i + 1)))
            if self.act_grads:  # the reference's per-loop attention / MLP output gradients
                self.handles.append(block.attn.register_forward_hook(self._output_grad_hook(M.ACT_GRAD_NORM_ATTN, i + 1)))
                self.handles.append(block.mlp.register_forward_hook(self._output_grad_hook(M.ACT_GRAD_NORM_MLP, i + 1)))
            if self.attention:
                self.handles.append(block.attn.register_forward_hook(self._attn_hook(i + 1)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._active = self._armed = False

    def _start(self, module, args):
        self._active, self._armed = self._armed, False
        self.loop = 1

    def _stop(self, module, args, output):
        self._active = False

    def _loop_end(self, module, args, output):
        if self._active:
            self.log(M.RESID_NORM_LOOP_END, output.detach().norm(dim=-1).mean(), self.loop, M.NONE)
            self.loop += 1

    def _block_hook(self, layer: int):
        record_grad = self._output_grad_hook(M.ACT_GRAD_NORM, layer)

        def hook(module, args, output):
            if not self._active:
                return
            self.log(M.RESID_NORM, output.detach().norm(dim=-1).mean(), self.loop, layer)
            if self.act_grads:
                record_grad(module, args, output)
        return hook

    def _output_grad_hook(self, metric: str, layer: int):
        """Forward hook that records ||d(loss)/d(output)|| under (loop, layer) during backward."""
        def hook(module, args, output):
            if not self._active or not output.requires_grad:
                return
            loop, scale = self.loop, self.grad_scale
            output.register_hook(lambda g: self.log(metric, g.detach().norm() * scale, loop, layer))
        return hook

    def _attn_hook(self, layer: int):
        def hook(module, args, output):
            if not self._active:
                return
            q_src, kv_src, cos, sin = args
            with torch.no_grad():
                q, k = module.query_key(q_src, kv_src, cos, sin)  # (B, T, H, D)
                scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) / math.sqrt(q.shape[-1])
                T = scores.shape[-1]
                causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
                scores = scores.masked_fill(~causal, float("-inf"))  # (B, H, T, T)
                p = scores.softmax(-1)
                entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
            self.log(M.ATTN_MAX_LOGIT, scores.amax(), self.loop, layer)
            self.log(M.ATTN_ENTROPY, entropy, self.loop, layer)
        return hook


def flat_grads(params) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten().float() for p in params if p.grad is not None])


def pair_sums(g: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """[g.prev, |g|^2, |prev|^2, flipped coordinates, coordinates] of two flat gradients."""
    prod = g * prev
    return torch.stack([prod.sum(), g.square().sum(), prev.square().sum(), (prod < 0).sum().float(),
                        torch.tensor(float(g.numel()), device=g.device)])


def consecutive_stats(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine between consecutive gradients, and the share of coordinates whose sign flipped
    (g_i * prev_i < 0: a coordinate that is zero in either step does not count as flipped),
    from `pair_sums` (summed over groups for the global figures)."""
    dot, sq_g, sq_prev, flips, n = sums.unbind()
    return dot / (sq_g * sq_prev).sqrt().clamp_min(1e-30), flips / n


class DiagnosticsCallback(Callback):
    """Records everything of DESIGN.md §3 on recorded steps (see `should_record`)."""

    def __init__(self, cfg: DiagnosticsConfig):
        self.cfg = cfg
        self.prev: dict[str, torch.Tensor] = {}  # previous step's flat gradient per group
        self.prev_step = -2
        self.before: dict[str, list[torch.Tensor]] = {}
        self.recording = False

    def on_start(self, trainer) -> None:
        self.groups = parameter_groups(trainer.model)
        self.hooks = LoopHooks(trainer.model, trainer.log.add, attention=self.cfg.attention)
        self.hooks.grad_scale = trainer.cfg.train.grad_accum
        self.hooks.__enter__()

    def before_step(self, trainer, step: int) -> None:
        self.recording = should_record(step, self.cfg)
        self.hooks.arm(self.recording)

    def after_backward(self, trainer, step: int) -> None:
        need_next = should_record(step + 1, self.cfg)
        if not (self.recording or need_next):
            return
        log = trainer.log.add
        flats = {name: flat_grads(ps) for name, ps in self.groups.items()}
        if self.recording:
            have_prev = self.prev_step == step - 1 and self.prev.keys() == flats.keys()
            total = 0
            for name, g in flats.items():
                metric, layer = M.group_key(M.GRAD_NORM, name)
                log(metric, g.norm(), M.NONE, layer)
                if have_prev:
                    sums = pair_sums(g, self.prev[name])
                    cos, flip = consecutive_stats(sums)
                    log(M.group_key(M.GRAD_COSINE, name)[0], cos, M.NONE, layer)
                    log(M.group_key(M.SIGN_FLIP, name)[0], flip, M.NONE, layer)
                    total = total + sums
            if have_prev:
                cos, flip = consecutive_stats(total)
                log(M.GRAD_COSINE, cos)
                log(M.SIGN_FLIP, flip)
            self.before = {name: [p.detach().clone() for p in ps] for name, ps in self.groups.items()}
        if need_next:
            self.prev, self.prev_step = flats, step
        else:
            self.prev, self.prev_step = {}, -2

    def after_clip(self, trainer, step: int) -> None:
        """Per-group gradient norms after clipping (the reference's grad_norm/block_XX/attn|mlp,
        grad_norm/embed, grad_norm/lm_head), beside the pre-clipping ones of `after_backward`."""
        if not self.recording:
            return
        for name, ps in self.groups.items():
            norms = torch._foreach_norm([p.grad for p in ps if p.grad is not None])
            if norms:
                metric, layer = M.group_key(M.GRAD_NORM_CLIPPED, name)
                trainer.log.add(metric, torch.linalg.vector_norm(torch.stack(norms)), M.NONE, layer)

    def after_step(self, trainer, step: int) -> None:
        if not self.recording:
            return
        for name, ps in self.groups.items():
            before = self.before[name]
            delta = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(torch._foreach_sub(ps, before))))
            weight = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(before)))
            metric, layer = M.group_key(M.UPDATE_RATIO, name)
            trainer.log.add(metric, delta / weight.clamp_min(1e-30), M.NONE, layer)
        self.before = {}

    def on_end(self, trainer) -> None:
        self.hooks.__exit__(None, None, None)

    def state_dict(self) -> dict:
        return {"prev": {k: v.cpu() for k, v in self.prev.items()}, "prev_step": self.prev_step}

    def load_state_dict(self, state: dict) -> None:
        self.prev, self.prev_step = state["prev"], state["prev_step"]

