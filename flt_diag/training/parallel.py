"""Cross-cutting concerns applied to a built model from outside: compilation, precision.

`compile_blocks` compiles each block's attention and MLP forward, not the whole model: the loop
over K stays in Python (cheap calls at GPU scale), and module hooks - which run around `forward`,
outside the compiled region - keep firing once per (loop, layer) on the blocks, their attention and
their MLP, so diagnostics work unchanged under torch.compile. (Compiling the whole block would
put the attention/MLP output hooks inside the compiled region, where each one is a graph break.)
DDP is applied by the Trainer when launched with torchrun (WORLD_SIZE > 1).
"""
from __future__ import annotations

import torch

from flt_diag.model.transformer import LoopedTransformer


def compile_blocks(model: LoopedTransformer, **compile_kwargs) -> LoopedTransformer:
    for block in model.blocks:
        for part in (block.attn, block.mlp):
            part.forward = torch.compile(part.forward, **compile_kwargs)
    return model


def reference_precision(model: LoopedTransformer) -> LoopedTransformer:
    """Precision as the reference trains on GPU: bf16 embedding weights (so, under bf16 autocast,
    a bf16 residual stream and bf16 RMSNorm) and bf16 rotary tables used as bf16. flt-diag's
    default keeps fp32 weights and stream (autocast only rounds the matmuls)."""
    model.embed.to(torch.bfloat16)
    model.table_dtype = torch.bfloat16
    model._rotary(model.cos.shape[1])
    return model
