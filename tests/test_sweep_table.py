"""analysis/sweep_table.py: a sweep (a folder or its archive) as the Markdown of a generated block of
docs/results.md. Its rows checked against the runs' summary.json read here by hand."""
import json
import sys
from pathlib import Path

import pytest

from fake_runs import make_sweep
from flt_diag.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
import sweep_table  # noqa: E402


def rows_of(markdown: str) -> dict[tuple[str, int], dict]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    return {(r["variant"], int(r["K"])): r for r in rows}


@pytest.mark.parametrize("archived", [False, True])
def test_rows_are_the_runs_summaries(tmp_path, capsys, archived):
    sweep = make_sweep(tmp_path / "sweep")
    if archived:
        assert main(["archive", str(sweep), "--to", str(tmp_path / "arch")]) == 0
        capsys.readouterr()
    text = sweep_table.table(tmp_path / "arch" / "sweep" if archived else sweep)
    rows = rows_of(text)
    summaries = {}
    for cell in sorted((sweep / "cells").iterdir()):
        if (cell / "summary.json").exists():
            s = json.loads((cell / "summary.json").read_text())
            summaries[(s["variant"], s["loops"])] = s
    assert set(rows) == set(summaries)  # finished runs only (fla K=3 stopped half way; fla K=6 never started)
    for key, s in summaries.items():
        r = rows[key]
        assert r["verdict"] == s["verdict"]
        assert float(r["val loss"]) == pytest.approx(s["val_loss"], abs=5e-4)
        best = min(t["val_loss"] for t in summaries.values() if t["loops"] == s["loops"])
        gap = s["val_loss"] - best
        if round(gap, 3) == 0:
            assert r["gap to best"] == "best"
        else:
            assert float(r["gap to best"]) == pytest.approx(gap, abs=5e-4)
        assert r["peak final-loop norm"].endswith("*") == bool(s["residual_explosion"])
    assert ("not finished" + (" (or not archived)" if archived else "") + ": 2." in text)  # fla K=3 and K=6
    assert ("Code: made by" in text) == archived


def test_a_folder_that_is_no_sweep_is_one_line(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert sweep_table.main([str(tmp_path / "x")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "not a sweep folder" in err[0]
