"""A record that needs the step's batch gets it from its context (flt_diag.records.RecordContext, `context=True`):
a toy record outside the package (tests/toy_records/batch_seen.py), registered before the config is first read, sees
under flt_diag.watch the step and the token ids each recorded forward was given (summed by hand here), and its state
kept from step to step; under flt-diag's Trainer also the model's targets, each the next token of idx (a language
model's: every position but the last of each sequence)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import json, sys
import flt_diag
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import batch_seen
flt_diag.register_record(batch_seen.RECORD)

import torch
from flt_diag.cli import main
from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.storage.folders import load_config, load_metrics
from probe_models import UniversalTransformer, batches, lm_loss
out = sys.argv[3]

def rows(folder):
    df = load_metrics(folder)
    df = df[df.metric.str.startswith("toy_ctx_")]
    return {f"{r.metric}@{int(r.step)}": float(r.value) for r in df.itertuples()}

torch.manual_seed(0)
model = UniversalTransformer(loops=3)
opt = torch.optim.AdamW(model.parameters(), 1e-3)
by_hand = {}
with flt_diag.watch(model, blocks=[model.layer], folder=f"{out}/watch", optimizer=opt,
                    diagnostics=DiagnosticsConfig(toy_batch=2)) as probe:
    for s, x in enumerate(batches(5)):
        by_hand[s] = int(x.sum())
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        opt.zero_grad()
code = main(["train", "--steps", "3", "--loops", "2", "--device", "cpu", "--eval-every", "0", "--eval-batches", "1",
             "--toy-batch", "1", "--out", f"{out}/train"])
cfg = load_config(f"{out}/train")
print(json.dumps(dict(watch=rows(f"{out}/watch"), by_hand=by_hand, code=code, train=rows(f"{out}/train"),
                      positions=cfg.train.batch_size * (cfg.model.seq_len - 1))))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("context")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TESTS / "toy_records"), str(TESTS), str(out)],
                          cwd=TESTS, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_record_sees_the_step_and_the_batch_of_its_forward_under_watch(run):
    watch = run["watch"]
    assert {k for k in watch if k.startswith("toy_ctx_step")} == {"toy_ctx_step@0", "toy_ctx_step@2",
                                                                  "toy_ctx_step@4"}
    for n, step in enumerate((0, 2, 4), 1):
        assert watch[f"toy_ctx_step@{step}"] == step
        assert watch[f"toy_ctx_ids@{step}"] == run["by_hand"][str(step)]
        assert watch[f"toy_ctx_calls@{step}"] == n  # (its state, kept between steps)
    assert not any(k.startswith("toy_ctx_shifted") for k in watch)  # (a model flt-diag did not write: no targets)


def test_a_record_sees_the_models_targets_under_the_trainer(run):
    train = run["train"]
    assert run["code"] == 0
    for step in range(3):
        assert train[f"toy_ctx_step@{step}"] == step
        assert train[f"toy_ctx_shifted@{step}"] == run["positions"]
