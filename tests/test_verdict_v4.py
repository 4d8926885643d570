"""Verdict v4 (docs/plans/2026-12-05-verdict-v4.md): rule 4b net of the loop count a step ran. Synthetic runs whose
gradient norm follows a sampled loop count, with and without an oscillation of their own; the slope, the residuals
and the medians recomputed here with numpy's least squares, window by window; a fixed count is v3 exactly; the
early warning's gradient features under the same adjustment."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from fake_runs import series_config, series_metrics
from flt_diag.judge import verdict as X
from flt_diag.judge.early_warning import RunSeries, features_at
from flt_diag.storage import metric_names as M

STEPS, SPAN_END, WINDOW, THRESHOLD = 1000, 800, 200, math.log(1.5)  # warm-down 0.2: rule 4b reads steps < 800


def stars_counts(steps: int, K: int = 12, seed: int = 1) -> np.ndarray:
    """r = round(exp(N(ln K - 1/8, 1/2))) clipped to [1, 2K], drawn here with numpy (STARS's distribution)."""
    z = np.random.default_rng(seed).standard_normal(steps)
    return np.clip(np.round(np.exp(math.log(K) - 0.125 + 0.5 * z)), 1, 2 * K)


def gradients(r: np.ndarray, slope: float, sigma: float = 0.1, alternation: float = 0.0, seed: int = 0) -> np.ndarray:
    """log g = a slow trend + slope * log r + sigma * z (+ alternation * (-1)^t: a period-2 oscillation)."""
    t = np.arange(len(r))
    z = np.random.default_rng(seed).standard_normal(len(r))
    return np.exp(-t / (2 * len(r)) + slope * np.log(r) + sigma * z + alternation * (-1.0) ** t)


def metrics(g: np.ndarray, r: np.ndarray | None) -> pd.DataFrame:
    loss = 1.5 + 4.0 * np.exp(-np.arange(len(g)) / 60)  # a clean descent: only rule 4 can fire
    df = series_metrics(loss, g)
    if r is None:
        return df
    extra = pd.DataFrame(dict(step=np.arange(len(r)), metric=M.LOOPS_RUN, loop=M.NONE, layer=M.NONE, value=r))
    return pd.concat([df, extra.astype(df.dtypes.to_dict())], ignore_index=True)


def summary(g, r):
    return X.summarize(metrics(g, r), series_config(STEPS, loops=12, warmdown_frac=0.2), unigram_entropy=5.0)


def by_hand(g: np.ndarray, r: np.ndarray) -> list[dict]:
    """Each window's slope, count changes and median |d'| worked out here: d and delta over consecutive steps
    t, t+1 < 800 (first step in the window), the slope by numpy's least squares without an intercept."""
    d, delta = np.diff(np.log(g[:SPAN_END])), np.diff(np.log(r[:SPAN_END]))
    t = np.arange(SPAN_END - 1)
    out = []
    for start in range(0, SPAN_END, WINDOW):
        w = (t >= start) & (t < start + WINDOW)
        x, y = delta[w], d[w]
        beta = float(np.linalg.lstsq(x[:, None], y, rcond=None)[0][0])
        out.append(dict(slope=beta, changes=int((x != 0).sum()), median=float(np.median(np.abs(y - beta * x))),
                        median_v3=float(np.median(np.abs(y)))))
    return out


def test_a_gradient_norm_that_follows_a_sampled_loop_count_on_a_clean_descent_is_stable_under_v4_not_v3():
    r = stars_counts(STEPS)
    g = gradients(r, slope=1.5)
    s = summary(g, r)
    hand = by_hand(g, r)
    assert max(h["median_v3"] for h in hand) > THRESHOLD  # v3 reads the count's jumps as oscillation
    assert max(h["median"] for h in hand) < THRESHOLD  # net of them: 0.954 * sqrt(2) * 0.1 or so
    assert s.verdict == "stable" and s.verdict_v3 == "unstable" and s.verdict_version == 4
    assert s.evidence.osc_loop_count == "sampled"
    for w, h in zip(s.osc_dlog_windows, hand):
        assert w.loop_slope == pytest.approx(h["slope"], rel=1e-12) and w.count_changes == h["changes"]
        assert w.median_abs_dlog == pytest.approx(h["median"], rel=1e-12)
        assert w.loop_slope == pytest.approx(1.5, abs=0.1)  # the slope the series was built with
    assert s.osc_dlog_median == pytest.approx(max(h["median"] for h in hand), rel=1e-12)
    assert s.osc_dlog_median_v3 == pytest.approx(max(h["median_v3"] for h in hand), rel=1e-12)


def test_a_real_oscillation_at_a_sampled_loop_count_is_still_caught():
    r = stars_counts(STEPS)
    g = gradients(r, slope=1.5, alternation=0.5)  # d alternates by +-1.0 on top of the count's part
    s = summary(g, r)
    hand = by_hand(g, r)
    assert s.verdict == "unstable" and s.verdict_v3 == "unstable"
    assert s.osc_dlog_median == pytest.approx(max(h["median"] for h in hand), rel=1e-12)
    assert min(h["median"] for h in hand) > 0.9  # every window, net of the count
    assert s.osc_alternation > 0.9  # period 2: nearly every successive residual changes sign
    assert "net of the loop count" in s.evidence.reason


def test_a_fixed_loop_count_recorded_or_not_is_v3_bit_for_bit():
    rng = np.random.default_rng(3)
    g = np.exp(0.3 * rng.standard_normal(STEPS))  # median |d| about 0.954 * 0.3 * ... near the threshold
    without = summary(g, None)
    fixed = summary(g, np.full(STEPS, 12.0))
    assert json.dumps(without.as_written(), allow_nan=True) == json.dumps(fixed.as_written(), allow_nan=True)
    d = np.diff(np.log(g[:SPAN_END]))
    medians = [float(np.median(np.abs(d[s:s + WINDOW]))) for s in range(0, SPAN_END, WINDOW)]
    assert fixed.osc_dlog_median == max(medians) and fixed.osc_dlog_median_v3 == max(medians)  # exactly
    assert fixed.verdict == fixed.verdict_v3 and fixed.evidence.osc_loop_count == "fixed"
    assert math.isnan(fixed.evidence.osc_loop_slope)


def test_with_fewer_than_20_count_changes_in_a_window_only_its_equal_count_pairs_are_judged():
    r = np.full(STEPS, 12.0)
    r[np.arange(10, SPAN_END, 40)] = 13.0  # 5 steps a window: 10 pairs a window change count
    g = gradients(r, slope=40.0, sigma=0.3)  # a count change moves log g by 40 * log(13/12) = 3.2
    s = summary(g, r)
    d, delta = np.diff(np.log(g[:SPAN_END])), np.diff(np.log(r[:SPAN_END]))
    for w, start in zip(s.osc_dlog_windows, range(0, SPAN_END, WINDOW)):
        x, y = delta[start:start + WINDOW], d[start:start + WINDOW]
        kept = y[x == 0]
        assert w.count_changes == 10 and w.differences == len(kept) and math.isnan(w.loop_slope)
        assert w.median_abs_dlog == float(np.median(np.abs(kept)))


def test_pairs_without_a_recorded_count_are_left_out_of_a_sampled_run():
    r = stars_counts(STEPS)
    g = gradients(r, slope=1.5)
    df = metrics(g, r)
    df = df[~((df.metric == M.LOOPS_RUN) & (df.step >= 100) & (df.step < 150))]  # no count at steps 100-149
    s = X.summarize(df, series_config(STEPS, loops=12, warmdown_frac=0.2), unigram_entropy=5.0)
    assert s.osc_dlog_windows[0].differences == 200 - 51  # of t = 0-199, the pairs (t, t+1) with t in 99-149 have no count at one end


def test_the_early_warnings_gradient_features_are_net_of_the_loop_count():
    r = stars_counts(400)
    g = gradients(r, slope=1.5, seed=5)
    df = metrics(g, r)
    run = RunSeries(df, loops=12, depth=2)
    f = features_at(run, 300, d_model=64)  # its window: steps 200-299
    x, y = np.diff(np.log(r[200:300])), np.diff(np.log(g[200:300]))
    beta = float(np.linalg.lstsq(x[:, None], y, rcond=None)[0][0])
    assert f["grad_dlog"] == pytest.approx(float(np.abs(y - beta * x).mean()), rel=1e-9)
    rho = np.log(r[200:300])
    adjusted = g[200:300] * np.exp(-beta * (rho - rho.mean()))
    assert f["grad_cv"] == pytest.approx(float(adjusted.std() / adjusted.mean()), rel=1e-9)
    fixed = features_at(RunSeries(metrics(g, np.full(400, 12.0)), loops=12, depth=2), 300, d_model=64)
    plain = features_at(RunSeries(metrics(g, None), loops=12, depth=2), 300, d_model=64)
    assert pd.Series(fixed).equals(pd.Series(plain)) and plain["grad_dlog"] == float(np.abs(np.diff(np.log(g[200:300]))).mean())


def test_a_watch_run_that_records_a_sampled_loop_count_is_judged_net_of_it(tmp_path):
    """flt_diag.watch on a model drawing its loop count per forward (2 to 5): the summary's rule 4b is v4's, its
    one window worked out here from the stored gradient norms and counts (no warm-down given: every step)."""
    import torch
    import flt_diag
    from probe_models import UniversalTransformer, batches, lm_loss
    from flt_diag.storage.folders import load_metrics, load_summary, series
    torch.manual_seed(0)
    model = UniversalTransformer(loops=4, sample_loops=True)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with flt_diag.watch(model, folder=tmp_path / "w", optimizer=opt, blocks=[model.layer]) as probe:
        for x in batches(30):
            loss = lm_loss(model(x), x)
            loss.backward()
            opt.step()
            probe.step(loss=loss)
            opt.zero_grad()
    df, s = load_metrics(tmp_path / "w"), load_summary(tmp_path / "w")
    g, r = series(df, M.GRAD_NORM).to_numpy(), series(df, M.LOOPS_RUN).to_numpy()
    assert list(r) == model.sampled and len(set(model.sampled)) > 1
    d, delta = np.diff(np.log(g)), np.diff(np.log(r))
    changes = int((delta != 0).sum())
    if changes >= 20:
        beta = float(np.linalg.lstsq(delta[:, None], d, rcond=None)[0][0])
        expected = float(np.median(np.abs(d - beta * delta)))
    else:
        expected = float(np.median(np.abs(d[delta == 0])))
    assert s.evidence.osc_loop_count == "sampled" and s.osc_dlog_windows[0].count_changes == changes
    assert s.osc_dlog_median == pytest.approx(expected, rel=1e-12)
    assert s.osc_dlog_median_v3 == pytest.approx(float(np.median(np.abs(d))), rel=1e-12)


class _Trainer:
    """What DecidedStop reads of a Trainer: its recipe, run folder, rank, and where it asks the run to stop."""

    def __init__(self, recipe):
        self.recipe, self.run_dir, self.is_main, self.world, self.stopped = recipe, "run", True, 1, None

    def request_stop(self, text):
        self.stopped = text


def _fed_step_by_step(df: pd.DataFrame):
    """A DecidedStop fed a run's rows step by step, as the Trainer feeds it; (its decision, the first step at which
    decided_at on the whole table up to that step decides: the independent replay)."""
    from flt_diag.judge.decided import decided_at
    from flt_diag.judge.verdict import Recipe
    from flt_diag.training.decided_stop import DecidedStop
    recipe = Recipe.of(series_config(STEPS, loops=12, warmdown_frac=0.2))
    stop, trainer = DecidedStop(["training"]), _Trainer(recipe)
    replay = None
    for step, rows in df.groupby("step", sort=True):
        stop.on_rows(trainer, int(step), list(rows.itertuples(index=False, name=None)))
        if replay is None and decided_at(df[df.step <= step], recipe, ["training"]) is not None:
            replay = int(step)
    return stop.decision, replay


def test_the_stop_once_decided_reads_the_loop_count_as_the_verdict_does():
    """A stars-like run on a clean descent (v4: stable, v3: unstable): a run stopped once decided must not stop it
    (it did, when the stop kept no loops_run and so judged by v3: stage D's stars-source probes, 2026-12-07); a real
    oscillation at a sampled count is stopped at the step the replay on the whole table gives."""
    r = stars_counts(STEPS)
    clean = metrics(gradients(r, slope=1.5), r)
    decision, replay = _fed_step_by_step(clean)
    assert replay is None and decision is None
    shaking = metrics(gradients(r, slope=1.5, alternation=0.5), r)
    decision, replay = _fed_step_by_step(shaking)
    assert replay is not None and decision is not None and decision.step == replay
