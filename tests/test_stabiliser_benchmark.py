"""analysis/stabiliser_benchmark.py (issue 56's benchmark, read as its plan fixes): a line's breaking lr from
made-up probes whose answer is known by hand, Holm's adjustment against a hand computation, the exact p with ties
against a full enumeration of the splits, no test before the plan's 72 lines are finished, and bad input as one
line."""
import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
import stabiliser_benchmark as B  # noqa: E402


def probes(variant, seed, outcomes):
    """outcomes {lr: stable?} -> probe rows of one line."""
    return [dict(variant=variant, seed=seed, lr=float(lr), loops=12, verdict="stable" if ok else "collapsed",
                 val_loss=2.0, code="made-up") for lr, ok in outcomes.items()]


@pytest.mark.parametrize("outcomes, breaking, finished, monotone", [
    ({16: True, 64: False, 32: False}, 32, True, True),          # bisection: held at 16, broke at 32
    ({16: False, 4: False, 1: False}, 1, True, True),            # broke at the grid's first value
    ({16: True, 64: True, 256: True}, 512, True, True),          # held at the top: above the grid
    ({16: True, 64: True}, 512, False, True),                    # held so far, the top not probed
    ({16: True, 64: False}, 64, False, True),                    # 32 not probed yet: the bracket is open
    ({16: False, 8: True, 32: True}, 16, True, False),           # held above the breaking lr: not monotone
])
def test_a_lines_breaking_lr_as_the_plan_reads_it(outcomes, breaking, finished, monotone):
    got = B.read_line(pd.DataFrame(probes("lt", 1, outcomes)))
    assert (got["breaking"], got["finished"], got["monotone"]) == (breaking, finished, monotone)


def test_holm_against_a_hand_computation():
    # sorted p: 0.01 (x4 = 0.04), 0.02 (x3 = 0.06), 0.03 (x2 = 0.06, kept monotone), 0.5 (x1 = 0.5)
    assert B.holm([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06])
    assert B.holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_the_exact_p_with_ties_is_the_enumeration_of_every_split():
    x, y = [32, 64, 64, 512, 16], [1, 1, 2, 64, 1]  # ties within and across the groups, one above the grid
    pooled = np.log2(np.array(x + y, float))
    ranks = pd.Series(pooled).rank().to_numpy()
    sums = np.array([ranks[list(c)].sum() for c in itertools.combinations(range(10), 5)])
    expected = np.mean(sums >= ranks[:5].sum() - 1e-9)
    assert B.exact_p(x, y, "greater") == pytest.approx(expected, rel=1e-9)


def complete(breaking_of):
    """Probes of all 72 lines, each a closed bracket at its variant's breaking lr (seed s adds s - 1 grid steps
    to variants marked by a list)."""
    rows = []
    for v in B.VARIANTS:
        for s in B.SEEDS:
            b = breaking_of(v, s)
            i = B.GRID.index(b)
            outcomes = {b: False} if i == 0 else {B.GRID[i - 1]: True, b: False}
            rows += probes(v, s, outcomes)
    return pd.DataFrame(rows)


def test_no_test_before_every_line_is_finished_then_the_plans_two_families():
    table = complete(lambda v, s: 1.0 if v == "lt" else (64.0 if v == "flt" else 2.0 ** (s + 1)))
    text = B.report_from(table.iloc[:-1])  # one line's last probe missing: 59 finished
    assert "No test yet" in text and "71 of 72" in text
    text = B.report_from(table)
    assert "No test yet" not in text and text.count("| lt |") + text.count("| flt |") >= 2
    res = B.comparisons(B.lines_table(table))
    assert len(res) == 22 and (res.against == "lt").sum() == 11
    flt_vs_lt = res[(res.variant == "flt") & (res.against == "lt")]
    assert flt_vs_lt.p.item() == pytest.approx(1 / 924)  # no overlap, 6 v 6: one split of C(12, 6) is as extreme
    lt_family = res[res.against == "lt"].sort_values("p")  # Holm within the 11 against LT, by hand
    by_hand = np.maximum.accumulate([min(1, (11 - i) * p) for i, p in enumerate(lt_family.p)])
    assert lt_family["p (Holm)"].to_numpy() == pytest.approx(by_hand)
    assert res[(res.variant == "flt") & (res.against == "lt")].decision.item() == "holds longer than LT"
    assert "flt" in text.split("holds longer than LT:")[1].split(";")[0]


def test_the_tables_median_is_on_the_log2_scale_and_above_the_grid_stays_above():
    """Parcae-like lines 16, 128, 128, 16 (an even count): the median is sqrt(16 * 128) = 45.3, the geometric
    middle on the scale the tests use, not the arithmetic 72; a middle pair 256 and "held at the top" is "> 256"."""
    marks = {"parcae": [16.0, 128.0, 128.0, 16.0, 8.0, 256.0], "flt": [256.0, 256.0, 256.0, None, None, None]}
    rows = []
    for v, breaks in marks.items():
        for s, b in zip(B.SEEDS, breaks):
            if b is None:  # held at every probe up to the top: above the grid
                rows += probes(v, s, {B.GRID[-1]: True})
            else:
                i = B.GRID.index(b)
                rows += probes(v, s, {B.GRID[i - 1]: True, b: False})
    table = pd.DataFrame(rows)
    got = B.variants_table(B.lines_table(table), table).set_index("variant")["breaking lr (median)"]
    assert got["parcae"] == f"{math.sqrt(16 * 128):.3g}" == "45.3"  # sorted 8 16 16 128 128 256: middle 16, 128
    assert got["flt (paper)"] == "> 256"


def test_bad_input_is_one_line(tmp_path, capsys):
    assert B.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:")
    pilot = Path(__file__).resolve().parents[1] / "docs" / "data" / "runs" / "stabiliser-pilot" / "stabiliser-pilot"
    assert B.main([str(pilot)]) == 2  # the pilot's seed 0 is not the benchmark's
    assert "no probe of the benchmark" in capsys.readouterr().err


def test_the_loop_dynamics_snapshot_against_the_record_read_by_pandas():
    """On a real archived probe (the pilot's FLT at lr x 8): the last snapshot's records, recomputed from the
    Parquet table read by pandas alone."""
    record = (Path(__file__).resolve().parents[1] / "docs" / "data" / "runs" / "stabiliser-pilot" / "stabiliser-pilot"
              / "flt_K12_seed0_lr8.parquet")
    df = pd.read_parquet(record)
    last = df[df.metric == "loop_spectral_radius"].step.max()
    at = df[df.step == last]
    got = B.snapshot(str(record), 12)
    radius = at[(at.metric == "loop_spectral_radius") & (at.loop == 12)].value.item()
    growth = at[at.metric == "loop_perturbation_growth"].value.to_numpy()
    cosine = df[(df.metric == "token_cosine") & (df.loop == 12)].sort_values("step").value.iloc[-1]
    assert got["spectral radius"] == pytest.approx(radius)
    assert got["growth"] == pytest.approx(float(np.prod(growth) ** (1 / len(growth))))
    assert got["token cosine"] == pytest.approx(cosine)
    agreement = at[at.metric == "loop_grad_cosine"].value
    assert got["agreement"] == pytest.approx(agreement[agreement.abs() <= 1].mean())
    assert got["agreement outside [-1, 1]"] == (agreement.abs() > 1).sum()
    lines = pd.DataFrame([dict(variant="flt", seed=1, breaking=16.0, finished=True, monotone=True, probes=2)])
    probes = pd.DataFrame([dict(variant="flt", seed=1, lr=lr, loops=12, path=str(record)) for lr in (8.0, 16.0)])
    table = B.dynamics_table(lines, probes)
    assert list(table.side) == ["last stable", "first broken"] and (table.lines == 1).all()
