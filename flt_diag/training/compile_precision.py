"""Cross-cutting concerns applied to a built model from outside: compilation, precision.

`compile_blocks` compiles the two residual halves of each block, not the whole model: the loop over K stays
in Python and every diagnostic hook runs outside the compiled region, so the diagnostics record the same
(loop, layer) values (DESIGN.md §3, "Compilation"). When to compile (`compile_wanted`, the `--compile`
default): always on CUDA; on a CPU for runs of at least COMPILE_MIN_STEPS_CPU steps and only with a C++
compiler (compiling costs seconds before the first step: benchmarks/README.md, "Compilation cost").
"""
from __future__ import annotations

import shutil
import sys

import torch

from flt_diag.model.transformer import LoopedTransformer


COMPILE_MIN_STEPS_CPU = 1000


def cpu_compiler_available() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def compile_wanted(option: bool | None, device_type: str, steps: int) -> bool:
    """`--compile` resolved: the user's choice, else on CUDA always, on a CPU for long runs only."""
    if option is not None:
        return option
    return device_type == "cuda" or (device_type == "cpu" and steps >= COMPILE_MIN_STEPS_CPU
                                      and cpu_compiler_available())


def compile_blocks(model: LoopedTransformer, **compile_kwargs) -> LoopedTransformer:
    """Compile both residual halves of every block (`attend`: norms, attention, residual add; `feed`:
    norm, MLP, residual add). Each block instance, query or none, and grad mode (training, evaluation)
    is one entry of its code object's cache, so a deep model needs more entries than dynamo's default
    allows; the limits are raised so that no block silently falls back to eager."""
    import torch._dynamo  # seconds of imports on top of torch's (benchmarks/README.md): only when compiling
    need = 8 * len(model.blocks) + 8
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), need))
    for block in model.blocks:  # (a Block's methods, compiled on the instance)
        block.attend = torch.compile(block.attend, **compile_kwargs)  # type: ignore[assignment, arg-type]
        block.feed = torch.compile(block.feed, **compile_kwargs)  # type: ignore[assignment, arg-type]
    return model


def drop_queued_compiles() -> None:
    """On an interrupt: cancel the kernel builds torch.compile has queued and not started. On a CPU with more
    than one compile thread, inductor builds each kernel (a C++ compiler run) on a thread pool while the step
    waits for them; Ctrl-C ends that wait at once, but at exit Python joins the pool's threads, which first run
    every queued build, one compiler run after another (49.5 s on a loaded machine, issue 67). Builds already
    running (one per compile thread) finish or die with Ctrl-C's signal to their process group. The pool is
    forgotten too, so that a later torch.compile in this process (a notebook) makes a new one. A torch whose
    inductor has no such pool: nothing to do."""
    async_compile = sys.modules.get("torch._inductor.async_compile")  # (never imported here: not compiling)
    made = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if made is None or not hasattr(made, "cache_info") or not made.cache_info().currsize:
        return
    made().shutdown(wait=False, cancel_futures=True)
    made.cache_clear()


def reference_precision(model: LoopedTransformer) -> LoopedTransformer:
    """Precision as the reference trains on GPU: bf16 embedding weights (so, under bf16 autocast,
    a bf16 residual stream and bf16 RMSNorm) and bf16 rotary tables used as bf16. flt-diag's
    default keeps fp32 weights and stream (autocast only rounds the matmuls)."""
    model.embed.to(torch.bfloat16)
    model.table_dtype = torch.bfloat16
    model._rotary(model.cos.shape[1])
    return model
