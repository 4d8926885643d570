"""flt-diag: diagnose looped-transformer training instability.

The public API (docs/api.md), imported on first use so that `import flt_diag` and the torch-free layers
stay torch-free: `flt_diag.watch(model, blocks=..., folder=...)` returns a `LoopProbe`; its one-line
errors are `ProbeError` (a ValueError) and its kinds `BlocksNotFound`, `NotLooped`, `BlockCalledTwice`.
"""
from __future__ import annotations

import importlib

_PUBLIC = {"watch": "flt_diag.probe.watch", "LoopProbe": "flt_diag.probe.watch",
           "ProbeError": "flt_diag.instruments.diagnostics", "BlocksNotFound": "flt_diag.instruments.diagnostics",
           "NotLooped": "flt_diag.instruments.diagnostics", "BlockCalledTwice": "flt_diag.instruments.diagnostics"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flt_diag' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
