"""A toy record at the loop's end with a state, in one file outside the package (tests/test_loop_end_records.py
registers it): ||h(t) - h(t-1)||, the Frobenius norm of one loop's change of the loop-end state, loop t >= 2
(`--toy-change`). Its state keeps the previous loop's h; loop 1 starts a forward and has none."""
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from flt_diag.records import Record, RecordOptions

CHANGE = "toy_stream_change"


class ChangeOptions(RecordOptions):
    toy_change: bool = Field(False, description="Toy: ||h(t) - h(t-1)|| at every loop end t >= 2.")


@dataclass
class Previous:
    h: Any = None


def compute(loop, h, state: Previous) -> dict:
    prev, state.h = (state.h if loop > 1 else None), h.double().clone()
    return {} if prev is None else {CHANGE: (state.h - prev).norm()}


RECORD = Record(options=ChangeOptions, metrics={CHANGE: "||h(t) - h(t-1)|| of the loop-end state, loop t >= 2"},
                moment="loop_end", compute=compute, state=Previous)
