"""The early warning evaluated as a reviewer asks (docs/plans/2026-12-01-verdict-v3-and-warning-evaluation.md):
against baselines that read no training signal, under cross-validation that never lets a sibling seed of
a held-out configuration into the training set, with AUROC and intervals. Torch-free.

Labels, scores, folds and statistics: docs/DESIGN.md section 6, "The evaluation against baselines". At each
step s a run has the early warning's features (from rows before s) and the scores named in `scores_at`.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.judge.early_warning import (RunSeries, feature_matrix, features_at, finished_runs, probability, sigmoid,
                                          standardised)
from flt_diag.judge.spike_detectors import dense_series, kill_loss_spike, lightning_spike
from flt_diag.results.predictor_fit import class_weights, fit_logistic
from flt_diag.results.tables import CELL
from flt_diag.storage import metric_names as M
from flt_diag.storage.cells import RunId
from flt_diag.storage.file_models import Summary
from flt_diag.storage.folders import load_config, load_metrics

SCALED: dict[str, dict] = {"lightning": dict(window=50), "kill_loss_spike": dict(window=200)}  # the plan's scaled windows
OLMO_WINDOW, OLMO_THRESHOLD = 128, 6.0  # OLMo-core StabilityMonitorCallback defaults
FEATURE_GROUPS = {"residual": ["resid_level", "resid_growth", "loop_ratio"],
                  "gradient": ["grad_cv", "grad_dlog"], "backward": ["act_grad_decay"],
                  "loss": ["loss_slope", "loss_climb"]}
DETECTOR_SCORES = ["olmo", "olmo fired", "lightning", "lightning_scaled", "kill_loss_spike", "kill_loss_spike_scaled"]
# Loop-dynamics records alone as scores (plan 2026-12-01 14:21 UTC; higher = fails, the sign fixed there), each
# read at the latest recorded step <= s; NaN for a run without the record (it is then left out of that score).
RECORD_SCORES = ["loop gain (final loop)", "fixed-point residual (final loop)", "exit-loss gap (final - best loop)"]
# The value a score is read as "fails" at, for its agreement: 0.5 for the probabilities and the detectors' 0/1,
# 1 for the gain (an expanding loop map); none for the other records (no agreement, only AUROC).
AGREEMENT_AT = {"loop gain (final loop)": 1.0, "fixed-point residual (final loop)": None,
                "exit-loss gap (final - best loop)": None}


# --------------------------------------------------------------------------- scores of one run

def olmo_spike_score(loss: np.ndarray, grad: np.ndarray, at: int, window: int = OLMO_WINDOW,
                     threshold: float = OLMO_THRESHOLD) -> float:
    """OLMo-core's cumulative SpikeScore after the steps before `at` (0 until `window` steps are seen):
    a step spikes when its loss or its gradient norm exceeds mean + threshold * std (population) of the
    previous `window` values of that series (a std below 1e-10 never spikes)."""
    n = min(at, len(loss))
    if n < window:
        return 0.0

    def spikes(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x[:n], dtype=float)
        out = np.zeros(n, dtype=bool)
        if len(x) <= window:
            return out
        view = np.lib.stride_tricks.sliding_window_view(x[:-1], window)  # view[i] = x[i : i + window]
        mean, std = view.mean(axis=1), view.std(axis=1)
        out[window:] = (std >= 1e-10) & (x[window:] > mean + threshold * std)
        return out

    any_spike = spikes(loss) | (spikes(grad) if len(grad) >= n else False)
    return float(any_spike.sum() / n)


def _latest(sel: pd.DataFrame, at: int) -> pd.DataFrame:
    """The rows of the latest recorded step <= at."""
    sel = sel[sel.step <= at]
    return sel[sel.step == sel.step.max()] if len(sel) else sel


def record_scores(df: pd.DataFrame, at: int, loops: int) -> dict[str, float]:
    """RECORD_SCORES at step `at`: the final loop's loop-map gain and fixed-point residual, and its exit loss
    minus the lowest exit loss over the loops, each at the latest step <= at that recorded it."""
    out = {}
    for name, metric in zip(RECORD_SCORES[:2], (M.LOOP_GAIN, M.FIXED_POINT_RESIDUAL)):
        last = _latest(df[(df.metric == metric) & (df.loop == loops)], at)
        out[name] = float(last.value.iloc[-1]) if len(last) else math.nan
    last = _latest(df[df.metric == M.EXIT_LOSS], at)
    final = last[last.loop == loops].value
    out[RECORD_SCORES[2]] = float(final.iloc[-1] - last.value.min()) if len(final) else math.nan
    return out


def scored_steps(steps: list[int], total: int, done: int) -> list[int]:
    """The steps s a run is scored at: s before its last finished step, and in the first half of its length
    (a warning in the last half of a short run is not early). On runs of 600 steps or more this is the 11:12
    plan's "step 500 only for runs of >= 1,000 steps"; a shorter run also loses 300 (every stored run is
    600 or 2,000 steps long)."""
    return [s for s in steps if s < done and 2 * s <= total]


def run_rows(run_dir: Path, summary: Summary, steps: list[int], packaged: dict) -> list[dict]:
    """One finished run's rows, one per step s < its length: identity, label, features, detector scores,
    P(packaged)."""
    cfg, df = load_config(run_dir), load_metrics(run_dir)
    run = RunId.read(cfg.model, cfg.train)
    loss, grad = dense_series(df, M.LOSS), dense_series(df, M.GRAD_NORM)
    total = cfg.train.steps
    fired = {"lightning": lightning_spike(loss), "kill_loss_spike": kill_loss_spike(loss, total_steps=total)[0],
             "lightning_scaled": lightning_spike(loss, **SCALED["lightning"]),
             "kill_loss_spike_scaled": kill_loss_spike(loss, total_steps=total, **SCALED["kill_loss_spike"])[0]}
    identity = dict(run=str(run_dir), **run.row(), verdict=summary.verdict, failed=int(summary.verdict != "stable"))
    series = RunSeries(df, run.loops, cfg.model.depth)
    rows = []
    for at in scored_steps(steps, total, summary.steps_done):
        feats = features_at(series, at, cfg.model.width)
        rows.append(identity | feats | dict(
            step=at, packaged=probability(packaged, feats, at)[0], olmo=olmo_spike_score(loss, grad, at),
            **{k: float(v is not None and v < at) for k, v in fired.items()}, **record_scores(df, at, run.loops)))
    return rows


def evaluation_table(sources, steps: list[int], packaged: dict) -> pd.DataFrame:
    """Every finished run of the given run or sweep folders, one row per (run, step)."""
    return pd.DataFrame([row for d, s in finished_runs(sources) for row in run_rows(d, s, steps, packaged)])


# --------------------------------------------------------------------------- models under grouped CV

def prior_matrix(table: pd.DataFrame, variants: list[str]) -> np.ndarray:
    """The config-only design: one-hot variant (every variant seen), K, depth, log2 lr scale."""
    onehot = np.stack([(table.variant == v).to_numpy(float) for v in variants], axis=1)
    numeric = np.stack([table.loops.to_numpy(float), table.depth.to_numpy(float),
                        np.log2(table.lr_scale.to_numpy(float))], axis=1)
    return np.concatenate([onehot, numeric], axis=1)


def group_keys(table: pd.DataFrame, by: str) -> pd.Series:
    if by == "config":
        return table[CELL].astype(str).agg("|".join, axis=1)  # (a configuration: a cell of a grid)
    if by == "variant":
        return table.variant.astype(str)
    raise ValueError(f"cross-validation groups are config or variant, got {by!r}")


TIE_BITS = 40  # cross-validated P(fail) to 40 of float64's 52 mantissa bits, ~1e-12 relative (cross_validated)


def tie_rounded(p: np.ndarray) -> np.ndarray:
    """p with its mantissa rounded to TIE_BITS bits: values equal but for their last bits (two fits that agree up to
    float rounding) become equal, on every CPU, while distinct values stay distinct however small (a relative,
    not an absolute, rounding)."""
    mantissa, exponent = np.frexp(np.asarray(p, float))
    return np.ldexp(np.round(mantissa * 2.0 ** TIE_BITS) / 2.0 ** TIE_BITS, exponent)


def _fit_predict(X_train, y_train, X_test, l2: float = 1.0) -> np.ndarray:
    """Class-balanced, L2-penalised (1.0) logistic regression on standardised columns: fit-predictor's fitter
    with the packaged predictor's settings. The column means and spreads are the training rows' only
    (`standardised`), and a missing value on either side counts as the training rows' mean: nothing of the
    held-out rows enters their own fit."""
    Z, mean, std = standardised(X_train)
    if y_train.min() == y_train.max():  # one class only: its frequency is all a fit can say
        return np.full(len(X_test), float(y_train[0]))
    w, b = fit_logistic(Z, y_train, l2, class_weights(y_train))
    return sigmoid(standardised(X_test, mean, std)[0] @ w + b)


def cross_validated(table: pd.DataFrame, model: str, by: str, feature_names: list[str] | None = None) -> np.ndarray:
    """Out-of-fold P(fail) of every row (one step's rows), each group's from a fit on the other groups:
    `model` "refit" (the early-warning features) or "prior" (the configuration). Through `tie_rounded`:
    probabilities equal but for their last bits (the prior's of two configurations it cannot tell apart, or of
    the seeds of one, 1-2 ulp apart) tie on every CPU rather than rank by its float rounding (since 2026-12-04;
    DESIGN.md §6)."""
    if model == "refit":  # raw values; _fit_predict standardises and fills them from each fold's training rows
        X = feature_matrix(table.to_dict("records"), feature_names)  # type: ignore[arg-type]  # (refit: given them)
    else:
        X = prior_matrix(table, sorted(table.variant.unique()))
    y = table.failed.to_numpy(float)
    keys = group_keys(table, by).to_numpy()
    out = np.full(len(table), math.nan)
    for key in np.unique(keys):
        test = keys == key
        if (~test).sum() == 0:
            continue
        out[test] = _fit_predict(X[~test], y[~test], X[test])
    return tie_rounded(out)


# --------------------------------------------------------------------------- statistics

def auroc(y, score) -> float:
    """Area under the ROC curve: P(score of a failing run > a stable run's), ties counting half
    (the Mann-Whitney statistic); NaN without both outcomes."""
    y, score = np.asarray(y, bool), np.asarray(score, float)
    pos, neg = score[y], score[~y]
    if not len(pos) or not len(neg):
        return math.nan
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def bootstrap_interval(y, score, n: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the AUROC over `n` resamples of runs with replacement (resamples with one
    outcome only are skipped)."""
    y, score = np.asarray(y, bool), np.asarray(score, float)
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n):
        i = rng.integers(0, len(y), len(y))
        if y[i].any() and not y[i].all():
            values.append(auroc(y[i], score[i]))
    if not values:
        return math.nan, math.nan
    a = (1 - level) / 2
    return float(np.quantile(values, a)), float(np.quantile(values, 1 - a))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def score_row(name: str, y, score, threshold: float | None = 0.5) -> dict:
    """AUROC with its bootstrap interval, and the agreement of `score >= threshold` with y (Wilson interval;
    NaN where threshold is None: a score with no value that means "fails")."""
    y, score = np.asarray(y, bool), np.asarray(score, float)
    ok = ~np.isnan(score)  # (an infinite score, e.g. the gain of an exploded loop, ranks first; NaN: no score)
    y, score = y[ok], score[ok]
    lo, hi = bootstrap_interval(y, score)
    if threshold is None or not len(y):
        agreement = alo = ahi = math.nan
    else:
        agree = int(((score >= threshold) == y).sum())
        agreement, (alo, ahi) = agree / len(y), wilson(agree, len(y))
    return dict(score=name, runs=len(y), failing=int(y.sum()), auroc=auroc(y, score), auroc_lo=lo, auroc_hi=hi,
                agreement=agreement, agreement_lo=alo, agreement_hi=ahi)


def scores_at(table: pd.DataFrame, feature_names: list[str],
              wide_features: list[str] | None = None) -> dict[str, np.ndarray]:
    """Every score of one step's rows: packaged, refit and prior under both groupings (and, with
    `wide_features`, the refit on that larger set, configuration-grouped), the detectors."""
    out = {"packaged": table.packaged.to_numpy(float)}
    for by in ("config", "variant"):
        out[f"refit ({by} CV)"] = cross_validated(table, "refit", by, feature_names)
        out[f"prior ({by} CV)"] = cross_validated(table, "prior", by)
    if wide_features and list(wide_features) != list(feature_names):
        out[f"refit, {len(wide_features)} features (config CV)"] = cross_validated(table, "refit", "config",
                                                                                  wide_features)
    for name in DETECTOR_SCORES:
        out[name] = (table.olmo.to_numpy(float) > 0).astype(float) if name == "olmo fired" \
            else table[name].to_numpy(float)
    for name in RECORD_SCORES:
        if name in table and (~np.isnan(table[name].to_numpy(float))).any():
            out[name] = table[name].to_numpy(float)
    return out


def comparison(table: pd.DataFrame, feature_names: list[str], sets: dict | None = None,
               wide_features: list[str] | None = None) -> pd.DataFrame:
    """AUROC (bootstrap interval) and agreement (Wilson interval) of every score at every step, over all
    runs and over each of `sets` (name -> a function of the table giving a row mask: e.g. the LT seeds at
    K = 9). The cross-validated scores are fitted on all runs; a set only selects where they are judged."""
    rows = []
    sets = {"all": lambda t: np.ones(len(t), bool), **(sets or {})}
    for step, at in table.groupby("step"):
        at = at.reset_index(drop=True)
        scores = scores_at(at, feature_names, wide_features)
        for set_name, select in sets.items():
            mask = np.asarray(select(at), bool)
            for name, score in scores.items():
                rows.append(dict(step=step, set=set_name) | score_row(name, at.failed[mask], score[mask],
                                                                      AGREEMENT_AT.get(name, 0.5)))
    return pd.DataFrame(rows)


LOOP_DYNAMICS_FEATURES = ["log10 loop gain", "log10 fixed-point residual", "log10 exit-loss gap"]
RECORD_FLOOR, RECORD_CEILING = 1e-3, 1e6  # a zero exit-loss gap (the final loop is the best) is 1e-3, not an outlier


def with_record_features(table: pd.DataFrame) -> pd.DataFrame:
    """The rows that have every loop-dynamics record, with the records as features: log10 of each, clipped
    to [RECORD_FLOOR, RECORD_CEILING] (an exploded loop's infinite gain is the largest value, not a missing
    one; a gap of 0, a third of the stored runs' exit-loss gaps, sits at the floor, near the small gaps)."""
    present = np.ones(len(table), bool)
    out = table.copy()
    for name, feature in zip(RECORD_SCORES, LOOP_DYNAMICS_FEATURES):
        values = table[name].to_numpy(float) if name in table else np.full(len(table), math.nan)
        present &= ~np.isnan(values)
        out[feature] = np.log10(np.clip(np.nan_to_num(values, nan=1.0), RECORD_FLOOR, RECORD_CEILING))
    return out[present].reset_index(drop=True)


def ablation(table: pd.DataFrame, feature_names: list[str], by: str = "config") -> pd.DataFrame:
    """AUROC of the refit under `by` cross-validation with all features and with each group dropped; then,
    on the runs with the loop-dynamics records, the same with the records added as a group of their own
    (`runs`: "all" or "with records")."""
    rows = []
    subsets = {"all": (table, feature_names, FEATURE_GROUPS),
               "with records": (with_record_features(table), [*feature_names, *LOOP_DYNAMICS_FEATURES],
                                {**FEATURE_GROUPS, "loop dynamics": LOOP_DYNAMICS_FEATURES})}
    for subset, (rows_of, names_of, groups) in subsets.items():
        for step, at in rows_of.groupby("step"):
            at = at.reset_index(drop=True)
            if at.failed.nunique() < 2:
                continue
            for group, names in {"(none)": [], **groups}.items():
                kept = [f for f in names_of if f not in names]
                if not kept:
                    continue
                p = cross_validated(at, "refit", by, kept)
                rows.append(dict(subset=subset, step=step, dropped=group, features=len(kept))
                            | score_row(f"refit, {len(names_of)} features", at.failed, p))
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- what ships

SHIP_STEP, SHIP_MARGIN = 300, 0.05  # the 11:12 plan's rule


def ship_decision(comparison: pd.DataFrame, step: int = SHIP_STEP, margin: float = SHIP_MARGIN) -> tuple[bool, str]:
    """The plan's rule for what ships (docs/plans/2026-12-01-verdict-v3-and-warning-evaluation.md, and the
    14:21 plan's reading of its second half): the refit replaces the packaged predictor only if its
    configuration-grouped AUROC at `step` over all runs exceeds the prior's by at least `margin`, and it is at
    least as good as the packaged predictor in every within-variant set given (`--set`) where both outcomes
    occur (AUROC defined). Returns (the refit ships, the reason in one line)."""
    if comparison.empty or step not in set(comparison.step):
        return False, f"the packaged predictor stays: nothing was scored at step {step}, the step the rule reads"
    at = comparison[comparison.step == step]

    def value(set_name, score):
        row = at[(at.set == set_name) & (at.score == score)]
        return float(row.auroc.iloc[0]) if len(row) else math.nan

    refit, prior = value("all", "refit (config CV)"), value("all", "prior (config CV)")
    if not (math.isfinite(refit) and math.isfinite(prior)):
        return False, (f"the packaged predictor stays: at step {step} the refit or the prior has no AUROC over all "
                       "runs (one outcome only)")
    if refit - prior < margin - 1e-9:  # AUROCs are fractions: an exact 0.05 is "at least 0.05"
        return False, (f"the packaged predictor stays: the refit's configuration-grouped AUROC at step {step} "
                       f"({refit:.2f}) does not exceed the prior's ({prior:.2f}) by {margin:g}")
    worse = [name for name in at.set.unique() if name != "all"
             and math.isfinite(value(name, "refit (config CV)")) and math.isfinite(value(name, "packaged"))
             and value(name, "refit (config CV)") < value(name, "packaged") - 1e-9]
    if worse:
        return False, (f"the packaged predictor stays: the refit beats the prior ({refit:.2f} vs {prior:.2f}) but is "
                       f"below the packaged predictor within {', '.join(worse)} at step {step}")
    return True, (f"the refit ships: its configuration-grouped AUROC at step {step} ({refit:.2f}) exceeds the "
                  f"prior's ({prior:.2f}) by {margin:g} or more, and it is at least as good as the packaged "
                  "predictor in every set where both outcomes occur")
