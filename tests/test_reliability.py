"""Hostile input and hostile events: one writer per folder, no code execution from a checkpoint,
an unreadable resume state leaves the folder as it was, failures are reported with their exit
status, and a sweep's workers die with their parent."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import processes
from conftest import tiny_config
from cli_errors import one_error_line
from flt_diag.cli import main
from flt_diag.storage.folders import StorageError, folder_lock


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_writer_of_a_run_folder_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    with folder_lock(run):  # another process would hold the same flock
        code = main(["train", "--steps", "2", "--device", "cpu", "--out", str(run)])
        assert [p.name for p in run.iterdir()] == [".lock"]  # nothing was written (the lock is the holder's)
    assert code == 2 and "being written by another flt-diag process" in one_error_line(capsys)


def test_a_second_sweep_on_the_same_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "sweep"
    with folder_lock(out):
        code = main(["run-ablation", "--loops", "2", "--variants", "lt", "--steps", "2", "--device", "cpu",
                     "--out", str(out), "--quiet"])
    assert code == 2 and "being written by another" in one_error_line(capsys)


def test_the_lock_of_a_dead_process_is_free(tmp_path, spawn):
    folder = tmp_path / "run"
    p = spawn([sys.executable, "-c", "import sys, time; from flt_diag.storage.folders import folder_lock\n"
               f"with folder_lock({str(folder)!r}):\n    print('held', flush=True); time.sleep(60)"],
              stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(StorageError, match=f"pid {p.pid}"):
        with folder_lock(folder):
            pass
    p.kill()  # kill -9: the kernel drops the flock
    p.wait()
    with folder_lock(folder):
        pass


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch EVIL_RAN",))


def test_a_crafted_checkpoint_runs_no_code(tmp_path, capsys, monkeypatch):
    from flt_diag.training.trainer import train
    train(tiny_config(variant="lt", loops=2, steps=2), tmp_path / "run")
    torch.save({"model": _Evil(), "model_config": {}}, tmp_path / "run" / "checkpoint.pt")
    monkeypatch.chdir(tmp_path)
    code = main(["eval-loops", str(tmp_path / "run"), "--loops", "1", "--batches", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "unreadable" in err and "Traceback" not in err
    assert not (tmp_path / "EVIL_RAN").exists()


def test_eval_loops_goes_on_after_a_bad_cell(tmp_path, capsys):
    from flt_diag.grids.sweep import SweepSpec, run_sweep
    run_sweep(SweepSpec(tiny_config(steps=2), ["lt", "flt"], [2], [0], [1.0]), tmp_path / "sw", workers=1,
              show_progress=False)
    (tmp_path / "sw" / "cells" / "lt_K02_seed0_lr1" / "checkpoint.pt").write_bytes(b"truncated")
    code = main(["eval-loops", str(tmp_path / "sw"), "--loops", "1", "2", "--batches", "1"])
    out, err = capsys.readouterr()
    assert code == 1 and "lt_K02_seed0_lr1: error: unreadable" in err
    assert "flt_K02_seed0_lr1: trained at K=2" in out  # the next cell was still evaluated


@pytest.mark.parametrize("content", [b"not a torch file", b""])
def test_an_unreadable_resume_state_changes_nothing(tmp_path, capsys, content):
    from flt_diag.training.trainer import train
    run = tmp_path / "run"
    cfg = tiny_config(variant="lt", loops=2, steps=4, checkpoint_every=2)
    train(cfg, run)
    (run / "summary.json").unlink()  # an unfinished run ...
    (run / "resume.pt").write_bytes(content)  # ... whose resume state is damaged
    before = _snapshot(run)
    with pytest.raises(StorageError, match="resume.pt"):  # the CLI prints it as one error line
        train(cfg, run)
    after = _snapshot(run)
    after.pop(".lock", None), before.pop(".lock", None)
    assert after == before  # config.json was not rewritten, nothing else touched


def test_a_wrong_shaped_resume_state_is_one_line(tmp_path, capsys):
    from flt_diag.training.trainer import train
    run = tmp_path / "run"
    train(tiny_config(variant="lt", loops=2, steps=4), run)
    (run / "summary.json").unlink()
    torch.save({"model": {"embed.weight": torch.zeros(3, 3)}, "optimizers": [], "callbacks": [], "step": 2,
                "wall_time": 0.0}, run / "resume.pt")
    with pytest.raises(StorageError, match=r"resume.pt: model.embed.weight has shape \(3, 3\)"):
        train(tiny_config(variant="lt", loops=2, steps=4), run)


def test_a_sweep_with_failed_cells_exits_non_zero(tmp_path, capsys, monkeypatch):

    def boom(cfg, run_dir, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr("flt_diag.training.trainer.train", boom)
    code = main(["run-ablation", "--loops", "2", "--variants", "lt", "flt", "--steps", "2", "--device", "cpu",
                 "--workers", "1", "--out", str(tmp_path / "sw"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "error: 2 of 2 cells not done (2 failed" in err


def test_study_errors_keep_their_exit_status(tmp_path, capsys):
    assert main(["study", str(tmp_path)]) == 2  # a folder, not a study file
    (tmp_path / "s.toml").write_text("[ablation]\nloops = [0]\n")
    assert main(["study", str(tmp_path / "s.toml")]) == 2


@pytest.mark.parametrize("args", [["train", "--device", "banana"], ["train", "--out", "__FILE__"],
                                  ["eval-loops", "__RUN__", "--device", "cuda"]])
def test_bad_devices_and_paths_are_one_line(tmp_path, capsys, args):
    f = tmp_path / "file.txt"
    f.write_text("x")
    args = [str(f) if a == "__FILE__" else str(tmp_path) if a == "__RUN__" else a for a in args]
    if torch.cuda.is_available() and "cuda" in args:
        pytest.skip("CUDA present")
    assert main(args + (["--steps", "1"] if args[0] == "train" else [])) == 2
    one_error_line(capsys)
    assert f.read_text() == "x"


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_a_tests_child_is_killed_with_its_own_children():
    """The tests' process guard (tests/processes.py) kills a child's whole group, a grandchild too."""
    grandchild = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; " \
                 "time.sleep(60)']); print(c.pid, flush=True); time.sleep(60)"
    p = processes.start([sys.executable, "-c", grandchild], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        assert _alive(pid)
    finally:
        processes.kill_group(p)
    deadline = time.time() + 10
    while time.time() < deadline and _alive(pid):
        time.sleep(0.1)
    assert p.returncode == -signal.SIGKILL and not _alive(pid)


def test_sweep_workers_die_with_their_parent(tmp_path, spawn):
    """kill -9 of a sweep's parent leaves no worker training as an orphan (the parent alone is
    killed; `spawn` kills the whole group at the end, whatever the test found)."""
    out = tmp_path / "sw"
    parent = spawn([sys.executable, "-m", "flt_diag", "run-ablation", "--loops", "2", "--variants", "lt", "flt",
                    "--steps", "5000", "--device", "cpu", "--workers", "2", "--quiet", "--out", str(out)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    kids = []
    while time.time() < deadline and len(kids) < 2:
        time.sleep(0.5)
        kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True,
                                               text=True).stdout.split()]
        kids = [k for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text(errors="replace")] \
            if kids else []
    assert len(kids) >= 2, "the workers did not start"
    while time.time() < deadline and len(list(out.glob("cells/*/progress.json"))) < 2:
        time.sleep(0.5)  # both workers are training
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(Path(f"/proc/{k}").exists() and
                                         "Z" not in Path(f"/proc/{k}/stat").read_text().split()[2] for k in kids):
        time.sleep(0.2)
    alive = [k for k in kids if Path(f"/proc/{k}").exists() and "Z" not in Path(f"/proc/{k}/stat").read_text().split()[2]]
    assert not alive, f"orphaned workers still running: {alive}"


# ------------------------------------------------------------------ bad values, generated from the options

def _numeric_options():
    """(command path, option name, kind, positional arguments) for every int/float option of every
    command, read from the option definitions the parser is generated from."""
    from flt_diag.cli.commands import COMMANDS
    from flt_diag.cli.options import POSITIONALS, command_options
    from flt_diag.config.option_fields import flag, form
    out = []
    for name in COMMANDS:
        for _, field, info in command_options(name):
            if form(info).kind in (int, float):
                out.append(((name,), flag(field, info), form(info).kind.__name__,
                            [p[1] for p in POSITIONALS.get(name, [])]))
    return out


NUMERIC = _numeric_options()


def test_the_generated_cases_cover_every_command():
    commands = {c[0][0] for c in NUMERIC}
    assert {"train", "run-ablation", "map", "eval-loops", "predict", "fit-predictor", "import-reference"} <= commands


@pytest.mark.parametrize("command, option, kind, arguments", NUMERIC, ids=[f"{' '.join(c[0])} {c[1]}" for c in NUMERIC])
def test_every_numeric_option_refuses_bad_values(tmp_path, monkeypatch, capsys, command, option, kind, arguments):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("data")
    positional = [str(tmp_path / "missing") for _ in arguments]
    bad = ["abc", "1.5"] if kind == "int" else ["abc", "nan", "inf", "1e400"]
    for value in bad:
        code = main([*command, *positional, option, value])
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        if kind == "float" and value in ("nan", "inf", "1e400") and code != 2:
            pytest.fail(f"{' '.join(command)} {option} {value}: accepted (exit {code})")
        assert code == 2, (value, err)
        assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], (value, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]  # nothing created, nothing changed
    assert (tmp_path / "keep.txt").read_text() == "data"


def _default_sigint():
    """The child starts with SIGINT's default disposition, as in a terminal. A test run started in the
    background by a non-interactive shell (`pytest &`) inherits SIGINT ignored, and Python keeps an
    inherited SIG_IGN: Ctrl-C would then (rightly) do nothing and this test would hang."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# (train: eager, so that Ctrl-C lands between steps of the same kind every time; the compiled path, where the step
# waits for kernel builds, is tests/test_reliability_6b.py's, counted without a clock)
@pytest.mark.parametrize("command", [["train", "--variant", "lt", "--loops", "2", "--no-compile"],
                                     ["run-ablation", "--variants", "lt", "flt", "--loops", "2", "--workers", "2",
                                      "--quiet"]])
def test_ctrl_c_exits_130_with_a_message(tmp_path, command, spawn):
    out = tmp_path / "out"
    p = spawn([sys.executable, "-m", "flt_diag", *command, "--steps", "5000", "--device", "cpu",
               "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
              preexec_fn=_default_sigint,  # its own process group, as a terminal's foreground job
              env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # (SIGABRT then prints every thread's stack)
    deadline = time.time() + 240  # a loaded machine (spawned workers, first compile) can take minutes
    while time.time() < deadline and not list(out.rglob("progress.json")):
        time.sleep(0.3)
    assert list(out.rglob("progress.json")), "training did not start"
    os.killpg(p.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground process group
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # seen once in 8 trials (pass 4 of 20, 2026-12-01): where does it wait?
        os.kill(p.pid, signal.SIGABRT)
        _, err = p.communicate(timeout=30)
        pytest.fail(f"still running 120 s after Ctrl-C; its threads' stacks:\n{err[-6000:]}")
    assert p.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", b'{"text": 5}\n{"text": 6}\n', "not text"),
    ("bin.txt", bytes(range(256)) * 8, "not UTF-8 text"),
    ("empty.txt", b"", "is empty"),
    ("blank.txt", b"   \n\n   \t\n", "has no text"),
])
def test_bad_corpus_files_are_one_line_before_any_folder(tmp_path, capsys, monkeypatch, name, content, message):
    monkeypatch.setenv("FLT_DIAG_CACHE", str(tmp_path / "cache"))
    (tmp_path / name).write_bytes(content)
    code = main(["train", "--data", str(tmp_path / name), "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "r")])
    assert code == 2 and message in one_error_line(capsys)
    assert not (tmp_path / "r").exists()


def test_folders_that_are_not_flt_diag_folders_are_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    for args in (["train", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "run")],
                 ["eval-loops", str(tmp_path / "run")], ["plot", "all", str(tmp_path / "run")]):
        assert main(args) in (0, 2)
        err = capsys.readouterr().err
        assert "Traceback" not in err
    assert (tmp_path / "run" / "config.json").read_text() == "{}"
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "sweep.json").write_text("{}")
    assert main(["run-ablation", "--loops", "2", "--variants", "lt", "--steps", "1", "--device", "cpu",
                 "--out", str(tmp_path / "sw"), "--quiet"]) == 2
    assert "sweep.json: variants is missing" in one_error_line(capsys)
    assert (tmp_path / "sw" / "sweep.json").read_text() == "{}"


def test_report_into_a_folder_is_refused_without_leftovers(tmp_path, capsys):
    from flt_diag.training.trainer import train
    train(tiny_config(variant="lt", loops=2, steps=2), tmp_path / "run")
    (tmp_path / "out").mkdir()
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    assert "is a folder" in one_error_line(capsys)
    assert list((tmp_path / "out").iterdir()) == [] and not list(tmp_path.glob(".*tmp*"))


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    from flt_diag.storage.folders import atomic_path
    with pytest.raises(OSError):
        with atomic_path(tmp_path / "x.csv") as tmp:
            tmp.write_text("half")
            raise OSError(28, "No space left on device")  # what a full disk raises mid-write
    assert list(tmp_path.iterdir()) == []


def test_os_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code = main(["train", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "file" / "run")])
    assert code == 2 and one_error_line(capsys)


@pytest.mark.slow  # ~1-2.5 min: three sweeps of two cells
def test_kill_9_of_a_sweep_and_an_immediate_restart_give_the_uninterrupted_result(tmp_path, spawn):
    """The sweep's parent is killed with SIGKILL mid-way and the same command is run again at once:
    every cell ends with exactly the metrics of an uninterrupted sweep (no duplicated row, the same
    final loss) - the workers died with their parent and released their folders."""
    from flt_diag.storage.folders import load_metrics, load_summary
    args = ["run-ablation", "--variants", "lt", "flt", "--loops", "2", "--steps", "150", "--device", "cpu",
            "--workers", "2", "--quiet"]
    cmd = [sys.executable, "-m", "flt_diag", *args]
    processes.run(cmd + ["--out", str(tmp_path / "a")], timeout=600, check=True, capture_output=True)
    parent = spawn(cmd + ["--out", str(tmp_path / "b")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        steps = [json_step(p) for p in (tmp_path / "b").glob("cells/*/progress.json")]
        if len(steps) == 2 and min(steps) >= 20:
            break
        time.sleep(0.2)
    parent.kill()
    parent.wait()
    processes.run(cmd + ["--out", str(tmp_path / "b")], timeout=600, check=True, capture_output=True)
    for cell in ("lt_K02_seed0_lr1", "flt_K02_seed0_lr1"):
        a, b = load_metrics(tmp_path / "a" / "cells" / cell), load_metrics(tmp_path / "b" / "cells" / cell)
        key = ["step", "metric", "loop", "layer"]
        assert not b.duplicated(key).any()
        pd_a, pd_b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
        assert pd_a[key].equals(pd_b[key]) and (pd_a.value.to_numpy() == pd_b.value.to_numpy()).all()
        assert load_summary(tmp_path / "a" / "cells" / cell).final_loss == \
            load_summary(tmp_path / "b" / "cells" / cell).final_loss


def json_step(path) -> int:
    import json
    try:
        return json.loads(Path(path).read_text())["step"]
    except (ValueError, KeyError, OSError):
        return 0
