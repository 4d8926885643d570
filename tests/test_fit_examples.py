"""Fit-examples tables (`fit-predictor --examples-out`): a fit set as one file that refits the same
predictor without the run folders, relabels runs judged before the verdict change, and is checked like
every file from elsewhere."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from fake_runs import make_sweep
from flt_diag.storage.files import BadFile, load_examples
from flt_diag.results.predictor_fit import examples_from_rows
from flt_diag.cli import main


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit-examples")
    sweep = make_sweep(root / "sw", seeds=(0, 1))
    args = ["fit-predictor", str(sweep), "--at", "20", "40", "--out", str(root / "from-folders.json")]
    assert main([*args, "--examples-out", str(root / "examples.csv")]) == 0
    return root


def test_a_table_refits_the_predictor_its_folders_fit(fitted):
    assert main(["fit-predictor", str(fitted / "examples.csv"), "--at", "20", "40",
                 "--out", str(fitted / "from-table.json")]) == 0
    a, b = (json.loads((fitted / f).read_text())["models"] for f in ("from-folders.json", "from-table.json"))
    assert a.keys() == b.keys() == {"20", "40"}
    for step in a:
        assert a[step]["coef"] == pytest.approx(b[step]["coef"], abs=1e-9) and a[step]["runs"] == b[step]["runs"]


def test_the_table_has_a_row_per_run_and_step_with_the_stored_verdict(fitted):
    table = pd.read_csv(fitted / "examples.csv")
    assert len(table) == 2 * 2 * 4  # 2 seeds x 4 finished cells x 2 steps
    summary = json.loads((fitted / "sw" / "cells" / "lt_K06_seed1_lr1" / "summary.json").read_text())
    row = table[(table.variant == "lt") & (table.loops == 6) & (table.seed == 1)].iloc[0]
    assert row.verdict == summary["verdict"] == "collapsed" and row.steps_done == summary["steps_done"]


@pytest.mark.parametrize("verdict, rebound, fails", [("stable", True, 1), ("stable", False, 0),
                                                      ("collapsed", False, 1), ("unstable", True, 1)])
def test_a_recovered_loss_climb_judged_stable_before_the_change_is_relabelled(fitted, verdict, rebound, fails):
    row = load_examples(fitted / "examples.csv")[0] | dict(verdict=verdict, transient_rebound=rebound,
                                                           verdict_version=2)  # judged before v3
    (example,) = examples_from_rows([row], [20, 40], "fails")
    assert example["y"] == fails
    assert example["summary"]["verdict"] == ("unstable" if (verdict, rebound) == ("stable", True) else verdict)


H1, MARGIN = 3.25, 0.1625  # the byte corpus's unigram entropy and v3's stall margin there


@pytest.mark.parametrize("version, verdict, final, want", [
    (2, "stable", H1 - 0.01, "stalled"),      # 0.01 nats below the unigram entropy: a stall by v3
    (2, "unstable", H1 - 0.01, "stalled"),    # v3 judges the stall before the oscillation
    (2, "stable", H1 - MARGIN - 0.01, "stable"),  # learned past the margin
    (2, "collapsed", H1 + 0.5, "collapsed"),  # a worse verdict stays
    (None, "stable", H1 - 0.01, "stalled"),   # a table without the version: judged before v3
    (3, "stable", H1 - 0.01, "stable"),       # a v3 verdict is v3's: kept as it is
    (2, "stable", None, "stable")])           # no stall evidence: nothing to relabel with
def test_a_stall_judged_before_v3_is_relabelled_from_the_tables_evidence(fitted, version, verdict, final, want):
    row = load_examples(fitted / "examples.csv")[0] | dict(
        verdict=verdict, transient_rebound=False, verdict_version=version, final_smoothed_loss=final,
        stall_reference=H1, stall_margin=MARGIN)
    (example,) = examples_from_rows([row], [20, 40], "fails")
    assert example["summary"]["verdict"] == want and example["y"] == int(want != "stable")


def test_the_table_carries_the_verdict_version_and_the_stall_evidence_and_an_older_table_still_reads(fitted, tmp_path):
    table = pd.read_csv(fitted / "examples.csv")
    summary = json.loads((fitted / "sw" / "cells" / "lt_K06_seed1_lr1" / "summary.json").read_text())
    row = table[(table.variant == "lt") & (table.loops == 6) & (table.seed == 1)].iloc[0]
    assert row.verdict_version == summary["verdict_version"] == 3
    for key in ("final_smoothed_loss", "stall_reference", "stall_margin"):
        assert row[key] == pytest.approx(summary["evidence"][key], rel=1e-12)
    older = table.drop(columns=["verdict_version", "final_smoothed_loss", "stall_reference", "stall_margin"])
    older.to_csv(tmp_path / "older.csv", index=False)
    assert len(load_examples(tmp_path / "older.csv")) == len(table)
    assert main(["fit-predictor", str(tmp_path / "older.csv"), "--at", "20", "--out", str(tmp_path / "p.json")]) == 0


@pytest.mark.parametrize("column, value, field", [("seed", -1, "seed"), ("verdict", "fine", "verdict"),
                                                  ("grad_dlog", "high", "grad_dlog"), ("step", 0, "step"),
                                                  ("loops", 10**6, "loops")])
def test_a_bad_table_is_one_line_naming_the_field(fitted, tmp_path, capsys, column, value, field):
    table = pd.read_csv(fitted / "examples.csv")
    table[column] = table[column].astype(object)
    table.loc[1, column] = value
    bad = tmp_path / "bad.csv"
    table.to_csv(bad, index=False)
    with pytest.raises(BadFile, match=field):
        load_examples(bad)
    assert main(["fit-predictor", str(bad), "--at", "20", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err and not (tmp_path / "p.json").exists()


def test_a_table_without_a_column_or_not_a_table_is_refused(fitted, tmp_path):
    table = pd.read_csv(fitted / "examples.csv").drop(columns=["climb"])
    table.to_csv(tmp_path / "short.csv", index=False)
    with pytest.raises(BadFile, match="climb"):
        load_examples(tmp_path / "short.csv")
    (tmp_path / "junk.csv").write_text('a,"b\n1,2,3\n')
    with pytest.raises(BadFile):
        load_examples(tmp_path / "junk.csv")
