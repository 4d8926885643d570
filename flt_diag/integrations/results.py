"""What the probe hands out, typed, beside the run's summary (flt_diag.storage.file_models.Summary): the early
warning's latest check (EarlyWarning). Both are read-only FileModels: read their attributes (`probe.summary.verdict`,
`probe.warning().p_collapse`); `model_dump()` gives a dict."""
from __future__ import annotations

from pydantic import ConfigDict

from flt_diag.storage.file_models import FileModel


class EarlyWarning(FileModel, allow_inf_nan=True):
    """The early warning's check at `step` (steps done): P(collapse), the threshold it is held against, and the
    evidence (the features that weigh most, or the non-finite loss)."""

    model_config = ConfigDict(frozen=True)

    step: int
    p_collapse: float
    threshold: float
    evidence: str
