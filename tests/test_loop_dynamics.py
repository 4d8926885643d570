"""Loop dynamics (flt_diag.instruments.loop_dynamics, dynamics_callback) against independent computations:
exact Jacobians and Hessians (torch.autograd.functional, torch.linalg), the head applied by hand, the
residual written out, and the gradient of each loop from a hand-unrolled forward with one copy of
the blocks per loop."""
import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import tiny_config
from equations import randomize
from flt_diag.model.transformer import LoopedTransformer, ModelConfig, norm, parameter_groups
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics
from flt_diag.instruments import loop_dynamics as D
from flt_diag.instruments.looped import LoopedModel, LoopStep
from flt_diag.judge.verdict import Recipe
from flt_diag.instruments.sharpness import sharpness
from flt_diag.instruments.dynamics_callback import own_model_dynamics
from flt_diag.integrations.probe import Probe
from flt_diag.instruments.records import StepLog
from flt_diag.training.trainer import train
from flt_diag.config.run_config import DiagnosticsConfig

V = 16


def tiny(variant="lt", K=3, d=8, heads=2, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, depth=layers, width=d, heads=heads, seq_len=4, variant=variant, loops=K)
    return randomize(LoopedTransformer(cfg), seed=seed)


def batch(B=1, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize("variant", ["lt", "flt"])
def test_loop_map_gain_against_the_exact_jacobian(variant):
    model = tiny(variant)
    idx, _ = batch()
    states = D.loop_states(model, idx)
    step = LoopStep.of(model, idx).map(1)
    stats = D.loop_map_stats(model, idx, iters=30, krylov_dim=32, generator=torch.Generator().manual_seed(1))
    sigma, rho = stats[M.LOOP_GAIN], stats[M.LOOP_SPECTRAL_RADIUS]
    assert sigma.shape == rho.shape == (2,)
    for t, h in enumerate(states[:-1]):  # the Jacobian at h(t-1), by reverse mode (the model's own ops)
        n = h.numel()
        J = torch.autograd.functional.jacobian(lambda z: step(z).flatten(), h).reshape(n, n).double()
        top_sv, radius = torch.linalg.svdvals(J)[0].item(), torch.linalg.eigvals(J).abs().max().item()
        assert abs(top_sv - radius) > 0.2 * top_sv  # a non-normal map: the two figures are told apart
        assert sigma[t].item() == pytest.approx(top_sv, rel=1e-3)
        assert rho[t].item() == pytest.approx(radius, rel=1e-3)  # a full Krylov basis (n = 32): exact


def test_flt_diags_model_is_read_through_the_instruments_protocol_and_another_module_is_not():
    """LoopedTransformer implements the protocol the instruments read (instruments/looped.py); a module that does
    not is measured from its hooks and what the user gives."""
    assert isinstance(tiny("lt"), LoopedModel)
    assert not isinstance(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoopedModel)


def test_loop_step_and_states_are_the_models_loops():
    model = tiny("lt-ii")
    idx, _ = batch(B=2)
    states = D.loop_states(model, idx)
    logits = model.forward_loops(idx, keep="all")
    head = model.loop_head
    step = LoopStep.of(model, idx).map(1)
    for t in range(3):
        assert torch.allclose(head(states[t]), logits[t], atol=1e-5)
        if t:
            assert torch.allclose(step(states[t - 1]), states[t], atol=1e-5)


def hand_cross_entropy(h, model, targets):
    """15 tanh(h W^T / 15), log-softmax and the target's negative log-likelihood, written out in float64."""
    c = model.cfg.softcap
    logits = c * torch.tanh(h.double() @ model.head.weight.double().T / c)
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    return -logp.gather(-1, targets[..., None]).mean().item()


def hand_residual(h, h_prev):
    ratios = [(h[b, i] - h_prev[b, i]).double().norm() / h_prev[b, i].double().norm()
              for b in range(h.shape[0]) for i in range(h.shape[1])]
    return (sum(ratios) / len(ratios)).item()


def hooked_forward(model, idx, targets, cfg=DiagnosticsConfig()):
    """The Trainer's instruments during one armed model forward, with a stand-in trainer: the loop dynamics' rows."""
    log = StepLog()
    trainer = type("T", (), {"model": model, "log": log, "recipe": Recipe.of(tiny_config()), "is_main": True})()
    probe = Probe(cfg, own_model_dynamics(cfg, model))
    probe.build(parameter_groups(model))
    probe.on_start(trainer)
    probe.before_step(trainer, 0)
    model(idx, targets)
    model(idx, targets)  # a second forward (a further micro-batch): not armed, records nothing
    probe.on_end(trainer)
    dynamics = (M.EXIT_LOSS, M.FIXED_POINT_RESIDUAL, M.TOKEN_COSINE, M.EFFECTIVE_RANK)
    rows = [r for r in log.collect(0) if r[1] in dynamics]
    return {(m, lp): v for _, m, lp, ly, v in rows}, len(rows)


@pytest.mark.parametrize("variant", ["lt", "fla"])
def test_exit_loss_and_fixed_point_residual_recorded_by_the_hooks(variant):
    model = tiny(variant)
    idx, targets = batch(B=2)
    rows, n = hooked_forward(model, idx, targets)
    states = D.loop_states(model, idx)
    assert n == 3 + 2 + 2 * 3  # exit loss of loops 1..3, residual of loops 2..3, token cosine and rank of 1..3
    for t in range(1, 4):
        assert rows[(M.EXIT_LOSS, t)] == pytest.approx(hand_cross_entropy(states[t - 1], model, targets), rel=1e-5)
    for t in range(2, 4):
        assert rows[(M.FIXED_POINT_RESIDUAL, t)] == pytest.approx(hand_residual(states[t - 1], states[t - 2]), rel=1e-5)
    assert rows[(M.FIXED_POINT_RESIDUAL, 3)] > 1e-3  # a random-weight loop is not at a fixed point


def unrolled_loop_gradients(model, idx, targets):
    """Per-loop block gradients from a hand-unrolled forward where loop t runs its own deep copy."""
    copies = [copy.deepcopy(model) for _ in range(model.cfg.loops)]
    emb = model.embed(idx).detach()
    T = idx.shape[1]
    cos, sin = model.cos[:, :T], model.sin[:, :T]
    x, h = norm(emb), None
    for c in copies:
        x = c._loop(x, h, emb, cos, sin)
        h = norm(x)
    c = model.cfg.softcap
    logits = c * torch.tanh(model.head(h) / c)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return [[torch.cat([p.grad.flatten() for p in c.blocks[i].parameters()]) for i in range(model.cfg.depth)]
            for c in copies]


@pytest.mark.parametrize("variant", ["lt", "flt"])
def test_per_loop_gradient_agreement_against_separate_copies(variant):
    model = tiny(variant)
    idx, targets = batch(B=2)
    cos = D.loop_gradient_agreement(model, idx, targets)
    assert all(p.grad is None for p in model.parameters())  # nothing left on the weights
    per_loop = unrolled_loop_gradients(model, idx, targets)
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, targets)  # the total gradient, through the shared weights
    loss.backward()
    for layer in range(model.cfg.depth):
        total = torch.cat([p.grad.flatten() for p in model.blocks[layer].parameters()])
        mine = sum(per_loop[t][layer] for t in range(3))
        assert torch.allclose(mine, total, atol=1e-5, rtol=1e-4)  # the loops' gradients sum to the total
        for t in range(3):
            want = F.cosine_similarity(per_loop[t][layer], total, dim=0).item()
            assert cos[t, layer].item() == pytest.approx(want, abs=1e-4)
    assert cos.min() < 0.99  # the loops do not all agree: the test tells them apart


def test_sharpness_against_the_exact_hessian():
    model = tiny("flt", K=2, d=4, heads=1, layers=1).double()
    idx, targets = batch(B=1, T=3)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def loss_of(vec):
        parts = vec.split([math.prod(s) for s in shapes])
        params = {n: part.view(s) for n, part, s in zip(names, parts, shapes)}
        return torch.func.functional_call(model, params, (idx, targets))[1]

    with sdpa_kernel(SDPBackend.MATH):  # float64: norm is F.rms_norm, not the code's written-out form
        H = torch.autograd.functional.hessian(loss_of, flat, vectorize=True)
    eig = torch.linalg.eigvalsh((H + H.T) / 2)
    top = eig.max().item()
    assert eig.min().item() < -top  # a saddle whose largest-magnitude eigenvalue is negative
    got = sharpness(model, idx, targets, iters=100, generator=torch.Generator().manual_seed(0))
    assert got.item() == pytest.approx(top, rel=2e-3)
    assert all(p.grad is None for p in model.parameters())


def test_sharpness_leaves_a_frozen_embedding_out():
    """--freeze-embedding: the sharpness is the top eigenvalue of the Hessian over the trained parameters only (the
    exact one, the embedding held fixed), not over all of them (before, the frozen embedding was in it)."""
    model = tiny("flt", K=2, d=4, heads=1, layers=1).double()
    model.embed.weight.requires_grad_(False)
    idx, targets = batch(B=1, T=3)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for _, p in named]
    flat = torch.cat([p.detach().flatten() for _, p in named])

    def loss_of(vec):
        parts = vec.split([math.prod(s) for s in shapes])
        params = {"embed.weight": model.embed.weight, **{n: part.view(s) for (n, _), part, s in zip(named, parts, shapes)}}
        return torch.func.functional_call(model, params, (idx, targets))[1]

    with sdpa_kernel(SDPBackend.MATH):
        H = torch.autograd.functional.hessian(loss_of, flat, vectorize=True)
    eig = torch.linalg.eigvalsh((H + H.T) / 2)
    # (a saddle: the shifted run's two top eigenvalues lie within 2 %, so 400 iterations, not 100)
    got = sharpness(model, idx, targets, iters=400, generator=torch.Generator().manual_seed(0)).item()
    assert got == pytest.approx(eig.max().item(), rel=2e-3)
    everything = torch.cat([p.detach().flatten() for p in model.parameters()])

    def loss_of_all(vec):
        parts = vec.split([p.numel() for p in model.parameters()])
        params = {n: part.view(p.shape) for (n, p), part in zip(model.named_parameters(), parts)}
        return torch.func.functional_call(model, params, (idx, targets))[1]

    with sdpa_kernel(SDPBackend.MATH):
        top_all = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss_of_all, everything, vectorize=True)).max()
    assert abs(top_all.item() - got) > 1e-2 * abs(got)  # the embedding's curvature counts: the test tells them apart


def test_looped_loss_with_the_weights_themselves_is_the_training_loss():
    model = tiny("lt-ai", K=4)
    idx, targets = batch(B=2)
    shared, _ = D.block_weights(model)
    for loss_on in ("end", "all", "last-third"):
        mine = D.looped_loss(model, idx, targets, loss_on)([shared] * 4)
        assert mine.item() == pytest.approx(model(idx, targets, loss_on=loss_on)[1].item(), rel=1e-5)


def run_rows(tmp_path, name, diagnostics, **train_options):
    train(tiny_config(variant="lt", loops=3, steps=3, **train_options, diagnostics=diagnostics), tmp_path / name)
    return load_metrics(tmp_path / name)


def test_a_short_run_records_every_key_and_keeps_its_trajectory(tmp_path):
    on = dict(exit_loss_every=2, dynamics_every=2, sharpness_every=2, dynamics_batch=2, dynamics_iters=3)
    off = dict(loop_dynamics=False, dynamics_every=0, sharpness_every=0)
    with_dynamics = run_rows(tmp_path, "on", on, checkpoint_loops=True)
    without = run_rows(tmp_path, "off", off, checkpoint_loops=True)
    loss = lambda df: df[df.metric == M.LOSS].sort_values("step").value.tolist()
    assert loss(with_dynamics) == loss(without)  # the same trajectory, bit for bit
    keys = lambda metric: sorted(set(with_dynamics[with_dynamics.metric == metric][["step", "loop", "layer"]]
                                     .itertuples(index=False, name=None)))
    assert keys(M.EXIT_LOSS) == [(s, t, -1) for s in (0, 2) for t in (1, 2, 3)]  # every 2nd recorded step
    assert keys(M.FIXED_POINT_RESIDUAL) == [(s, t, -1) for s in range(3) for t in (2, 3)]
    assert keys(M.LOOP_GAIN) == keys(M.LOOP_SPECTRAL_RADIUS) == [(s, t, -1) for s in (0, 2) for t in (2, 3)]
    assert keys(M.LOOP_GRAD_COSINE) == [(s, t, ly) for s in (0, 2) for t in (1, 2, 3) for ly in (1, 2)]
    assert keys(M.SHARPNESS) == [(0, -1, -1), (2, -1, -1)]
    assert keys("param_norm/attn") == [(s, -1, ly) for s in range(3) for ly in (1, 2)]
    assert keys("param_norm/head") == [(s, -1, -1) for s in range(3)]
    for metric in (M.EXIT_LOSS, M.FIXED_POINT_RESIDUAL, M.LOOP_GAIN, M.SHARPNESS):
        assert with_dynamics[with_dynamics.metric == metric].value.notna().all()
    assert not set(without.metric) & {M.EXIT_LOSS, M.FIXED_POINT_RESIDUAL, M.LOOP_GAIN, M.SHARPNESS}


def test_figures_of_the_new_records_draw_and_skip_runs_without_them(tmp_path):
    from flt_diag.results.figures import plot
    on = dict(dynamics_every=1, dynamics_batch=1, dynamics_iters=2, attention_stats=True)
    train(tiny_config(variant="flt", loops=2, steps=2, diagnostics=on), tmp_path / "on")
    train(tiny_config(variant="flt", loops=2, steps=2, diagnostics=dict(loop_dynamics=False, dynamics_every=0)),
          tmp_path / "off")
    new = {"exit-loss", "loop-dynamics", "weights", "attention"}
    written = plot("all", tmp_path / "on", out_dir=tmp_path / "figs-on", formats=("png",))
    assert new <= {p.stem for p in written}
    written = plot("all", tmp_path / "off", out_dir=tmp_path / "figs-off", formats=("png",))
    assert {"exit-loss", "loop-dynamics", "attention"} <= set(written.skipped)  # skipped with a reason, no crash


@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e-30, 1e18])
def test_gradient_agreement_is_a_cosine_at_any_gradient_scale(scale):
    """Per-loop gradients of 10^-20 (a collapsing run's early loops) once gave |cosine| up to 10^10: the product of
    the squared norms underflowed in float32. Against the cosines in float64 by numpy."""
    rng = np.random.default_rng(0)
    per = rng.normal(size=(4, 50)) * np.array([[1.0], [0.3], [1e-3], [0.0]])  # the last loop sends nothing
    per_loop = [{"w": torch.tensor(row * scale, dtype=torch.float32)} for row in per]
    cos = D.gradient_agreement(per_loop, {"block1": ["w"]})[:, 0].double().numpy()
    stored = np.array([t["w"].double().numpy() for t in per_loop])  # what float32 holds, in float64
    total = stored.sum(0)
    want = [row @ total / (np.linalg.norm(row) * np.linalg.norm(total)) if np.linalg.norm(row) else 0.0 for row in stored]
    assert cos == pytest.approx(want, abs=1e-5)


def test_loss_of_loops_averages_the_loops_the_training_loss_is_on():
    """The instruments' recomputed loss takes the loops the model's loss takes: the last one (end), every one (all)
    or the last ceil(K/3) (last-third; K = 5 tells 2 from floor 1 and half 3), each a cross-entropy by hand."""
    import torch.nn.functional as F
    from flt_diag.instruments.loop_dynamics import loss_of_loops
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(2, 4, 7, generator=g) for _ in range(5)]
    y = torch.randint(0, 7, (2, 4), generator=g)
    ce = [F.cross_entropy(lg.reshape(8, 7), y.reshape(8)) for lg in logits]
    torch.testing.assert_close(loss_of_loops(logits, y, "end"), ce[-1])
    torch.testing.assert_close(loss_of_loops(logits, y, "all"), sum(ce) / 5)
    torch.testing.assert_close(loss_of_loops(logits, y, "last-third"), (ce[3] + ce[4]) / 2)
