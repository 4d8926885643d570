"""analysis/gradient_path_2.py (issue 53's frozen-embedding contrast, fixed in its plan): the exact U
distribution against scipy's exact Mann-Whitney p-values, the Hodges-Lehmann interval against the interval got by
inverting scipy's exact two-sided test, the plan's reading of each outcome, and the refusal to analyse before the
plan's 20 runs are archived."""
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import mannwhitneyu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
import gradient_path_2 as G  # noqa: E402


@pytest.mark.parametrize("m,n", [(3, 4), (10, 10), (7, 5)])
def test_the_exact_u_distribution_gives_scipys_exact_p_values(m, n):
    counts = G.u_null_counts(m, n)
    assert len(counts) == m * n + 1 and counts.sum() == __import__("math").comb(m + n, m)
    x, y = np.arange(m) * 1.7 + 0.3, np.arange(n) * 1.1  # no ties
    u = mannwhitneyu(x, y, alternative="greater", method="exact").statistic
    p_ours = counts[int(u):].sum() / counts.sum()
    assert p_ours == pytest.approx(mannwhitneyu(x, y, alternative="greater", method="exact").pvalue, rel=1e-12)


def test_the_hodges_lehmann_interval_is_the_inverted_exact_test():
    rng = np.random.default_rng(3)
    x, y = rng.normal(0.5, 0.2, 10), rng.normal(0.3, 0.2, 10)
    shift, low, high = G.hodges_lehmann(x, y)
    assert shift == pytest.approx(np.median(np.subtract.outer(x, y)))
    grid = np.linspace(-0.6, 1.0, 3201)
    kept = [s for s in grid if mannwhitneyu(x - s, y, alternative="two-sided", method="exact").pvalue > 0.05]
    assert low == pytest.approx(min(kept), abs=1e-3) and high == pytest.approx(max(kept), abs=1e-3)


def rows(full, trunc):
    r = [dict(arm="LT full, frozen E", seed=i, climb=c, failed=False) for i, c in enumerate(full)]
    return pd.DataFrame(r + [dict(arm="LT k=2, frozen E", seed=i, climb=c, failed=False) for i, c in enumerate(trunc)])


def test_the_plans_reading_of_each_outcome():
    base = np.linspace(0.3, 0.5, 10)
    res, reading = G.primary(rows(base + 0.4, base))
    assert res["p"] < 0.05 and reading.startswith("p < 0.05")
    res, reading = G.primary(rows(base + 0.001, base))
    assert res["p"] >= 0.05 and res["high"] < G.PARTIAL and "no effect the size of a partial" in reading
    res, reading = G.primary(rows(np.linspace(0.3, 1.2, 10), np.linspace(0.35, 0.9, 10)))
    assert res["p"] >= 0.05 and res["high"] >= G.PARTIAL and "inconclusive" in reading
    _, reading = G.primary(rows(np.full(10, 0.1) + base / 100, np.full(10, 0.1)))
    assert "changed the regime" in reading
    res, reading = G.primary(rows(base, base + 0.5))  # the truncated arm climbs more
    assert res["high"] < 0 and "truncated arm climbs more" in reading
    res, _ = G.primary(rows(list(base[:-1]) + [np.nan], base + 0.0005))  # a diverged run: ranked highest
    assert res["p"] == pytest.approx(mannwhitneyu(list(base[:-1]) + [9.0], base + 0.0005, alternative="greater",
                                                  method="exact").pvalue)
    assert np.isfinite(res["shift"])
    assert G.hodges_lehmann(np.arange(3.0), np.arange(2.0))[1:] == (-np.inf, np.inf)  # too few runs: no interval


def test_the_p_value_with_ties_is_the_exact_one_over_every_split():
    """Two diverged runs and equal climbs: p against a full enumeration of the C(20, 10) splits, by hand."""
    import itertools
    full = np.array([0.5, 0.5, 0.6, 0.7, 0.4, np.inf, np.inf, 0.3, 0.5, 0.9])
    trunc = np.array([0.3, 0.5, 0.2, 0.4, 0.4, 0.35, 0.5, 0.1, 0.6, 0.25])
    res, _ = G.primary(rows(np.where(np.isinf(full), np.nan, full), trunc))
    pooled = np.concatenate([full, trunc])
    ranks = pd.Series(pooled).rank().to_numpy()  # mid-ranks for ties
    observed = ranks[:10].sum()
    sums = [ranks[list(c)].sum() for c in itertools.combinations(range(20), 10)]
    p = np.mean(np.array(sums) >= observed - 1e-9)
    assert res["p"] == pytest.approx(p, rel=1e-9)


def test_no_primary_before_the_plans_runs_are_in_and_bad_input_is_one_line(tmp_path, capsys):
    root = Path(__file__).resolve().parents[1] / "docs" / "data" / "runs" / "gradient-path-2"
    assert G.main([str(root)]) == 0
    out = capsys.readouterr().out
    n = sum(1 for a in ("g53-0", "g53-2") for _ in (root / a).glob("*.parquet"))
    assert ("not analysed yet" in out) == (n < 20) and "commit" in out
    assert G.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:")
