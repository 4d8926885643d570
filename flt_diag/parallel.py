"""Cross-cutting concerns applied to a built model from outside: compilation.

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
