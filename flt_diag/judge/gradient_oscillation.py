"""Rule 4b of the verdict, gradient oscillation (v3, and v4 for a loop count that changes per step), numpy/pandas.

v3: over the recorded consecutive steps before the warm-down, in windows of `osc_window` steps, the median of
|d|, d(t) = log g(t+1) - log g(t). v4 (docs/plans/2026-12-05-verdict-v4.md): where the run records a loop count
`loops_run` that takes two or more values before the warm-down, d is taken net of the count's change
delta(t) = log r(t+1) - log r(t): per window, with c >= MIN_DIFFERENCES pairs whose count changed, the residual
d - beta * delta of the least-squares slope beta = sum(d delta) / sum(delta^2); with 1 <= c < MIN_DIFFERENCES the
count-changing pairs are left out. A fixed count (or none recorded) takes v3's code path unchanged. The same
adjustment of a window's gradient norms for the early warning's features: `netted_levels`. docs/DESIGN.md §3.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

MIN_DIFFERENCES = 20  # a window with fewer recorded consecutive-step differences is not judged; also the fewest
# count-changing pairs a window's slope on the loop count is estimated from (v4)


def window_starts(steps, window: int, end: int | None = None) -> list[int]:
    """The starts (multiples of `window` from 0) of the windows [start, start + window) that hold a stored step
    (below `end`): windows follow the rows stored, never a step count read from the folder (a config.json
    or summary that says 10**12 steps asks for no 10**10 empty windows)."""
    steps = np.asarray(steps, dtype=np.int64)
    steps = steps[(steps >= 0) & (steps < end)] if end is not None else steps[steps >= 0]
    return [int(k) * window for k in np.unique(steps // window)]


def log_differences(grad_norm: pd.Series, end: int) -> pd.Series:
    """log g(t+1) - log g(t), indexed by t, for each pair of recorded consecutive steps t, t+1 < end with a
    finite positive value at both (a gradient norm, or a loop count)."""
    g = grad_norm[grad_norm.index < end]
    g = g[np.isfinite(g.to_numpy(dtype=float)) & (g.to_numpy(dtype=float) > 0)]
    steps, logs = g.index.to_numpy(), np.log(g.to_numpy(dtype=float))
    consecutive = np.diff(steps) == 1
    return pd.Series(np.diff(logs)[consecutive], index=steps[:-1][consecutive], dtype=float)


def samples_count(loops: pd.Series | None, end: int) -> bool:
    """Whether the recorded loop count takes two or more (finite, positive) values at steps before `end`."""
    if loops is None:
        return False
    r = loops[loops.index < end].to_numpy(dtype=float)
    return len(np.unique(r[np.isfinite(r) & (r > 0)])) >= 2


def netted(d: pd.Series, delta: pd.Series) -> tuple[pd.Series, float, int]:
    """(differences net of the loop count, slope, count changes) of one window's pairs: d - beta * delta with
    beta = sum(d delta) / sum(delta^2) where at least MIN_DIFFERENCES pairs changed count; the equal-count pairs
    alone where 1 to MIN_DIFFERENCES - 1 did (slope NaN); d itself where none did. `delta` is aligned with `d`."""
    x = delta.to_numpy(dtype=float)
    changed = x != 0
    c = int(changed.sum())
    if c >= MIN_DIFFERENCES:
        y = d.to_numpy(dtype=float)
        slope = float(np.dot(y, x) / np.dot(x, x))
        return pd.Series(y - slope * x, index=d.index, dtype=float), slope, c
    return (d[~changed], math.nan, c) if c else (d, math.nan, 0)


def _dlog_window(d: pd.Series, start: int, end: int, slope: float, changes: int) -> dict:
    """One window's index: the median |d| and the share of sign changes between successive differences."""
    steps, v = d.index.to_numpy(), d.to_numpy()
    successive = np.diff(steps) == 1
    changes_of_sign = (v[1:] * v[:-1] < 0)[successive]
    return dict(start=start, end=end, differences=len(v), median_abs_dlog=float(np.median(np.abs(v))),
                alternation=float(changes_of_sign.mean()) if len(changes_of_sign) else math.nan,
                loop_slope=slope, count_changes=changes)


def oscillation_index(grad_norm: pd.Series, span_end: int, window: int, threshold: float,
                      loops: pd.Series | None = None) -> dict:
    """Rule 4b: over the recorded consecutive steps before `span_end` (the warm-down start), in windows
    [start, start + window) of the first step of each difference, the median |d|; oscillating if any judged
    window's (>= MIN_DIFFERENCES differences) exceeds `threshold`. `loops`: the run's `loops_run` series; where
    it takes two or more values the differences are net of the count's (v4; `netted`), else v3's exactly
    (loops None: v3). The evidence names the window with the largest median, its alternation share
    (osc_alternation) and slope on the log loop count (osc_loop_slope)."""
    d = log_differences(grad_norm, span_end)
    delta = None
    if samples_count(loops, span_end):
        assert loops is not None  # (samples_count says so)
        delta = log_differences(loops, span_end)
        d = d[d.index.isin(delta.index)]  # a pair whose count was not recorded at both steps cannot be netted
        delta = delta.reindex(d.index)
    windows = []
    for start in window_starts(d.index.to_numpy(), window, span_end):
        inside = (d.index >= start) & (d.index < start + window)
        w, slope, changes = netted(d[inside], delta[inside]) if delta is not None else (d[inside], math.nan, 0)
        if len(w) >= MIN_DIFFERENCES:
            windows.append(_dlog_window(w, start, min(start + window, span_end) - 1, slope, changes))
    worst = max(windows, key=lambda w: w["median_abs_dlog"]) if windows else None
    return dict(osc_dlog_median=worst["median_abs_dlog"] if worst else math.nan,
                osc_alternation=worst["alternation"] if worst else math.nan,
                osc_dlog_window=[worst["start"], worst["end"]] if worst else None,
                osc_dlog_threshold=threshold, osc_windows_judged=len(windows), osc_span_end=int(span_end),
                osc_loop_count="sampled" if delta is not None else "fixed",
                osc_loop_slope=worst["loop_slope"] if worst else math.nan,
                oscillating=bool(worst and worst["median_abs_dlog"] > threshold), osc_dlog_windows=windows)


def netted_levels(grad_norm: pd.Series, loops: pd.Series | None) -> pd.Series:
    """A window's gradient norms net of the loop count (the early warning's grad_cv and grad_dlog): unchanged
    where the window's count takes one value (or none is recorded); else, over the steps with a recorded count,
    g * exp(-beta * (log r - mean log r)) with beta `netted`'s slope over the window's consecutive pairs where at
    least MIN_DIFFERENCES changed count, and the steps at the window's most frequent count alone where fewer did."""
    if loops is None:
        return grad_norm
    r = loops.reindex(grad_norm.index).to_numpy(dtype=float)
    known = np.isfinite(r) & (r > 0)
    if len(np.unique(r[known])) < 2:
        return grad_norm
    g, rho = grad_norm[known], np.log(r[known])
    d = log_differences(g, int(g.index.max()) + 1 if len(g) else 0)
    delta = log_differences(pd.Series(r[known], index=g.index), int(g.index.max()) + 1 if len(g) else 0)
    _, slope, changes = netted(d, delta.reindex(d.index))
    if changes >= MIN_DIFFERENCES:
        return pd.Series(g.to_numpy(dtype=float) * np.exp(-slope * (rho - rho.mean())), index=g.index, dtype=float)
    counts, freq = np.unique(r[known], return_counts=True)
    return g[r[known] == counts[np.argmax(freq)]]
