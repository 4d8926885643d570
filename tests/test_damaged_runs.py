"""Damaged finished runs in a sweep (found by a bad-input hunt, 2026-12-07): a run whose summary.json reads but whose
metrics are gone, whose config.json is gone or broken, or whose cell is a file or a link, is refused in one line by
the reading commands and shown as `damaged` by `status` (exit 1); nothing already written is changed. Before,
`summary --recompute` judged the empty metrics as `diverged` over the run's summary, and a cell without config.json
was left out of summary.csv in silence."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from fake_runs import make_sweep
from flt_diag.cli import main

CELL = "lt_K03_seed0_lr1"


def digest(folder: Path) -> dict[str, str]:
    """Every file's SHA-256 under `folder` (links not followed): what "nothing was changed" compares."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture
def sweep(tmp_path) -> Path:
    return make_sweep(tmp_path / "sw")


def damage(sweep: Path, how: str) -> None:
    cell = sweep / "cells" / CELL
    if how == "metrics-gone":
        shutil.rmtree(cell / "metrics")
    elif how == "metrics-emptied":
        for p in (cell / "metrics").iterdir():
            p.unlink()
    elif how == "metrics-a-file":
        shutil.rmtree(cell / "metrics")
        (cell / "metrics").write_text("not parts")
    elif how == "metrics-part-copied":  # a part copied under the next part number: its rows twice
        part = sorted((cell / "metrics").glob("part-*.parquet"))[0]
        shutil.copyfile(part, cell / "metrics" / (part.name[:-13] + "99999.parquet"))
    elif how == "config-gone":
        (cell / "config.json").unlink()
    elif how == "config-truncated":
        text = (cell / "config.json").read_text()
        (cell / "config.json").write_text(text[: len(text) // 2])
    elif how == "cell-a-file":
        shutil.rmtree(cell)
        cell.write_text("a file where the cell's folder goes")
    elif how == "cell-a-link":
        shutil.rmtree(cell)
        os.symlink(sweep / "cells" / "flt_K03_seed0_lr1", cell)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("how", ["metrics-gone", "metrics-emptied", "metrics-a-file"])
def test_recompute_refuses_a_run_without_stored_metrics_and_changes_nothing(sweep, capsys, how):
    assert main(["summary", str(sweep)]) == 0  # (the plain table reads summaries only)
    damage(sweep, how)
    before = digest(sweep)
    assert main(["summary", "--recompute", str(sweep)]) == 2
    assert "holds no stored loss to judge" in one_error_line(capsys)
    assert digest(sweep) == before  # the run's summary.json (and summary.csv) as they were


def test_a_copied_metrics_part_is_one_line_never_judged_twice(sweep, capsys):
    damage(sweep, "metrics-part-copied")
    before = digest(sweep)
    assert main(["summary", "--recompute", str(sweep)]) == 2
    assert "a copied or stale metrics part" in one_error_line(capsys)
    assert digest(sweep) == before


@pytest.mark.parametrize("how", ["config-gone", "cell-a-file", "cell-a-link"])
def test_a_cell_that_is_no_run_is_one_line_never_left_out(sweep, capsys, how, tmp_path):
    damage(sweep, how)
    before = digest(sweep)
    for command in (["summary", str(sweep)], ["summary", "--recompute", str(sweep)],
                    ["archive", str(sweep), "--to", str(tmp_path / "arch")]):
        assert main(command) == 2, command
        assert CELL in one_error_line(capsys)
    assert digest(sweep) == before and not (tmp_path / "arch" / "sw").exists()


@pytest.mark.parametrize("how", ["config-truncated", "metrics-gone"])
def test_status_shows_a_damaged_run_and_exits_1(sweep, capsys, how):
    damage(sweep, how)
    before = digest(sweep)
    assert main(["status", str(sweep)]) == 1
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if CELL in line)
    assert row.split()[2] == "damaged" and "damaged:" in row
    assert "1 damaged" in out.splitlines()[-1]
    assert err.strip().splitlines() == ["error: 1 of 6 runs are damaged (above: why); nothing was changed"]
    assert digest(sweep) == before
