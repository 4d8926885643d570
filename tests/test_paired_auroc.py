"""analysis/paired_auroc.py against independent computations: its AUROC against the Mann-Whitney U of
scipy.stats.mannwhitneyu divided by n1 * n2, its exact permutation p against 1 / C(n, k) and against scipy's
exact Mann-Whitney test, its bootstrap drawing whole configurations (never single runs), and its refit and prior
against the AUROCs committed in docs/data/warning-eval-w4/comparison.csv (computed by flt_diag's own code)."""
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import mannwhitneyu

from cli_errors import one_error_line

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))
import paired_auroc as P  # noqa: E402

W4 = ROOT / "docs" / "data" / "warning-eval-w4"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auroc_is_the_mann_whitney_u_over_n1_n2(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 30).astype(bool)
    y[:2] = [True, False]
    score = rng.integers(0, 6, 30).astype(float)  # many ties
    u = mannwhitneyu(score[y], score[~y], alternative="two-sided").statistic
    assert P.auroc(y, score) == pytest.approx(u / (y.sum() * (~y).sum()))


def test_auroc_without_both_outcomes_is_nan():
    assert math.isnan(P.auroc([1, 1, 1], [0.1, 0.2, 0.3]))


@pytest.mark.parametrize("n, k", [(7, 2), (10, 2), (11, 10), (6, 3)])
def test_all_failures_ranked_first_has_exact_p_one_over_n_choose_k(n, k):
    y = np.r_[np.ones(k, bool), np.zeros(n - k, bool)]
    score = np.r_[np.arange(k) + 100.0, np.arange(n - k, dtype=float)]
    p, total = P.exact_p(y, score)
    assert total == math.comb(n, k) and p == pytest.approx(1 / math.comb(n, k))


def test_exact_p_matches_scipys_exact_mann_whitney_without_ties():
    rng = np.random.default_rng(3)
    score = rng.permutation(12).astype(float)
    y = np.zeros(12, bool)
    y[[0, 3, 5, 8]] = True
    expected = mannwhitneyu(score[y], score[~y], alternative="greater", method="exact").pvalue
    assert P.exact_p(y, score)[0] == pytest.approx(expected)


def _table(sizes):
    rows = []
    for g, size in enumerate(sizes):
        rows += [dict(variant="lt", loops=g, depth=2, width=64, lr_scale=1.0, seed=s) for s in range(size)]
    return pd.DataFrame(rows)


def test_the_bootstrap_draws_whole_configurations_not_runs():
    sizes = [1, 2, 3, 5, 8]
    keys = P.config_keys(_table(sizes))
    size_of = {k: int((keys == k).sum()) for k in np.unique(keys)}
    lengths = set()
    for idx in P.cluster_draws(keys, 300, seed=0):
        drawn = pd.Series(keys[idx]).value_counts()
        # every drawn configuration comes with all its runs (a multiple of its size), and as many
        # configurations are drawn as there are
        assert all(count % size_of[k] == 0 for k, count in drawn.items())
        assert sum(count // size_of[k] for k, count in drawn.items()) == len(sizes)
        # each run of a drawn configuration appears equally often: whole groups, not runs
        for k in drawn.index:
            assert len(set(pd.Series(idx[keys[idx] == k]).value_counts())) == 1
        lengths.add(len(idx))
    assert len(lengths) > 1  # a run-level bootstrap would draw len(keys) rows every time


def test_paired_is_refit_minus_prior_on_the_same_draws():
    rng = np.random.default_rng(4)
    keys = np.repeat(np.arange(10).astype(str), 4)
    y = np.repeat(rng.permutation([1] * 4 + [0] * 6), 4).astype(bool)
    refit = y + rng.normal(0, 0.7, 40)
    prior = y + rng.normal(0, 0.7, 40)
    out = P.paired(y, refit, prior, keys, draws=400, seed=1)
    assert out["difference"] == pytest.approx(P.auroc(y, refit) - P.auroc(y, prior))
    assert out["draws_used"] + out["draws_skipped"] == 400 and out["lo"] <= out["hi"]
    same = P.paired(y, refit, refit, keys, draws=100)
    assert same["difference"] == 0 and same["lo"] == 0 and same["hi"] == 0


def test_the_refit_and_prior_reproduce_the_committed_w4_aurocs_at_step_300():
    rows = pd.read_csv(W4 / "rows.csv")
    committed = pd.read_csv(W4 / "comparison.csv")
    committed = committed[(committed.set == "all") & (committed.step == 300)].set_index("score").auroc
    at = rows[rows.step == 300].reset_index(drop=True)
    refit, prior = P.scores(at, P.RECIPE)
    assert P.auroc(at.failed, refit) == pytest.approx(committed["refit (config CV)"], abs=1e-9)
    assert P.auroc(at.failed, prior) == pytest.approx(committed["prior (config CV)"], abs=1e-9)


def test_the_command_refuses_a_missing_file_and_a_table_without_labels(tmp_path, capsys):
    assert P.main([str(tmp_path / "none.csv")]) == 2 and "none.csv" in one_error_line(capsys, blank_lines=False)
    (tmp_path / "t.csv").write_text("a,b\n1,2\n")
    assert P.main([str(tmp_path / "t.csv")]) == 2 and "failed" in one_error_line(capsys, blank_lines=False)


def test_exact_mode_prints_one_row_per_step(capsys):
    assert P.main([str(W4 / "rows.csv"), "--exact", "exit-loss gap (final - best loop)",
                   "--where", "variant=lt", "loops=8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + 4 and "| 300 | 7 (2) | 1.00 | 0.048 | 1/21 = 0.048 |" in out
    assert P.main([str(W4 / "rows.csv"), "--exact", "exit-loss gap (final - best loop)", "--where", "loops=99"]) == 2
    assert "no row" in one_error_line(capsys, blank_lines=False)
