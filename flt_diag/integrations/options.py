"""What watch() takes, typed once (docs/api.md has every option): the blocks, the head and watch()'s keyword
options (WatchOptions, for the callbacks that pass them on: **options: Unpack[WatchOptions])."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict, Union

import torch
from torch import Tensor, nn

from flt_diag.instruments.callbacks import Callback
from flt_diag.config.run_config import DiagnosticsConfig

Blocks = Union[str, nn.Module, Sequence[nn.Module]]  # "auto", a module-path pattern, the modules, one module
Head = Union[nn.Module, Callable[[Tensor], Tensor]]


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
    seed: int | None
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
