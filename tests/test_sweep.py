from pathlib import Path

import pandas as pd
import pytest

from conftest import tiny_config
from flt_diag.grids import sweep as S
from flt_diag.cli import main
from flt_diag.storage.folders import StorageError, load_summary
from flt_diag.training.trainer import Callback, Trainer


def spec(variants=("lt", "flt"), loops=(1, 2), seeds=(0,), lrs=(1.0,), steps=4):
    return S.SweepSpec(tiny_config(steps=steps, checkpoint_every=2), list(variants), list(loops), list(seeds), list(lrs))


def test_cell_expansion_order_and_names():
    cells = spec(variants=["lt", "fla", "flt"], loops=[3, 12], seeds=[0, 1], lrs=[0.5, 1.0]).cells()
    assert len(cells) == 3 * 2 * 2 * 2
    assert [c.index for c in cells] == list(range(24))
    assert cells[0].name == "lt_K03_seed0_lr0.5" and cells[-1].name == "flt_K12_seed1_lr1"
    assert len({c.name for c in cells}) == 24
    assert [(c.variant, c.loops) for c in cells[:6]] == [(v, k) for k in (3, 12) for v in ("lt", "fla", "flt")]
    cfg = spec().cell_config(cells[11])  # lr scale outermost, then seed, loops, variant
    assert (cfg.model.variant, cfg.model.loops, cfg.train.seed, cfg.train.lr_scale) == ("flt", 12, 1, 0.5)


@pytest.mark.parametrize("bad", [dict(loops=[]), dict(variants=["lt", "lt"]), dict(loops=[0]), dict(variants=["zz"])])
def test_bad_specs(bad):
    with pytest.raises(ValueError):
        spec(**bad)


def _parsed(argv):
    """The option values the real parser produces for argv (no command runs)."""
    from flt_diag.cli.app import parse
    _, values, _ = parse(argv)
    return values


def test_list_options_space_separated_repeated_and_commas():
    assert _parsed(["run-ablation", "--loops", "3", "6", "9", "--out", "x"])["loops"] == [3, 6, 9]
    assert _parsed(["run-ablation", "--loops", "3", "--loops", "6"])["loops"] == [3, 6]
    assert _parsed(["run-ablation", "--loops=3,6", "--variants", "lt", "flt"])["loops"] == [3, 6]
    v = _parsed(["run-ablation", "--loops", "3,6", "9", "--variants", "lt", "flt", "--list"])
    assert v["loops"] == [3, 6, 9] and v["variants"] == ["lt", "flt"] and v["list"] is True
    # negative numbers are values (refused later by the option's bound, not taken for options)
    assert _parsed(["run-ablation", "--lr-scale", "0.5", "-1", "--list"])["lr_scale"] == [0.5, -1.0]
    # train's --loops is one value: a second one is an error, never silently the last
    from flt_diag.cli.options import UserError
    with pytest.raises(UserError, match=r"unexpected extra argument\(s\) \(6\)"):
        _parsed(["train", "--loops", "3", "6"])


def test_cli_list_parses_space_separated(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["run-ablation", "--preset", "tiny", "--loops", "3", "6", "--variants", "lt", "flt",
                 "--seeds", "0", "1", "--out", str(out), "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 8 and "lt_K03_seed0_lr1" in lines[0] and lines[0].split()[-1] == "open"
    assert not out.exists()  # --list writes nothing


@pytest.mark.parametrize("args,message", [
    (["--variants", "lt", "bogus"], "--variants must be one of lt, lt-ii, lt-ai, fla, flt, parcae, huginn, stars"),
    (["--loops", "3", "0"], "--loops must be in 1..1024, got 0"),
    (["--loops", "3", "x"], "Invalid value for '--loops'"),
    (["--lr-scale", "0"], "--lr-scale must be > 0"),
    (["--loops", "3", "3"], "duplicates"),
    (["--cell", "99"], "--cell must be in 0.."),
    (["--out", "/proc/forbidden/sweep"], "cannot create sweep folder"),
])
def test_cli_bad_input_before_training(args, message, capsys, tmp_path):
    argv = ["run-ablation", "--preset", "tiny", "--steps", "2", "--out", str(tmp_path / "s")] + args
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "s" / "cells").exists() or not any((tmp_path / "s" / "cells").iterdir())


def test_sweep_runs_skips_finished_and_writes_summary(tmp_path, monkeypatch):
    sp = spec()
    df = S.run_sweep(sp, tmp_path / "sw", show_progress=False)
    assert len(df) == 4 and set(df.verdict) <= {"stable", "stalled", "collapsed", "diverged"}  # a few steps: v3 stalled
    pq, csv = pd.read_parquet(tmp_path / "sw" / "summary.parquet"), pd.read_csv(tmp_path / "sw" / "summary.csv")
    assert list(pq.cell) == list(csv.cell) and list(pq.verdict) == list(csv.verdict)
    assert pq.final_loss.tolist() == pytest.approx(csv.final_loss.tolist())
    assert list(pd.read_csv(tmp_path / "sw" / "summary.csv").cell) == [c.name for c in sp.cells()]
    monkeypatch.setattr(S, "run_cell", lambda *a, **k: pytest.fail("re-ran a finished cell"))
    assert len(S.run_sweep(spec(), tmp_path / "sw", show_progress=False)) == 4


class Kill(Callback):
    def after_step(self, trainer, step):
        if step == 2:
            raise KeyboardInterrupt


def test_killed_cell_is_resumed_and_others_skipped(tmp_path):
    sp = spec(variants=["lt"], loops=[1, 2])
    S.prepare_folder(sp, tmp_path / "sw")
    first, second = sp.cells()
    with pytest.raises(KeyboardInterrupt):  # cell 0 dies after a mid-run checkpoint at step 2
        Trainer(sp.cell_config(first), tmp_path / "sw" / "cells" / first.name, callbacks=[Kill()]).fit()
    assert S.cell_status(tmp_path / "sw", first) == "partial"
    df = S.run_sweep(sp, tmp_path / "sw", show_progress=False)
    assert len(df) == 2 and (df.steps_done == 4).all()
    # the resumed cell equals an uninterrupted run of the same config
    Trainer(sp.cell_config(first), tmp_path / "straight").fit()
    from flt_diag.storage.folders import load_metrics
    assert load_metrics(tmp_path / "straight").equals(load_metrics(tmp_path / "sw" / "cells" / first.name))


def test_changed_spec_is_refused(tmp_path):
    S.run_sweep(spec(variants=["lt"], loops=[1]), tmp_path / "sw", show_progress=False)
    for changed in (spec(variants=["lt"], loops=[1, 2]), spec(variants=["lt"], loops=[1], steps=5)):
        with pytest.raises(StorageError, match="different spec"):
            S.run_sweep(changed, tmp_path / "sw", show_progress=False)
    assert len(pd.read_csv(tmp_path / "sw" / "summary.csv")) == 1


def test_a_sweep_json_written_with_the_old_names_is_the_same_spec(tmp_path):
    """sweep.json holds the grid's lr scales as lr_scale (as --lr-scale and study files name them) and the base's
    sizes as depth, width, ...; one written before (lr_scales, n_layer, n_embd, n_head, sequence_len) is the same
    spec: the folder is resumed, not refused."""
    import json
    sp = spec(variants=["lt"], loops=[1], steps=2)
    S.prepare_folder(sp, tmp_path / "sw")
    path = tmp_path / "sw" / "sweep.json"
    written = json.loads(path.read_text())
    assert written["lr_scale"] == [1.0] and "lr_scales" not in written and "depth" in written["base"]["model"]
    old_model = dict(depth="n_layer", width="n_embd", heads="n_head", seq_len="sequence_len")
    written["lr_scales"] = written.pop("lr_scale")
    written["base"]["model"] = {old_model.get(k, k): v for k, v in written["base"]["model"].items()}
    path.write_text(json.dumps(written))
    S.prepare_folder(sp, tmp_path / "sw")  # the same spec: no StorageError
    with pytest.raises(StorageError, match="different spec"):
        S.prepare_folder(spec(variants=["lt"], loops=[1], lrs=(2.0,), steps=2), tmp_path / "sw")


def test_failed_cell_does_not_stop_the_sweep(tmp_path, monkeypatch):
    import flt_diag.training.trainer as T
    real = T.train

    def flaky(cfg, run_dir, **kw):
        if cfg.model.variant == "lt":
            raise RuntimeError("boom")
        return real(cfg, run_dir, **kw)

    monkeypatch.setattr(T, "train", flaky)
    df = S.run_sweep(spec(loops=[1]), tmp_path / "sw", show_progress=False)
    assert list(df.variant) == ["flt"]
    assert "boom" in (tmp_path / "sw" / "cells" / "lt_K01_seed0_lr1" / "error.txt").read_text()


def test_cell_option_runs_one_cell(tmp_path, capsys):
    argv = ["run-ablation", "--preset", "tiny", "--steps", "3", "--loops", "1", "2", "--variants", "flt",
            "--out", str(tmp_path / "sw"), "--quiet"]
    assert main(argv + ["--cell", "1"]) == 0
    assert load_summary(tmp_path / "sw" / "cells" / "flt_K02_seed0_lr1") is not None
    assert not (tmp_path / "sw" / "cells" / "flt_K01_seed0_lr1").exists()
    capsys.readouterr()
    assert main(argv + ["--list"]) == 0
    status = [line.split()[-1] for line in capsys.readouterr().out.strip().splitlines()]
    assert status == ["open", "finished"]  # (flt-diag status's words)


def test_parallel_workers(tmp_path):
    df = S.run_sweep(spec(variants=["flt"], loops=[1, 2], steps=3), tmp_path / "sw", workers=2, show_progress=False)
    assert len(df) == 2 and (df.steps_done == 3).all()
    # workers split the 2 cores: each cell ran with one thread
    import json
    for c in ("flt_K01_seed0_lr1", "flt_K02_seed0_lr1"):
        env = json.loads((tmp_path / "sw" / "cells" / c / "config.json").read_text())["env"]
        assert env["threads"] == max(1, (__import__("os").cpu_count() or 1) // 2)


def test_every_study_file_lists_its_cells(capsys):
    from pathlib import Path
    from flt_diag.cli.specs import load_study
    studies = sorted((Path(__file__).parent.parent / "experiments").rglob("*.toml"))  # the benchmark stages too
    assert len(studies) >= 6
    for path in studies:
        command, args = load_study(path)
        assert command in ("run-ablation", "map") and args.out
        assert main(["study", str(path), "--list"]) == 0, path
        assert capsys.readouterr().out.strip()


def test_a_study_file_is_the_same_spec_as_its_command_line(tmp_path):
    """A study TOML loads straight into the sweep spec: the same cells and configs as the options."""
    from flt_diag.cli.options import command_args
    from flt_diag.cli.specs import load_study, sweep_spec
    (tmp_path / "s.toml").write_text('[ablation]\npreset = "tiny"\nvariants = ["lt", "flt"]\nloops = [2, 3]\n'
                                     'seeds = [1]\nlr_scale = [0.5, 2]\nsteps = 7\nseq_len = 32\nout = "o"\n')
    command, args = load_study(tmp_path / "s.toml")
    from_file = sweep_spec(args)
    from_cli = sweep_spec(command_args(command, _parsed(["run-ablation", "--preset", "tiny", "--variants", "lt", "flt",
                                                         "--loops", "2", "3", "--seeds", "1", "--lr-scale", "0.5",
                                                         "2", "--steps", "7", "--seq-len", "32"])))
    assert from_file.to_dict() == from_cli.to_dict()
    cfg = from_file.cell_config(from_file.cells()[-1])
    assert (cfg.model.variant, cfg.model.loops, cfg.train.seed, cfg.train.lr_scale, cfg.train.steps,
            cfg.model.seq_len) == ("flt", 3, 1, 2.0, 7, 32)


def test_one_value_of_a_list_option_in_a_study_file_is_a_list_of_one(tmp_path):
    """As on the command line (--loops 4): a study's `loops = 4` is the list [4], a path is a Path."""
    from flt_diag.cli.specs import load_study
    (tmp_path / "s.toml").write_text('[ablation]\nvariants = "lt"\nloops = 4\nlr_scale = 2\nout = "o"\n')
    _, args = load_study(tmp_path / "s.toml")
    assert (args.variants, args.loops, args.lr_scale, args.out) == (["lt"], [4], [2.0], Path("o"))
    assert isinstance(args.lr_scale[0], float)


@pytest.mark.parametrize("text, message", [
    ('[ablation]\nstep = 3\n', "unknown option 'step'"),
    ('[ablation]\nsteps = 0\n', "[ablation] steps must be in 1..9007199254740992, got 0"),
    ('[ablation]\nloops = [3, 3]\n', "duplicates"),
    ('[ablation]\nsteps = "many"\n', "[ablation] steps must be an integer"),
    ('[map]\nratio = 1\n', "[map] ratio must be > 1"),
    ('[ablation]\n[map]\n', "exactly one"),
])
def test_bad_study_files_are_one_line(tmp_path, capsys, text, message):
    (tmp_path / "s.toml").write_text(text)
    assert main(["study", str(tmp_path / "s.toml"), "--list"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_parallel_workers_take_the_longest_cells_first():
    cells = spec(variants=["lt", "flt"], loops=[1, 3, 2], seeds=[0, 1]).cells()
    order = S.longest_first(cells)
    assert [c.loops for c in order] == [3] * 4 + [2] * 4 + [1] * 4
    assert [c.index for c in order[:4]] == sorted(c.index for c in cells if c.loops == 3)  # ties: grid order
    assert sorted(c.index for c in order) == [c.index for c in cells]


def test_sweep_prints_status_lines_where_stdout_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    """In a log file (no terminal for the bar) the sweep says how far it is, not only when a cell ends."""
    from conftest import tiny_config
    from flt_diag.grids.progress import SweepMonitor
    from flt_diag.grids.sweep import SweepSpec, run_sweep
    monkeypatch.setattr(SweepMonitor, "heartbeat", 0.0)
    run_sweep(SweepSpec(tiny_config(steps=12), ["lt"], [2], [0], [1.0]), tmp_path / "sw", workers=1,
              show_progress=True)
    lines = capsys.readouterr().out.splitlines()
    beats = [line for line in lines if "0/1 cells" in line and "of the work" in line]
    assert beats and any("running: lt_K02_seed0_lr1 " in line for line in beats), lines[:5]
    assert any("cell 0 lt_K02_seed0_lr1: " in line for line in lines)


def test_the_sweep_prints_one_estimate_of_its_total_time_from_its_first_steps(tmp_path, capsys, monkeypatch):
    from conftest import tiny_config
    from flt_diag.grids.progress import SweepMonitor
    from flt_diag.grids.sweep import SweepSpec, run_sweep
    monkeypatch.setattr(SweepMonitor, "estimate_after", 0.0)
    run_sweep(SweepSpec(tiny_config(steps=6), ["lt", "flt"], [2, 4], [0], [1.0]), tmp_path / "sw", workers=1,
              show_progress=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if "the whole sweep takes about" in line]
    assert len(lines) == 1 and "from now" in lines[0]


def test_the_estimate_extrapolates_the_work_done_weighted_by_loops_and_depth(monkeypatch):
    from flt_diag.storage.cells import RunId
    from flt_diag.grids.progress import SweepMonitor
    cells = [RunId("lt", 2, 0, 1.0, index=0), RunId("lt", 6, 0, 1.0, depth=3, index=1)]  # 2x100 and 18x100 units of work
    m = SweepMonitor(Path("/nonexistent"), cells, 100, enabled=False)
    printed = []
    m.bar = type("Bar", (), {"console": type("C", (), {"print": lambda self, s, **k: printed.append(s)})()})()
    m._estimate(work=20, elapsed=30.0)  # the first progress, after 30 s of start-up and compilation
    m._estimate(work=200, elapsed=80.0)  # 180 units in 50 s: not yet estimate_after (60 s) of training
    assert printed == []
    m._estimate(work=620, elapsed=90.0)  # 600 units in 60 s: 10 units/s, 1,980 more units after the first 30 s
    assert printed == ["  estimate from 60 s of training: the whole sweep takes about 4 min, 2 min from now"]
    m._estimate(work=800, elapsed=120.0)
    assert len(printed) == 1  # once


def _study(path: Path, out: Path) -> Path:
    path.write_text(f'[ablation]\npreset = "tiny"\nvariants = ["lt"]\nloops = [2]\nsteps = 2\ndepth = 1\nseq_len = 16\n'
                    f'batch_size = 2\neval_batches = 1\ndevice = "cpu"\nout = "{out}"\n')
    return path


def test_several_study_files_run_one_after_another_and_the_first_failure_ends_them(tmp_path, capsys):
    """`flt-diag study A B`: both run, in order, with the folder options given once; a bad file among them is
    refused before anything runs; a study that fails ends the command with its status, the next not started."""
    a, b = _study(tmp_path / "a.toml", tmp_path / "ra"), _study(tmp_path / "b.toml", tmp_path / "rb")
    bad = tmp_path / "bad.toml"
    bad.write_text('[ablation]\nstep = 3\n')
    assert main(["study", str(a), str(bad), "--quiet", "--workers", "1"]) == 2
    assert not (tmp_path / "ra").exists() and "unknown option 'step'" in capsys.readouterr().err
    assert main(["study", str(a), str(b), "--quiet", "--workers", "1", "--archive-to", str(tmp_path / "arch")]) == 0
    out = capsys.readouterr().out
    assert out.index(f"study {a}") < out.index(f"study {b}")
    for name in ("ra", "rb"):
        assert (tmp_path / name / "cells" / "lt_K02_seed0_lr1" / "summary.json").is_file()
        assert (tmp_path / "arch" / name / "lt_K02_seed0_lr1.parquet").is_file()
    (tmp_path / "rc").write_text("a file where the study's folder goes")
    c, d = _study(tmp_path / "c.toml", tmp_path / "rc"), _study(tmp_path / "d.toml", tmp_path / "rd")
    assert main(["study", str(c), str(d), "--quiet", "--workers", "1"]) != 0
    assert not (tmp_path / "rd").exists() and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["study", str(a), str(a), "--list"]) == 2
    assert f"write the folder {(tmp_path / 'ra').resolve()}" in capsys.readouterr().err
    (tmp_path / "x").mkdir()
    e = _study(tmp_path / "e.toml", tmp_path / "x" / "ra")  # another folder of the same name as a's
    assert main(["study", str(a), str(e), "--list"]) == 0  # two folders: fine ...
    capsys.readouterr()
    assert main(["study", str(a), str(e), "--list", "--archive-to", str(tmp_path / "arch2")]) == 2  # ... unless
    assert "named ra: under --archive-to" in capsys.readouterr().err  # both would be archived into arch2/ra
    unnamed = tmp_path / "f.toml"
    unnamed.write_text('[ablation]\npreset = "tiny"\nvariants = ["lt"]\nloops = [2]\nsteps = 2\n')
    assert main(["study", str(a), str(unnamed), "--list"]) == 2
    assert f"{unnamed} names no `out`" in capsys.readouterr().err
