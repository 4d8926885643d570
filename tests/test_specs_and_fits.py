"""What a command writes, the same version reads back (sweep and map specs, predictors, fit tables), and
a spec is checked before anything trains; a checkpoint meets data of its own vocabulary only; the online
replay is bounded by the metrics stored; only sweeps are pooled; a fit needs features that say something;
a second copy of a `--cell` task is told apart from a failure. Each test runs over a list of cases."""
import os
import socket
import json
import math
import time

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import tiny_config
from cli_errors import one_error_line
from fake_runs import make_run, make_sweep
from flt_diag.cli import main
from flt_diag.storage.cells import RunId
from flt_diag.storage.files import load_examples, load_predictor, load_spec
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import folder_lock


def _files(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ every writer's output read back

def _sweep_spec(tmp_path):
    from flt_diag.grids.sweep import SweepSpec, prepare_folder
    spec = SweepSpec(tiny_config(steps=2), ["lt"], [2], [0, 2**63 - 1], [1.0, 1.0000001, 1.0000002, 1e-7])
    prepare_folder(spec, tmp_path / "sw")
    read = load_spec(tmp_path / "sw" / "sweep.json")
    assert read.cell_names == [c.name for c in spec.cells()] and len(set(read.cell_names)) == 8
    return read.lr_scale == spec.lr_scale


def _map_spec(tmp_path):
    from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
    spec = MapSpec(tiny_config(steps=2), ["lt"], [2], [0], "lr", [0.5, 0.7071, 1.0], ["training"])
    prepare_map_folder(spec, tmp_path / "map")
    return load_spec(tmp_path / "map" / "sweep.json").grid == spec.grid


def _predictor_and_examples(tmp_path):
    sweep = make_sweep(tmp_path / "sw", seeds=(0, 1))
    assert main(["fit-predictor", str(sweep), "--at", "20", "40", "--out", str(tmp_path / "p.json"),
                 "--examples-out", str(tmp_path / "e.csv")]) == 0
    rows = load_examples(tmp_path / "e.csv")
    return load_predictor(tmp_path / "p.json").features and len(rows) == len(pd.read_csv(tmp_path / "e.csv"))


WRITERS = {"sweep spec": _sweep_spec, "map spec": _map_spec, "predictor and fit examples": _predictor_and_examples}


@pytest.mark.parametrize("name", list(WRITERS))
def test_what_a_command_writes_the_same_version_reads(tmp_path, name):
    assert WRITERS[name](tmp_path)


@pytest.mark.parametrize("lr, name", [(1.0, "lr1"), (0.5, "lr0.5"), (1.0000001, "lr1.0000001"), (1e-7, "lr1e-07"),
                                      (2.0000000000000004, "lr2.0000000000000004")])
def test_a_cell_name_writes_its_lr_scale_exactly(lr, name):
    assert RunId("lt", 2, 0, lr).name == f"lt_K02_seed0_{name}"
    assert float(name[2:]) == lr  # the name reads back as the very number


def test_one_run_identity_names_every_folder_and_reads_back_from_what_a_run_stored(tmp_path):
    """A sweep's cell, a map's line and its depth probe are one type, named as the folders on disk are (the
    archive's lt_K09_seed301_lr1); a run's config, its summary and its fit-examples row read back one identity,
    whatever its folder is called and wherever in a grid it sits."""
    assert RunId("lt", 9, 301, 1.0).name == "lt_K09_seed301_lr1"  # docs/data/runs/gradient-path-2/g53-2
    assert RunId("flt", 3, 0).name == "flt_K03_seed0" and RunId("flt", 3, 0, 1.0, depth=2).name == "flt_K03_seed0_lr1_L2"
    assert RunId("lt", 2, 0, 1.0, index=5) == RunId("lt", 2, 0, 1.0)  # its place in a grid is no part of it
    run = make_run(tmp_path / "renamed", "lt", 3, seed=7, lr_scale=0.5, depth=2)
    cfg, summary = json.loads((run / "config.json").read_text()), json.loads((run / "summary.json").read_text())
    want = RunId("lt", 3, 7, 0.5, depth=2, width=cfg["model"]["width"])
    from flt_diag.results.tables import collect
    from flt_diag.results.predictor_fit import examples_table, training_examples
    (got,) = collect(run).runs
    assert got.id == want and (summary["variant"], summary["loops"], summary["seed"], summary["lr_scale"]) == \
        ("lt", 3, 7, 0.5)
    (example,) = training_examples([run], [10])
    examples_table([example]).to_csv(tmp_path / "ex.csv", index=False)
    (row,) = load_examples(tmp_path / "ex.csv")
    assert example["identity"] == RunId.read(row) == want and (row.depth, row.width) == (2, want.width)


SPECS = [  # (command line, what the one error line says): refused before any folder is made
    (["run-ablation", "--seeds", *map(str, range(101)), "--lr-scale", *(f"{1 + i / 100:g}" for i in range(100)),
      "--loops", "2", "--variants", "lt"], "at most 10,000"),  # 10,100 cells, each list within its bound
    (["run-ablation", "--loops", "2", "--variants", "lt", "--lr-scale", "1", "1.0"], "duplicates"),
    (["run-ablation", "--loops", "2", "--variants", "lt", "--seeds", str(2**64)], "--seeds must be in"),
    (["train", "--seed", str(2**63)], "--seed must be in"),
    (["map", "--loops", "2", "--variants", "lt", "--seeds", str(2**64)], "--seeds must be in"),
]


@pytest.mark.parametrize("args, message", SPECS, ids=[f"{a[0]}-{m}" for a, m in SPECS])
def test_a_spec_is_refused_before_anything_runs(tmp_path, capsys, args, message):
    assert main([*args, "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


FITS = [(["loss_climb"], None, "constant"), (["grad_cos", "resid_level"], math.inf, "missing"),
        (["grad_cos"], math.nan, "missing"), (["resid_level", "loss_slope"], None, "too large")]


@pytest.mark.parametrize("features, value, why", FITS, ids=[f"{'-'.join(f)}-{w}" for f, _, w in FITS])
def test_a_fit_on_features_that_say_nothing_writes_nothing(tmp_path, capsys, features, value, why):
    sweep = make_sweep(tmp_path / "sw", seeds=(0, 1))
    if why != "constant":  # every run's gradient cosine made infinite or NaN (for "too large": its loss +-1e308)
        for part in sweep.glob("cells/*/metrics/part-*.parquet"):
            df = pd.read_parquet(part)
            if why == "too large":
                sel = df.metric == M.LOSS
                df.loc[sel, "value"] = np.where(df.step[sel] % 2, 1e308, -1e308)
            else:
                df.loc[df.metric == M.GRAD_COSINE, "value"] = value
            df.to_parquet(part, index=False)
    with _no_warnings():
        code = main(["fit-predictor", str(sweep), "--at", "20", "40", "--features", *features,
                     "--out", str(tmp_path / "p.json"), "--examples-out", str(tmp_path / "e.csv")])
    assert code == 2 and "carries no information" in (line := one_error_line(capsys)) and why in line, line
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "e.csv").exists()


class _no_warnings:
    """numpy's RuntimeWarnings (Mean of empty slice, overflow) never reach the user."""
    def __enter__(self):
        import warnings
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.catcher.__exit__(*exc)
        shown = [f"{w.filename}:{w.lineno}: {w.message}" for w in self.caught if issubclass(w.category, RuntimeWarning)]
        assert not shown, shown[:3]


# ------------------------------------------------------------------ a checkpoint meets data

@pytest.fixture(scope="module")
def small_vocab_runs(tmp_path_factory):
    """Runs whose checkpoint's model has a vocabulary of 16 or 64 tokens (the data's has 256)."""
    from flt_diag.model.transformer import LoopedTransformer, ModelConfig
    from flt_diag.training.trainer import train
    root = tmp_path_factory.mktemp("vocab")
    train(tiny_config(variant="lt", loops=2, steps=2), root / "base")
    runs = {}
    for vocab in (16, 64):
        run = root / f"v{vocab}"
        run.mkdir()
        (run / "config.json").write_bytes((root / "base" / "config.json").read_bytes())
        cfg = json.loads((run / "config.json").read_text())["model"] | {"vocab_size": vocab}
        model = LoopedTransformer(ModelConfig(**cfg))
        torch.save({"model": model.state_dict(), "model_config": cfg, "step": 2}, run / "checkpoint.pt")
        runs[vocab] = run
    return runs


@pytest.mark.parametrize("vocab, data", [(64, None), (16, "phop"), (16, "addition")])
def test_a_checkpoint_and_data_of_other_vocabularies_are_one_line(small_vocab_runs, capsys, vocab, data):
    run = small_vocab_runs[vocab]
    before = _files(run)
    code = main(["eval-loops", str(run), "--loops", "1", "--batches", "1", *(["--data", data] if data else [])])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code != 0 and len(err) == 1 and f"vocabulary of {vocab} tokens" in err[0] and "uses 256" in err[0], err
    assert "Traceback" not in err[0] and _files(run) == before


# ------------------------------------------------------------------ the online replay

@pytest.mark.parametrize("steps_done", [80, 10**15])
def test_the_online_replay_is_bounded_by_the_metrics_stored(tmp_path, steps_done):
    from flt_diag.judge.early_warning import CHECK_EVERY, first_warning
    from flt_diag.storage.folders import load_metrics
    run = make_run(tmp_path / "run", "lt", 3, collapsed=True)
    df = load_metrics(run)
    predictor = {"features": ["loss_climb"], "threshold": 0.5,
                 "models": {"25": {"mean": [0.0], "std": [1.0], "coef": [1.0], "intercept": 0.0}}}
    t0 = time.monotonic()
    w = first_warning(df, predictor, 3, 2, 64, steps_done)
    assert time.monotonic() - t0 < 20
    assert w["checks"] == len(range(25, int(df.step.max()) + 2, CHECK_EVERY))  # 25, 50, 75: never past step 80


# ------------------------------------------------------------------ pooling and concurrent cells

@pytest.mark.parametrize("command", [["summary"], ["report", "--out", "{tmp}/r.html"], ["plot", "all", "--out", "{tmp}/f"]])
@pytest.mark.parametrize("kinds", [("map", "sweep"), ("sweep", "map"), ("map", "map")])
def test_a_map_is_never_pooled(tmp_path, capsys, command, kinds):
    from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
    folders = []
    for i, kind in enumerate(kinds):
        if kind == "sweep":
            folders.append(make_sweep(tmp_path / f"sw{i}"))
        else:
            prepare_map_folder(MapSpec(tiny_config(steps=2), ["lt"], [2], [0], "lr", [0.5, 1.0], ["training"]),
                               tmp_path / f"map{i}")
            folders.append(tmp_path / f"map{i}")
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    assert main([*args[:2 if args[0] == "plot" else 1], *map(str, folders), *args[2 if args[0] == "plot" else 1:]]) == 2
    assert "is a map folder" in one_error_line(capsys)
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "f").exists()


def test_a_second_copy_of_a_cell_task_is_not_a_failure(tmp_path, capsys):
    out = tmp_path / "sw"
    args = ["run-ablation", "--loops", "2", "--variants", "lt", "--steps", "2", "--device", "cpu", "--depth", "1",
            "--quiet", "--out", str(out), "--cell", "0"]
    cell = out / "cells" / "lt_K02_seed0_lr1"
    assert main(args) == 0
    (cell / "summary.json").unlink()  # unfinished again: a task would train it
    with folder_lock(cell):  # the first copy of the task, training the cell
        assert main(args) == 2
        line = one_error_line(capsys)  # what it is: busy, whose, since when
        assert "is busy" in line and f"held by pid {os.getpid()} on host {socket.gethostname()} since " in line
        assert not (cell / "error.txt").exists()
    assert main(args) == 0 and not (cell / "error.txt").exists()
