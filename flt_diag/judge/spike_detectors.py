"""The loss-spike detectors a user would reach for instead of flt-diag's early warning, replayed over a
run's recorded training loss (every step), written from their documented rules with their default
settings, so `flt-diag predict --online` can set them beside the predictor on the same runs
(`detector_sweep`).

    lightning        Lightning's `SpikeDetection` callback (lightning.pytorch.callbacks; defaults
                     mode="min", window=10, warmup=1, atol=None, rtol=2.0, finite_only=True). From step
                     `warmup` on, a step is a spike when its loss is not finite, or when it is higher
                     than the last accepted loss and differs from the running mean of the last `window`
                     accepted losses by at least rtol x that mean (and by atol, when set). The callback
                     ends training at the first spike: its step is the warning.
    kill_loss_spike  llm-foundry's `KillLossSpike` callback (defaults patience=4, outlier_multiplier=2,
                     a window of max(100, 5 % of the run's steps) losses, a loss cap of min(10, the
                     largest loss of the first full window), log_only=True). Once the window is full, a
                     loss at least outlier_multiplier x the window's mean is an outlier, and more than
                     `patience` outliers in a row are a loss spike; otherwise, from step 2 x window on,
                     a window with at least half its losses above the cap is "high losses". Every loss
                     then joins the window. The first step of either is the warning.

Both read the raw per-step loss (flt-diag records it at every step up to `--dense-steps`); numpy only.
"""
from __future__ import annotations

from collections import deque
import numpy as np
import pandas as pd

from flt_diag.judge.early_warning import RUN, finished_runs, run_row
from flt_diag.judge.verdict import quiet
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_config, load_metrics, series

DETECTORS = ("lightning", "kill_loss_spike")


def lightning_spike(loss, window: int = 10, warmup: int = 1, atol: float | None = None, rtol: float | None = 2.0,
                    finite_only: bool = True) -> int | None:
    """The step at which Lightning's SpikeDetection (mode "min") would end training, or None."""
    recent: deque[float] = deque(maxlen=window)
    last = 0.0
    for step, value in enumerate(np.asarray(loss, dtype=float)):
        if step >= warmup:
            if finite_only and not np.isfinite(value):
                return step
            mean = float(np.mean(recent)) if recent else float("nan")
            rising = not value - last <= 0.0
            if rising and (atol is None or abs(value - mean) >= abs(atol)) \
                    and (rtol is None or abs(value - mean) >= abs(rtol * mean)):
                return step
        if finite_only or np.isfinite(value):  # (with finite_only, a non-finite loss was a spike already)
            recent.append(value)
            last = value
    return None


def kill_loss_spike(loss, patience: int = 4, outlier_multiplier: float = 2.0, window: int | None = None,
                    loss_cap: float | None = None, total_steps: int | None = None) -> tuple[int | None, str | None]:
    """(step, "loss spike" or "high losses") where llm-foundry's KillLossSpike would first fire, or (None, None).
    `window` None: max(100, 5 % of `total_steps`, the run's planned steps, default len(loss)); `loss_cap`
    None: min(10, max of the first full window)."""
    loss = np.asarray(loss, dtype=float)
    size = window if window is not None else max(100, round(0.05 * (total_steps or len(loss))))
    recent: deque[float] = deque(maxlen=size)
    cap, outliers = loss_cap, 0
    for step, value in enumerate(loss):
        if len(recent) == size:
            if cap is None:
                cap = min(max(recent), 10.0)
            mean = float(np.mean(recent))
            if value >= mean * outlier_multiplier:
                outliers += 1
                if outliers > patience:
                    return step, "loss spike"
            else:
                outliers = 0
            if step >= 2 * size and sum(x > cap for x in recent) >= size / 2:
                return step, "high losses"
        recent.append(value)
    return None, None


@quiet  # (a loss of 1e308: the means overflow to inf, without numpy's warnings)
def first_warnings(loss, total_steps: int | None = None) -> dict:
    """Each detector's first warning step (None: never) over one run's per-step training loss."""
    step, kind = kill_loss_spike(loss, total_steps=total_steps)
    return dict(lightning=lightning_spike(loss), kill_loss_spike=step, kill_loss_spike_kind=kind)


def dense_series(df: pd.DataFrame, metric: str) -> np.ndarray:
    """A metric of a run's metrics table at every step from 0 while it was recorded at every step (the training
    loss and the gradient norm are, up to --dense-steps); empty where step 0 was not recorded."""
    s = series(df, metric).sort_index()
    steps = s.index.to_numpy()
    gaps = np.flatnonzero(np.diff(steps) != 1)
    end = gaps[0] + 1 if len(gaps) else len(steps)
    return s.to_numpy(dtype=float)[:end] if len(steps) and steps[0] == 0 else np.array([])


def detector_sweep(path) -> pd.DataFrame:
    """Per finished run of a run or sweep folder: each detector's first warning step beside the final
    verdict (`fails`: not stable), whether it warned on a failing run (`*_caught`) or a stable one
    (`*_false_alarm`)."""
    rows = []
    for d, s in finished_runs([path]):
        w = first_warnings(dense_series(load_metrics(d, [M.LOSS]), M.LOSS), load_config(d).train.steps)
        fails = s.verdict != "stable"
        rows.append(run_row(d, s) | dict(fails=fails, **w,
                                         **{f"{k}_caught": fails and w[k] is not None for k in DETECTORS},
                                         **{f"{k}_false_alarm": not fails and w[k] is not None for k in DETECTORS}))
    return pd.DataFrame(rows, columns=[*RUN, "verdict", "fails", "lightning", "kill_loss_spike", "kill_loss_spike_kind"]
                        + [f"{k}_{what}" for what in ("caught", "false_alarm") for k in DETECTORS])
