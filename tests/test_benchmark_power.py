"""analysis/benchmark_power.py: round two's power simulation, against counts and spreads worked by hand."""
from __future__ import annotations

import math
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
import benchmark_power as B  # noqa: E402


def test_seed_spreads_keeps_stable_cells_with_enough_seeds_and_computes_the_sample_sd():
    rows = [dict(variant="a", lr=1.0, verdict="stable", val_loss=v) for v in (1.0, 1.2, 1.4, 1.6)]
    rows += [dict(variant="a", lr=1.0, verdict="collapsed", val_loss=9.0)]  # not stable: left out
    rows += [dict(variant="b", lr=2.0, verdict="stable", val_loss=v) for v in (2.0, 2.0, 2.0)]  # 3 seeds: too few
    rows += [dict(variant="c", lr=8.0, verdict="stable", val_loss=v) for v in (1.0, 2.0, 3.0, 4.0)]  # lr > 4
    got = B.seed_spreads(pd.DataFrame(rows))
    assert list(zip(got.variant, got.lr, got.seeds)) == [("a", 1.0, 4)]
    mean = 1.3
    by_hand = math.sqrt(sum((v - mean) ** 2 for v in (1.0, 1.2, 1.4, 1.6)) / 3)
    assert abs(got.sd[0] - by_hand) < 1e-12


def test_the_smallest_exact_two_sided_p_decides_what_six_seeds_can_show():
    """With n = 6 per arm and no overlap, the exact two-sided p is 2 / C(12, 6) = 0.0022 < 0.05/11: a shift far
    beyond the noise is found every time; with n = 5 it is 2 / C(10, 5) = 0.0079 > 0.05/11: never."""
    assert 2 / math.comb(12, 6) < 0.05 / 11 < 2 / math.comb(10, 5)
    assert B.power(6, delta=100.0, sd=1.0, trials=200) == 1.0
    assert B.power(5, delta=100.0, sd=1.0, trials=200) == 0.0


def test_power_under_the_null_matches_the_exact_null_distributions_tail():
    """Under delta = 0 the rejection rate is the exact null probability of p <= alpha/11, counted here by
    enumerating every split of 12 ranks into two sixes (no ties with continuous noise)."""
    n, cut = 6, 0.05 / 11
    sums = [sum(c) for c in combinations(range(1, 2 * n + 1), n)]
    total = len(sums)
    centre = n * (2 * n + 1) / 2
    p_of = {}
    for s in set(sums):
        dev = abs(s - centre)
        p_of[s] = sum(1 for t in sums if abs(t - centre) >= dev) / total
    tail = sum(1 for s in sums if p_of[s] <= cut) / total  # = 2 / 924
    rate = B.power(n, delta=0.0, sd=1.0, trials=20_000, seed=3)
    assert abs(rate - tail) < 4 * np.sqrt(tail * (1 - tail) / 20_000) + 1e-4
