"""Verdict v3 on synthetic series, one test per rule (docs/plans/2026-12-01-verdict-v3-and-warning-evaluation.md):
the stall against the unigram entropy, the gradient-oscillation index before the warm-down, the peer flags
behind / no_loop_gain with the pooled seed noise written out here, and the sensitivity table. Expected
values are computed here from the series (the trailing mean, the median, the pooled SD formula), not
read back from the code."""
from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pandas as pd
import pytest

from fake_runs import make_run, make_series_run, series_config, series_metrics
from flt_diag.judge import verdict as X
from flt_diag.results.sensitivity import sensitivity
from flt_diag.results.tables import summary_table, sweep_summary
from flt_diag.storage.folders import CELLS, load_summary, write_json
from flt_diag.grids.sweep import SweepSpec, write_summary
from fake_runs import config

H1 = 3.25  # the byte-level stdlib corpus's unigram entropy, in nats
MARGIN = max(0.1, 0.05 * H1)  # tol(H1) = max(recovery_abs, recovery_rel * H1) at the defaults


def curve(values) -> pd.Series:
    return pd.Series(np.asarray(values, dtype=float), index=range(len(values)))


def descent_to(final: float, steps: int = 800) -> pd.Series:
    """A loss falling from 5.5 and levelling off at `final` (the 50-step trailing mean ends there)."""
    t = np.arange(steps)
    return curve(final + (5.5 - final) * np.exp(-t / 60))


def judge(loss, grad_norm, steps=None, warmdown_frac: float = 0.2, unigram_entropy: float | None = 5.0):
    """summary.json of a synthetic run (H1 = 5 far above its final loss of 1.5: only rule 4 can fire)."""
    cfg = series_config(len(loss), warmdown_frac=warmdown_frac)
    return X.summarize(series_metrics(loss, grad_norm, steps=steps), cfg, unigram_entropy)


def clean_gradients(steps: int, sigma: float = 0.1, seed: int = 0) -> np.ndarray:
    """A clean descent's gradient norm: a slow trend times multiplicative noise exp(sigma * z), z ~ N(0, 1)."""
    t = np.arange(steps)
    return np.exp(-t / (2 * steps) + sigma * np.random.default_rng(seed).standard_normal(steps))


# ---------------------------------------------------------------- rule 3: stalled

def test_a_stall_just_below_the_unigram_entropy_is_stalled():
    loss = descent_to(H1 - 0.01)
    s_final = loss.iloc[-50:].mean()  # the 50-step trailing mean at the last step, by hand
    assert s_final > H1 - MARGIN
    v, ev = X.verdict(loss, H1)
    assert v == "stalled" and ev["stalled"]
    assert ev["stall_reference"] == H1 and ev["stall_margin"] == pytest.approx(MARGIN)
    assert "unigram entropy" in ev["reason"]


def test_a_run_ending_half_a_nat_below_the_unigram_entropy_is_not_stalled():
    v, ev = X.verdict(descent_to(H1 - 0.5), H1)
    assert v == "stable" and not ev["stalled"]
    # between the two: H1 - 0.15 is inside the 0.1625 margin, H1 - 0.17 outside it
    assert X.verdict(descent_to(H1 - 0.15), H1)[0] == "stalled"
    assert X.verdict(descent_to(H1 - 0.17), H1)[0] == "stable"


def test_without_a_unigram_entropy_no_stall_is_judged_and_the_evidence_says_so():
    v, ev = X.verdict(descent_to(H1), None)
    assert v == "stable" and not ev["stalled"] and ev["stall_judged"].startswith("no")


def test_a_loss_that_climbs_and_stays_up_is_collapsed_before_it_is_stalled():
    t = np.arange(800)
    loss = np.where(t < 300, 5.5 - t * 0.01, 2.5 + (t - 300) * 0.003)  # down to 2.5, then up to 4.0 > H1
    assert X.verdict(curve(loss), H1)[0] == "collapsed"


# ---------------------------------------------------------------- rule 4b: gradient oscillation

@pytest.mark.parametrize("steps", [300, 2000, 10000])
def test_a_clean_descent_with_multiplicative_noise_is_stable_at_any_length(steps):
    s = judge(descent_to(1.5, steps), clean_gradients(steps, 0.1))
    assert s.verdict == "stable", s.evidence.reason
    # the null model: |dlog g| = |sigma (z1 - z2)| has median sqrt(2) * sigma * Phi^-1(3/4) = 0.954 sigma
    null_median = math.sqrt(2) * 0.1 * NormalDist().inv_cdf(0.75)
    assert s.osc_dlog_median == pytest.approx(null_median, rel=0.3)
    assert s.evidence.osc_windows_judged >= 1


def test_the_threshold_is_the_null_models_median_for_a_43_percent_jitter():
    """log 1.5 = 0.954 sigma at sigma = 0.425: the median of a long noise-only series sits there."""
    sigma = math.log(1.5) / (math.sqrt(2) * NormalDist().inv_cdf(0.75))
    assert sigma == pytest.approx(0.425, abs=0.001)
    d = X.log_differences(pd.Series(clean_gradients(200_000, sigma)), 200_000)
    assert np.median(np.abs(d)) == pytest.approx(math.log(1.5), rel=0.01)
    alternation = (d.to_numpy()[1:] * d.to_numpy()[:-1] < 0).mean()  # i.i.d. noise: 2/3 sign changes
    assert alternation == pytest.approx(2 / 3, abs=0.01)


def test_one_isolated_huge_spike_is_not_unstable():
    g = clean_gradients(2000)
    g[700] *= 1000.0
    s = judge(descent_to(1.5, 2000), g)
    assert s.verdict == "stable"
    cv = g[:2000].std() / g[:2000].mean()  # v2's index over the dense steps, by hand: the spike alone exceeds 3
    assert cv > 3


def test_sustained_oscillation_is_unstable():
    n = 2000
    g = np.exp(-np.arange(n) / 4000 + 0.5 * (-1.0) ** np.arange(n))  # log g alternates +-0.5 around a trend
    s = judge(descent_to(1.5, n), g)
    assert s.verdict == "unstable" and "gradient oscillation" in s.evidence.reason
    assert s.osc_dlog_median == pytest.approx(1.0, abs=0.01) and s.osc_alternation == 1.0


def test_oscillation_only_inside_the_warm_down_is_not_unstable():
    n, warmdown = 2000, 400  # warm-down from step 1600 = 2000 - round(0.2 * 2000)
    g = clean_gradients(n)
    wild = np.exp(0.5 * (-1.0) ** np.arange(n))
    inside = np.where(np.arange(n) >= n - warmdown, g * wild, g)
    assert judge(descent_to(1.5, n), inside).verdict == "stable"
    # the same oscillation 100 steps earlier reaches before the warm-down: a window of 100 differences judges it
    earlier = np.where(np.arange(n) >= n - warmdown - 100, g * wild, g)
    s = judge(descent_to(1.5, n), earlier)
    assert s.verdict == "unstable" and s.evidence.osc_dlog_window == [1400, 1599]


def test_windows_with_fewer_than_twenty_consecutive_differences_are_not_judged():
    n = 2000
    wild = np.exp(0.5 * (-1.0) ** np.arange(0, n, 1))
    # recorded every 10 steps but for one burst of 20 consecutive steps (19 differences): nothing judged
    sparse_steps = np.r_[np.arange(0, 500, 10), np.arange(500, 520), np.arange(530, n, 10)]
    s = judge(descent_to(1.5, n), wild[sparse_steps], steps=sparse_steps)
    assert s.verdict == "stable" and s.evidence.osc_windows_judged == 0
    # 25 consecutive steps (24 differences) recorded in a window: judged
    dense = np.r_[np.arange(0, 500, 10), np.arange(500, 525), np.arange(530, n, 10)]
    s = judge(descent_to(1.5, n), wild[dense], steps=dense)
    assert s.verdict == "unstable" and s.evidence.osc_windows_judged == 1


# ---------------------------------------------------------------- peer flags

def peer_sweep(out: Path, shifts: dict, loops=(3,)) -> Path:
    """A sweep whose runs' final val losses are the fake curve's plus shifts[(variant, loops)][seed]."""
    seeds = sorted({s for per_seed in shifts.values() for s in range(len(per_seed))})
    variants = sorted({v for v, _ in shifts})
    spec = SweepSpec(config("flt", 3), variants, list(loops), seeds, [1.0])
    (out / CELLS).mkdir(parents=True)
    write_json(out / "sweep.json", spec.to_dict())
    for cell in spec.cells():
        per_seed = shifts[(cell.variant, cell.loops)]
        if cell.seed < len(per_seed):
            make_run(out / CELLS / cell.name, cell.variant, cell.loops, cell.seed, val_shift=per_seed[cell.seed])
    write_summary(out)
    return out


def test_a_cell_half_a_nat_behind_its_peers_is_behind_and_a_hundredth_is_not(tmp_path):
    sweep = peer_sweep(tmp_path / "s", {("lt", 3): [0.5], ("fla", 3): [0.01], ("flt", 3): [0.0]})
    cells = summary_table(sweep).set_index("variant")
    assert cells.loc["lt", "val_gap"] == pytest.approx(0.5)
    assert cells.loc["lt", "behind"] and cells.loc["lt", "behind_margin"] == pytest.approx(0.10)  # one seed
    assert not cells.loc["fla", "behind"] and cells.loc["fla", "val_gap"] == pytest.approx(0.01)
    assert not cells.loc["flt", "behind"]
    runs = sweep_summary(sweep).set_index("variant")  # per run: the same with one seed
    assert runs.loc["lt", "behind"] and not runs.loc["fla", "behind"]


def pooled(cells: list[list[float]]) -> float:
    """The pooled within-cell SD, written out: sqrt(sum_c sum_i (x_ci - mean_c)^2 / sum_c (n_c - 1))."""
    ss = sum(sum((x - sum(c) / len(c)) ** 2 for x in c) for c in cells)
    return math.sqrt(ss / sum(len(c) - 1 for c in cells))


def test_the_behind_margin_pools_the_seed_noise_of_the_other_cells(tmp_path):
    flt, fla, lt = [0.0, 0.04, -0.04], [0.03, 0.09, -0.03], [0.09, 0.09, 0.09]
    sweep = peer_sweep(tmp_path / "s", {("flt", 3): flt, ("fla", 3): fla, ("lt", 3): lt})
    cells = summary_table(sweep).set_index("variant")
    lt_margin = max(0.02, 2 * pooled([fla, flt]) * math.sqrt(1 / 3 + 1 / 3))  # best is FLT (mean 0), 3 seeds each
    fla_margin = max(0.02, 2 * pooled([lt, flt]) * math.sqrt(1 / 3 + 1 / 3))
    assert cells.loc["lt", "behind_margin"] == pytest.approx(lt_margin)
    assert cells.loc["fla", "behind_margin"] == pytest.approx(fla_margin)
    assert cells.loc["lt", "val_gap"] == pytest.approx(0.09) and 0.09 > lt_margin and cells.loc["lt", "behind"]
    assert cells.loc["fla", "val_gap"] == pytest.approx(0.03) and 0.03 < fla_margin and not cells.loc["fla", "behind"]
    # per run: one seed a side (n = 1), the noise pooled over the other variants' cells alike
    runs = sweep_summary(sweep)
    lt0 = runs[(runs.variant == "lt") & (runs.seed == 0)].iloc[0]
    assert lt0.behind_margin == pytest.approx(max(0.02, 2 * pooled([fla, flt]) * math.sqrt(2)))
    assert not lt0.behind  # 0.09 behind at seed 0 is inside one run's noise


def test_no_loop_gain_compares_a_cell_with_the_same_setting_at_one_loop(tmp_path):
    shifts = {("lt", 1): [0.0], ("lt", 3): [-0.005], ("flt", 1): [0.3], ("flt", 3): [0.0]}
    cells = summary_table(peer_sweep(tmp_path / "s", shifts, loops=(1, 3))).set_index(["variant", "loops"])
    assert cells.loc[("lt", 3), "loop_gain"] == pytest.approx(0.005)
    assert cells.loc[("lt", 3), "no_loop_gain"]  # 0.005 better than K = 1: inside the 0.10 one-seed margin
    assert cells.loc[("flt", 3), "loop_gain"] == pytest.approx(0.3) and not cells.loc[("flt", 3), "no_loop_gain"]
    assert not cells.loc[("lt", 1), "no_loop_gain"] and math.isnan(cells.loc[("lt", 1), "loop_gain"])


def test_a_behind_cell_is_not_green_in_the_grid_and_the_report(tmp_path):
    import re
    from matplotlib.colors import to_hex
    from matplotlib.patches import Rectangle
    from flt_diag.results import figures as P
    from flt_diag.results.report import write_report
    from flt_diag.results.figures.style import VERDICT_COLORS
    sweep = peer_sweep(tmp_path / "s", {("lt", 3): [0.5], ("flt", 3): [0.0]})
    ax = (fig := P.FIGURES["collapse"].figure(P.study_of(sweep, ["collapse"]))).axes[0]
    filled = {round(p.get_y() + 0.5): p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()}
    lt, flt = filled[0], filled[1]  # rows in the project's order: lt, then flt
    green = VERDICT_COLORS["stable"]
    assert to_hex(flt.get_facecolor()) == green and not flt.get_hatch()
    assert to_hex(lt.get_facecolor()) != green and lt.get_hatch()
    assert "behind" in [t.get_text() for t in fig.legends[0].get_texts()]
    html = write_report(sweep, tmp_path / "report.html").read_text()
    lt_row = re.search(r"<tr><td[^>]*>lt</td>(.*?)</tr>", html).group(1)
    assert "stable" in lt_row and f"background:{green}" not in lt_row and "behind (+0.500 &gt; 0.100)" in lt_row
    assert f"background:{VERDICT_COLORS['stalled']}" not in html  # stalled has its own colour, unused here


# ---------------------------------------------------------------- sensitivity

def test_the_sensitivity_table_counts_the_verdicts_each_threshold_moves(tmp_path):
    n = 800
    near = make_series_run(tmp_path / "near", descent_to(H1 - 0.12, n), clean_gradients(n), unigram_entropy=H1,
                           val_loss=3.2)  # 0.12 below H1: stalled at the 0.1625 margin, not at half of it
    jitter = make_series_run(tmp_path / "jitter", descent_to(1.5, n), clean_gradients(n, 0.3), variant="lt",
                             unigram_entropy=H1, val_loss=1.6)  # median |dlog g| ~ 0.29: unstable at x0.5 only
    assert load_summary(near).verdict == "stalled" and load_summary(jitter).verdict == "stable"
    table = sensitivity([near, jitter]).set_index(["threshold", "factor"])
    assert table.loc[("stall_margin", 0.5), "verdicts_changed"] == 1
    assert table.loc[("stall_margin", 0.5), "changes"] == "stalled→stable 1"
    assert table.loc[("stall_margin", 1.5), "verdicts_changed"] == 0
    assert table.loc[("osc_dlog_threshold", 0.5), "changes"] == "stable→unstable 1"
    assert table.loc[("osc_dlog_threshold", 1.5), "verdicts_changed"] == 0
    # recovery_rel defines the stall margin too (max(0.1, 0.05 H1) = 0.1625): x0.5 gives 0.1 < 0.12
    assert table.loc[("recovery_rel", 0.5), "changes"] == "stalled→stable 1"
    assert table.loc[("rebound_abs", 0.5), "verdicts_changed"] == 0
    assert set(table.index.get_level_values("threshold")) == {
        "rebound_abs", "rebound_rel", "recovery_abs", "recovery_rel", "stall_margin", "osc_dlog_threshold",
        "explosion_ratio", "behind_margin"}


def test_summary_recompute_applies_v3_to_a_v2_folder(tmp_path):
    """A folder judged by v2 (config.json with osc_cv_threshold, a plateau above H1 called collapsed)."""
    from flt_diag.cli import main
    from flt_diag.storage.folders import read_json
    run = make_series_run(tmp_path / "r", descent_to(H1 + 0.05), clean_gradients(800), unigram_entropy=H1)
    cfg, old = read_json(run / "config.json"), read_json(run / "summary.json")
    write_json(run / "config.json", {**cfg, "verdict": {**cfg["verdict"], "osc_cv_threshold": 3.0}})
    old.pop("verdict_version")
    write_json(run / "summary.json", {**old, "verdict": "collapsed"})
    assert main(["summary", str(run), "--recompute"]) == 0
    new = load_summary(run)
    assert new.verdict == "stalled" and new.verdict_version == 4 and new.verdict_v3 == "stalled"
