"""What the probe hands out, typed, beside the run's summary (flt_diag.storage.file_models.Summary): the early
warning's latest check (EarlyWarning). Both are FileModels, read-only mappings as well - `probe.summary["verdict"]`,
`probe.warning()["p_collapse"]`, `dict(probe.summary)` - the documented compatibility path for scripts written
against the dicts of before."""
from __future__ import annotations

from flt_diag.storage.file_models import FileModel


class EarlyWarning(FileModel, allow_inf_nan=True):
    """The early warning's check at `step` (steps done): P(collapse), the threshold it is held against, and the
    evidence (the features that weigh most, or the non-finite loss)."""

    step: int
    p_collapse: float
    threshold: float
    evidence: str
