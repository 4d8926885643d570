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
    row = load_examples(fitted / "examples.csv")[0].model_copy(update=dict(verdict=verdict, transient_rebound=rebound,
                                                                           verdict_version=2))  # judged before v3
    (example,) = examples_from_rows([row], [20, 40], "fails")
    assert example["y"] == fails
    assert example["summary"].verdict == ("unstable" if (verdict, rebound) == ("stable", True) else verdict)


def test_the_table_carries_the_verdict_version_and_the_stall_evidence_and_an_older_table_still_reads(fitted, tmp_path):
    table = pd.read_csv(fitted / "examples.csv")
    summary = json.loads((fitted / "sw" / "cells" / "lt_K06_seed1_lr1" / "summary.json").read_text())
    row = table[(table.variant == "lt") & (table.loops == 6) & (table.seed == 1)].iloc[0]
    assert row.verdict_version == summary["verdict_version"] == 4
    for key in ("final_smoothed_loss", "stall_reference", "stall_margin"):
        assert row[key] == pytest.approx(summary["evidence"][key], rel=1e-12)
    older = table.drop(columns=["verdict_version", "final_smoothed_loss", "stall_reference", "stall_margin"])
    older.to_csv(tmp_path / "older.csv", index=False)
    rows = load_examples(tmp_path / "older.csv")
    assert len(rows) == len(table) and all(r.verdict_version is None for r in rows)
    assert main(["fit-predictor", str(tmp_path / "older.csv"), "--at", "20", "--out", str(tmp_path / "p.json")]) == 0


def test_a_table_mixing_v3_and_older_rows_is_written_read_back_and_relabelled_only_where_older(fitted, tmp_path,
                                                                                              capsys):
    """Rows judged before v3 (no verdict_version: a table written before the column) beside v3 rows: the
    table reads back (the version column is then partly empty), refits, and a table written from it keeps
    every row's version and evidence. A recovered climb judged `stable` is relabelled in an older row only."""
    table = pd.read_csv(fitted / "examples.csv")
    runs = sorted(table.run.unique())
    old = table.run.isin(runs[::2])  # every other run judged before v3
    table.loc[old, ["verdict_version", "final_smoothed_loss", "stall_reference", "stall_margin"]] = None
    stable_old, stable_new = (table[(table.verdict == "stable") & sel].run.iloc[0] for sel in (old, ~old))
    table.loc[table.run.isin([stable_old, stable_new]), "transient_rebound"] = True
    table.to_csv(tmp_path / "mixed.csv", index=False)
    rows = load_examples(tmp_path / "mixed.csv")
    assert {type(r.verdict_version) for r in rows} == {int, type(None)}
    labels = {e["run"].as_posix(): e["summary"].verdict for e in examples_from_rows(rows, [20, 40], "fails")}
    assert labels[stable_old] == "unstable" and labels[stable_new] == "stable"  # v3 judged it already
    again = tmp_path / "again.csv"
    assert main(["fit-predictor", str(tmp_path / "mixed.csv"), "--at", "20", "40", "--out", str(tmp_path / "p.json"),
                 "--examples-out", str(again)]) == 0
    assert f"note: {len(runs[::2])} of the {len(runs)} runs were judged before verdict v3" in capsys.readouterr().out
    back = pd.read_csv(again)
    key = ["run", "step"]
    merged = table.merge(back, on=key, suffixes=("", "_again"))
    assert len(merged) == len(table)
    for column in ("verdict_version", "final_smoothed_loss", "stall_reference", "stall_margin", "climb"):
        a, b = merged[column].astype(float), merged[f"{column}_again"].astype(float)
        assert ((a == b) | (a.isna() & b.isna())).all(), column


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
