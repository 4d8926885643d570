"""The exit status tells the truth, and the early-warning predictor is checked where it is made and
where it is loaded: a grid whose probes failed exits non-zero, a full disk is one line and loses
nothing, a predictor that could never warn (or warns at P = 0.06) is refused, and every field that may
change on reuse may change on resume."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from cli_errors import one_error_line
from fake_runs import make_run
from flt_diag.storage.folders import load_summary
from flt_diag.cli import main
from flt_diag.training.settle import VOLATILE_DIAGNOSTICS_FIELDS, VOLATILE_TRAIN_FIELDS

BASE = {"--steps": "4", "--device": "cpu", "--preset": "tiny", "--variant": "lt", "--loops": "2", "--depth": "1",
        "--checkpoint-every": "2", "--eval-every": "0", "--eval-batches": "1"}
MAP = ["map", "--variants", "lt", "--loops", "2", "--lo", "1", "--hi", "2", "--ratio", "2", "--steps", "2",
       "--device", "cpu", "--preset", "tiny", "--depth", "1", "--workers", "1"]


def _train(options: dict, out: Path, *flags: str) -> list[str]:
    return ["train", *[x for kv in options.items() for x in kv], *flags, "--out", str(out)]


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _boom(cfg, run_dir, **kw):
    raise RuntimeError("boom")


# ------------------------------------------------------------------ grids that failed

def test_a_map_whose_every_probe_fails_exits_non_zero(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("flt_diag.training.trainer.train", _boom)
    code = main([*MAP, "--out", str(tmp_path / "m")])
    err = _stderr_lines(capsys)
    assert code == 1 and err == [f"error: 1 of 1 map lines did not finish their search (lt_K02_seed0): a probe "
                                 f"failed; see {tmp_path / 'm'}/cells/<cell>/error.txt where it exists"]


def test_a_map_whose_failure_could_not_be_recorded_exits_non_zero(tmp_path, capsys, monkeypatch):
    """A full disk: the probe fails and so does its error.txt; the search stopped all the same."""
    def no_space(path, text):
        raise OSError(28, "No space left on device", str(path))
    monkeypatch.setattr("flt_diag.training.trainer.train", _boom)
    monkeypatch.setattr("flt_diag.grids.sweep.atomic_write_text", no_space)
    assert main([*MAP, "--out", str(tmp_path / "m")]) == 1
    assert not list((tmp_path / "m").rglob("error.txt"))
    assert "1 of 1 map lines did not finish" in _stderr_lines(capsys)[-1]


def test_a_study_whose_map_fails_exits_non_zero(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("flt_diag.training.trainer.train", _boom)
    (tmp_path / "s.toml").write_text('[map]\nvariants = ["lt"]\nloops = [2]\nlo = 1\nhi = 2\nratio = 2\nsteps = 2\n'
                                     f'device = "cpu"\npreset = "tiny"\ndepth = 1\nout = "{tmp_path / "m"}"\n')
    assert main(["study", str(tmp_path / "s.toml"), "--workers", "1"]) == 1
    assert "map lines did not finish" in _stderr_lines(capsys)[-1]


def test_a_map_whose_probes_finished_exits_zero(tmp_path, capsys):
    assert main([*MAP, "--out", str(tmp_path / "m")]) == 0
    assert _stderr_lines(capsys) == []


def test_summary_of_a_sweep_whose_spec_is_empty_is_one_line(tmp_path, capsys):
    (tmp_path / "sw" / "cells").mkdir(parents=True)
    (tmp_path / "sw" / "sweep.json").write_text("{}")
    assert main(["summary", str(tmp_path / "sw")]) == 2
    assert _stderr_lines(capsys) == [f"error: {tmp_path / 'sw' / 'sweep.json'}: variants is missing"]


def test_summary_of_a_run_whose_config_is_half_written_is_one_line_and_leaves_the_folder(tmp_path, capsys):
    run = make_run(tmp_path / "r", "flt", 3)
    text = (run / "config.json").read_text()
    (run / "config.json").write_text(text[:len(text) // 2])
    before = {p.name: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert main(["summary", str(run)]) == 2
    assert "config.json" in one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    (run / "config.json").write_text(text)  # whole again: the summary is printed
    assert main(["summary", str(run)]) == 0
    printed = capsys.readouterr()
    assert str(run) in printed.out and not printed.err.strip()


# ------------------------------------------------------------------ a full disk (a small tmpfs)

@contextlib.contextmanager
def _small_disk(tmp_path: Path, size: str):
    """A tmpfs of `size` at tmp_path/disk (root only; the test is skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_while_resume_pt_is_saved_is_one_line_and_loses_nothing(tmp_path, capsys):
    """512 KiB hold the run's first resume.pt (about 420 KB) but not a second one beside it: the save fails
    with one line, the first resume.pt stays whole, and the folder resumed on a roomy disk ends exactly
    where a run that never stopped ends."""
    options = {**BASE, "--steps": "8"}
    with _small_disk(tmp_path, "512k") as disk:
        assert main(_train(options, disk / "run")) == 2
        assert _stderr_lines(capsys) == [f"error: No space left on device: {disk / 'run' / 'resume.pt'}"]
        assert not [p for p in (disk / "run").rglob("*") if ".tmp" in p.name]
        shutil.copytree(disk / "run", tmp_path / "moved")
    assert main(_train(options, tmp_path / "moved")) == 0
    assert main(_train(options, tmp_path / "never-stopped")) == 0
    assert load_summary(tmp_path / "moved").final_loss == load_summary(tmp_path / "never-stopped").final_loss


@pytest.mark.parametrize("command", [["run-ablation", "--variants", "lt", "flt", "--loops", "2", "--quiet"],
                                     ["map", "--variants", "lt", "--loops", "2", "--lo", "1", "--hi", "2", "--ratio", "2"]])
def test_a_grid_on_a_full_disk_exits_non_zero_with_one_line(tmp_path, capsys, command):
    options = {k: v for k, v in BASE.items() if k not in ("--variant", "--loops")} | {"--steps": "8", "--workers": "1"}
    with _small_disk(tmp_path, "512k") as disk:
        code = main([*command, *[x for kv in options.items() for x in kv], "--out", str(disk / "grid")])
        captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert code in (1, 2) and len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in captured.out + captured.err


# ------------------------------------------------------------------ the predictor, made and loaded

def test_fit_predictor_refuses_labels_of_one_class(tmp_path, capsys):
    runs = [make_run(tmp_path / f"r{seed}", "flt", 3, seed=seed) for seed in (0, 1)]
    assert {load_summary(r).verdict for r in runs} == {"stable"}  # no run fails: nothing to tell apart
    code = main(["fit-predictor", *map(str, runs), "--at", "20", "--out", str(tmp_path / "p.json")])
    assert code == 2 and "every one of the 2 finished runs does not have the target fails" in one_error_line(capsys)
    assert not (tmp_path / "p.json").exists()


def test_fit_predictor_refuses_when_no_run_reaches_a_step(tmp_path, capsys):
    runs = [make_run(tmp_path / "a", "lt", 12, collapsed=True), make_run(tmp_path / "b", "flt", 3)]
    steps = {load_summary(r).steps_done for r in runs}
    code = main(["fit-predictor", *map(str, runs), "--at", str(max(steps) + 100), "--out", str(tmp_path / "p.json")])
    assert code == 2 and "no finished run ran past any step of --at" in one_error_line(capsys)
    assert not (tmp_path / "p.json").exists()


def _predictor(tmp_path: Path, **changes) -> Path:
    from flt_diag.judge.early_warning import PACKAGED
    path = tmp_path / "p.json"
    path.write_text(json.dumps(json.loads(PACKAGED.read_text()) | changes))
    return path


@pytest.mark.parametrize("flag", ["--warn", "--stop-on-collapse"])
@pytest.mark.parametrize("threshold", [-1, 0, 1, 1.5])
def test_a_predictor_threshold_outside_0_1_is_refused_before_the_first_step(tmp_path, capsys, flag, threshold):
    pred = _predictor(tmp_path, threshold=threshold)
    code = main(_train(BASE, tmp_path / "run", flag, "--predictor", str(pred)))
    assert code == 2 and _stderr_lines(capsys) == [f"error: {pred}: threshold must be {'>' if threshold <= 0 else '<'} "
                                                   f"{0 if threshold <= 0 else 1}, got {threshold}"]
    assert not (tmp_path / "run").exists()


def test_an_empty_predictor_name_is_an_error_not_the_packaged_predictor(tmp_path, capsys):
    assert main(_train(BASE, tmp_path / "run", "--warn", "--predictor", "")) == 2
    assert "the predictor file name is empty" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ every field changeable on reuse, on resume

CHANGES = {"device": {"--device": "auto"}, "threads": {"--threads": "2"}, "compile": {"--no-compile": None},
           "eval_every": {"--eval-every": "1"}, "checkpoint_every": {"--checkpoint-every": "3"},
           "flush_every": {"--flush-every": "1"}, "tensorboard": {"--tensorboard": None},
           "wandb": {"--wandb": "a-project"}, "warn": {"--warn": None},
           "loop_dynamics": {"--no-loop-dynamics": None}, "exit_loss_every": {"--exit-loss-every": "2"},
           "dynamics_every": {"--dynamics-every": "2"},
           "sharpness_every": {"--sharpness-every": "3"}, "dynamics_batch": {"--dynamics-batch": "2"},
           "dynamics_iters": {"--dynamics-iters": "3"}, "stop_when_decided": {"--stop-when-decided": "explosion"}}


def test_every_field_changeable_on_reuse_has_a_resume_case():
    assert set(CHANGES) == set(VOLATILE_TRAIN_FIELDS) | set(VOLATILE_DIAGNOSTICS_FIELDS)


def _fake_mirrors(monkeypatch):
    """TensorBoard and W&B stand-ins (neither is installed here; what matters is the resume)."""
    writer = types.SimpleNamespace(add_scalar=lambda *a: None, close=lambda: None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=lambda d: writer))
    run = types.SimpleNamespace(log=lambda values, step: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: run))


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("never-stopped") / "run"
    assert main(_train(BASE, out)) == 0
    return load_summary(out)


def _stop_after_step_3(monkeypatch, run) -> None:
    """`flt-diag train` of BASE into `run`, Ctrl-C at the end of step 3 (index 2): exit 130, resume.pt at step 2."""
    from flt_diag.training.run_callbacks import Progress
    original = Progress.on_step_end

    def interrupt(self, trainer, step):
        if step == 2:
            raise KeyboardInterrupt
        original(self, trainer, step)
    with monkeypatch.context() as m:
        m.setattr(Progress, "on_step_end", interrupt)
        assert main(_train(BASE, run)) == 130


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_a_field_changeable_on_reuse_is_changeable_on_resume(tmp_path, monkeypatch, capsys, never_stopped, field):
    """Ctrl-C after step 3 (resume.pt holds step 2); the same command with the field changed resumes the
    run, which ends where the run that never stopped ends."""
    _stop_after_step_3(monkeypatch, tmp_path / "run")
    assert (tmp_path / "run" / "resume.pt").exists()
    _fake_mirrors(monkeypatch)
    changed = {**BASE, **{k: v for k, v in CHANGES[field].items() if v is not None}}
    code = main(_train(changed, tmp_path / "run", *[k for k, v in CHANGES[field].items() if v is None]))
    assert code == 0, _stderr_lines(capsys)
    s = load_summary(tmp_path / "run")
    assert s.steps_done == 4
    if not (field == "device" and torch.cuda.is_available()):  # (auto: the GPU, whose sums differ)
        assert s.final_loss == pytest.approx(never_stopped.final_loss, rel=1e-5)


# The names config.json held before its fields were named as users type them (model: n_layer for --depth, ...).
OLD_NAMES = {"model": {"depth": "n_layer", "width": "n_embd", "heads": "n_head", "seq_len": "sequence_len"},
             "diagnostics": {"diagnostics": "enabled", "record_every": "every", "attention_stats": "attention"}}


def test_a_run_folder_written_with_the_old_names_resumes_and_new_files_hold_the_new_names(tmp_path, monkeypatch,
                                                                                           capsys, never_stopped):
    """A run stopped after step 3 writes config.json with the names users type; rewritten with the old names (as
    an earlier flt-diag wrote it), the same command resumes it (not refused as another config) and ends where the
    run that never stopped ends."""
    run = tmp_path / "run"
    _stop_after_step_3(monkeypatch, run)
    written = json.loads((run / "config.json").read_text())
    for section, names in OLD_NAMES.items():
        assert set(names) <= set(written[section]) and not set(names.values()) & set(written[section])
    assert (written["model"]["depth"], written["diagnostics"]["record_every"]) == (1, 10)  # --depth 1; the default
    old = {**written, **{s: {names.get(k, k): v for k, v in written[s].items()} for s, names in OLD_NAMES.items()}}
    (run / "config.json").write_text(json.dumps(old))
    assert main(_train(BASE, run)) == 0, _stderr_lines(capsys)
    s = load_summary(run)
    assert s.steps_done == 4 and s.final_loss == pytest.approx(never_stopped.final_loss, rel=1e-5)


def test_a_warning_added_on_resume_sees_the_steps_trained_before(tmp_path):
    """The collapse warning added when a run resumes holds the same series as one there from step 0."""
    from flt_diag.training.settle import run_config
    from flt_diag.instruments.callbacks import Callback
    from flt_diag.training.trainer import Trainer

    class Interrupt(Callback):
        def on_step_end(self, trainer, step):
            if step == 2:
                raise KeyboardInterrupt
    values = dict(steps=4, device="cpu", preset="tiny", variant="lt", loops=2, depth=1, checkpoint_every=2,
                  eval_every=0, eval_batches=1)  # BASE
    plain, warned = run_config(values), run_config({**values, "warn": True})
    with pytest.raises(KeyboardInterrupt):
        Trainer(plain, tmp_path / "resumed", callbacks=[Interrupt()]).fit()
    resumed, throughout = Trainer(warned, tmp_path / "resumed"), Trainer(warned, tmp_path / "throughout")
    resumed.fit()
    throughout.fit()
    rows = [sorted(t.probe.warning.rows, key=lambda r: r[:4])
            for t in (resumed, throughout)]  # (the order within a step does not enter the features)
    assert rows[0] == rows[1] and {r[0] for r in rows[0]} == {0, 1, 2, 3}


# ------------------------------------------------------------------ library log lines

@pytest.mark.parametrize("content", [b"garbage", b"PAR1" + b"\x00" * 64])
def test_a_corpus_parquet_that_is_not_parquet_is_one_line_without_library_logs(tmp_path, capsys, content):
    (tmp_path / "bad.parquet").write_bytes(content)
    code = main(_train({**BASE, "--data": str(tmp_path / "bad.parquet")}, tmp_path / "run"))
    assert code == 2 and one_error_line(capsys).startswith(f"error: data file {tmp_path / 'bad.parquet'} is not a "
                                                           "readable Parquet file")


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`flt-diag ... | head -1`: the pipe closes under the command; it stops with no error line (141, as a
    command killed by SIGPIPE), not 'error: Broken pipe'."""
    import subprocess
    import sys
    script = ("import sys\nfrom flt_diag.cli.app import main\n"
              "sys.exit(main(['variants']))\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # (the reader is gone before the command writes)
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "error" not in err, err


def test_a_study_that_fails_ends_a_chain_of_studies_with_its_status(tmp_path, capsys, monkeypatch):
    """`flt-diag study A B`: A's lines fail (status 1, no exception), so B is not started and the status is A's."""
    monkeypatch.setattr("flt_diag.training.trainer.train", _boom)
    (tmp_path / "a.toml").write_text('[map]\nvariants = ["lt"]\nloops = [2]\nlo = 1\nhi = 2\nratio = 2\nsteps = 2\n'
                                     f'device = "cpu"\npreset = "tiny"\ndepth = 1\nout = "{tmp_path / "m"}"\n')
    (tmp_path / "b.toml").write_text('[ablation]\nvariants = ["lt"]\nloops = [2]\nsteps = 2\ndevice = "cpu"\n'
                                     f'preset = "tiny"\ndepth = 1\nout = "{tmp_path / "b"}"\n')
    assert main(["study", str(tmp_path / "a.toml"), str(tmp_path / "b.toml"), "--workers", "1", "--quiet"]) == 1
    assert (tmp_path / "m").is_dir() and not (tmp_path / "b").exists()
