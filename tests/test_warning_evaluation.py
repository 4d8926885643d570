"""The early warning's evaluation (flt_diag.results.warning_evaluation) against independent computations:
AUROC by counting pairs by hand, the Wilson interval from scipy, OLMo-core's spike score by its loop, and
grouped cross-validation that never sees the held-out group's labels."""
import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binomtest

from flt_diag.results import warning_evaluation as W


def test_auroc_counts_pairs_with_ties_as_half():
    y = [1, 1, 0, 0, 0]
    score = [0.9, 0.4, 0.4, 0.1, 0.8]
    pairs = [(p, n) for p, n in itertools.product([0.9, 0.4], [0.4, 0.1, 0.8])]
    by_hand = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert W.auroc(y, score) == pytest.approx(by_hand) and by_hand == pytest.approx(4.5 / 6)


def test_auroc_of_a_perfect_and_a_reversed_score_and_of_one_outcome():
    assert W.auroc([0, 0, 1], [0.1, 0.2, 0.3]) == 1.0
    assert W.auroc([0, 0, 1], [0.3, 0.2, 0.1]) == 0.0
    assert math.isnan(W.auroc([1, 1], [0.1, 0.2]))


@pytest.mark.parametrize("k, n", [(0, 10), (7, 22), (22, 22), (3, 5)])
def test_wilson_interval_matches_scipy(k, n):
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert W.wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-6)


def test_bootstrap_interval_brackets_the_auroc_and_is_degenerate_for_a_perfect_score():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 40)
    score = y + rng.normal(0, 0.8, 40)
    lo, hi = W.bootstrap_interval(y, score, n=500)
    assert lo < W.auroc(y, score) < hi
    assert W.bootstrap_interval([0, 1, 0, 1], [0, 1, 0, 1], n=200) == (1.0, 1.0)


def olmo_by_loop(loss, grad, at, window=128, threshold=6.0):
    """OLMo-core's StabilityMonitorCallback as a plain loop (its documented rule, step by step)."""
    hist_l, hist_g, spikes, steps = [], [], 0, 0
    for x, g in zip(loss[:at], grad[:at]):
        def spike(v, h):
            if len(h) < window:
                return False
            m = sum(h) / len(h)
            s = math.sqrt(sum((u - m) ** 2 for u in h) / len(h))
            return s >= 1e-10 and v > m + threshold * s
        hit = spike(x, hist_l) or spike(g, hist_g)
        hist_l = (hist_l + [x])[-window:]
        hist_g = (hist_g + [g])[-window:]
        steps += 1
        spikes += hit
    return spikes / steps if steps >= window else 0.0


@pytest.mark.parametrize("window", [8, 32])
def test_olmo_spike_score_equals_the_callbacks_loop(window):
    rng = np.random.default_rng(0)
    loss = 3 - np.linspace(0, 1, 300) + rng.normal(0, 0.02, 300)
    grad = 1 + rng.normal(0, 0.05, 300)
    loss[[100, 180]] += 2.0  # two loss spikes
    grad[250] = 40.0  # one gradient spike
    for at in (50, 150, 260, 300):
        assert W.olmo_spike_score(loss, grad, at, window=window) == pytest.approx(olmo_by_loop(loss, grad, at, window))
    assert W.olmo_spike_score(loss, grad, 300, window=window) > 0


def toy_table(n_configs=6, seeds=3, seed=0):
    """One step's rows: configurations of two variants, a feature that tracks the label with noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(n_configs):
        variant = "lt" if c % 2 else "flt"
        for s in range(seeds):
            failed = int(variant == "lt" and rng.random() < 0.7)
            rows.append(dict(variant=variant, loops=3 * (c + 1), depth=2, width=64, lr_scale=1.0, seed=s,
                             failed=failed, resid_level=failed + rng.normal(0, 0.5), grad_cv=rng.normal(), step=100))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("model", ["refit", "prior"])
@pytest.mark.parametrize("by", ["config", "variant"])
def test_grouped_cross_validation_never_sees_the_held_out_groups_labels(model, by):
    table = toy_table()
    p = W.cross_validated(table, model, by, ["resid_level", "grad_cv"])
    keys = W.group_keys(table, by)
    for key in keys.unique():
        flipped = table.copy()
        held = (keys == key).to_numpy()
        flipped.loc[held, "failed"] = 1 - flipped.loc[held, "failed"]
        again = W.cross_validated(flipped, model, by, ["resid_level", "grad_cv"])
        assert np.allclose(p[held], again[held]), key  # its own labels changed nothing about its scores


def test_config_groups_hold_every_seed_of_a_configuration_together():
    table = toy_table()
    keys = W.group_keys(table, "config")
    assert keys.nunique() == 6 and all(keys.value_counts() == 3)
    assert W.group_keys(table, "variant").nunique() == 2


def test_prior_reads_the_configuration_only():
    table = toy_table()
    shuffled = table.copy()
    shuffled["resid_level"] = np.random.default_rng(5).permutation(shuffled.resid_level.to_numpy())
    assert np.allclose(W.cross_validated(table, "prior", "config"), W.cross_validated(shuffled, "prior", "config"))


def test_comparison_reports_each_set_and_score():
    table = toy_table()
    for name in W.DETECTOR_SCORES:
        table[name] = 0.0
    table["packaged"] = table.resid_level
    out = W.comparison(table, ["resid_level", "grad_cv"], sets={"lt": lambda t: (t.variant == "lt").to_numpy()})
    assert set(out.set) == {"all", "lt"}
    packaged = out[(out.set == "all") & (out.score == "packaged")].iloc[0]
    assert packaged.auroc == pytest.approx(W.auroc(table.failed, table.resid_level))
    assert packaged.runs == 18 and packaged.failing == table.failed.sum()


@pytest.mark.parametrize("script, args", [("evaluate_warning.py", ["--out", "OUT"]), ("loop_dynamics_table.py", [])])
def test_an_analysis_script_on_a_missing_folder_is_one_error_line(tmp_path, script, args):
    import subprocess
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "analysis" / script
    missing = tmp_path / "nope"
    done = subprocess.run([sys.executable, str(path), str(missing), *[str(tmp_path / a) if a == "OUT" else a for a in args]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"error: no such file or folder: {missing}", done.stderr


def test_record_scores_read_the_final_loop_at_the_latest_recorded_step_at_or_before_s():
    """The plan's single-record scores, from a hand-built long metrics table: gain every 100 steps, the
    residual every step, the exit loss every 10th step; K = 3 (the final loop is 3)."""
    from flt_diag.storage import metric_names as M
    rows = []
    for step in range(0, 301):
        for loop in (2, 3):
            rows.append((step, M.FIXED_POINT_RESIDUAL, loop, -1, 0.001 * step + loop))
            if step % 100 == 0:
                rows.append((step, M.LOOP_GAIN, loop, -1, 10.0 * step + loop))
        if step % 10 == 0:
            for loop, v in ((1, 5.0), (2, 4.0 - step / 1000), (3, 4.5)):
                rows.append((step, M.EXIT_LOSS, loop, -1, v))
    df = pd.DataFrame(rows, columns=["step", "metric", "loop", "layer", "value"])
    got = W.record_scores(df, 250, 3)
    assert got["loop gain (final loop)"] == 10.0 * 200 + 3  # the step-200 record: the latest <= 250
    assert got["fixed-point residual (final loop)"] == pytest.approx(0.25 + 3)
    assert got["exit-loss gap (final - best loop)"] == pytest.approx(4.5 - (4.0 - 0.25))
    assert W.record_scores(df, 300, 3)["loop gain (final loop)"] == 3003  # step s itself counts (<= s)
    none = W.record_scores(df[df.metric == M.FIXED_POINT_RESIDUAL], 250, 3)
    assert math.isnan(none["loop gain (final loop)"]) and math.isnan(none["exit-loss gap (final - best loop)"])


def test_a_record_score_is_agreed_at_its_own_threshold_or_not_at_all():
    y = np.array([0, 0, 1, 1])
    gain = np.array([0.8, 1.2, 1.1, 3.0])  # read as fails at >= 1: 3 of 4 agree
    row = W.score_row("loop gain (final loop)", y, gain, W.AGREEMENT_AT["loop gain (final loop)"])
    assert row["agreement"] == 0.75 and row["auroc"] == pytest.approx(0.75)
    row = W.score_row("x", y, gain, None)
    assert math.isnan(row["agreement"]) and row["auroc"] == pytest.approx(0.75)


def test_the_evaluation_scripts_sets_select_by_every_condition_and_any_listed_value():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "analysis" / "evaluate_warning.py"
    spec = importlib.util.spec_from_file_location("evaluate_warning_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    table = pd.DataFrame(dict(variant=["lt", "lt", "lt", "flt"], loops=[3, 6, 9, 9], depth=[2, 2, 2, 6]))
    assert script.selector(["variant=lt", "loops=6,9"])(table).tolist() == [False, True, True, False]
    assert script.selector(["loops=9"])(table).tolist() == [False, False, True, True]
    assert script.selector(["depth=6", "variant=lt"])(table).tolist() == [False] * 4


def test_a_run_is_scored_only_in_the_first_half_of_its_length_and_before_its_end():
    from flt_diag.results.warning_evaluation import scored_steps
    at = [100, 200, 300, 500]
    assert scored_steps(at, total=600, done=600) == [100, 200, 300]  # 500 of 600 is not early
    assert scored_steps(at, total=1000, done=1000) == at
    assert scored_steps(at, total=2000, done=250) == [100, 200]  # stopped at 250: nothing after it
    assert scored_steps(at, total=2000, done=100) == []


def test_a_held_out_rows_missing_feature_is_filled_from_the_training_rows_only():
    """A NaN in a held-out row counts as the mean of the *other* groups' values (by hand): the held-out
    group's own values (shifted far away here) do not enter its fit."""
    table = toy_table()
    keys = W.group_keys(table, "config")
    key = keys.iloc[0]
    held = (keys == key).to_numpy()
    table.loc[held, "resid_level"] += 50.0  # the held-out group sits far from the others
    row = int(np.flatnonzero(held)[0])
    with_nan = table.copy()
    with_nan.loc[row, "resid_level"] = np.nan
    filled = table.copy()
    filled.loc[row, "resid_level"] = table.resid_level[~held].mean()
    p_nan = W.cross_validated(with_nan, "refit", "config", ["resid_level", "grad_cv"])
    p_filled = W.cross_validated(filled, "refit", "config", ["resid_level", "grad_cv"])
    assert p_nan[row] == pytest.approx(p_filled[row], abs=1e-9)


def test_olmo_fired_is_the_spike_score_read_as_a_detector_and_the_wide_refit_is_its_own_row():
    table = toy_table()
    for name in W.DETECTOR_SCORES:
        table[name] = 0.0
    table["olmo"] = np.where(table.failed == 1, 0.02, 0.0) * (np.arange(len(table)) % 2)  # half the failures fire
    table["packaged"] = table.resid_level
    out = W.comparison(table, ["resid_level"], wide_features=["resid_level", "grad_cv"])
    fired = out[(out.score == "olmo fired")].iloc[0]
    pos, k = int(table.failed.sum()), int((table.olmo > 0).sum())  # k of the failures fire, no stable run does
    assert fired.auroc == pytest.approx(k / pos * 1.0 + (1 - k / pos) * 0.5)  # fired > quiet; quiet ties 1/2
    assert fired.agreement == pytest.approx((len(table) - (pos - k)) / len(table))  # wrong: the silent failures
    wide = out[out.score == "refit, 2 features (config CV)"].iloc[0]
    assert wide.auroc == pytest.approx(W.auroc(table.failed, W.cross_validated(table, "refit", "config",
                                                                                ["resid_level", "grad_cv"])))
    narrow = out[out.score == "refit (config CV)"].iloc[0]
    assert narrow.auroc == pytest.approx(W.auroc(table.failed, W.cross_validated(table, "refit", "config",
                                                                                  ["resid_level"])))


def _comparison_rows(values: dict) -> pd.DataFrame:
    """A comparison table at step 300: {(set, score): auroc}."""
    return pd.DataFrame([dict(step=300, set=k[0], score=k[1], auroc=v) for k, v in values.items()])


@pytest.mark.parametrize("refit, prior, in_set, ships", [
    (0.80, 0.74, 0.90, True),    # beats the prior by 0.06, as good as packaged (0.90) in the set
    (0.80, 0.76, 0.90, False),   # by 0.04 only
    (12 / 20, 11 / 20, 0.90, True),  # by exactly 0.05 (AUROCs are fractions; 0.55 + 0.05 > 0.6 in floats)
    (0.80, 0.60, 0.85, False),   # beats the prior, but below packaged inside the set
    (math.nan, 0.5, 0.9, False),  # no refit score: nothing replaces the packaged predictor
])
def test_what_ships_follows_the_rule_fixed_in_the_plan(refit, prior, in_set, ships):
    table = _comparison_rows({("all", "refit (config CV)"): refit, ("all", "prior (config CV)"): prior,
                              ("all", "packaged"): 0.95, ("LT K=9", "refit (config CV)"): in_set,
                              ("LT K=9", "packaged"): 0.90, ("LT K=6", "refit (config CV)"): math.nan,
                              ("LT K=6", "packaged"): math.nan})  # one outcome only: no AUROC, no say
    decided, reason = W.ship_decision(table)
    assert decided is ships and "\n" not in reason
    assert ("refit ships" in reason) is ships


def test_what_ships_without_the_step_the_rule_reads_says_so():
    decided, reason = W.ship_decision(_comparison_rows({("all", "packaged"): 0.9}).assign(step=200))
    assert not decided and "nothing was scored at step 300" in reason
    assert W.ship_decision(pd.DataFrame())[0] is False


def test_the_ablation_adds_the_loop_dynamics_records_as_a_group_on_the_runs_that_have_them():
    table = toy_table()
    rng = np.random.default_rng(3)
    has = np.arange(len(table)) < 12  # the last six runs have no records
    gain = np.where(table.failed == 1, 3.0, 0.5) * np.exp(rng.normal(0, 0.1, len(table)))
    table[W.RECORD_SCORES[0]] = np.where(has, gain, np.nan)
    table.loc[0, W.RECORD_SCORES[0]] = np.inf  # an exploded loop: the largest gain, not a missing one
    table[W.RECORD_SCORES[1]] = np.where(has, 0.1, np.nan)
    table[W.RECORD_SCORES[2]] = np.where(has, 0.0, np.nan)  # a zero gap: clipped, not -inf
    sub = W.with_record_features(table)
    assert len(sub) == 12
    assert sub["log10 loop gain"].iloc[0] == 6.0 and sub["log10 exit-loss gap"].iloc[1] == -3.0
    assert sub["log10 loop gain"].iloc[1] == pytest.approx(math.log10(gain[1]))
    out = W.ablation(table, ["resid_level", "grad_cv"])
    rec = out[out.subset == "with records"].set_index("dropped")
    assert set(rec.score) == {"refit, 5 features"}
    assert set(rec.index) >= {"(none)", "loop dynamics"} and (rec.runs == 12).all()
    assert rec.loc["(none)", "features"] == 5 and rec.loc["loop dynamics", "features"] == 2
    # the gain separates the toy labels; dropping the group leaves the noisy features only
    expected = W.auroc(sub.failed, W.cross_validated(sub, "refit", "config", ["resid_level", "grad_cv"]))
    assert rec.loc["loop dynamics", "auroc"] == pytest.approx(expected)
    assert (out[out.subset == "all"].runs == 18).all()


def test_tie_rounded_ties_values_equal_but_for_their_last_bits_and_keeps_small_ones_apart():
    """Two fits that agree up to float rounding tie on every CPU; distinct probabilities stay distinct, however
    small or however close to 1."""
    from flt_diag.results.warning_evaluation import auroc, tie_rounded
    p = np.array([0.3, 0.1, 2.4e-10, 1.3e-8, 1 - 1e-7, 1 - 2e-7, 0.0])
    jittered = np.nextafter(np.nextafter(p, 1), 1)  # two ulp up
    assert (tie_rounded(jittered[:6]) == tie_rounded(p[:6])).all() and tie_rounded(p)[-1] == 0
    assert len(set(tie_rounded(p).tolist())) == len(p)
    y = np.array([1, 0])  # a failing and a stable run whose scores differ by one ulp: a tie, AUROC 0.5 either way
    for a, b in ((0.1, np.nextafter(0.1, 0)), (np.nextafter(0.1, 0), 0.1)):
        assert auroc(y, tie_rounded(np.array([a, b]))) == 0.5
