"""analysis/factorial.py (the gradient-path factorial's evaluation, fixed in its plan) on folders whose
verdicts and records are built by hand: counts, the one-sided Fisher p-value from the hypergeometric
tail (scipy.stats.hypergeom, not fisher_exact), the climb onset, the agreement drop and the degenerate
fixed point, each against the value written into the series."""
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import hypergeom

from fake_runs import ENV, series_config
from flt_diag.judge.verdict import summarize
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import CONFIG, SUMMARY, MetricsWriter, load_metrics, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
import factorial  # noqa: E402

STEPS, K = 600, 3


def make(run_dir: Path, variant: str, grad_loops: int, seed: int, collapses: bool, cosine: float, drop: bool):
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS)
    loss = 2.0 + 3.0 * np.exp(-t / 40) + 0.01 * rng.standard_normal(STEPS)
    if collapses:
        loss = loss + np.where(t > 300, 0.01 * (t - 300), 0.0)  # climbs from step ~300 and stays up
    cfg = series_config(STEPS, variant, K, seed)
    doc = cfg.to_dict()
    doc["train"]["grad_loops"] = grad_loops
    run_dir.mkdir(parents=True)
    write_json(run_dir / CONFIG, {**doc, "env": ENV, "corpus": {"unigram_entropy": 4.5}})
    rows = [(int(s), M.LOSS, -1, -1, float(v)) for s, v in zip(t, loss)]
    rows += [(int(s), M.GRAD_NORM, -1, -1, 1.0 + 0.01 * (s % 2)) for s in t]
    for s in range(0, STEPS, 50):  # (step 0 is left out of the agreement: the plan reads A from step 200)
        for loop in range(1, K + 1):
            a = 0.0 if loop <= (K - grad_loops if 0 < grad_loops < K else 0) else (
                1.0 if s == 0 else 0.8 - (0.5 if drop and s >= 250 else 0))
            for layer in (1, 2):
                rows.append((s, M.LOOP_GRAD_COSINE, loop, layer, a))
        for loop in range(2, K + 1):
            for metric, v in ((M.LOOP_GAIN, 3.0), (M.LOOP_SPECTRAL_RADIUS, 0.5), (M.LOOP_SPECTRAL_RESIDUAL, 1e-4),
                              (M.LOOP_MEAN_GAIN, 0.7), (M.LOOP_PERTURBATION_GROWTH, 0.25 if loop == 2 else 1.0)):
                rows.append((s, metric, loop, -1, v))
    for s in range(0, STEPS, 10):
        for loop in range(1, K + 1):
            rows.append((s, M.TOKEN_COSINE, loop, -1, cosine if s >= 400 else 0.2))
            rows.append((s, M.EFFECTIVE_RANK, loop, -1, 5.0))
    w = MetricsWriter(run_dir)
    w.extend(rows)
    w.flush()
    write_json(run_dir / SUMMARY, summarize(load_metrics(run_dir), cfg, 4.5, wall_time=1.0))


@pytest.fixture
def folders(tmp_path):
    plan = {  # (variant, grad_loops): per seed (collapses, final-loop token cosine, agreement drops)
        ("lt", 0): [(True, 0.95, True), (True, 0.95, False), (True, 0.5, True), (False, 0.3, False)],
        ("lt", 2): [(False, 0.3, False), (False, 0.95, False), (True, 0.95, True), (False, 0.3, False)],
    }
    for (variant, g), seeds in plan.items():
        for seed, (c, cos, drop) in enumerate(seeds):
            make(tmp_path / f"f-{g}" / f"{variant}_s{seed}", variant, g, seed, c, cos, drop)
    return sorted((tmp_path / "f-0").iterdir()) + sorted((tmp_path / "f-2").iterdir())  # run folders


def test_counts_and_the_one_sided_fisher_test(folders):
    runs = factorial.runs_table(folders)
    arms = runs.groupby("arm").failed.sum().to_dict()
    assert arms == {"LT full": 3, "LT k=2": 1}
    t = factorial.fisher(runs, "LT full", "LT k=2")
    # P(X >= 3), X ~ hypergeometric: 8 runs, 4 failures, 4 drawn (the full arm)
    assert t["p"] == pytest.approx(hypergeom.sf(2, 8, 4, 4), rel=1e-9)
    assert t["counts"] == "3/4 vs 1/4"


def test_onset_agreement_and_degenerate_fixed_point(folders):
    runs = factorial.runs_table(folders).set_index(["arm", "seed"])
    r = runs.loc[("LT full", 0)]
    assert 290 <= r.onset <= 330  # the loss was built to climb from step 300
    assert r.agreement_fell and r.A_first == pytest.approx(0.8) and r.A_before == pytest.approx(0.3)
    assert not runs.loc[("LT full", 1)].agreement_fell
    assert r.degenerate and r.degenerate_from == 400 and r.token_cosine == pytest.approx(0.95)
    assert not runs.loc[("LT full", 2)].degenerate
    # truncated: loop 1 is detached (K = 3, k = 2) and is left out of A
    assert runs.loc[("LT k=2", 2)].A_first == pytest.approx(0.8)
    assert r.spectral_radius == 0.5 and r.sigma_max == 3.0
    assert r.growth == pytest.approx(np.exp((np.log(0.25) + np.log(1.0)) / 2))
    text = factorial.report(folders)
    assert "LT full" in text and "3/4" in text and "1/4" in text


def test_a_missing_folder_is_one_line(tmp_path, capsys):
    assert factorial.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1
