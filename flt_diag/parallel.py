"""Cross-cutting concerns applied to a built model from outside: compilation, precision.

`compile_blocks` compiles each block's forward, not the whole model: the loop over K stays
in Python (L*K cheap calls at GPU scale), and module hooks - which run around `forward`,
outside the compiled region - keep firing once per (loop, layer), so diagnostics work
unchanged under torch.compile.
DDP is applied by the Trainer when launched with torchrun (WORLD_SIZE > 1).
"""
from __future__ import annotations

import torch

from .model import LoopedTransformer


def compile_blocks(model: LoopedTransformer, **compile_kwargs) -> LoopedTransformer:
    for block in model.blocks:
        block.forward = torch.compile(block.forward, **compile_kwargs)
    return model


def reference_precision(model: LoopedTransformer) -> LoopedTransformer:
    """Precision as the reference trains on GPU: bf16 embedding weights (so, under bf16 autocast,
    a bf16 residual stream and bf16 RMSNorm) and bf16 rotary tables used as bf16. flt-diag's
    default keeps fp32 weights and stream (autocast only rounds the matmuls)."""
    model.embed.to(torch.bfloat16)
    model.table_dtype = torch.bfloat16
    model._rotary(model.cos.shape[1])
    return model
