"""Records in one file each: every module of this package (its folder, or any folder on its `__path__`) holds one
diagnostic record, `RECORD`, with everything about it: its options (fields of DiagnosticsConfig, declared with
`opt`: default and help beside them), its metric names with a one-line definition each, its schedule, the moment
it is taken at, and its computation. DiagnosticsConfig's record options (flt_diag.config.run_config) and the
recorded metric names (flt_diag.storage.metric_names.RECORDED) are assembled from `all_records()`; the
diagnostics take each record that is switched on at its moment, for flt-diag's Trainer and flt_diag.watch alike
(flt_diag.instruments.diagnostics, through the run's record guard: one that fails is said once and skipped).

The schedule is the record's first option, its switch: a bool (on: every recorded step, `dense_steps` then
`every`), or an int N (every recorded step that is a multiple of N; 0 = never). Torch-free: a record computes
through the tensors it is handed (the diagnostics run it under no_grad), so config/ and storage/ read its
declaration without torch (docs/DESIGN.md §7, "A record is one file").
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

MOMENTS = {  # when a record is taken, what its compute is given; it returns {metric: 0-d tensor or float}
    "after_block": "after each block's forward in a recorded forward: compute(block, args, output), at (loop, layer)",
    "after_backward": "the gradients ready, before clipping: compute(model), at no loop and no layer",
    "after_clip": "the gradients clipped: compute(model), at no loop and no layer",
    "after_step": "the optimizer stepped: compute(model), at no loop and no layer",
}


@dataclass(frozen=True, eq=False)
class Record:
    """One record: `options` field name -> (type, opt(...)), the first its switch; `metrics` name -> definition;
    `moment` one of MOMENTS; `compute` as its moment says."""

    options: dict[str, tuple[Any, Any]]
    metrics: dict[str, str]
    moment: str
    compute: Callable[..., dict]

    def __post_init__(self) -> None:
        if self.moment not in MOMENTS or not self.options or not self.metrics:
            raise ValueError(f"a record needs options, metrics and one of the moments {', '.join(MOMENTS)} "
                             f"(got {self.moment!r})")
        if self.options[self.switch][0] not in (bool, int):
            raise ValueError(f"a record's first option ({self.switch}) is its switch: a bool or an int")

    @property
    def switch(self) -> str:
        return next(iter(self.options))

    def due(self, cfg, step: int) -> bool:
        """Whether a recorded `step` takes it under DiagnosticsConfig `cfg` (the module docstring's schedule)."""
        on = getattr(cfg, self.switch)
        return on if isinstance(on, bool) else on > 0 and step % on == 0


@functools.cache
def all_records() -> tuple[Record, ...]:
    """The RECORD of every module of this package, by module name (two that name one option or metric: ValueError)."""
    records = tuple(importlib.import_module(f"{__name__}.{m.name}").RECORD
                    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name))
    for kind in ("options", "metrics"):
        names = [n for r in records for n in getattr(r, kind)]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"two records name the {kind[:-1]} {', '.join(twice)}")
    return records
