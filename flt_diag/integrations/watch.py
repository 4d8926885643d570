"""flt_diag.watch: flt-diag's diagnostics, verdict and early warning on any looped nn.Module, trained by any
loop (docs/api.md has the usage, every option and the refusals).

The probe is a small stand-in for flt-diag's Trainer: the same instruments and online early warning, run by the
same Probe (integrations/probe.py), a metrics table and summary, so its run folder reads as any other. A step's moments: the
first training forward after the previous step arms the hooks on a recorded step (should_record);
`after_backward()` (optional: gradients before clipping, parameters before the optimizer step); `step()` (after
the optimizer step; without `after_backward()` the update ratio is taken against a copy of the parameters kept
at the end of the previous step). `callbacks=` get the Trainer's moments with the probe's stand-in trainer.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from flt_diag.instruments.callbacks import Callback
from flt_diag.instruments.loop_hooks import ProbeError
from flt_diag.integrations.loop_probe import Blocks, Head, LoopProbe, WatchOptions
from flt_diag.config.run_config import DiagnosticsConfig

__all__ = ["LoopProbe", "WatchOptions", "watch"]


def watch(model: nn.Module, blocks: Blocks = "auto", folder: str | os.PathLike[str] = "runs/probe", *,
          head: Head | None = None, loss: Callable[[Any], Any] | None = None,
          loop_boundary: nn.Module | Literal["manual"] | None = None, optimizer: torch.optim.Optimizer | None = None,
          scheduler: object | None = None, warmdown: float | None = None, grad_clip: float | None = None,
          diagnostics: DiagnosticsConfig | None = None, steps: int | None = None, variant: str | None = None,
          seed: int | None = None, vocab_size: int | None = None, grad_scale: float = 1.0, warn: bool = False,
          stop_on_collapse: bool = False, predictor_path: str | None = None, callbacks: list[Callback] | None = None,
          note: str | None = None, unigram_entropy: float | None = None, grad_hooks: bool = False,
          loop_step: Callable[[Tensor], Tensor] | None = None,
          targets: Callable[..., Tensor | None] | None = None) -> LoopProbe:
    """Attach flt-diag's diagnostics to a looped model; returns a LoopProbe (a context manager). The options:
    docs/api.md (blocks="auto": the outermost modules the first training forward calls more than once). Wrong
    use is one ProbeError line: BlocksNotFound, NotLooped, BlockCalledTwice."""
    return LoopProbe(**locals())


def started(probe: LoopProbe | None, callback: str) -> LoopProbe:
    """The probe a trainer's callback made when its training began (flt_diag.integrations.hf, lightning); a moment
    before that is one ProbeError line."""
    if probe is None:
        raise ProbeError(f"{callback}: a training moment came before the training began (no probe yet): add the "
                         "callback to the trainer before it trains")
    return probe
