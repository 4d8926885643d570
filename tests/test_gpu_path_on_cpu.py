"""The code paths a GPU run takes, exercised on CPU so that the first GPU run is not their first
run: compiled attention/MLP with the diagnostic hooks attached (with and without activation
checkpointing), and bf16 autocast (CPU autocast) through the hooks and the trainer."""
import numpy as np
import pytest
import torch

from flt_diag.storage import metric_names as M

from conftest import tiny_config
from flt_diag.instruments.loop_hooks import LoopHooks
from flt_diag.instruments.sharpness import sharpness
from flt_diag.model.transformer import LoopedTransformer, ModelConfig
from flt_diag.training.compile_precision import compile_blocks, cpu_compiler_available


def _records(model, idx):
    rows = []
    with LoopHooks(model, lambda m, v, lp, ly: rows.append((m, lp, ly, v.detach()))) as h:
        h.arm()
        _, loss = model(idx, idx)
        loss.backward()
    return {(m, lp, ly): float(v) for m, lp, ly, v in rows}, loss.detach()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_blocks_keep_every_hook_record(checkpointing):
    """torch.compile (aot_eager backend: dynamo + AOTAutograd, the graph capture a GPU run uses,
    without C++ code generation) around attention and MLP: the hooks still see every (loop, layer)
    exactly once, with values equal to eager. Float64 on both sides, so only reassociation inside
    the captured graph can differ: relative 1e-9 bounds it with room to spare."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, depth=2, width=32, heads=2, variant="flt", loops=3)
    eager = LoopedTransformer(cfg).double()
    compiled = LoopedTransformer(cfg).double()
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled, backend="aot_eager", dynamic=False)
    for m in (eager, compiled):
        m.checkpoint_loops = checkpointing
    idx = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    a, la = _records(eager, idx)
    b, lb = _records(compiled, idx)
    assert set(a) == set(b) and len(a) == 3 * 2 * 4 + 3  # resid, act grad, attn/mlp grads per (loop, layer); loop ends
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key
    assert float(lb) == pytest.approx(float(la), rel=1e-12)
    for pa, pb in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-9, atol=1e-12)


def test_cpu_autocast_trains_with_every_diagnostic(tmp_path):
    """bf16 autocast, as on a GPU: the Trainer's autocast path with hooks recording every metric."""
    from flt_diag.storage.folders import load_metrics
    from flt_diag.training.trainer import train
    s = train(tiny_config(variant="flt", loops=2, steps=4, precision="reference"), tmp_path / "run")
    df = load_metrics(tmp_path / "run")
    assert np.isfinite(s.final_loss)
    for metric in ("resid_norm", "act_grad_norm", "act_grad_norm/attn", "grad_norm_clipped/mlp", "momentum"):
        values = df[df.metric == metric].value.to_numpy()
        assert len(values) and np.isfinite(values).all(), metric


@pytest.mark.skipif(not cpu_compiler_available(), reason="torch.compile's inductor needs a C++ compiler")
def test_costly_loop_dynamics_records_on_compiled_blocks_equal_eager_and_leave_the_model_as_it_was():
    """The every-N records (loop-map gain and spectral radius, per-loop gradient agreement, sharpness) on
    a model whose blocks are compiled by inductor (the --compile path) equal the same records on the eager
    model (float64, the same weights and start vectors), and the compiled model computes bit for bit the
    same loss and gradients afterwards as before them: no recompilation for the transforms' aliases and
    dual tensors (without the force_eager stance the gradients afterwards differ: seen once), nothing on
    .grad. About 25 s, most of it inductor's first compile."""
    from flt_diag.instruments import loop_dynamics as D
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, depth=2, width=32, heads=2, variant="lt", loops=3)
    eager = LoopedTransformer(cfg).double()
    compiled = LoopedTransformer(cfg).double()
    compiled.load_state_dict(eager.state_dict())
    with torch.no_grad():  # away from the zero-initialised output projections: a gain that is not 0
        for a, b in zip(eager.parameters(), compiled.parameters()):
            a.add_(0.05 * torch.randn_like(a))
            b.copy_(a)
    compile_blocks(compiled, backend="inductor", dynamic=False)
    idx = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, 1)

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    before = loss_and_grads(compiled)
    records = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        gen = lambda: torch.Generator().manual_seed(3)
        stats = D.loop_map_stats(model, idx, 6, 8, 2, gen())
        sigma, rho = stats[M.LOOP_GAIN], stats[M.LOOP_SPECTRAL_RADIUS]
        cos = D.loop_gradient_agreement(model, idx, targets)
        lam = sharpness(model, idx, targets, 6, generator=gen())
        records[name] = (sigma, rho, cos, lam)
        assert all(p.grad is None for p in model.parameters())
    for a, b in zip(records["eager"], records["compiled"]):
        torch.testing.assert_close(b, a, rtol=1e-7, atol=1e-10)
    assert records["eager"][0].min() > 0  # a gain, not the 0 of the zero-initialised projections
    after = loss_and_grads(compiled)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    for a, b in zip(before[1], after[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
