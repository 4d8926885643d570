"""Settling a run's config once, below the Trainer: torch-free, idempotent, devices checked against
the machine, the predictor read once per file version, and the fields that decide what a run computes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import tiny_config
from flt_diag.training import settle as S
from flt_diag.instruments import warning_callback as W
from flt_diag.judge.early_warning import PACKAGED
from flt_diag.storage.file_models import PredictorFile


def test_settling_a_run_config_from_options_imports_no_torch():
    code = ("import sys; from flt_diag.training.settle import run_config\n"
            "cfg = run_config(dict(preset='tiny', loops=6, steps=7, device='cpu'))\n"
            "assert (cfg.model.loops, cfg.train.steps, cfg.model.vocab_size, cfg.train.device) == (6, 7, 256, 'cpu')\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_settling_a_settled_config_changes_nothing():
    once = S.settle(tiny_config(loops=2))
    assert S.settle(once).to_dict() == once.to_dict()


def test_devices_are_decided_and_checked_against_the_machine():
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert S.choose_device("cpu") == "cpu"
    assert S.choose_device("auto") == ("cuda" if gpus else "cpu")
    for bad in ("banana", "mps", "cuda:x"):
        with pytest.raises(ValueError, match="unknown device"):
            S.choose_device(bad)
    with pytest.raises(ValueError, match="not available" if not gpus else f"there are {gpus} GPUs"):
        S.choose_device(f"cuda:{gpus}")


def test_a_bad_option_is_one_line_naming_its_flag():
    with pytest.raises(ValueError, match=r"--steps must be in 1\.\.9007199254740992, got 0"):
        S.run_config(dict(steps=0, device="cpu"))
    with pytest.raises(ValueError, match="tokenizer file /no/such.json does not exist"):
        S.run_config(dict(tokenizer="/no/such.json", device="cpu"))


def test_options_are_named_as_users_type_them_or_by_old_name_and_a_misspelt_one_is_refused():
    """`depth` is the flag's name and the field's; `n_layer`, its name before, still reads as it; a name no section
    has (a typo that would otherwise leave the option at its default without a word) is one line naming it."""
    by_flag = S.unsettled_config(dict(preset="tiny", depth=3, seq_len=32, record_every=5, device="cpu"))
    by_old_name = S.unsettled_config(dict(preset="tiny", n_layer=3, sequence_len=32, every=5, device="cpu"))
    assert by_flag.to_dict() == by_old_name.to_dict()
    assert (by_flag.model.depth, by_flag.model.width, by_flag.model.seq_len, by_flag.diagnostics.record_every) == \
        (3, 96, 32, 5)  # the tiny preset's width is 32 per block
    assert {"depth", "width", "heads", "seq_len"} <= set(by_flag.to_dict()["model"])
    with pytest.raises(ValueError, match="^stepz is not a config option$"):
        S.run_config(dict(stepz=3, device="cpu"))


def test_the_predictor_is_read_once_per_version_of_its_file(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    path.write_text(PACKAGED.read_text())
    reads = []
    monkeypatch.setattr(W, "load_predictor", lambda p: reads.append(p) or PredictorFile.model_validate(json.loads(path.read_text())))
    S.settle(tiny_config(loops=2, diagnostics=dict(warn=True, predictor=str(path))))
    assert S.predictor(str(path)).features and len(reads) == 1  # the run's warning uses the settled copy
    model = json.loads(path.read_text())
    model["threshold"] = 0.25
    path.write_text(json.dumps(model))  # a new version of the file is read again
    assert S.predictor(str(path)).threshold == 0.25 and len(reads) == 2


def test_only_the_fields_that_decide_a_run_are_compared():
    a = tiny_config(loops=6).to_dict()
    b = tiny_config(loops=12, device="cuda", eval_every=5, threads=3).to_dict()
    b["verdict"]["smooth_window"] = 7  # thresholds can change without invalidating a run
    assert S.differences(S.comparable(a), S.comparable(b)) == ["model.loops: 6 -> 12"]


def test_the_fields_that_may_change_on_resume_are_the_ones_that_change_nothing_computed():
    """Read from the fields' `volatile` facts; written out here independently: where the run goes and how
    often it logs or records may change when a folder is resumed, never what it trains."""
    from flt_diag.config.grid_options import SWEEP_GRID_FIELDS
    assert set(S.VOLATILE_TRAIN_FIELDS) == {"device", "threads", "compile", "eval_every", "checkpoint_every"}
    assert set(S.VOLATILE_DIAGNOSTICS_FIELDS) == {"flush_every", "tensorboard", "wandb", "warn", "loop_dynamics",
                                                  "exit_loss_every", "dynamics_every", "sharpness_every",
                                                  "dynamics_batch", "dynamics_iters",
                                                  "stop_when_decided"}  # (where a run ends, once its outcome is certain)
    assert {k: set(v) for k, v in SWEEP_GRID_FIELDS.items()} == {"model": {"variant", "loops"},
                                                                "train": {"seed", "lr_scale"}}
