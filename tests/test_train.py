import math

import pytest
import torch

from conftest import tiny_config
from flt_diag import metric_names as M
from flt_diag.cli import main
from flt_diag.model import LoopedTransformer
from flt_diag.optim import build_optimizers, lr_multiplier
from flt_diag.storage import load_metrics, load_summary, series
from flt_diag.train import Callback, Trainer, train
from numerics import assert_close64


def losses(run_dir):
    return series(load_metrics(run_dir), M.LOSS)


def test_loss_falls_on_tiny(tmp_path):
    cfg = tiny_config(variant="flt", loops=2, steps=60, diagnostics=dict(enabled=False))
    summary = train(cfg, tmp_path / "run")
    loss = losses(tmp_path / "run")
    assert len(loss) == 60
    assert loss.iloc[0] > 5.4  # ln(256) = 5.55 at init (head ~ N(0, 0.001))
    assert loss.iloc[-10:].mean() < 3.3
    assert summary["verdict"] == "stable"
    # ... and by a margin, so that another CPU's fp32 rounding of the run cannot flip it: no climb
    # near the rebound threshold, the smoothed loss well below the unigram entropy, the gradient-norm
    # oscillation well below the "unstable" threshold (measured: climb 0, 2.40 vs 3.25, CV 0.58 vs 3)
    ev = summary["evidence"]
    assert ev["climb"] < 0.5 * ev["rebound_threshold"]
    assert ev["min_smoothed_loss"] < ev["unigram_entropy"] - 0.3
    assert summary["osc_cv"] < 0.5 * cfg.verdict.osc_cv_threshold
    assert math.isfinite(summary["val_loss"])


def test_cpu_runs_are_bit_identical(tmp_path):
    cfg = tiny_config(variant="lt-ai", loops=3, steps=8, seed=3)
    train(cfg, tmp_path / "a")
    train(tiny_config(variant="lt-ai", loops=3, steps=8, seed=3), tmp_path / "b")
    a, b = load_metrics(tmp_path / "a"), load_metrics(tmp_path / "b")
    assert a.equals(b)
    c = tiny_config(variant="lt-ai", loops=3, steps=8, seed=4)
    train(c, tmp_path / "c")
    assert not losses(tmp_path / "a").equals(losses(tmp_path / "c"))


class Interrupt(Callback):
    def __init__(self, at):
        self.at = at

    def after_step(self, trainer, step):
        if step == self.at:
            raise KeyboardInterrupt


def test_resume_after_interruption_continues_exactly(tmp_path):
    def cfg():
        return tiny_config(variant="flt", loops=2, steps=12, checkpoint_every=5, seed=1)

    train(cfg(), tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg(), tmp_path / "resumed", callbacks=[Interrupt(at=7)]).fit()
    assert (tmp_path / "resumed" / "resume.pt").exists()
    assert load_summary(tmp_path / "resumed") is None
    stored = losses(tmp_path / "resumed")
    assert stored.index.max() >= 5  # what was recorded before the kill is still there
    train(cfg(), tmp_path / "resumed")
    a, b = load_metrics(tmp_path / "straight"), load_metrics(tmp_path / "resumed")
    assert a.equals(b)  # every metric of every step, bit for bit
    assert not (tmp_path / "resumed" / "resume.pt").exists()
    sa = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["model"]
    sb = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_finished_run_is_not_retrained(tmp_path, monkeypatch):
    train(tiny_config(loops=1, steps=3), tmp_path / "r")
    monkeypatch.setattr(Trainer, "train_step", lambda *a: pytest.fail("retrained a finished run"))
    assert train(tiny_config(loops=1, steps=3), tmp_path / "r")["steps_done"] == 3


def test_reference_recipe_learning_rates():
    cfg = tiny_config(loops=2, lr_scale=0.5)
    model = LoopedTransformer(cfg.model)
    muon, adamw = build_optimizers(model, cfg.train)
    assert isinstance(muon, torch.optim.Muon)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5)
    assert muon.param_groups[0]["momentum"] == pytest.approx(0.85)  # step 0 of the warm-up 0.85 -> 0.95
    assert muon.param_groups[0]["weight_decay"] == 0
    scale = (64 / 768) ** -0.5
    emb, head = adamw.param_groups
    assert emb["lr"] == pytest.approx(0.2 * scale * 0.5) and head["lr"] == pytest.approx(0.004 * scale * 0.5)
    assert emb["betas"] == (0.8, 0.95) and emb["eps"] == 1e-10 and emb["weight_decay"] == 0
    n_matrices = sum(p.numel() for p in muon.param_groups[0]["params"])
    assert n_matrices == sum(p.numel() for b in model.blocks for p in b.parameters())


def test_warmdown_schedule():
    total = 100
    values = [lr_multiplier(s, total, 0.2) for s in range(total)]
    assert values[:80] == [1.0] * 80
    assert values[80] == 1.0 and values[90] == pytest.approx(0.5) and values[99] == pytest.approx(0.05)
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_gradient_accumulation_matches_big_batch(tmp_path):
    """grad_accum=2 with micro-batches of 8 equals the mean of both micro-batch gradients."""
    cfg = tiny_config(variant="flt", loops=2, steps=1, batch_size=8, grad_accum=2, grad_clip=0.0)
    trainer = Trainer(cfg, tmp_path / "acc", diagnostics=False)
    grads = {}

    class Grab(Callback):
        def after_backward(self, tr, step):
            grads.update({n: p.grad.clone() for n, p in tr.model.named_parameters()})

    trainer.callbacks.append(Grab())
    trainer.model.double()  # both sides in float64 (the optimizers hold the same Parameter objects)
    ref = LoopedTransformer(cfg.model).double()
    ref.load_state_dict(trainer.model.state_dict())
    trainer.train_step(0)
    from flt_diag.data import batch_generator, get_batch
    total = 0
    for micro in range(2):
        x, y = get_batch(trainer.train_data, 8, cfg.model.sequence_len, batch_generator(cfg.train.seed, 0, micro))
        total = total + ref(x, y)[1] / 2
    expected = torch.autograd.grad(total, list(ref.parameters()))
    for (name, _), g in zip(ref.named_parameters(), expected):
        assert_close64(grads[name], g)


def test_loss_on_all_loops_trains(tmp_path):
    s = train(tiny_config(variant="lt-ii", loops=3, steps=4, loss_on="all"), tmp_path / "r")
    assert s["steps_done"] == 4 and math.isfinite(s["final_loss"])


def test_adamw_option(tmp_path):
    cfg = tiny_config(loops=1, steps=3, optimizer="adamw")
    assert len(build_optimizers(LoopedTransformer(cfg.model), cfg.train)) == 1
    assert train(cfg, tmp_path / "r")["steps_done"] == 3


# ---------------------------------------------------------------- the CLI on bad input

def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("args,message", [
    (["train", "--variant", "nope"], "unknown variant 'nope'"),
    (["train", "--loops", "0"], "loops must be in 1..1024"),
    (["train", "--loops", "-3"], "loops must be in 1..1024"),
    (["train", "--loops", "many"], "Invalid value for '--loops'"),
    (["train", "--data", "/no/such/file.txt"], "neither a known corpus"),
    (["train", "--preset", "huge"], "unknown preset 'huge'"),
    (["train", "--steps", "0"], "--steps"),
    (["train", "--tokenizer", "/no/such/tokenizer.json"], "tokenizer file /no/such/tokenizer.json does not exist"),
])
def test_cli_bad_input_one_line(args, message, capsys):
    code, err = run_cli(args, capsys)
    assert code == 2
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_unreadable_data(tmp_path, capsys):
    f = tmp_path / "secret.txt"
    f.write_text("x")
    f.chmod(0)
    if open(f, "rb").readable() and __import__("os").access(f, __import__("os").R_OK):
        pytest.skip("running as a user that can read mode-0 files (root)")
    code, err = run_cli(["train", "--data", str(f)], capsys)
    assert code == 2 and "cannot read" in err


def test_cli_train_then_refuses_other_config_without_touching_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "--preset", "tiny", "--steps", "3", "--loops", "2", "--out", str(out), "--eval-every", "0"]
    assert main(base) == 0
    assert "final loss" in capsys.readouterr().out
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != ".lock"}  # the lock holds no data
    code, err = run_cli(base[:-4] + ["--variant", "lt", "--out", str(out)], capsys)
    assert code == 2 and "different config" in err and "model.variant" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != ".lock"} == before


@pytest.mark.slow
def test_ddp_with_torchrun_on_cpu(tmp_path):
    """Two gloo ranks via torchrun: one run folder, written once, with the global mean loss."""
    import shutil
    import subprocess
    import sys
    torchrun = shutil.which("torchrun") or str(__import__("pathlib").Path(sys.executable).parent / "torchrun")
    out = tmp_path / "ddp"
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "flt_diag.cli", "train", "--preset", "tiny",
           "--variant", "flt", "--loops", "2", "--steps", "4", "--out", str(out), "--device", "cpu",
           "--threads", "1", "--eval-every", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert load_summary(out)["steps_done"] == 4
    assert len(losses(out)) == 4  # rank 0 wrote each step once


def test_cli_half_written_run_folder(tmp_path, capsys):
    """A run folder whose config.json was cut short: one line, nothing overwritten."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"model": {"variant": "flt"')
    code, err = run_cli(["train", "--preset", "tiny", "--steps", "2", "--out", str(out)], capsys)
    assert code == 2 and "unreadable" in err and len(err.splitlines()) == 1
    assert (out / "config.json").read_text() == '{"model": {"variant": "flt"'
