"""A record of moment loop_map (schedule every_n, flt_diag/records/__init__.py), defined here and registered with
flt_diag.register_record the way a user's own is, is taken by flt-diag's Trainer every N steps of its switch whether
the step is recorded or not, and at the extra step a decided stop asks for (flt_diag/training/decided_stop.py): the
steps it was taken at against those written out by hand."""
import pytest

import flt_diag.records as records
from conftest import tiny_config
from flt_diag.config.run_config import with_overrides
from flt_diag.records import Record, RecordOptions
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics, series
from flt_diag.training.trainer import train
from test_decided_stop import VERDICT, first_certain_climb

STEP, BATCH = "toy_snapshot_step", "toy_snapshot_batch"


def compute(ctx) -> dict:
    """The step it is taken at, and the sequences of the step's loop map (its first dynamics_batch)."""
    assert ctx.loop_map is not None
    return {STEP: ctx.step, BATCH: ctx.idx.shape[0]}


TOY = Record(options=RecordOptions, switched_by="dynamics_every", moment="loop_map", schedule="every_n",
             context=True, compute=compute, metrics={STEP: "the step", BATCH: "the loop map's sequences"})

CHEAP = dict(dynamics_batch=2, dynamics_iters=1, krylov_dim=2, perturbation_dirs=1)  # (the loop map's, every N)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(records, "_REGISTERED", [])
    records.all_records.cache_clear()
    records.register_record(TOY)
    yield
    monkeypatch.undo()
    records.all_records.cache_clear()


def taken(folder) -> dict[int, float]:
    df = load_metrics(folder)
    return {int(r.step): float(r.value) for r in df[df.metric == STEP].itertuples()}


def test_a_loop_map_record_is_taken_every_n_steps_recorded_or_not(tmp_path, toy):
    cfg = tiny_config(loops=2, steps=7, diagnostics=dict(dense_steps=0, record_every=3, dynamics_every=2, **CHEAP))
    train(cfg, tmp_path / "run")
    df = load_metrics(tmp_path / "run")
    assert sorted(set(df[df.metric == M.RESID_NORM].step)) == [0, 3, 6]  # the recorded steps: 0, then every 3
    assert taken(tmp_path / "run") == {0: 0.0, 2: 2.0, 4: 4.0, 6: 6.0}  # every 2, recorded (0, 6) or not (2, 4)
    assert set(df[df.metric == BATCH].value) == {2.0}
    assert sorted(set(df[df.metric == M.LOOP_GAIN].step)) == [0, 2, 4, 6]  # (the loop map's own, on the same steps)


def test_a_loop_map_record_is_taken_at_the_step_a_decided_stop_asks_for(tmp_path, toy):
    cfg = tiny_config(variant="flt", loops=2, steps=40, diagnostics=dict(dynamics_every=1000, **CHEAP))
    cfg = with_overrides(cfg, verdict=VERDICT, diagnostics=dict(stop_when_decided=["training"]))
    summary = train(cfg, tmp_path / "run")
    decided = first_certain_climb(series(load_metrics(tmp_path / "run"), M.LOSS).to_numpy(), 5, 0.01)
    assert decided is not None and 0 < decided and summary.decided_at == decided
    assert taken(tmp_path / "run") == {0: 0.0, decided + 1: float(decided + 1)}  # step 0 (of 1000), and the stop's


@pytest.mark.parametrize("moment, schedule, context", [("loop_map", "recorded", True), ("after_step", "every_n", True),
                                                       ("loop_map", "every_n", False), ("loop_map", "every 2", True)])
def test_the_every_n_schedule_is_the_loop_map_moments_and_only_its(moment, schedule, context):
    with pytest.raises(ValueError, match="loop_map"):
        Record(options=RecordOptions, switched_by="dynamics_every", moment=moment, schedule=schedule,
               context=context, compute=compute, metrics={STEP: "the step"})
