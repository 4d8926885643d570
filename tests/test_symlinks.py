"""A run folder comes from elsewhere: no write ever follows a symbolic link in it, and a refused
command leaves no lock file (or folder) behind."""
import os
from pathlib import Path

import pytest

from cli_errors import one_error_line
from flt_diag.cli import main
from flt_diag.storage.folders import LOCK, StorageError, atomic_write_text, folder_lock

TRAIN = ["train", "--steps", "3", "--device", "cpu", "--preset", "tiny", "--loops", "2", "--depth", "1"]
PRECIOUS = "a colleague's notes\n"


def _outside(tmp_path) -> Path:
    f = tmp_path / "elsewhere" / "notes.txt"
    f.parent.mkdir(exist_ok=True)
    f.write_text(PRECIOUS)
    return f


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("done") / "run"
    assert main([*TRAIN, "--out", str(run)]) == 0
    return run


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_a_rerun_into_a_folder_whose_lock_is_a_link_leaves_the_target_alone(finished_run, tmp_path, capsys):
    run, target = _copy(finished_run, tmp_path / "run"), _outside(tmp_path)
    (run / LOCK).symlink_to(target)
    assert main([*TRAIN, "--out", str(run)]) == 2
    assert "symbolic link" in one_error_line(capsys)
    assert target.read_text() == PRECIOUS and (run / LOCK).is_symlink()


@pytest.mark.parametrize("name", ["config.json", "summary.json", "progress.json"])
def test_a_rerun_never_writes_through_a_linked_file(finished_run, tmp_path, capsys, name):
    run, target = _copy(finished_run, tmp_path / "run"), _outside(tmp_path)
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(target)
    main([*TRAIN, "--out", str(run)])
    main(["summary", str(run), "--recompute"])
    assert target.read_text() == PRECIOUS


def test_a_linked_metrics_part_is_never_rewritten_on_resume(finished_run, tmp_path):
    run, target = _copy(finished_run, tmp_path / "run"), _outside(tmp_path)
    part = sorted((run / "metrics").glob("part-*.parquet"))[-1]
    part.unlink()
    part.symlink_to(target)
    (run / "summary.json").unlink()  # as if unfinished: the next command trains into the folder
    main([*TRAIN, "--out", str(run)])
    assert target.read_text() == PRECIOUS


def test_a_linked_metrics_folder_is_refused(finished_run, tmp_path, capsys):
    run, elsewhere = _copy(finished_run, tmp_path / "run"), tmp_path / "elsewhere"
    (run / "metrics").rename(elsewhere)
    (run / "summary.json").unlink()
    (run / "metrics").symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    assert main([*TRAIN, "--out", str(run)]) == 2
    assert "symbolic link" in one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


def test_a_report_whose_target_is_a_link_is_refused(finished_run, tmp_path, capsys):
    target = _outside(tmp_path)
    link = tmp_path / "report.html"
    link.symlink_to(target)
    assert main(["report", str(finished_run), "--out", str(link)]) == 2
    assert "symbolic link" in one_error_line(capsys)
    assert target.read_text() == PRECIOUS


def test_a_sweep_whose_cell_folder_is_a_link_leaves_the_target_alone(tmp_path, capsys):
    out, elsewhere = tmp_path / "sweep", tmp_path / "elsewhere"
    args = ["run-ablation", "--loops", "2", "--variants", "lt", "--steps", "2", "--device", "cpu",
            "--depth", "1", "--out", str(out)]
    assert main(args) == 0
    cell = next((out / "cells").iterdir())
    cell.rename(elsewhere)
    cell.symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "summary.json").unlink()
    before = {p.name: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    assert main(args) != 0
    assert {p.name: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before


def test_the_temporary_file_of_a_write_is_never_an_existing_link(tmp_path):
    target = _outside(tmp_path)
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old predictable names
        (tmp_path / f".x.json.tmp{pid}.json").symlink_to(target)
    atomic_write_text(tmp_path / "x.json", "{}")
    assert target.read_text() == PRECIOUS and (tmp_path / "x.json").read_text() == "{}"


def test_a_refused_command_leaves_no_lock_and_no_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    assert main([*TRAIN, "--out", str(mine)]) == 2  # not a run folder
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]
    assert main([*TRAIN, "--out", str(tmp_path / "new"), "--loops", "-1"]) == 2
    assert not (tmp_path / "new").exists() and not (tmp_path / LOCK).exists()


def test_the_lock_file_is_gone_after_a_run_and_a_second_writer_is_still_refused(tmp_path):
    run = tmp_path / "run"
    with folder_lock(run):
        with pytest.raises(StorageError, match="being written by another"):
            with folder_lock(run):
                pass
        assert (run / LOCK).exists()
    assert not (run / LOCK).exists() and not run.exists()  # it made the folder, and left it empty
