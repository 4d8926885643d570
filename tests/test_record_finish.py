"""A record's values taken together at the forward's end (Record.finish), a metric a record cannot take skipped
alone, and the records' own checks of finish= and switched_by= (flt_diag.records; the loop dynamics' record files
records/fixed_point_residual.py and token_similarity.py stand on them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flt_diag.instruments.guard import Records
from flt_diag.instruments.record_checks import take_finish, take_record
from flt_diag.records import Record, RecordOptions, Unrecordable
from flt_diag.records import fixed_point_residual as R
from flt_diag.records import token_similarity as S


class Log:
    def __init__(self):
        self.rows = []

    def __call__(self, metric, value, loop, layer):
        self.rows.append((metric, float(value), loop, layer))


def record(**fields) -> Record:
    return Record(**{"options": RecordOptions, "switched_by": "loop_dynamics", "metrics": {"a": "a", "b": "b"},
                     "moment": "loop_end", **fields})


def test_a_metric_that_fails_is_skipped_alone_and_the_others_are_logged():
    guard, log = Records(), Log()
    rec = record(compute=lambda loop, h: {"a": 2.5, "b": RuntimeError("no b here\nmore")})
    guard.take(("a", "b"), take_record, rec, log, (3, None), {}, 3)
    assert log.rows == [("a", 2.5, 3, -1)]
    assert list(guard.not_recorded) == ["b"] and guard.not_recorded["b"] == "RuntimeError: no b here"


def test_finish_logs_each_metric_at_each_loop_it_names():
    log = Log()
    rec = record(compute=lambda loop, h, state: {}, state=list,
                 finish=lambda loops, state: {"a": {2: 0.5, 3: 0.25}, "b": {3: torch.tensor(4.0)}})
    states: dict = {rec: []}
    take_finish(rec, log, 3, states)
    assert sorted(log.rows) == [("a", 0.25, 3, -1), ("a", 0.5, 2, -1), ("b", 4.0, 3, -1)]
    take_finish(rec, log, 3, {})  # (no loop end kept a state: nothing taken)
    assert len(log.rows) == 3


def test_finish_is_for_a_loop_end_record_with_a_state():
    with pytest.raises(ValueError, match="finish is for a record of moment loop_end that keeps a state"):
        record(compute=dict, moment="after_step", state=list, finish=dict)
    with pytest.raises(ValueError, match="finish is for a record of moment loop_end that keeps a state"):
        record(compute=dict, finish=dict)
    with pytest.raises(ValueError, match="needs options \\(or switched_by\\)"):
        record(compute=dict, switched_by=None)


def test_the_residual_against_the_streams_by_hand_across_a_change_of_shape():
    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(2, 5, 4, generator=g) for _ in range(3)] + [torch.randn(2, 4, 4, generator=g) for _ in range(2)]
    state, said = R.Loops(), []
    for t, h in enumerate(hs, 1):
        try:
            assert R.compute(t, h, state) == {}
        except Unrecordable as e:
            said.append((t, str(e)))
    got = {t: float(v) for t, v in R.finish(5, state)[R.RESIDUAL].items()}
    assert said == [(4, "the loop-end stream changed shape ((2, 5, 4) -> (2, 4, 4)): no fixed_point_residual there")]
    assert sorted(got) == [2, 3, 5]
    for t in got:
        a, b = hs[t - 1].double().numpy(), hs[t - 2].double().numpy()
        assert got[t] == pytest.approx((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).mean(), rel=1e-6)
    assert R.finish(5, state) == {}  # (taken once)


def test_a_non_finite_stream_keeps_its_token_cosine_and_loses_its_effective_rank():
    h = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(1))
    h[1, 2, 0] = float("nan")
    got = S.similarity([1, 2, 3], h)
    assert isinstance(got[S.EFFECTIVE_RANK], Unrecordable) and "not finite" in str(got[S.EFFECTIVE_RANK])
    for loop in (1, 3):  # (sequence 2 is the NaN one: loops 1 and 3 are finite, sequence for sequence)
        u = h[loop - 1].double().numpy()
        u = u / np.linalg.norm(u, axis=-1, keepdims=True)
        assert float(got[S.TOKEN_COSINE][loop]) == pytest.approx((u @ u.T)[~np.eye(6, dtype=bool)].mean(), rel=1e-5)
