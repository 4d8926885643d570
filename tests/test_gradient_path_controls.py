"""The controls the gradient-path contrast needs (issue 53): a frozen embedding (`--freeze-embedding`, held
equal between the full and the truncated arm) and the code that made a run, recorded in the run and in its
archive record. Checked against independent facts: the embedding's bytes before and after training, git's own
answer for the checkout's commit, the records' metadata read with pyarrow alone."""
import json
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import torch

from conftest import tiny_config
from flt_diag.storage.folders import load_config
from flt_diag.training.trainer import Trainer, train

ROOT = Path(__file__).resolve().parents[1]


def test_a_frozen_embedding_is_not_trained_and_everything_else_is(tmp_path):
    cfg = tiny_config(variant="lt", loops=3, steps=4, freeze_embedding=True)
    trainer = Trainer(cfg, tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    after = dict(trainer.model.named_parameters())
    assert torch.equal(after["embed.weight"], before["embed.weight"])
    changed = [n for n in before if n != "embed.weight" and not torch.equal(after[n], before[n])]
    assert "head.weight" in changed and any(n.startswith("blocks.") for n in changed)
    assert load_config(tmp_path / "run").train.freeze_embedding is True


def test_without_the_flag_the_embedding_trains_and_old_configs_read_as_unfrozen(tmp_path):
    cfg = tiny_config(variant="lt", loops=3, steps=2)
    trainer = Trainer(cfg, tmp_path / "run")
    before = trainer.model.embed.weight.detach().clone()
    trainer.fit()
    assert not torch.equal(trainer.model.embed.weight, before)
    doc = json.loads((tmp_path / "run" / "config.json").read_text())
    del doc["train"]["freeze_embedding"]  # a run folder written before the option existed
    (tmp_path / "run" / "config.json").write_text(json.dumps(doc))
    assert load_config(tmp_path / "run").train.freeze_embedding is False


def test_the_flag_reaches_a_sweep_cell_from_the_command_line(tmp_path):
    from flt_diag.cli import main
    code = main(["run-ablation", "--preset", "tiny", "--variants", "lt", "--loops", "2", "--steps", "2",
                 "--freeze-embedding", "--grad-loops", "1", "--eval-every", "0", "--eval-batches", "1",
                 "--out", str(tmp_path / "sw")])
    assert code == 0
    cell = next((tmp_path / "sw" / "cells").iterdir())
    t = load_config(cell).train
    assert t.freeze_embedding is True and t.grad_loops == 1


def _git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def test_a_run_and_its_archive_record_name_the_code_that_made_them(tmp_path, capsys):
    from flt_diag.cli import main
    train(tiny_config(variant="flt", loops=2, steps=2), tmp_path / "run")
    code = load_config(tmp_path / "run").env["code"]
    head = _git("rev-parse", "HEAD")
    if len(head) == 40 and (ROOT / ".git").exists():  # a checkout (CI's clean clone is one)
        assert code["commit"] == head
        dirty = _git("status", "--porcelain", "--untracked-files=no") != ""
        assert code["clean"] is (not dirty)
    assert code["flt_diag"] and code["flt_diag"] != "unknown"
    assert main(["archive", str(tmp_path / "run"), "--to", str(tmp_path / "arch")]) == 0
    record = tmp_path / "arch" / "run.parquet"
    meta = json.loads(pq.read_schema(record).metadata[b"flt_diag.archive"])
    assert meta["code"]["run"] == code and meta["code"]["archive"]["flt_diag"] == code["flt_diag"]
    capsys.readouterr()
    assert main(["summary", str(record)]) == 0
    out = capsys.readouterr().out
    made = [line for line in out.splitlines() if line.startswith("code: made by")]
    assert len(made) == 1 and (code["commit"] is None or code["commit"][:12] in made[0])
    assert "code: archived by flt-diag" in out


def test_a_record_with_a_malformed_code_entry_is_one_error_line(tmp_path, capsys):
    import pyarrow as pa
    from flt_diag.cli import main
    train(tiny_config(variant="flt", loops=2, steps=2), tmp_path / "run")
    assert main(["archive", str(tmp_path / "run"), "--to", str(tmp_path / "arch")]) == 0
    record = tmp_path / "arch" / "run.parquet"
    table = pq.read_table(record)
    meta = json.loads(table.schema.metadata[b"flt_diag.archive"])
    meta["code"] = ["not", "a", "map"]
    pq.write_table(table.replace_schema_metadata({b"flt_diag.archive": json.dumps(meta)}), record)
    capsys.readouterr()
    assert main(["summary", str(record)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(r"\bcode\b.*\btable\b", err)  # one line naming the field
