"""The loss-spike detectors of other libraries (analysis/spike_detectors.py), on loss series whose first
warning step is worked out here from each library's documented rule with its default settings."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from fake_runs import make_sweep
from flt_diag.judge.spike_detectors import detector_sweep, kill_loss_spike, lightning_spike
from flt_diag.cli import main


def descending(n: int) -> np.ndarray:
    return 2.0 + 3.0 / np.arange(1, n + 1)


def test_lightning_fires_where_a_rising_loss_reaches_three_times_the_mean_of_the_last_ten():
    loss = descending(60)
    mean = loss[30:40].mean()  # the last ten accepted losses before step 40
    loss[40] = 3 * mean + 1e-6  # |x - mean| >= rtol (2) x mean
    assert lightning_spike(loss) == 40
    loss[40] = 3 * mean - 1e-3
    assert lightning_spike(loss) is None
    loss[40] = np.nan  # a non-finite loss is a spike (finite_only)
    assert lightning_spike(loss) == 40


def test_lightning_ignores_a_falling_loss_and_the_steps_before_warmup():
    loss = descending(30)
    loss[0] = 1e6  # step 0 is before warmup = 1; the next steps fall from it
    assert lightning_spike(loss) is None
    loss = np.full(30, 5.0)
    loss[20] = 1.0  # far from the mean, but lower than the step before: an improvement, not a spike
    assert lightning_spike(loss) is None


def test_kill_loss_spike_needs_more_than_four_outliers_in_a_row():
    loss = np.full(400, 2.0)
    loss[300:305] = 5.0  # the window mean stays below 2.5 over these five, so each is >= 2x it
    assert kill_loss_spike(loss) == (304, "loss spike")
    loss[304] = 2.0  # four in a row, then a normal loss: the counter resets
    assert kill_loss_spike(loss) == (None, None)


def test_kill_loss_spike_high_losses_when_half_the_window_sits_above_the_first_windows_maximum():
    loss = np.full(400, 3.0)  # cap = max of the first window of 100 = 3.0
    loss[160:] = 3.5  # above the cap, never twice the mean
    # at step s the window holds steps s-100 .. s-1; 50 of them above 3.0 first at s = 210 (>= 2 x 100)
    assert kill_loss_spike(loss) == (210, "high losses")
    assert kill_loss_spike(loss[:210]) == (None, None)


def test_kill_loss_spike_window_grows_with_long_runs():
    loss = np.full(5000, 2.0)
    loss[150:155] = 5.0  # five outliers in a row: seen with a window of 100, not yet with 250 (5 % of 5000)
    assert kill_loss_spike(loss[:1000]) == (154, "loss spike")
    assert kill_loss_spike(loss) == (None, None)


def test_predict_online_sets_the_detectors_beside_the_predictor(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sw")  # finished: lt K3, flt K3, flt K6 stable; lt K6 collapsed
    table = detector_sweep(sweep)
    assert sorted(table.verdict) == ["collapsed", "stable", "stable", "stable"]
    for r in table.itertuples():
        for k in ("lightning", "kill_loss_spike"):
            warned = not (getattr(r, k) is None or (isinstance(getattr(r, k), float) and math.isnan(getattr(r, k))))
            assert getattr(r, f"{k}_caught") == (warned and r.fails)
            assert getattr(r, f"{k}_false_alarm") == (warned and not r.fails)
    assert main(["predict", "--online", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "Lightning SpikeDetection" in out and "of 1 failing runs" in out
    assert re.search(r"kill_loss_spike: warned on \d of 1 failing runs; false alarms on \d of 3 stable runs \(\d of 2 FLT\)", out)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_short_series_never_warn(n):
    assert lightning_spike(np.full(n, 1.0)) is None and kill_loss_spike(np.full(n, 1.0)) == (None, None)
