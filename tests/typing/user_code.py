"""Typed user code against the public API (tests/test_typing.py): a type checker finds no error in it."""
from __future__ import annotations

import torch
import torch.nn as nn

import flt_diag
from flt_diag.integrations.hf import FltDiagCallback
from flt_diag.integrations.lightning import FltDiagCallback as LightningCallback


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> str:
    probe: flt_diag.LoopProbe = flt_diag.watch(model, blocks="layers.*", folder="runs/x", optimizer=opt,
                                               warmdown=0.2, grad_clip=1.0, variant=None, steps=len(batches))
    with probe:
        for x in batches:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            rows = probe.step(loss=loss)
            first: float = rows[0].value
            w = probe.warning()
            if w is not None:
                p: float = w.p_collapse - w.threshold
    s = probe.summary
    assert s is not None
    verdict: str = s.verdict
    FltDiagCallback(blocks="model.layers.*", folder="runs/hf", warn=True, head=model)
    LightningCallback(folder="runs/pl", steps=10)
    return verdict + str(s.steps_done)
