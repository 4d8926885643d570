"""Issue 54: every analysis/ script has one error path (analysis/script_exit.py): bad input, a bad argument
included, is one `error:` line and exit 2; counts and steps are whole numbers in range; docs_tables.py never
runs itself; a table's empty column is refused or said, never a traceback or a NaN interval."""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import processes
from conftest import within
from cli_errors import one_error_line
from fake_runs import make_series_run, make_sweep

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))
import docs_tables  # noqa: E402

ROWS = ROOT / "docs" / "data" / "warning-eval-w4" / "rows.csv"
SCRIPTS = ["docs_tables", "evaluate_warning", "factorial", "failure_rates", "loop_dynamics_table", "paired_auroc",
           "regenerate", "sweep_table", "replay_early_stop", "stabiliser_benchmark_2", "stabiliser_choices"]


def _status(name: str, argv: list) -> int:
    """The script's exit status: main's, or an argparse refusal's."""
    try:
        return importlib.import_module(name).main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path, name, capsys):
    argv = [tmp_path / "x", "--out", tmp_path / "o", "--no-such-option"]
    assert _status(name, argv) == 2 and "--no-such-option" in one_error_line(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name, argv", [("evaluate_warning", ["{missing}", "--out", "{tmp}/o"]),
                                        ("factorial", ["{missing}"]), ("failure_rates", ["{missing}"]),
                                        ("loop_dynamics_table", ["{missing}"]), ("paired_auroc", ["{missing}"]),
                                        ("regenerate", ["{missing}"]), ("sweep_table", ["{missing}"]),
                                        ("replay_early_stop", ["{missing}", "--out", "{tmp}/o"]),
                                        ("stabiliser_benchmark_2", ["{missing}", "--out", "{tmp}/o"])])
def test_a_missing_input_is_one_line_and_exit_2(tmp_path, capsys, name, argv):
    missing = tmp_path / "nowhere"
    code = importlib.import_module(name).main([a.format(missing=missing, tmp=tmp_path) for a in argv])
    assert code == 2 and "nowhere" in one_error_line(capsys)


# ---------------------------------------------------------------- counts and steps

@pytest.mark.parametrize("name, argv", [("paired_auroc", [str(ROWS), "--draws", "-1"]),
                                        ("paired_auroc", [str(ROWS), "--draws", "0"]),
                                        ("paired_auroc", [str(ROWS), "--seed", "-1"]),
                                        ("paired_auroc", [str(ROWS), "--steps", "-5"]),
                                        ("loop_dynamics_table", ["{sweep}", "--at", "-5"]),
                                        ("loop_dynamics_table", ["{sweep}", "--at", "0"]),
                                        ("evaluate_warning", ["{sweep}", "--at", "-5", "--out", "{tmp}/o"]),
                                        ("evaluate_warning", ["{sweep}", "--out", "{tmp}/o", "--set", "name-only"])])
def test_a_count_or_step_out_of_range_is_refused_before_anything_is_read(tmp_path, capsys, name, argv):
    sweep = tmp_path / "not-read"  # (never made: the argument is refused first)
    assert _status(name, [a.format(sweep=sweep, tmp=tmp_path) for a in argv]) == 2 and one_error_line(capsys)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- paired_auroc: a crafted table

@pytest.mark.parametrize("column, argv", [("failed", []), ("variant", []), ("lr_scale", []), ("step", []),
                                          ("grad_dlog", []), ("grad_dlog", ["--exact", "grad_dlog"])])
def test_an_empty_column_is_one_line_never_a_traceback_or_nan(tmp_path, capsys, column, argv):
    table = pd.read_csv(ROWS)
    table[column] = np.nan
    table.to_csv(tmp_path / "rows.csv", index=False)
    code = importlib.import_module("paired_auroc").main([str(tmp_path / "rows.csv"), "--draws", "20", *argv])
    assert code == 2 and column in one_error_line(capsys, stdout_without=("nan",))


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_rows_that_are_not_a_regular_file_are_refused_unread(tmp_path, capsys, kind):
    path = {"device": Path("/dev/zero"), "fifo": tmp_path / "rows.csv", "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with within(20):
        assert importlib.import_module("paired_auroc").main([str(path)]) == 2
    assert "not a file" in one_error_line(capsys)


# ---------------------------------------------------------------- loop_dynamics_table: records no run has

def test_a_record_no_run_has_is_said_not_printed_as_nan(tmp_path, capsys):
    steps = 300
    make_series_run(tmp_path / "a", np.linspace(3, 1, steps), np.ones(steps))
    make_series_run(tmp_path / "b", np.linspace(3, 1, steps), np.ones(steps), variant="lt")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    (tmp_path / "b" / "summary.json").write_text(json.dumps({**summary, "verdict": "collapsed"}))
    code = importlib.import_module("loop_dynamics_table").main([str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert code == 0 and "no AUROC" in out
    assert "nan [" not in out  # (no interval of nothing)


# ---------------------------------------------------------------- docs_tables.py: crafted pages

def test_a_block_may_not_run_docs_tables_itself():
    with pytest.raises(ValueError, match="itself"):
        docs_tables.argv_of("python analysis/docs_tables.py --check")
    assert docs_tables.argv_of("python analysis/failure_rates.py x")[1:] == ["analysis/failure_rates.py", "x"]


def test_docs_tables_started_by_a_block_refuses_to_run():
    env = {**os.environ, docs_tables.INSIDE: "python analysis/x.py"}
    done = processes.run([sys.executable, str(ROOT / "analysis" / "docs_tables.py"), "--check"], timeout=60,
                         capture_output=True, env=env)
    err = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "refused" in err[0], err


@pytest.mark.parametrize("page", [
    "<!-- generated: python analysis/docs_tables.py --check -->\nold\n<!-- end generated -->\n",
    "<!-- generated: python analysis/no_such_script.py -->\nold\n<!-- end generated -->\n",
    "<!-- generated: flt-diag no-such-command -->\nold\n<!-- end generated -->\n",
    "<!-- generated: flt-diag summary 'unclosed -->\nold\n<!-- end generated -->\n",
    "<!-- generated: rm -rf / -->\nold\n<!-- end generated -->\n",
    b"caf\xe9 <!-- generated: flt-diag variants -->\nold\n<!-- end generated -->\n",
    None, "fifo"])
def test_a_crafted_page_is_one_line_and_left_as_it_was(tmp_path, monkeypatch, capsys, page):
    path = tmp_path / "page.md"
    if page == "fifo":
        os.mkfifo(path)
    elif page is not None:
        path.write_bytes(page if isinstance(page, bytes) else page.encode())
    before = path.read_bytes() if path.is_file() else None
    monkeypatch.setattr(docs_tables, "PAGES", [path])
    with within(120):
        assert docs_tables.main([]) == 2
    assert "page.md" in one_error_line(capsys) or page not in (None, "fifo")
    assert (path.read_bytes() if path.is_file() else None) == before
