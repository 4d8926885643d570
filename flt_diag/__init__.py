"""flt-diag: diagnose looped-transformer training instability.

The public API (docs/api.md), imported on first use so that `import flt_diag` and the torch-free layers
stay torch-free: `flt_diag.watch(model, blocks=..., folder=...)` returns a `LoopProbe`; its one-line
errors are `ProbeError` (a ValueError) and its kinds `BlocksNotFound`, `NotLooped`, `BlockCalledTwice`; what it
hands out: `Summary`, `EarlyWarning` (typed, read-only models: read their attributes). A researcher's own stabiliser
joins by `flt_diag.register_stabiliser(flt_diag.Stabiliser(...))`, a record of their own by `register_record(RECORD)`,
a `Record` of `RecordOptions` (docs/extending.md). Type checkers read the names below.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flt_diag.instruments.loop_hooks import BlockCalledTwice, BlocksNotFound, NotLooped, ProbeError
    from flt_diag.config.variants import register_stabiliser
    from flt_diag.integrations.results import EarlyWarning
    from flt_diag.model.stabilisers import Stabiliser
    from flt_diag.records import Record, RecordOptions, register_record
    from flt_diag.storage.file_models import Summary
    from flt_diag.integrations.watch import LoopProbe, watch

_PUBLIC = {"watch": "flt_diag.integrations.watch", "LoopProbe": "flt_diag.integrations.watch",
           "Summary": "flt_diag.storage.file_models", "register_stabiliser": "flt_diag.config.variants",
           "Stabiliser": "flt_diag.model.stabilisers", "EarlyWarning": "flt_diag.integrations.results", **dict.fromkeys(
               ("ProbeError", "BlocksNotFound", "NotLooped", "BlockCalledTwice"), "flt_diag.instruments.loop_hooks"),
           **dict.fromkeys(("Record", "RecordOptions", "register_record"), "flt_diag.records")}
__all__ = ["BlockCalledTwice", "BlocksNotFound", "EarlyWarning", "LoopProbe", "NotLooped", "ProbeError", "Record",
           "RecordOptions", "Stabiliser", "Summary", "register_record", "register_stabiliser", "watch"]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flt_diag' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
