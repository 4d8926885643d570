"""The public probe: flt-diag's diagnostics, verdict and early warning on any looped nn.Module, trained
by any loop (docs/api.md).

    with flt_diag.watch(model, blocks="auto", folder="runs/mine") as probe:
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            probe.step(loss=loss)          # after each optimizer step
            optimizer.zero_grad()
    print(probe.summary["verdict"])

The probe is a small stand-in for flt-diag's Trainer: the same instruments (flt_diag.instruments.dynamics_callback.
instruments: the diagnostics, their LoopHooks on the given blocks, and the loop dynamics), the same metrics table
(MetricsWriter), the same online early warning (CollapseWarning) and the same summary (judge.verdict.summarize), so
the run folder it writes is read by `flt-diag summary`, `plot`, `report`, `predict` and `summary --recompute` as
any other.

Moments of one step: the first training forward (grad enabled, module in training mode) after the
previous step arms the hooks on a recorded step (should_record); `after_backward()` (optional: gradients
before clipping, parameters before the optimizer step) and `step()` (after the optimizer step: clipped
gradients if they are still there, update ratios, the loss; then the rows). Without `after_backward()`,
`step()` reads the gradients it finds and takes the update ratio against a copy of the parameters kept
at the end of the previous step.

Further records plug in as training callbacks (`callbacks=`): they get the Trainer's moments with this probe's
stand-in trainer (`.model`, `.log`, `.cfg`, `.run_dir`), and `probe.hooks` (LoopHooks) offers `listeners`,
`on_loop_end` and `on_forward_end`.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal, TypedDict

import torch
from torch import Tensor, nn

from flt_diag.instruments.callbacks import Callback
from flt_diag.probe.loop_probe import Blocks, Head, LoopProbe
from flt_diag.config.run_config import DiagnosticsConfig

__all__ = ["LoopProbe", "WatchOptions", "watch"]


class WatchOptions(TypedDict, total=False):
    """watch()'s keyword options, for the callbacks that pass them on (**options: Unpack[WatchOptions])."""

    head: Head | None
    loss: Callable[[Any], Any] | None
    loop_boundary: nn.Module | Literal["manual"] | None
    optimizer: torch.optim.Optimizer | None
    scheduler: object | None
    warmdown: float | None
    grad_clip: float | None
    diagnostics: DiagnosticsConfig | None
    steps: int | None
    variant: str | None
    seed: int
    vocab_size: int | None
    grad_scale: float
    warn: bool
    stop_on_collapse: bool
    predictor_path: str | None
    callbacks: list[Callback] | None
    note: str | None
    unigram_entropy: float | None
    grad_hooks: bool
    loop_step: Callable[[Tensor], Tensor] | None
    targets: Callable[..., Tensor | None] | None


def watch(model: nn.Module, blocks: Blocks = "auto", folder: str | os.PathLike[str] = "runs/probe", *,
          head: Head | None = None, loss: Callable[[Any], Any] | None = None,
          loop_boundary: nn.Module | Literal["manual"] | None = None, optimizer: torch.optim.Optimizer | None = None,
          scheduler: object | None = None, warmdown: float | None = None, grad_clip: float | None = None,
          diagnostics: DiagnosticsConfig | None = None, steps: int | None = None, variant: str | None = None,
          seed: int = 0, vocab_size: int | None = None, grad_scale: float = 1.0, warn: bool = False,
          stop_on_collapse: bool = False, predictor_path: str | None = None, callbacks: list[Callback] | None = None,
          note: str | None = None, unigram_entropy: float | None = None, grad_hooks: bool = False,
          loop_step: Callable[[Tensor], Tensor] | None = None,
          targets: Callable[..., Tensor | None] | None = None) -> LoopProbe:
    """Attach flt-diag's diagnostics to a looped model; returns a LoopProbe (a context manager). Every option is
    described in docs/api.md: blocks (modules, a ModuleList, a module-path pattern, or "auto": the outermost
    modules the first training forward calls more than once, found by one extra no-grad forward), loops counted
    from the blocks' calls or at loop_boundary=, the recipe as the user ran it (optimizer, scheduler, steps,
    grad_clip, warmdown, variant: stored in config.json's probe.recipe; no warm-down unless given), the loop
    dynamics (head, targets, loop_step). Wrong use is one ProbeError line: BlocksNotFound, NotLooped,
    BlockCalledTwice."""
    return LoopProbe(**locals())
