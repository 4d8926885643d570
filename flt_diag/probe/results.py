"""What the probe hands out, typed, beside the run's summary (flt_diag.storage.file_models.Summary): the early
warning's latest check (EarlyWarning). Both are read-only mappings as well - `probe.summary["verdict"]`,
`probe.warning()["p_collapse"]`, `dict(probe.summary)` - the documented compatibility path for scripts written
against the dicts of before."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class EarlyWarning(Mapping[str, Any]):
    """The early warning's check at `step` (steps done): P(collapse), the threshold it is held against, and the
    evidence (the features that weigh most, or the non-finite loss)."""

    step: int
    p_collapse: float
    threshold: float
    evidence: str

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)
