"""Contraction measured right, the degenerate fixed point and truncated backpropagation (issue 40), each
against an independent computation: the exact Jacobian (torch.autograd.functional.jacobian) and its
eigenvalues (torch.linalg.eigvals), the same random directions pushed through that Jacobian by hand,
cosines and singular values in numpy, and the truncated gradient from a forward whose first loops run
under torch.no_grad (never the model's own detach)."""
import math

import numpy as np
import pytest
import torch

from conftest import tiny_config
from flt_diag.model.transformer import detached_loops, norm
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_config, load_metrics
from flt_diag.instruments import loop_dynamics as D
from flt_diag.instruments.looped import LoopStep
from flt_diag.training.trainer import train

from test_loop_dynamics import batch, tiny  # (the same tiny models and batches)


def exact_jacobian(step, h):
    n = h.numel()
    return torch.autograd.functional.jacobian(lambda z: step(z).flatten(), h).reshape(n, n).double()


def setup(variant, K=3):
    model = tiny(variant, K=K)
    idx, targets = batch()
    return model, idx, targets, LoopStep.of(model, idx).map(1), D.loop_states(model, idx)


# ----------------------------------------------------------------------------- spectral radius
@pytest.mark.parametrize("variant", ["lt", "fla", "flt"])
def test_spectral_radius_by_arnoldi_is_the_exact_jacobians(variant):
    model, idx, _, step, states = setup(variant)
    with D.transparent(model):
        for h in states[:-1]:
            rho, residual = D.spectral_radius(step, h, dim=h.numel(), generator=torch.Generator().manual_seed(2))
            radius = torch.linalg.eigvals(exact_jacobian(step, h)).abs().max().item()
            assert rho.item() == pytest.approx(radius, rel=1e-3)  # a full Krylov basis: exact up to rounding
            assert residual.item() < 1e-3


def test_spectral_radius_converges_below_the_full_basis_and_says_when_it_has_not():
    torch.manual_seed(0)
    n = 60
    Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    eig = torch.cat([torch.tensor([2.5]), torch.linspace(-1.0, 1.0, n - 1)]).double()
    A = (Q * eig) @ Q.T  # eigenvalues known
    A = A.float()
    step = lambda z: z @ A.T
    h = torch.randn(n)
    rho, residual = D.spectral_radius(step, h, dim=24, generator=torch.Generator().manual_seed(1))
    assert rho.item() == pytest.approx(2.5, rel=1e-4)
    assert residual.item() < 1e-3
    # two outer eigenvalues close in magnitude, 3 Arnoldi steps: not converged, and the residual says so
    eig2 = torch.cat([torch.tensor([1.0, -0.99]), torch.linspace(-0.98, 0.98, n - 2)]).double()
    B = ((Q * eig2) @ Q.T).float()
    rho2, residual2 = D.spectral_radius(lambda z: z @ B.T, h, dim=3, generator=torch.Generator().manual_seed(1))
    assert residual2.item() > 0.01


def test_sigma_max_exceeds_the_spectral_radius_on_a_non_normal_loop():
    """The old 'gain' is the largest singular value: above the spectral radius when J is non-normal, so a
    loop can have it above 1 and still contract (what issue 40 found on random weights)."""
    model, idx, _, step, states = setup("lt")
    with D.transparent(model):
        h = states[0]
        J = exact_jacobian(step, h)
        sigma = D.loop_map_gain(step, h, 40, torch.Generator().manual_seed(0))
        rho, _ = D.spectral_radius(step, h, h.numel(), torch.Generator().manual_seed(0))
    assert sigma.item() == pytest.approx(torch.linalg.svdvals(J)[0].item(), rel=1e-3)
    assert sigma.item() > 1.2 * rho.item()


# ----------------------------------------------------------------------------- mean gain, perturbation growth
def directions(shape, n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        v = torch.randn(shape, generator=g)
        out.append((v / v.norm()).flatten().double())
    return out


def test_mean_gain_is_the_mean_of_jv_over_the_same_random_directions():
    model, idx, _, step, states = setup("lt-ii")
    h = states[1]
    with D.transparent(model):
        got = D.mean_gain(step, h, 5, torch.Generator().manual_seed(7)).item()
        J = exact_jacobian(step, h)
    want = np.mean([(J @ v).norm().item() for v in directions(h.shape, 5, 7)])
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("variant", ["lt", "flt"])
def test_perturbation_growth_is_the_product_of_the_exact_jacobians_along_the_path(variant):
    model, idx, _, step, states = setup(variant, K=4)
    dirs = 3
    with D.transparent(model):
        got = D.perturbation_growth(step, states, dirs, torch.Generator().manual_seed(5))
        Js = [exact_jacobian(step, h) for h in states[:-1]]
    assert got.shape == (3,)
    logs = np.zeros((dirs, 3))
    for r, v in enumerate(directions(states[0].shape, dirs, 5)):
        for t, J in enumerate(Js):
            w = J @ v
            logs[r, t] = math.log(w.norm().item())
            v = w / w.norm()
    np.testing.assert_allclose(got.numpy(), np.exp(logs.mean(0)), rtol=1e-4)
    # over all three loops: ||J3 J2 J1 v|| ^ (1/3) for each direction, the same numbers
    for r, v in enumerate(directions(states[0].shape, dirs, 5)):
        total = (Js[2] @ Js[1] @ Js[0] @ v).norm().item()
        assert math.exp(logs[r].sum() / 3) == pytest.approx(total ** (1 / 3), rel=1e-6)


def test_loop_map_stats_names_and_shapes():
    model = tiny("flt", K=4)
    idx, _ = batch(B=2)
    stats = D.loop_map_stats(model, idx, iters=4, krylov_dim=8, dirs=2, generator=torch.Generator().manual_seed(0))
    assert set(stats) == {M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN,
                          M.LOOP_PERTURBATION_GROWTH}
    assert all(v.shape == (3,) and torch.isfinite(v).all() for v in stats.values())
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- the degenerate fixed point
@pytest.mark.parametrize("T, d", [(5, 7), (7, 5)])  # (either side of the Gram matrix)
def test_stream_similarity_against_numpy(T, d):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, T, d, generator=g)
    h[1] = h[1, :1] + 1e-3 * torch.randn(T, d, generator=g)  # sequence 1: every position nearly the same vector
    cosine, rank = D.stream_similarity(h)
    x = h.double().numpy()
    cos_want, rank_want = [], []
    for s in x:
        u = s / np.linalg.norm(s, axis=1, keepdims=True)
        c = u @ u.T
        cos_want.append(c[~np.eye(T, dtype=bool)].mean())
        sv = np.linalg.svd(s, compute_uv=False)
        p = sv / sv.sum()
        rank_want.append(np.exp(-(p * np.log(p)).sum()))
    assert cosine.item() == pytest.approx(np.mean(cos_want), rel=1e-5)
    assert rank.item() == pytest.approx(np.mean(rank_want), rel=1e-5)
    one, rank_one = D.stream_similarity(h[1:2])
    assert one.item() > 0.99 and rank_one.item() < 1.05


# ----------------------------------------------------------------------------- truncated backpropagation
def truncated_gradient_by_hand(model, idx, targets, k):
    """The loss's gradient when only the last k loops are differentiated: loops 1..K-k run under no_grad
    (their output enters as a constant), the rest with autograd, written out from the model's loop."""
    K = model.cfg.loops
    T = idx.shape[1]
    cos, sin = model.cos[:, :T], model.sin[:, :T]
    emb = model.embed(idx)
    x, h = norm(emb), None
    with torch.no_grad():
        for _ in range(K - k):
            x = model._loop(x, h, emb, cos, sin)
            h = norm(x)
    for _ in range(k):
        x = model._loop(x, h, emb, cos, sin)
        h = norm(x)
    c = model.cfg.softcap
    logits = c * torch.tanh(model.head(h).float() / c)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    params = [p for _, p in model.named_parameters()]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("variant", ["lt", "lt-ii", "lt-ai", "fla", "flt"])
def test_grad_loops_gradient_equals_the_no_grad_prefix(variant):
    model = tiny(variant, K=4)
    idx, targets = batch(B=2)
    model.grad_loops = 2
    _, loss = model(idx, targets)
    params = [p for _, p in model.named_parameters()]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    want = truncated_gradient_by_hand(model, idx, targets, 2)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0, name
        else:
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
    model.grad_loops = 0
    full = torch.autograd.grad(model(idx, targets)[1], params, allow_unused=True)
    blocks = [i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith("blocks.")]
    assert any(not torch.allclose(full[i], got[i], atol=1e-6) for i in blocks)  # truncation changes the gradient


def test_grad_loops_leaves_the_forward_and_at_k_ge_K_the_gradient_bit_for_bit():
    model = tiny("flt", K=3)
    idx, targets = batch(B=2)
    params = [p for _, p in model.named_parameters()]
    logits0, loss0 = model(idx, targets)
    g0 = torch.autograd.grad(loss0, params)
    for k in (3, 5, 2):
        model.grad_loops = k
        logits, loss = model(idx, targets)
        assert torch.equal(logits, logits0) and torch.equal(loss, loss0)
        if k >= 3:
            assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(loss, params), g0))
    assert [detached_loops(12, k) for k in (0, 1, 2, 11, 12, 13)] == [0, 11, 10, 1, 0, 0]


def test_lt_truncated_sends_no_gradient_to_the_embedding():
    """LT starts every loop t >= 2 from h(t-1) alone: cut there, its embedding learns nothing (a property of
    the recipe that the factorial's plan names)."""
    model = tiny("lt", K=4)
    idx, targets = batch(B=2)
    model.grad_loops = 2
    g = torch.autograd.grad(model(idx, targets)[1], [model.embed.weight], allow_unused=True)[0]
    assert g is None or torch.count_nonzero(g) == 0
    model2 = tiny("lt-ii", K=4)
    model2.grad_loops = 2
    g2 = torch.autograd.grad(model2(idx, targets)[1], [model2.embed.weight])[0]
    assert torch.count_nonzero(g2) > 0  # input injection: the embedding enters the differentiated loops


def test_gradient_agreement_of_detached_loops_is_zero():
    model = tiny("flt", K=4)
    idx, targets = batch()
    model.grad_loops = 2
    cos = D.loop_gradient_agreement(model, idx, targets)
    assert cos.shape == (4, 2)
    assert torch.all(cos[:2] == 0) and torch.all(cos[2:].abs() > 0)


def test_a_truncated_run_records_zero_activation_gradients_for_its_detached_loops(tmp_path):
    cfg = tiny_config(variant="lt", loops=4, steps=3, grad_loops=1,
                      diagnostics=dict(dynamics_every=2, krylov_dim=4, perturbation_dirs=1, exit_loss_every=1))
    train(cfg, tmp_path / "run")
    assert load_config(tmp_path / "run").train.grad_loops == 1
    m = load_metrics(tmp_path / "run")
    act = m[(m.metric == M.ACT_GRAD_NORM) & (m.step == 1)]
    assert sorted(act.loop.unique()) == [1, 2, 3, 4]
    assert (act[act.loop <= 3].value == 0).all() and (act[act.loop == 4].value > 0).all()
    for metric in (M.TOKEN_COSINE, M.EFFECTIVE_RANK):
        assert sorted(m[(m.metric == metric) & (m.step == 1)].loop) == [1, 2, 3, 4]
    for metric in (M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN, M.LOOP_PERTURBATION_GROWTH):
        assert sorted(m[(m.metric == metric) & (m.step == 2)].loop) == [2, 3, 4]
    cosines = m[(m.metric == M.LOOP_GRAD_COSINE) & (m.step == 2)]
    assert (cosines[cosines.loop <= 3].value == 0).all()


def test_grad_loops_reaches_every_grid_from_the_cli_and_a_study(tmp_path, capsys):
    from flt_diag.cli import main
    from flt_diag.cli.specs import load_study, sweep_spec
    study = tmp_path / "s.toml"
    study.write_text('[ablation]\npreset = "tiny"\nvariants = ["lt"]\nloops = [4]\ngrad_loops = 2\nsteps = 3\n')
    command, options = load_study(study)
    spec = sweep_spec(options, settled=False)
    assert command == "run-ablation" and all(spec.cell_config(c).train.grad_loops == 2 for c in spec.cells())
    assert main(["train", "--grad-loops", "-1"]) == 2
    assert "--grad-loops" in capsys.readouterr().err
    code = main(["run-ablation", "--preset", "tiny", "--variants", "lt", "--loops", "3", "--steps", "2",
                 "--grad-loops", "1", "--eval-every", "0", "--eval-batches", "1", "--out", str(tmp_path / "sw")])
    assert code == 0
    cell = next((tmp_path / "sw" / "cells").iterdir())
    assert load_config(cell).train.grad_loops == 1
