"""The reference training recipe (DESIGN.md §2: Muon on the block matrices, momentum warmed up by
`muon_momentum`; AdamW on the embedding and head) and plain AdamW (`adamw_lr` on every parameter, the same
betas and eps). Both: every lr times `lr_scale`; constant, then a linear warm-down to 0 over the final
`warmdown_frac` of the steps.

On GPUs torch.optim.Muon itself is used; on a CPU `BatchedMuon` (DESIGN.md §4): torch.optim.Muon's update
with two changes of *how* it is computed. (1) Every bf16 matmul of the Newton-Schulz iteration is an fp32
matmul of the bf16 values, rounded to bf16 (bf16 with fp32 accumulation, what a bf16 GEMM computes): CPUs
without bf16 hardware run torch's bf16 matmuls an order of magnitude slower (benchmarks/README.md); a bf16
rounding may differ in rare elements. (2) Matrices of the same (transposed) shape are orthogonalised together,
as one batch. Runs stay deterministic.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from flt_diag.config.run_config import TrainConfig
from flt_diag.model.transformer import LoopedTransformer, parameter_groups

BETAS, EPS = (0.8, 0.95), 1e-10


def build_optimizers(model: LoopedTransformer, cfg: TrainConfig, fused: bool = False) -> list[torch.optim.Optimizer]:
    groups = parameter_groups(model)
    matrices = [p for name, ps in groups.items() if name.startswith("block") for p in ps]
    adam_kw: dict[str, Any] = dict(betas=BETAS, eps=EPS, weight_decay=0.0, fused=fused or None)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=cfg.adamw_lr * cfg.lr_scale, **adam_kw)]
    scale = (model.cfg.width / 768) ** -0.5
    adamw = torch.optim.AdamW(
        [dict(params=groups["embedding"], lr=cfg.embedding_lr * scale * cfg.lr_scale),
         dict(params=groups["head"], lr=cfg.head_lr * scale * cfg.lr_scale)]
        + ([dict(params=groups["stabiliser"], lr=cfg.adamw_lr * cfg.lr_scale)] if "stabiliser" in groups else []),
        **adam_kw,
    )
    muon_class = torch.optim.Muon if fused else BatchedMuon  # fused: the CUDA path
    muon = muon_class(matrices, lr=cfg.matrix_lr * cfg.lr_scale, momentum=muon_momentum(0, cfg),
                      nesterov=True, weight_decay=0.0)
    return [muon, adamw]


def lr_multiplier(step: int, total: int, warmdown_frac: float) -> float:
    """1 until the warm-down starts, then linearly to 0 at `total` (step counts from 0)."""
    warmdown = round(warmdown_frac * total)
    if warmdown == 0 or step < total - warmdown:
        return 1.0
    return max(0.0, (total - step) / warmdown)


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
    """Every group's lr = its lr at the first call (kept as "base_lr", saved with the optimizer) x `multiplier`."""
    for opt in optimizers:
        for g in opt.param_groups:
            g.setdefault("base_lr", g["lr"])
            g["lr"] = g["base_lr"] * multiplier


def muon_momentum(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up from `momentum_start` at step 0 to `momentum` at step `momentum_warmup`
    (the reference's get_muon_momentum: 0.85 -> 0.95 over 300 steps), constant after."""
    if cfg.momentum_warmup <= 0:
        return cfg.momentum
    frac = min(step / cfg.momentum_warmup, 1.0)
    return (1 - frac) * cfg.momentum_start + frac * cfg.momentum


def set_momentum(optimizers: list[torch.optim.Optimizer], momentum: float) -> bool:
    """Set the momentum of every Muon optimizer; True if there was one."""
    muons = [opt for opt in optimizers if isinstance(opt, torch.optim.Muon)]
    for opt in muons:
        for g in opt.param_groups:
            g["momentum"] = momentum
    return bool(muons)


def _bf16_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 values with fp32 accumulation, rounded to bf16 (batched)."""
    return torch.matmul(a.float(), b.float()).bfloat16()


def newton_schulz_bf16(X: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                       eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz on a batch (n, rows, cols) with rows <= cols, in
    bf16 values (torch's `_zeropower_via_newtonschulz`, each bf16 op emulated as fp32 then rounded)."""
    a, b, c = coefficients
    X = X.bfloat16()
    norm = torch.linalg.vector_norm(X.float(), dim=(-2, -1), keepdim=True).bfloat16()
    X = (X.float() / norm.float().clamp(min=eps)).bfloat16()
    for _ in range(steps):
        A = _bf16_mm(X, X.mT)  # gram matrix
        B = (b * A.float() + c * torch.matmul(A.float(), A.float())).bfloat16()  # addmm(A, A, A, beta=b, alpha=c)
        X = (a * X.float() + torch.matmul(B.float(), X.float())).bfloat16()  # addmm(X, B, X, beta=a)
    return X


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon, computed for CPUs (see the module doc); the same state and hyper-parameters."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            batches: dict[tuple[int, int], list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                tall = update.size(0) > update.size(1)
                update = update.T if tall else update
                batches.setdefault(tuple(update.shape), []).append((p, update, tall))
            for items in batches.values():
                ortho = newton_schulz_bf16(torch.stack([u for _, u, _ in items]), group["ns_coefficients"],
                                           group["ns_steps"], group["eps"])
                for (p, _, tall), o in zip(items, ortho):
                    A, B = p.shape[:2]
                    ratio = math.sqrt(max(1, A / B)) if group["adjust_lr_fn"] in (None, "original") else \
                        0.2 * math.sqrt(max(A, B)) if group["adjust_lr_fn"] == "match_rms_adamw" else 1.0
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(o.T if tall else o, alpha=-lr * ratio)
        return loss
