"""Verdict v4 on the archive (docs/data/runs/**): every record whose loop count is fixed gets v3's verdict bit for
bit, its rule-4b index equal to one recomputed here by v3's written-out rule (docs/plans/2026-12-01-verdict-v3-
and-warning-evaluation.md, rule 4b), and every record keeps the v3 verdict its archive holds (`verdict` of a v3
summary, `verdict_v3` of a v4 one). The whole archive is slow (marked); one folder runs unmarked."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from flt_diag.judge import verdict as X
from flt_diag.storage import archive, metric_names as M
from flt_diag.storage.folders import load_config, load_metrics, load_summary, series

RUNS = Path(__file__).resolve().parents[1] / "docs" / "data" / "runs"
RECORDS = sorted(p for p in RUNS.rglob("*.parquet") if archive.is_record(p))
FAST = [p for p in RECORDS if p.parent.name == "readme-main-job"]  # 20 fixed-K records: the unmarked subset


def v3_index(grad, steps: int, warmdown_frac: float, window: int = 200) -> float:
    """Rule 4b of v3 written out: pairs of consecutive recorded steps t, t+1 < N - round(f N) with a finite positive
    g at both, d = log g(t+1) - log g(t); per window [k w, (k+1) w) of t with >= 20 pairs the median |d|; the largest."""
    end = steps - round(warmdown_frac * steps)
    g = grad[(grad.index < end)]
    g = g[np.isfinite(g.to_numpy()) & (g.to_numpy() > 0)]
    t, logs = g.index.to_numpy(), np.log(g.to_numpy())
    ok = np.diff(t) == 1
    d, first = np.diff(logs)[ok], t[:-1][ok]
    medians = [float(np.median(np.abs(d[first // window == k]))) for k in np.unique(first // window)
               if (first // window == k).sum() >= 20]
    return max(medians) if medians else math.nan


def stored_v3(path: Path) -> str:
    s = load_summary(path)
    assert s is not None and s.verdict_version in (3, 4)
    return s.verdict if s.verdict_version == 3 else s.verdict_v3


def check(path: Path) -> None:
    df, stored = load_metrics(path), load_config(path)
    cfg = X.stored_config(stored)
    old = load_summary(path)
    prediction = old.prediction.as_written() if old is not None and old.prediction is not None else None
    name, evidence, index = X.judged(df, cfg, stored.unigram_entropy, prediction)
    r = series(df, M.LOOPS_RUN).to_numpy()
    fixed = len(np.unique(r[np.isfinite(r)])) < 2
    assert index["verdict_v3"] == stored_v3(path), path
    v3 = v3_index(series(df, M.GRAD_NORM), cfg.train.steps, cfg.train.warmdown_frac, cfg.verdict.osc_window)
    same = (lambda a, b: a == b or (math.isnan(a) and math.isnan(b)))
    assert same(index["osc_dlog_median_v3"], v3), path
    if fixed:
        assert name == index["verdict_v3"] and evidence["osc_loop_count"] == "fixed", path
        assert same(index["osc_dlog_median"], v3), path


@pytest.mark.parametrize("path", FAST, ids=lambda p: p.name)
def test_a_fixed_loop_count_record_is_judged_by_v4_as_by_v3(path):
    check(path)


@pytest.mark.slow
def test_every_archived_record_keeps_its_v3_verdict_and_a_fixed_count_is_judged_as_by_v3():
    assert len(RECORDS) >= 400
    for path in RECORDS:
        check(path)
