"""A folder from elsewhere (a colleague's sweep, a download) may hold links at any depth and FIFOs,
folders or devices where files belong: every command that writes refuses a link anywhere below the
folder it was given, every reader refuses what is not a regular file (one line, never blocking), and
nothing outside the named folder changes. Files flt-diag writes honour the umask. Each test is generated
over a list of cases: a new command or file kind is covered by adding it to the list."""
import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import within
from flt_diag.cli import main
from flt_diag.storage import safe_files

SWEEP = ["run-ablation", "--loops", "2", "--variants", "lt", "--steps", "3", "--device", "cpu", "--depth", "1",
         "--checkpoint-every", "2", "--quiet"]
CELL = "cells/lt_K02_seed0_lr1"
TRAIN = ["train", "--variant", "lt", *SWEEP[1:3], *SWEEP[5:-1]]  # the sweep's one cell, as a run of its own


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished one-cell sweep (config, metrics, summary, checkpoint, eval_loops.csv)."""
    out = tmp_path_factory.mktemp("trained") / "sweep"
    assert main([*SWEEP, "--out", str(out)]) == 0
    assert main(["eval-loops", str(out), "--loops", "1", "--batches", "1"]) == 0
    return out


def _snapshot(folder: Path) -> dict:
    """Every regular file (never opening a FIFO) and every link below `folder`, with its content."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(folder))] = ("link", os.readlink(p))
        elif stat.S_ISREG(os.lstat(p).st_mode) and p.name != ".lock":
            out[str(p.relative_to(folder))] = p.read_bytes()
    return out


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "error:" in line]


# ------------------------------------------------------------------ links at any depth below the folder given

def _link_figures(sweep, elsewhere):
    (elsewhere / "loss.png").write_bytes(b"a colleague's figure")
    (sweep / "figures").symlink_to(elsewhere, target_is_directory=True)


def _link_cell(sweep, elsewhere):
    """The cell is a link to a run folder outside the sweep (unfinished there: a sweep would train it)."""
    cell = sweep / CELL
    shutil.rmtree(elsewhere)
    cell.rename(elsewhere)
    cell.symlink_to(elsewhere, target_is_directory=True)


def _link_cells(sweep, elsewhere):
    shutil.rmtree(elsewhere)
    (sweep / "cells").rename(elsewhere)
    (sweep / "cells").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "lt_K02_seed0_lr1" / "summary.json").unlink()  # unfinished: the sweep would train into it


def _link_metrics(sweep, elsewhere):
    shutil.rmtree(elsewhere)
    (sweep / CELL / "metrics").rename(elsewhere)
    (sweep / CELL / "metrics").symlink_to(elsewhere, target_is_directory=True)
    (sweep / CELL / "summary.json").unlink()  # unfinished: the sweep would append metrics parts


LINKS = [  # (what is a link, how, the command given the sweep folder)
    ("figures", _link_figures, ["plot", "all", "{sweep}"]),
    ("cell", _link_cell, ["eval-loops", "{sweep}", "--loops", "1", "--batches", "1"]),
    ("cell", _link_cell, ["summary", "{sweep}", "--recompute"]),
    ("cells", _link_cells, [*SWEEP, "--out", "{sweep}"]),
    ("cell", _link_cell, [*SWEEP, "--out", "{sweep}"]),
    ("metrics", _link_metrics, [*TRAIN, "--out", "{sweep}/" + CELL]),
]


@pytest.mark.parametrize("what, make, command", LINKS, ids=[f"{c[0]}-{c[2][0]}" for c in LINKS])
def test_no_command_writes_through_a_link_below_its_folder(trained, tmp_path, capsys, what, make, command):
    sweep, elsewhere = shutil.copytree(trained, tmp_path / "sweep"), tmp_path / "elsewhere"
    shutil.copytree(trained / CELL, elsewhere)
    make(sweep, elsewhere)
    before = _snapshot(elsewhere)
    code = main([a.replace("{sweep}", str(sweep)) for a in command])
    errors = _error_lines(capsys)
    assert code != 0 and len(errors) == 1 and "symbolic link" in errors[0], errors
    assert _snapshot(elsewhere) == before


# ------------------------------------------------------------------ what is not a regular file

def _predictor(sweep, tmp_path):
    return ["predict", str(sweep), "--predictor", str(tmp_path / "p.json")], tmp_path / "p.json"


READERS = [  # (the file, the command that reads it first); {sweep}, {run}, {tmp} are filled in
    ("{run}/config.json", ["summary", "{run}", "--recompute"]),
    ("{run}/summary.json", ["summary", "{run}"]),
    ("{sweep}/sweep.json", ["summary", "{sweep}"]),
    ("{run}/metrics/part-000000000-000000002-00000.parquet", ["summary", "{run}", "--recompute"]),
    ("{run}/checkpoint.pt", ["eval-loops", "{run}", "--loops", "1", "--batches", "1"]),
    ("{run}/resume.pt", ["RESUME"]),
    ("{run}/eval_loops.csv", ["plot", "loops", "{run}", "--out", "{tmp}/figs"]),
    ("{tmp}/p.json", ["predict", "{sweep}", "--predictor", "{tmp}/p.json"]),
    ("{tmp}/examples.csv", ["fit-predictor", "{tmp}/examples.csv", "--out", "{tmp}/fitted.json"]),
    ("{tmp}/study.toml", ["study", "{tmp}/study.toml"]),
]
KINDS = ["fifo", "folder"]


def _put(path: Path, kind: str) -> None:
    if path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path) if kind == "fifo" else path.mkdir()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where, command", READERS, ids=[Path(r[0]).name for r in READERS])
def test_what_is_not_a_regular_file_is_refused_before_it_is_opened(trained, tmp_path, capsys, kind, where,
                                                                    command):
    sweep = shutil.copytree(trained, tmp_path / "sweep")
    fill = {"{sweep}": str(sweep), "{run}": str(sweep / CELL), "{tmp}": str(tmp_path)}

    def filled(text):
        for k, v in fill.items():
            text = text.replace(k, v)
        return text
    if command == ["RESUME"]:  # an unfinished run resumed by its own command
        (sweep / CELL / "summary.json").unlink()
        command = [*TRAIN, "--out", "{run}"]
    path = Path(filled(where))
    if "part-" in where:
        path = sorted(path.parent.glob("part-*.parquet"))[0]
    _put(path, kind)
    (tmp_path / "keep.txt").write_text("x")
    before = _snapshot(tmp_path)
    with within(60):
        code = main([filled(a) for a in command])
    errors = _error_lines(capsys)
    assert code != 0 and len(errors) == 1, errors
    assert ("FIFO" if kind == "fifo" else "folder") in errors[0], errors
    assert {k: v for k, v in _snapshot(tmp_path).items() if "summary" not in k} == \
        {k: v for k, v in before.items() if "summary" not in k}


@pytest.mark.parametrize("kind", KINDS)
def test_the_one_check_names_the_kind_and_never_blocks(tmp_path, kind):
    _put(tmp_path / "x", kind)
    with within(10), pytest.raises(safe_files.BadFile, match="FIFO" if kind == "fifo" else "folder"):
        safe_files.open_regular(tmp_path / "x")
    with pytest.raises(safe_files.StorageError, match="missing"):
        safe_files.open_regular(tmp_path / "absent")


# ------------------------------------------------------------------ the umask

@pytest.mark.parametrize("mask, readable", [(0o022, True), (0o077, False)])
def test_written_files_honour_the_umask(tmp_path, monkeypatch, mask, readable):
    old = os.umask(mask)
    safe_files.umask.cache_clear()
    try:
        out = tmp_path / "sweep"
        assert main([*SWEEP, "--out", str(out)]) == 0
        assert main(["plot", "all", str(out), "--format", "png"]) == 0
        assert main(["report", str(out)]) == 0
    finally:
        os.umask(old)
        safe_files.umask.cache_clear()
    written = [p for p in out.rglob("*") if p.is_file() and p.name != ".lock"]
    assert any(p.suffix == ".png" for p in written) and (out / "report.html").exists()
    for p in written:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == 0o666 & ~mask, (p, oct(mode))
        assert bool(mode & stat.S_IRGRP and mode & stat.S_IROTH) == readable
