"""The reference training recipe (DESIGN.md §2) and plain AdamW.

muon:  torch.optim.Muon on the block matrices (lr 0.02, Nesterov, no weight decay; momentum raised
       linearly from 0.85 at step 0 to 0.95 at step 300, then constant: `muon_momentum`);
       AdamW on the embedding (lr 0.2) and head (lr 0.004), betas (0.8, 0.95), eps 1e-10, no weight
       decay, AdamW lrs scaled by (d/768)^-0.5.
adamw: AdamW on every parameter (lr `adamw_lr`), same betas and eps.
Both: every lr times `lr_scale`; constant, then linear warm-down to 0 over the final
`warmdown_frac` of the steps.
"""
from __future__ import annotations

import torch

from .config import TrainConfig
from .model import LoopedTransformer, parameter_groups

BETAS, EPS = (0.8, 0.95), 1e-10


def build_optimizers(model: LoopedTransformer, cfg: TrainConfig, fused: bool = False) -> list[torch.optim.Optimizer]:
    groups = parameter_groups(model)
    matrices = [p for name, ps in groups.items() if name.startswith("block") for p in ps]
    adam_kw = dict(betas=BETAS, eps=EPS, weight_decay=0.0, fused=fused or None)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=cfg.adamw_lr * cfg.lr_scale, **adam_kw)]
    scale = (model.cfg.n_embd / 768) ** -0.5
    adamw = torch.optim.AdamW(
        [dict(params=groups["embedding"], lr=cfg.embedding_lr * scale * cfg.lr_scale),
         dict(params=groups["head"], lr=cfg.head_lr * scale * cfg.lr_scale)],
        **adam_kw,
    )
    muon = torch.optim.Muon(matrices, lr=cfg.matrix_lr * cfg.lr_scale, momentum=muon_momentum(0, cfg),
                            nesterov=True, weight_decay=0.0)
    for opt in (adamw, muon):
        for g in opt.param_groups:
            g["base_lr"] = g["lr"]
    return [muon, adamw]


def lr_multiplier(step: int, total: int, warmdown_frac: float) -> float:
    """1 until the warm-down starts, then linearly to 0 at `total` (step counts from 0)."""
    warmdown = round(warmdown_frac * total)
    if warmdown == 0 or step < total - warmdown:
        return 1.0
    return max(0.0, (total - step) / warmdown)


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
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
    found = False
    for opt in optimizers:
        if isinstance(opt, torch.optim.Muon):
            for g in opt.param_groups:
                g["momentum"] = momentum
            found = True
    return found
