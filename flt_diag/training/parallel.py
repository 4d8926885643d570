"""Cross-cutting concerns applied to a built model from outside: compilation, precision.

`compile_blocks` compiles each block's attention and MLP forward, not the whole model: the loop
over K stays in Python (cheap calls at GPU scale), and module hooks - which run around `forward`,
outside the compiled region - keep firing once per (loop, layer) on the blocks, their attention and
their MLP, so diagnostics work unchanged under torch.compile. (Compiling the whole block would
put the attention/MLP output hooks inside the compiled region, where each one is a graph break.)
DDP is applied by the Trainer when launched with torchrun (WORLD_SIZE > 1).

When to compile (`compile_wanted`, the `--compile` default): always on CUDA; on a CPU only for runs
of at least COMPILE_MIN_STEPS_CPU steps, because compiling costs seconds before the first step and
saves milliseconds on each (measured on the tiny preset, one thread, 2-core Intel Xeon with
AVX-512, peak 163 GFLOP/s: 4-10 s of compilation - warm or cold inductor cache - against 15-20 % of
a step: 85 -> 71 ms at K=3, 194 -> 161 ms at K=12; it pays after ~100-700 steps). A CPU without a
C++ compiler (inductor's CPU backend needs one) trains eagerly.
"""
from __future__ import annotations

import shutil

import torch

from flt_diag.model.transformer import LoopedTransformer


COMPILE_MIN_STEPS_CPU = 1000


def cpu_compiler_available() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def compile_wanted(option: bool | None, device_type: str, steps: int) -> bool:
    """`--compile` resolved: the user's choice, else on CUDA always, on a CPU for long runs only."""
    if option is not None:
        return option
    if device_type == "cuda":
        return True
    return device_type == "cpu" and steps >= COMPILE_MIN_STEPS_CPU and cpu_compiler_available()


def compile_blocks(model: LoopedTransformer, **compile_kwargs) -> LoopedTransformer:
    """Compile every block's attention and MLP forward. Each module instance (and grad mode: training
    and evaluation) is one entry of its code object's cache, so a deep model needs more entries than
    dynamo's default allows; the limits are raised so that no block silently falls back to eager."""
    import torch._dynamo  # 2.2 s of imports (-X importtime) on top of torch's: only when compiling
    need = 4 * len(model.blocks) + 8
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), need))
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
