"""Early warning: P(the run collapses by its end) from the signals recorded up to step s.

A logistic regression on a few named features of the window of the last W = min(100, s // 2)
recorded steps before s (numpy/scipy/pandas only; no torch):

    resid_level     log10(final-loop residual norm / sqrt(d)), window mean   (residual explosion)
    resid_growth    slope of log10(final-loop residual norm) per 100 steps    (still exploding?)
    loop_ratio      log10(final-loop / first-loop residual norm)              (later vs earlier loops)
    grad_cv         coefficient of variation of the global gradient norm      (oscillation)
    grad_dlog       mean |delta log gradient norm|                            (oscillation)
                    (both net of the loop count where `loops_run` changes in the window, as verdict v4's
                    rule 4b: flt_diag.judge.gradient_oscillation.netted_levels)
    grad_cos        mean cosine between successive gradients                  (oscillation: < 0 when
                    each step undoes part of the last)
    act_grad_decay  log10(||dL/d out(loop 1, block 1)|| / ||dL/d out(loop K, block L)||)
                    (how the backward signal changes through the loops)
    loss_slope      slope of the training loss per 100 steps
    loss_climb      trailing-mean loss minus its running minimum so far

The target, the fit (standardised features, L2-penalised, class-balanced logistic regression, one model per
fitted step) and the packaged predictor (early_warning.json): docs/DESIGN.md section 6. This module: the
features, the target, reading a predictor and predicting with it offline; results/predictor_fit.py fits one.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.storage.predictor_names import FEATURES, PACKAGED, TARGETS  # noqa: F401 (re-exported)
from flt_diag.storage import metric_names as M
from flt_diag.storage.cells import IDENTITY, RunId
from flt_diag.storage.file_models import PredictorFile, Summary
from flt_diag.storage.files import predictor_of
from flt_diag.storage.folders import load_config, load_metrics, load_summary, run_dirs, run_name, series
from flt_diag.judge.gradient_oscillation import netted_levels
from flt_diag.judge.verdict import coefficient_of_variation, mean_abs_dlog, quiet

SMOOTH = 50
WINDOW = 100  # the steps before a check that its windowed features read (all but the loss's climb)


def _slope_per_100(s: pd.Series) -> float:
    s = s[np.isfinite(s.to_numpy())]
    if len(s) < 3:
        return math.nan
    x = s.index.to_numpy(dtype=float)
    return float(np.polyfit(x - x.mean(), s.to_numpy(dtype=float), 1)[0] * 100)


def _window(s: pd.Series, lo: int, hi: int) -> pd.Series:
    """The rows of a step-sorted series with lo <= step < hi, found by bisection (no scan of the series)."""
    idx = s.index.to_numpy()
    return s.iloc[np.searchsorted(idx, lo, "left"):np.searchsorted(idx, hi, "left")]


def loop_series(loops: int, depth: int) -> tuple[tuple[str, int, int], ...]:
    """(metric, loop, layer) of the per-loop series the features read: the final and the first loop's
    loop-end residual norm, the activation gradient of the first and of the last block."""
    return ((M.RESID_NORM_LOOP_END, loops, M.NONE), (M.RESID_NORM_LOOP_END, 1, M.NONE), (M.ACT_GRAD_NORM, 1, 1),
            (M.ACT_GRAD_NORM, loops, depth))


class RunSeries:
    """The series the features read, taken once from a run's metrics table and sorted by step, with the
    smoothed loss and its running minimum over the whole run (both causal, so their value at a step is
    what the rows before it give): every check then reads windows by bisection, and a replay of all
    checks is linear in the series."""

    def __init__(self, df: pd.DataFrame, loops: int, depth: int):
        self._take(lambda metric, loop, layer: series(df, metric, loop, layer), loops, depth)
        self.last_step = int(df.step.max()) if len(df) else -1

    @classmethod
    def of_rows(cls, rows, loops: int, depth: int) -> "RunSeries":
        """The same from (step, metric, loop, layer, value) rows, grouped by key in one pass (no table: the
        online warning's check)."""
        by_key: dict[tuple, tuple[list, list]] = {}
        for step, metric, loop, layer, value in rows:
            steps, values = by_key.setdefault((metric, loop, layer), ([], []))
            steps.append(step)
            values.append(value)
        run = cls.__new__(cls)

        def one(metric, loop, layer):
            steps, values = by_key.get((metric, loop, layer), ([], []))
            return pd.Series(np.asarray(values, dtype=float), index=np.asarray(steps, dtype=np.int64), name=metric)
        run._take(one, loops, depth)
        run.last_step = max((max(steps) for steps, _ in by_key.values()), default=-1)
        return run

    def _take(self, get, loops: int, depth: int) -> None:
        def one(metric, loop=M.NONE, layer=M.NONE):
            x = get(metric, loop, layer)
            return x if x.index.is_monotonic_increasing else x.sort_index(kind="stable")
        self.final, self.first, self.act_first, self.act_last = (one(*s) for s in loop_series(loops, depth))
        self.grad, self.cos, self.loops = one(M.GRAD_NORM), one(M.GRAD_COSINE), one(M.LOOPS_RUN)
        self.loss = one(M.LOSS)
        smooth = self.loss.rolling(SMOOTH, min_periods=1).mean()
        self.climb = (smooth - smooth.cummin()).to_numpy(dtype=float)

    def climb_before(self, at: int) -> float:
        n = int(np.searchsorted(self.loss.index.to_numpy(), at, "left"))
        return float(self.climb[n - 1]) if n else math.nan


def features(df: pd.DataFrame, at: int, loops: int, depth: int, d_model: int) -> dict:
    """The features at step `at` (from rows with step < at) of one run's metrics table."""
    return features_at(RunSeries(df, loops, depth), at, d_model)


@quiet
def features_at(run: RunSeries, at: int, d_model: int) -> dict:
    """The features at step `at` (from rows with step < at) of a run's pre-indexed series; a value that
    overflows (a metric of 1e308) is NaN, without numpy's warnings."""
    W = max(2, min(WINDOW, at // 2))
    lo = at - W
    final, first = _window(run.final, lo, at), _window(run.first, lo, at)
    g = _window(run.grad, lo, at)
    g = netted_levels(g[np.isfinite(g.to_numpy()) & (g.to_numpy() > 0)], _window(run.loops, lo, at))  # verdict v4's
    cos = _window(run.cos, lo, at)
    cos = cos[np.isfinite(cos.to_numpy())]
    a_first, a_last = _window(run.act_first, lo, at), _window(run.act_last, lo, at)

    def log_mean(s):
        v = s.to_numpy(dtype=float)
        v = v[np.isfinite(v) & (v > 0)]
        return float(np.log10(v.mean())) if len(v) else math.nan

    out = dict(
        resid_level=log_mean(final) - 0.5 * math.log10(d_model) if len(final) else math.nan,
        resid_growth=_slope_per_100(np.log10(final.clip(lower=1e-30))) if len(final) else math.nan,
        loop_ratio=log_mean(final) - log_mean(first) if len(final) and len(first) else math.nan,
        grad_cv=coefficient_of_variation(g) if len(g) > 1 else math.nan,  # as the oscillation index cv
        grad_dlog=mean_abs_dlog(g),
        grad_cos=float(cos.mean()) if len(cos) else math.nan,
        act_grad_decay=log_mean(a_first) - log_mean(a_last) if len(a_first) and len(a_last) else math.nan,
        loss_slope=_slope_per_100(_window(run.loss, lo, at)),
        loss_climb=run.climb_before(at),
    )
    return {k: (v if v is None or math.isfinite(v) else math.nan) for k, v in out.items()}


def run_features(run_dir: Path, at: int) -> dict:
    return run_features_at(run_dir, [at])[at]


def run_features_at(run_dir: Path, steps) -> dict[int, dict]:
    """The features of a run folder at each of `steps`, its config and metrics read once (one RunSeries)."""
    steps = list(steps)
    if not steps:
        return {}
    m = load_config(run_dir).model
    run = RunSeries(load_metrics(run_dir), m.loops, m.depth)
    return {at: features_at(run, at, m.width) for at in steps}


def label(summary: Summary, kind: str = "fails") -> int:
    verdicts, rebound = TARGETS[kind]
    return int(summary.verdict in verdicts or rebound and bool(summary.evidence.transient_rebound))


def target_text(kind: str) -> str:
    verdicts, rebound = TARGETS[kind]
    return f"final verdict in {', '.join(verdicts)}" + (
        ", or a loss climb that recovered (the verdict's transient_rebound)" if rebound else "")


# --------------------------------------------------------------------------- the predictor

def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def feature_matrix(rows: list[dict], features: list[str]) -> np.ndarray:
    """The rows' values of `features` (NaN where a row has none), one row each."""
    return np.array([[r.get(f, math.nan) for f in features] for r in rows], dtype=float).reshape(len(rows), len(features))


@quiet  # an all-NaN column, a +-1e308 one: no numpy noise
def standardised(X: np.ndarray, mean=None, std=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Z, mean, std): the columns of X standardised with `mean` and `std`, by default X's own (of its finite
    values: a column with none has mean 0; one without spread, std 1). A missing (or infinite) value counts
    as the mean: its Z is 0."""
    if mean is None:
        mean = np.nanmean(np.where(np.isfinite(X), X, np.nan), axis=0) if len(X) else np.zeros(X.shape[1])
        mean = np.where(np.isfinite(mean), mean, 0.0)
        std = np.nanstd(X, axis=0) if len(X) else np.ones(X.shape[1])
        std = np.where(np.isfinite(std) & (std > 1e-12), std, 1.0)
    Z = (X - mean) / std
    Z = np.where(np.isfinite(Z), Z, 0.0)
    return Z, np.asarray(mean, float), np.asarray(std, float)


def finished_runs(sources) -> list[tuple[Path, Summary]]:
    """The finished runs of the given run or sweep folders, each with its summary (summary.json)."""
    return [(d, s) for src in sources for d in run_dirs(Path(src)) if (s := load_summary(d)) is not None]


def probability(predictor: dict | PredictorFile, feats: dict, step: int) -> tuple[float, list[tuple[str, float]]]:
    """P(collapse) at `step` and each feature's contribution to the logit (largest first)."""
    predictor = predictor_of(predictor)
    usable = [s for s in sorted(predictor.models) if s <= step]
    if not usable:
        raise ValueError(f"the predictor is fitted from step {min(predictor.models)} on; step {step} is too early")
    m, names = predictor.models[usable[-1]], predictor.features
    Z = standardised(feature_matrix([feats], names), np.array(m.mean), np.array(m.std))[0]
    contrib = Z[0] * np.array(m.coef)
    p = float(sigmoid(contrib.sum() + m.intercept))
    return p, sorted(zip(names, contrib.tolist()), key=lambda t: -abs(t[1]))


def evidence_text(feats: dict, contributions: list[tuple[str, float]], n: int = 3) -> str:
    return ", ".join(f"{name} {feats[name]:.3g} ({c:+.2f})" for name, c in contributions[:n]
                     if feats.get(name) is not None and math.isfinite(feats[name]))


RUN = ["cell", *IDENTITY[:4]]  # a finished run in the tables below: its folder and the identity its summary holds
SCORED = ["actual", "agree", "false_alarm", "miss"]
COLUMNS = [*RUN, "p_collapse", "predicted", "verdict", *SCORED, "evidence"]


def run_row(run_dir: Path, summary: Summary) -> dict:
    """A finished run's columns (RUN) and its final verdict: the first fields of a row of the tables of
    predictions and warnings (here, and flt_diag.judge.spike_detectors)."""
    return dict(cell=run_name(run_dir), **RunId.read(summary).row(), verdict=summary.verdict)


def _scored(run_dir: Path, summary: Summary, predictor: PredictorFile, predicted: bool) -> dict:
    """The fields every row of a prediction table has: `run_row`, and how the prediction fares against the
    predictor's target (SCORED)."""
    actual = bool(label(summary, predictor.target))
    return run_row(run_dir, summary) | dict(actual=actual, agree=predicted == actual,
                                            false_alarm=predicted and not actual, miss=actual and not predicted)


def prediction_row(run_dir: Path, summary: Summary, predictor: dict | PredictorFile, feats: dict, at: int) -> dict:
    """One run's prediction at `at` beside its final verdict (a row of `predict` / `cross_validate`)."""
    predictor = predictor_of(predictor)
    p, contrib = probability(predictor, feats, at)
    predicted = bool(p >= predictor.threshold)
    return _scored(run_dir, summary, predictor, predicted) | dict(
        p_collapse=p, predicted=predicted, evidence=evidence_text(feats, contrib))


def predict_sweep(path, at: int, predictor: dict | PredictorFile) -> pd.DataFrame:
    """Per finished cell: P(collapse) at step `at`, the prediction, the final verdict, agreement."""
    rows = [prediction_row(d, s, predictor, run_features(d, at), at)
            for d, s in finished_runs([path]) if s.steps_done > at]
    return pd.DataFrame(rows, columns=COLUMNS)


CHECK_EVERY = 25  # steps between two online checks (CollapseWarning and its replay, `first_warning`)


def first_warning(df: pd.DataFrame, predictor: dict | PredictorFile, loops: int, depth: int, d_model: int, steps_done: int,
                  every: int = CHECK_EVERY, threshold: float | None = None) -> dict:
    """Replay of the online warning on a recorded run: the checks `--warn` makes (every `every` steps
    from the predictor's first fitted step), the first step where P reaches the threshold (None if
    never), that P and its evidence, and the largest P of all checks."""
    predictor = predictor_of(predictor)
    threshold = predictor.threshold if threshold is None else threshold
    fitted = list(predictor.models)
    start = -(-min(fitted) // every) * every  # the first multiple of `every` at or after the first fitted step
    run = RunSeries(df, loops, depth)
    # bounded by the metrics stored (a summary's steps_done may say anything): no check past the last row,
    # and only the checks whose windows differ from the check before are computed
    checks = range(start, min(int(steps_done), run.last_step + 1) + 1, every)
    p_max, out = 0.0, dict(warned_at=None, p_warn=math.nan, evidence="")
    for at in changing_checks(run, checks, fitted):
        feats = features_at(run, at, d_model)
        p, contrib = probability(predictor, feats, at)
        p_max = max(p_max, p)
        if p >= threshold and out["warned_at"] is None:
            out = dict(warned_at=at, p_warn=p, evidence=evidence_text(feats, contrib))
    return out | dict(p_max=p_max, checks=len(checks))


def changing_checks(run: RunSeries, checks: range, fitted: list[int]) -> list[int]:
    """The checks of `checks` whose P can differ from the check before's: the first; those whose windows
    (at most 100 steps back) hold a stored step, and the first after them; the first at each fitted step. Any
    other check reads empty windows, the same loss climb and the same fitted model as the check before it, so
    the replay's work follows the rows stored: one row at step 10**12 is a few checks, not 4 * 10**10."""
    if not len(checks):
        return []
    first, last, every = checks.start, checks[-1], checks.step

    def at_or_after(x: int) -> int | None:
        at = first if x <= first else first + -(-(x - first) // every) * every
        return at if at <= last else None
    picked = {first} | {a for a in map(at_or_after, fitted) if a is not None}
    series_ = (run.final, run.first, run.grad, run.cos, run.act_first, run.act_last, run.loss)
    stored = np.unique(np.concatenate([s.index.to_numpy(dtype=np.int64) for s in series_]))
    for t in stored.tolist():
        lo = at_or_after(t + 1)
        if lo is not None:  # the checks whose windows hold t, then the first whose windows no longer do
            picked.update(range(lo, min(t + 100 + every, last) + 1, every))
    return sorted(picked)


def online_sweep(path, predictor: dict | PredictorFile) -> pd.DataFrame:
    """Per finished cell: what `--warn` would have said over the whole run (first warning step, its P and
    evidence, the largest P), beside the final verdict; `onset` is the step of the smoothed loss's minimum
    before a collapse (collapsed runs), so `onset - warned_at` is the warning's lead."""
    rows, predictor = [], predictor_of(predictor)
    for d, s in finished_runs([path]):
        m = load_config(d).model
        w = first_warning(load_metrics(d), predictor, m.loops, m.depth, m.width, s.steps_done)
        onset = s.evidence.min_step if s.verdict == "collapsed" else None
        rows.append(_scored(d, s, predictor, w["warned_at"] is not None) | dict(
            warned_at=w["warned_at"], p_warn=w["p_warn"], p_max=w["p_max"], onset=onset, evidence=w["evidence"]))
    return pd.DataFrame(rows, columns=[*RUN, "warned_at", "p_warn", "p_max", "verdict", "onset", *SCORED, "evidence"])


def agreement(table: pd.DataFrame) -> dict:
    n = len(table)
    return dict(cells=n, accuracy=float(table.agree.mean()) if n else math.nan,
                false_alarms=int(table.false_alarm.sum()), misses=int(table.miss.sum()),
                positives=int(table.actual.sum()) if n else 0)
