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

from cli_errors import one_error_line
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


def damage(sweep: Path, how: str, name: str = CELL) -> None:
    cell = sweep / "cells" / name
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


@pytest.mark.parametrize("how", ["metrics-gone", "metrics-emptied", "metrics-a-file"])
@pytest.mark.parametrize("name", [CELL, "flt_K06_seed0_lr1"])  # the sweep's first finished cell, and its last
def test_recompute_refuses_a_run_without_stored_metrics_and_changes_nothing(sweep, capsys, how, name):
    """Every run is judged before any summary is written: with the damaged run last, the runs before it are not
    rewritten either (under other thresholds, which would change them)."""
    assert main(["summary", str(sweep)]) == 0  # (the plain table reads summaries only)
    damage(sweep, how, name)
    before = digest(sweep)
    assert main(["summary", "--recompute", "--explosion-ratio", "3", str(sweep)]) == 2
    assert "is not a folder of metrics parts" in one_error_line(capsys)
    assert digest(sweep) == before  # every summary.json (and summary.csv) as they were


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


@pytest.mark.parametrize("how", ["config-truncated", "metrics-gone", "cell-a-link", "cell-a-file"])
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
    (sweep.parent / "campaign").mkdir()  # a folder holding it (a campaign's stages): its counts, and exit 1 too
    sweep.rename(sweep.parent / "campaign" / "sw")
    assert main(["status", str(sweep.parent / "campaign")]) == 1
    assert capsys.readouterr().out.splitlines()[0] == "sw: 3 finished, 2 open, 1 damaged"


def test_a_folder_named_like_a_record_is_damaged_never_an_open_run(sweep, capsys, tmp_path):
    """An archive whose record is replaced by a folder of its name: `status` says damaged (exit 1), every reader
    one line; nothing written."""
    assert main(["archive", str(sweep), "--to", str(tmp_path / "arch")]) == 0
    arch = tmp_path / "arch" / "sw"
    record = arch / f"{CELL}.parquet"
    record.unlink()
    record.mkdir()
    capsys.readouterr()
    before = digest(arch)
    assert main(["status", str(arch)]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if CELL in line)
    assert row.split()[2] == "damaged"
    for command in (["summary", str(arch)], ["report", str(arch), "--out", str(tmp_path / "r.html")]):
        assert main(command) == 2, command
        assert "named like a run record but is not a file" in one_error_line(capsys)
    assert digest(arch) == before


@pytest.mark.parametrize("change", [{"code": 5, "host": 3}, {"code": {}, "at": ["x"]}, {"code": {}, "machine": "x"}])
def test_a_crafted_code_change_in_sweep_json_is_one_line_for_every_reader(sweep, capsys, tmp_path, change):
    import json
    spec = json.loads((sweep / "sweep.json").read_text())
    spec["campaign"] = {"code": {"commit": "a" * 40, "clean": True}, "changes": [change]}
    (sweep / "sweep.json").write_text(json.dumps(spec))
    before = digest(sweep)
    for command in (["status", str(sweep)], ["summary", str(sweep)], ["archive", str(sweep), "--to",
                                                                        str(tmp_path / "a")]):
        assert main(command) == 2, command
        assert "[campaign]: changes entry 0" in one_error_line(capsys)
    assert digest(sweep) == before and not (tmp_path / "a" / "sw").exists()


def test_a_lease_mark_that_is_no_file_still_marks_the_probe_failed(tmp_path):
    """A folder (or FIFO) named `<probe>.failed` under leases/: the probe is failed, said so, never a traceback or
    a blocked read."""
    from flt_diag.grids.leases import LEASES, lease_lines
    (tmp_path / LEASES / "p1.failed").mkdir(parents=True)
    os.mkfifo(tmp_path / LEASES / "p2.failed")
    (tmp_path / LEASES / "p3.failed").write_text("RuntimeError: out of memory\n")
    assert lease_lines(tmp_path) == ["lease p1: failed: failed (its mark is not a readable file)",
                                     "lease p2: failed: failed (its mark is not a readable file)",
                                     "lease p3: failed: RuntimeError: out of memory"]


def test_parts_are_read_in_step_order_past_a_billion_steps(tmp_path):
    """Part names pad steps to 9 digits: a part from step 10**9 sorts before one from 999,999,999 by name. They
    are read by their numbers: the rows come back in step order and no part is taken for a copy."""
    from flt_diag.storage.folders import MetricsWriter, load_metrics
    w = MetricsWriter(tmp_path)
    for step in (999_999_998, 999_999_999, 1_000_000_000, 1_000_000_001):
        w.add(step, "loss", -1, -1, float(step % 7))
        w.flush()
    names = sorted(p.name for p in (tmp_path / "metrics").iterdir())
    assert names[0].startswith("part-1000000000-")  # (by name, the last steps come first)
    assert load_metrics(tmp_path).step.tolist() == [999_999_998, 999_999_999, 1_000_000_000, 1_000_000_001]
