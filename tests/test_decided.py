"""When a criterion's outcome is certain (flt_diag.judge.decided): on records written out by hand (the step worked out
in each test's comment), and replayed on every archived probe of the stabiliser benchmark: the `training` outcome of
the records cut at the decided step is that of all the records."""
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flt_diag.config.run_config import VerdictConfig
from flt_diag.judge.decided import decided_at
from flt_diag.judge.verdict import Recipe, judged
from flt_diag.storage import metric_names as M

ARCHIVE = Path(__file__).resolve().parents[1] / "docs" / "data" / "runs" / "stabiliser-map"


def recipe(steps=1000, width=64, **verdict) -> Recipe:
    return Recipe(steps=steps, loops=2, width=width, depth=2, dense_steps=steps, warmdown_frac=0.2,
                  verdict=VerdictConfig(**verdict))


def records(loss, grad=None, extra=()) -> pd.DataFrame:
    """A metrics table: loss (and a gradient norm, 1.0 where not given) at steps 0.., and extra rows."""
    grad = [1.0] * len(loss) if grad is None else grad
    rows = [(s, M.LOSS, -1, -1, float(v)) for s, v in enumerate(loss)]
    rows += [(s, M.GRAD_NORM, -1, -1, float(v)) for s, v in enumerate(grad)]
    return pd.DataFrame(rows + list(extra), columns=["step", "metric", "loop", "layer", "value"])


def step_of(df, r, criteria=("training",)):
    d = decided_at(df, r, criteria)
    return None if d is None else d.step


def test_a_climb_past_the_threshold_is_decided_at_the_step_it_passes():
    # window 3: s = 3, 2.667, 2.333, 2.0, 2.167, 2.333, 2.5 at steps 2..8; running minimum 2.0 from step 5;
    # threshold max(0.25, 0.1 * 2.0) = 0.25; rise 0.167 at step 6, 0.333 at step 7: decided at step 7
    loss = [3, 3, 3, 2, 2, 2, 2.5, 2.5, 2.5, 2, 2, 2]
    r = recipe(smooth_window=3)
    df = records(loss)
    assert step_of(df, r) == 7
    assert step_of(df[df.step <= 6], r) is None and step_of(df[df.step <= 7], r) == 7
    assert judged(df, r, None)[0] != "stable"  # recovered at the end: unstable, never stable


def test_an_earlier_rise_counts_once_the_running_minimum_lowers_the_threshold():
    # window 1 (s = loss), rebound_abs 0: threshold 0.1 * running minimum. Step 1 rises 0.3 above 4.0 (threshold
    # 0.4: open); step 3 sets the minimum to 2.9, threshold 0.29 < 0.3, the rise of step 1: decided at step 3
    loss = [4.0, 4.3, 4.0, 2.9, 2.8, 2.7]
    r = recipe(smooth_window=1, rebound_abs=0.0, rebound_rel=0.1)
    df = records(loss)
    assert step_of(df[df.step <= 2], r) is None and step_of(df, r) == 3
    assert judged(df, r, None)[0] != "stable"


def test_no_decision_before_a_full_smoothing_window():
    loss = [1.0, 9.0, 9.0]  # a huge rise, but the verdict smooths 3 values over what it has: nothing certain yet
    assert step_of(records(loss), recipe(smooth_window=4)) is None


def test_a_closed_oscillation_window_that_fires_is_decided_at_its_last_difference():
    # g alternates 1, 2, 1, 2: |dlog g| = log 2 = 0.693 > log 1.5 in every window; the window [0, 200) holds its
    # last difference (199, 200) once step 200 is recorded; the loss descends (no climb): decided at step 200
    n = 260
    loss = np.linspace(3.0, 2.0, n)
    grad = [1.0 if s % 2 == 0 else 2.0 for s in range(n)]
    df, r = records(loss, grad), recipe(steps=1000)
    assert step_of(df[df.step <= 199], r) is None and step_of(df, r) == 200


def test_the_oscillation_window_is_cut_at_the_warm_down():
    # steps 300, warm-down 0.2: span end 240; the window [200, 400) holds differences t = 200..238 and closes
    # once step 239 = span_end - 1 is recorded; the first window [0, 200) is quiet
    n = 300
    grad = [1.0] * 200 + [1.0 if s % 2 == 0 else 2.0 for s in range(200, n)]
    df, r = records(np.linspace(3.0, 2.0, n), grad), recipe(steps=300)
    assert step_of(df[df.step <= 238], r) is None and step_of(df, r) == 239


def test_explosion_is_decided_at_the_first_residual_norm_above_the_threshold():
    # threshold 100 * sqrt(64) = 800; a norm of 801 at step 37 (loop 2, layer 1); 700 earlier does not count
    loss = np.linspace(3.0, 2.0, 60)
    extra = [(10, M.RESID_NORM, 1, 1, 700.0), (37, M.RESID_NORM, 2, 1, 801.0), (40, M.RESID_NORM_LOOP_END, 2, -1, 9e3)]
    df, r = records(loss, extra=extra), recipe(steps=60)
    assert step_of(df, r, ["explosion"]) == 37
    assert step_of(df, r, ["training", "explosion"]) is None  # training stays open: both are needed


def test_a_non_finite_loss_decides_every_criterion():
    loss = [3.0] * 12 + [math.nan]
    df = records(loss)
    for criteria in (["training"], ["collapse"], ["explosion"], ["training", "collapse", "explosion"]):
        assert step_of(df, recipe(), criteria) == 12


def test_collapse_is_never_decided_by_a_climb():
    loss = [3, 3, 3, 2, 2, 2, 2.5, 2.5, 2.5]  # decided for training (first test), not for collapse: it can recover
    assert step_of(records(loss), recipe(smooth_window=3), ["collapse"]) is None


def test_a_clean_descent_is_never_decided():
    rng = np.random.default_rng(0)
    n = 700
    loss = 3.0 * np.exp(-np.arange(n) / 300) + 1.0 + 0.01 * rng.standard_normal(n)
    grad = np.exp(0.05 * rng.standard_normal(n))
    df, r = records(loss, grad), recipe(steps=n)
    assert judged(df, r, 3.25)[0] == "stable"
    assert all(step_of(df[df.step <= s], r) is None for s in range(0, n, 25))


@pytest.mark.parametrize("seed", range(8))
def test_the_cut_records_keep_the_training_outcome_of_a_random_run(seed):
    """A random walk of loss and gradient norm: wherever it is decided, the records cut there are not stable and
    neither are all of them (verdict.judged, the verdict's own code), and no earlier cut is decided."""
    rng = np.random.default_rng(seed)
    n = 400
    loss = 3.0 + np.cumsum(0.05 * rng.standard_normal(n))
    grad = np.exp(np.cumsum(0.3 * rng.standard_normal(n)) * 0.1 + rng.choice([0, 0.8], n))
    df, r = records(np.abs(loss), grad), recipe(steps=n, smooth_window=20)
    d = step_of(df, r)
    assert d is not None  # (each of these walks climbs or oscillates somewhere)
    assert judged(df, r, 3.25)[0] != "stable" and judged(df[df.step <= d], r, 3.25)[0] != "stable"
    assert step_of(df[df.step <= d - 1], r) is None


def archived_probes():
    return sorted(ARCHIVE.glob("*.parquet"))


def replayed(path):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
    from replay_early_stop import probe_replay
    return probe_replay(path, ["training"])


def test_the_stop_keeps_the_training_outcome_of_every_archived_probe():
    """Every probe of the stabiliser benchmark (about 6 s on two cores: not marked slow)."""
    paths = archived_probes()
    assert len(paths) == 312
    decided = 0
    for path in paths:
        decided += _check(path)
    assert decided > 100  # (109: the replay's count, docs/results.md)


def _check(path):
    from flt_diag.storage.folders import load_summary
    r = replayed(path)
    stored = load_summary(path).verdict
    assert (r["full"] == "stable") == (stored == "stable"), path.name  # the records judge as the summary says
    if r["decided"] is None:
        assert r["ran"] == r["steps"]
    else:
        assert r["cut"] != "stable" and stored != "stable", path.name
        assert r["ran"] <= r["steps"]
    return r["decided"] is not None


def test_the_replay_counts_the_steps_a_stopped_probe_runs():
    """Through the decided step, one more for the snapshot where the decided step took none, never past the end."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
    from replay_early_stop import stopped_steps
    assert stopped_steps(None, 600, 500) == 600
    assert stopped_steps(200, 600, 500) == 202  # steps 0..200, then 201 with its snapshot
    assert stopped_steps(500, 600, 500) == 501  # step 500 took the snapshot itself
    assert stopped_steps(200, 600, 0) == 201  # no snapshots in the run
    assert stopped_steps(599, 600, 500) == 600
