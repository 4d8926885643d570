"""What the probe hands out, typed: the early warning's latest check (EarlyWarning) and the run's summary
(Summary). Both are read-only mappings as well - `probe.summary["verdict"]`, `probe.warning()["p_collapse"]`,
`dict(probe.summary)` - the documented compatibility path for scripts written against the dicts of before."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
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


class Summary(Mapping[str, Any]):
    """summary.json of a probe's run (flt_diag.judge.verdict.summarize; docs/api.md lists its keys): the
    figures read most as typed attributes, every key by mapping access."""

    def __init__(self, data: Mapping[str, Any]):
        self._data = MappingProxyType(dict(data))

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def verdict(self) -> str:
        return str(self._data["verdict"])

    @property
    def evidence(self) -> Mapping[str, Any]:
        return MappingProxyType(self._data["evidence"])

    @property
    def final_loss(self) -> float:
        return float(self._data["final_loss"])

    @property
    def steps_done(self) -> int:
        return int(self._data["steps_done"])
