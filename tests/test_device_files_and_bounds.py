"""Issue 54: a path a user gives that must be a file is refused, one line, unless it is a regular file, and what
is read of it is bounded (a tokenizer.json, a study TOML); a .lock or a sweep's cells/ of the wrong kind is named;
a resume.pt that is a link is refused before anything trains or is written."""
import os
import shutil
import socket
import time

import pytest

from cli_errors import one_error_line
from conftest import tiny_config, within
from fake_runs import make_sweep
from flt_diag.cli import main
from flt_diag.data import corpus
from test_train import Interrupt
from flt_diag.storage import files
from flt_diag.storage.folders import LOCK, StorageError, folder_lock


# ---------------------------------------------------------------- --tokenizer

@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_a_tokenizer_that_is_not_a_regular_file_is_refused_unread(tmp_path, kind):
    path = {"device": "/dev/zero", "fifo": tmp_path / "tok.json", "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with within(20), pytest.raises(corpus.DataError, match="not a file"):  # /dev/zero: never read to the end
        corpus.get_tokenizer(str(path))


def test_a_tokenizer_json_over_the_bound_is_refused_with_at_most_the_bound_read(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    assert corpus.MAX_TOKENIZER_BYTES >= 40e6  # above the largest common one (Gemma 3's tokenizer.json: ~33 MB)
    path.write_bytes(b" " * 5000)
    monkeypatch.setattr(corpus, "MAX_TOKENIZER_BYTES", 4096)
    with pytest.raises(corpus.DataError, match="over 4,096 bytes"):
        corpus.get_tokenizer(str(path))


def test_train_with_a_device_as_tokenizer_is_one_line_and_writes_nothing(tmp_path, capsys):
    with within(60):
        code = main(["train", "--tokenizer", "/dev/zero", "--steps", "1", "--device", "cpu", "--out",
                     str(tmp_path / "run")])
    assert code == 2 and "/dev/zero is a device" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- study TOML

def test_a_study_over_the_bound_is_refused_before_it_is_parsed_and_one_at_the_bound_is_read(tmp_path, capsys):
    head, tail = 'description = "', '"\n[ablation]\nvariants = ["lt"]\nloops = [2]\n'
    study = tmp_path / "s.toml"
    study.write_text(head + "x" * (files.MAX_STUDY_BYTES - len(head) - len(tail)) + tail)
    assert study.stat().st_size == files.MAX_STUDY_BYTES
    assert main(["study", str(study), "--list"]) == 0, capsys.readouterr().err
    assert "lt_K02" in capsys.readouterr().out
    study.write_text(head + "x" * (files.MAX_STUDY_BYTES - len(head) - len(tail) + 1) + tail)  # one byte more
    started = time.perf_counter()
    assert main(["study", str(study), "--list"]) == 2
    assert f"over {files.MAX_STUDY_BYTES:,} bytes" in one_error_line(capsys)
    assert time.perf_counter() - started < 30


# ---------------------------------------------------------------- .lock and cells/

@pytest.mark.parametrize("kind, word", [("folder", "a folder"), ("socket", "a socket")])
def test_a_lock_that_is_a_folder_or_socket_is_named(tmp_path, monkeypatch, kind, word):
    run = tmp_path / "run"
    run.mkdir()
    if kind == "folder":
        (run / LOCK).mkdir()
    else:
        s = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(run)  # (a socket's path is limited to ~100 bytes: bound by its short relative name)
        s.bind(LOCK)
    with pytest.raises(StorageError) as e:
        with folder_lock(run):
            pytest.fail("held a lock that is not a file")
    assert str(run / LOCK) in str(e.value) and word in str(e.value)
    assert os.path.lexists(run / LOCK)  # left alone


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_sweep_whose_cells_is_not_a_folder_is_one_line(tmp_path, capsys, kind):
    sweep = make_sweep(tmp_path / "sw")
    shutil.rmtree(sweep / "cells")
    (sweep / "cells").write_text("x") if kind == "file" else os.mkfifo(sweep / "cells")
    with within(20):
        code = main(["summary", str(sweep)])
    line = one_error_line(capsys, stdout_without=("no finished runs",))
    assert code == 2 and str(sweep / "cells") in line and "not a folder" in line


# ---------------------------------------------------------------- resume.pt as a link (Interrupt: tests/test_train.py)

def _snapshot(folder):
    return {str(p.relative_to(folder)): (p.lstat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in folder.rglob("*") if p.name != LOCK}


@pytest.mark.parametrize("target", ["a file", "nothing"])
def test_a_resume_pt_that_is_a_link_is_refused_before_any_training_or_write(tmp_path, monkeypatch, target):
    from flt_diag.training.trainer import Trainer, train
    cfg = tiny_config(variant="lt", loops=2, steps=6, checkpoint_every=2)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, run, callbacks=[Interrupt(at=3)]).fit()
    elsewhere = tmp_path / "elsewhere.pt"
    (run / "resume.pt").rename(elsewhere)
    (run / "resume.pt").symlink_to(elsewhere if target == "a file" else tmp_path / "missing.pt")
    before = _snapshot(run)
    monkeypatch.setattr(Trainer, "train_step", lambda *a, **k: pytest.fail("trained before the link was refused"))
    with pytest.raises(StorageError, match="resume.pt is a symbolic link"):
        train(cfg, run)
    assert _snapshot(run) == before  # config.json, the metrics: nothing rewritten, nothing cut
    assert (run / "resume.pt").is_symlink()
