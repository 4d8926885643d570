import math
import sys
import types

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from flt_diag.cli import main
from flt_diag.data.batches import batch_generator, get_batch
from flt_diag.data.corpus import load_tokens
from flt_diag.training.evaluation import VAL_SEED, eval_loops
from flt_diag.training.external import ExternalSinks, tag
from flt_diag.model.transformer import LoopedTransformer, ModelConfig
from flt_diag.training.trainer import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "flt"
    train(tiny_config(variant="flt", loops=2, steps=15, eval_batches=2), run)
    return run


def test_eval_loops_agrees_with_direct_forward(trained):
    df = eval_loops(trained, [1, 2, 4], batches=2)
    assert list(df.loops) == [1, 2, 4] and (df.trained_loops == 2).all()
    ckpt = torch.load(trained / "checkpoint.pt", weights_only=False)
    model = LoopedTransformer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    val = load_tokens("stdlib", "bytes", "val")
    for k, got in zip(df.loops, df.val_loss):
        losses = []
        for i in range(2):
            x, y = get_batch(val, 16, 64, batch_generator(VAL_SEED, i))
            with torch.no_grad():
                losses.append(F.cross_entropy(model(x, loops=int(k)).flatten(0, 1), y.flatten()).item())
        # eval_loops and this loop run the same fp32 ops on the same batches in one process (no
        # independent computation to move to float64); 1e-6 (~8 eps32) allows only the mean over
        # the batches to be summed in another order
        assert got == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert df.perplexity.tolist() == pytest.approx([math.exp(v) for v in df.val_loss])
    assert pd.read_csv(trained / "eval_loops.csv").val_loss.tolist() == pytest.approx(df.val_loss.tolist())


def test_eval_loops_cli(trained, capsys, tmp_path):
    assert main(["eval-loops", str(trained), "--loops", "1", "3", "--batches", "1"]) == 0
    assert "trained at K=2" in capsys.readouterr().out
    table = pd.read_csv(trained / "eval_loops.csv")  # (the rows of another --batches, written before, are kept)
    assert list(table[table.batches == 1].loops) == [1, 3]
    assert main(["eval-loops", str(tmp_path), "--loops", "1"]) == 2  # not a run folder
    assert "neither a run folder" in capsys.readouterr().err


def test_external_tags_and_wandb_sink(monkeypatch, tmp_path):
    assert tag("loss", -1, -1) == "loss" and tag("resid_norm", 3, 2) == "resid_norm/loop3/layer2"
    logged = []
    fake = types.SimpleNamespace(init=lambda **kw: types.SimpleNamespace(
        log=lambda values, step: logged.append((step, values)), finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    trainer = types.SimpleNamespace(run_dir=tmp_path, is_main=True, cfg=types.SimpleNamespace(
        diagnostics=types.SimpleNamespace(tensorboard=False, wandb="proj"), to_dict=lambda: {}))
    sinks = ExternalSinks()
    sinks.on_start(trainer)
    sinks.on_rows(trainer, 1, [(0, "loss", -1, -1, 5.0), (0, "resid_norm", 1, 2, 8.0), (1, "loss", -1, -1, 4.0)])
    assert logged == [(0, {"loss": 5.0, "resid_norm/loop1/layer2": 8.0}), (1, {"loss": 4.0})]
