"""The Trainer's stop once decided (--stop-when-decided; flt_diag/training/decided_stop.py), on tiny CPU runs: a run
whose climb rule is certain at a step worked out from an identical run's losses (a trailing mean written out here)
stops there with the same records; the loop-dynamics snapshot is taken at the stop; a stable run runs to its end."""
import numpy as np

from conftest import tiny_config
from flt_diag.config.run_config import with_overrides
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics, load_summary, series
from flt_diag.training.trainer import train

STEPS = 40
VERDICT = dict(smooth_window=5, rebound_abs=0.01, rebound_rel=0.0)  # a rise of 0.01 nats decides `training`


def config(stop, dynamics_every=0, **verdict):
    cfg = tiny_config(variant="flt", loops=2, steps=STEPS, diagnostics=dict(dynamics_every=dynamics_every))
    return with_overrides(cfg, verdict=verdict or VERDICT, diagnostics=dict(stop_when_decided=stop))


def first_certain_climb(loss: np.ndarray, window: int, threshold: float) -> int | None:
    """By hand: s_t = (loss_{t-w+1} + ... + loss_t) / w from t = w - 1; m_t = min of s up to t; decided at the first t
    where max over u <= t of (s_u - m_u) exceeds the threshold (here a constant: rebound_rel is 0)."""
    c = np.concatenate([[0.0], np.cumsum(loss)])
    best_rise, low = -np.inf, np.inf
    for t in range(window - 1, len(loss)):
        s = (c[t + 1] - c[t + 1 - window]) / window
        low = min(low, s)
        best_rise = max(best_rise, s - low)
        if best_rise > threshold:
            return t
    return None


def test_a_run_certain_at_a_known_step_stops_there_with_the_same_records(tmp_path):
    full = train(config(None), tmp_path / "full")
    loss = series(load_metrics(tmp_path / "full"), M.LOSS).to_numpy()
    expected = first_certain_climb(loss, 5, 0.01)
    assert full.steps_done == STEPS and full.decided_at is None and expected is not None and expected < STEPS - 5
    stopped = train(config(["training"]), tmp_path / "stopped")
    assert stopped.decided_at == expected and stopped.steps_done == expected + 1  # (no snapshots in this run)
    assert stopped.stop_reason.startswith(f"decided at step {expected}: training")
    assert stopped.verdict != "stable" and full.verdict != "stable"
    cut = series(load_metrics(tmp_path / "stopped"), M.LOSS).to_numpy()
    assert np.array_equal(cut, loss[:expected + 1])  # the same run, cut at the decided step
    assert load_summary(tmp_path / "stopped").decided_at == expected  # (summary.json says it)
    assert np.isfinite(stopped.val_loss)  # evaluated at the stop, as at a run's end


def test_the_summary_recomputed_keeps_where_the_run_was_decided(tmp_path):
    from flt_diag.judge.verdict import resummarize
    s = train(config(["training"]), tmp_path / "r")
    assert s.decided_at is not None and resummarize(tmp_path / "r").decided_at == s.decided_at


def test_the_loop_dynamics_snapshot_is_taken_at_the_stop(tmp_path):
    s = train(config(["training"], dynamics_every=1000), tmp_path / "snap")  # snapshots at step 0 only, but ...
    assert s.decided_at is not None and s.decided_at > 0
    assert s.steps_done == s.decided_at + 2  # ... one more step, whose snapshot was asked for
    radius = load_metrics(tmp_path / "snap")
    steps = set(radius[radius.metric == M.LOOP_SPECTRAL_RADIUS].step)
    assert steps == {0, s.decided_at + 1}


def test_a_stable_run_runs_to_its_end(tmp_path):
    cfg = tiny_config(variant="flt", loops=2, steps=60, diagnostics=dict(dynamics_every=0))
    s = train(with_overrides(cfg, diagnostics=dict(stop_when_decided=["training", "explosion"])), tmp_path / "s")
    assert s.verdict == "stable" and s.steps_done == 60 and s.decided_at is None and s.stop_reason is None
