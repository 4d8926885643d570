"""The three stabilisers as their sources train them (issue 66, part 2): parcae-source, stars-source and
jacobian-fro-source, against computations written out here (tests/equations.py's blocks, the exact Jacobian of one
loop by torch.autograd.functional.jacobian, the distributions by scipy), and each through the Trainer."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import tiny_config
from equations import block_forward, randomize, rms
from flt_diag.config.run_config import build_config
from flt_diag.config.variants import STABILISERS
from flt_diag.model.stabilisers import jacobian_fro_source as jfs
from flt_diag.model.stabilisers import parcae_source, stars_source
from flt_diag.model.transformer import LoopedTransformer, ModelConfig
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics, load_summary
from flt_diag.training import stabiliser_step
from flt_diag.training.trainer import Trainer


def make(variant, K=4, d=16, L=2, seed=0):
    cfg = ModelConfig(vocab_size=50, depth=L, width=d, heads=2, seq_len=16, variant=variant, loops=K)
    torch.manual_seed(seed)
    return randomize(LoopedTransformer(cfg), seed).double()


def tokens(B, T=6, seed=1):
    return torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- parcae-source
def hand_loops(model, idx, first, last, x=None):
    """Loops first..last (from 1) of one sequence, written out: loop 1 from rms(E), loop t >= 2 from Parcae's
    injection exp(-dt exp(A_log)) x + dt B rms(E) (dt = softplus), each loop the L blocks of tests/equations.py."""
    E = model.embed.weight[idx]
    e, P = rms(E), model.injection
    for t in range(first, last + 1):
        if t == 1:
            x = e
        else:
            dt = torch.log1p(torch.exp(P.dt))
            x = torch.exp(-dt * torch.exp(P.A_log)) * x + dt * (e @ P.B.weight.T)
        for block in model.blocks:
            x = block_forward(block, x, model.cfg.heads)
    return x


def hand_logits(model, idx, n, k, truncate=True):
    """Each sequence on its own: n_i loops without the gradient (when `truncate`), then k_i with it."""
    out = []
    for i in range(idx.shape[0]):
        one = idx[i:i + 1]
        with torch.no_grad() if truncate else torch.enable_grad():
            x = hand_loops(model, one, 1, int(n[i])) if n[i] > 0 else None
        x = hand_loops(model, one, int(n[i]) + 1, int(n[i] + k[i]), x)
        out.append(rms(x) @ model.head.weight.T)
    return torch.cat(out)


def test_parcae_source_with_given_depths_is_each_sequence_on_its_own_with_its_last_k_loops_differentiated():
    model = make("parcae-source")
    model.train()
    idx = tokens(5)
    n, k = torch.tensor([2, 0, 3, 0, 1]), torch.tensor([2, 1, 2, 2, 1])  # n = 0: loop 1 falls in the grad phase
    w = torch.randn(5, 6, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    params = [p for p in model.parameters()]
    model.loop_head = lambda h: h @ model.head.weight.T  # (in float64, no soft-cap: the loops are under test)
    got = model(idx, depths=(n, k))
    want = hand_logits(model, idx, n, k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)  # (the model's rotary tables are fp32's)
    g_got = torch.autograd.grad((got * w).sum(), params, allow_unused=True)
    g_want = torch.autograd.grad((want * w).sum(), params, allow_unused=True)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
    # the no-grad loops matter: through every loop, the gradient is another
    g_full = torch.autograd.grad((hand_logits(model, idx, n, k, truncate=False) * w).sum(), params[:1])
    assert not torch.allclose(g_full[0], g_got[0], rtol=1e-3, atol=0)


def test_parcae_source_without_depths_runs_k_loops_as_parcae():
    model = make("parcae-source", K=3)
    idx = tokens(2)
    with torch.no_grad():
        want = torch.cat([15.0 * torch.tanh((rms(hand_loops(model, idx[i:i + 1], 1, 3)) @ model.head.weight.T).float()
                                            / 15.0) for i in range(2)])
        torch.testing.assert_close(model(idx), want, rtol=1e-5, atol=1e-5)


def test_parcae_source_depths_poisson_mean_k_truncated_at_s():
    K, s = 8, 4
    assert parcae_source.backprop_loops(8) == 4 and parcae_source.backprop_loops(9) == 5  # ceil(K / 2)
    n, k = parcae_source.sample_depths(K, s, 40_000, torch.Generator().manual_seed(0))
    r = (n + k).numpy()
    assert n.dtype == k.dtype == torch.long
    assert np.array_equal(k.numpy(), np.minimum(r, s)) and (r >= 1).all()
    # r = max(1, Poisson(K)): E[r] = K + P(Poisson = 0), Var by the pmf
    pmf = stats.poisson.pmf(np.arange(200), K)
    values = np.maximum(np.arange(200), 1)
    mean = (values * pmf).sum()
    var = ((values - mean) ** 2 * pmf).sum()
    assert mean == pytest.approx(K + math.exp(-K))
    assert abs(r.mean() - mean) < 4 * math.sqrt(var / r.size)
    assert abs((r == 1).mean() - pmf[:2].sum()) < 4 * math.sqrt(pmf[:2].sum() / r.size)
    n0, k0 = parcae_source.sample_depths(K, 0, 100, torch.Generator().manual_seed(1))
    assert (n0 == 0).all() and (k0 >= 1).all()  # s = 0: every loop with the gradient


def test_parcae_source_refuses_another_loss_than_the_end():
    with pytest.raises(Exception, match="per sequence: --loss-on end only"):
        build_config("tiny", model=dict(variant="parcae-source"), train=dict(loss_on="all", device="cpu"))


def test_parcae_source_loops_run_is_the_batch_mean_of_r(tmp_path):
    cfg = tiny_config(variant="parcae-source", loops=3, steps=3, batch_size=4, diagnostics=dict(dynamics_every=0))
    Trainer(cfg, tmp_path / "run").fit()
    m = load_metrics(tmp_path / "run")
    runs = m[m.metric == M.LOOPS_RUN].set_index("step").value
    seed = cfg.train.seed
    for step in range(3):  # r = max(1, Poisson(3)) for each of the 4 sequences, drawn again by hand
        gen = torch.Generator().manual_seed(hash((seed, step, 0, 0x4C4F4F50)) & (2 ** 63 - 1))
        r = torch.poisson(torch.full((4,), 3.0, dtype=torch.float64), generator=gen).clamp_min(1)
        assert runs[step] == pytest.approx(float(r.mean()))
    assert np.isfinite(m[m.metric == M.LOSS].value).all()


# ----------------------------------------------------------------------------- stars-source
def written_out_loop(model, h):
    x = h
    for block in model.blocks:
        x = block_forward(block, x, model.cfg.heads)
    return rms(x)


def penalty_model(variant):
    model = make(variant, K=3, d=8, L=1)
    model.train()
    idx = tokens(1, T=3)
    model(idx, idx)  # the training forward keeps its final state for the penalty
    h = model.penalty_inputs[0].detach().clone()
    n = h.numel()
    J = torch.autograd.functional.jacobian(lambda z: written_out_loop(model, z.view_as(h)).flatten(), h.flatten(),
                                           create_graph=True).reshape(n, n)  # J[i, j] = d g_i / d h_j
    return model, h, J


def test_stars_source_penalty_is_one_random_unit_probe_without_a_power_step():
    model, h, J = penalty_model("stars-source")
    blocks = list(model.blocks.parameters())
    got = stars_source.penalty(model, torch.Generator().manual_seed(5))
    v = torch.randn(h.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).flatten()
    v = v / v.norm()
    want = (v @ J).square().sum()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
    for a, b in zip(torch.autograd.grad(got, blocks), torch.autograd.grad(want, blocks)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())  # (fp32 rotary tables)


def test_stars_source_lambda_is_0_then_0_1_past_20_percent():
    assert [stars_source.weight(s, 10) for s in range(5)] == [0, 0, 0, 0.1, 0.1]
    assert stars_source.weight(2000, 10_000) == 0 and stars_source.weight(2001, 10_000) == 0.1  # step > 2000
    ce, pen = torch.tensor(2.5), torch.tensor(7.0)
    assert torch.equal(stars_source.objective(ce, pen, 1000, 10_000), ce)
    assert stars_source.objective(ce, pen, 5000, 10_000).item() == pytest.approx(0.9 * 2.5 + 0.1 * 7.0)
    assert stars_source.objective(ce, pen, 5000, 10_000, 3.0).item() == pytest.approx(0.7 * 2.5 + 0.3 * 7.0)


@pytest.mark.parametrize("K", [4, 8])
def test_stars_source_loop_count_is_the_sources_lognormal_rescaled_by_k_over_4(K):
    mu, sigma, top = 2 + math.log(K / 4), 0.7, 25 * K
    lo = np.arange(1, top + 1)  # P(round(X) = j) = P(j - 1/2 < X < j + 1/2); j = 1 takes X < 3/2, j = top the rest
    cdf = stats.lognorm(s=sigma, scale=math.exp(mu)).cdf
    p = cdf(lo + 0.5) - cdf(lo - 0.5)
    p[0], p[-1] = cdf(1.5), 1 - cdf(top - 0.5)
    mean = (lo * p).sum()
    draws = np.array([stars_source.sample_loops(K, torch.Generator().manual_seed(i)) for i in range(20_000)])
    sd = math.sqrt(((lo - mean) ** 2 * p).sum())
    assert abs(draws.mean() - mean) < 4 * sd / math.sqrt(draws.size)
    assert draws.min() >= 1 and draws.max() <= top
    if K == 4:  # the source's own: LogNormal(2, 0.7), mean e^(2 + 0.245) = 9.44 before rounding
        assert mean == pytest.approx(math.exp(2 + 0.7 ** 2 / 2), abs=0.01)


# ----------------------------------------------------------------------------- jacobian-fro-source
def test_jacobian_fro_source_penalty_is_one_gaussian_probe_over_n():
    model, h, J = penalty_model("jacobian-fro-source")
    got = jfs.penalty(model, torch.Generator().manual_seed(7))
    v = torch.randn(h.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).flatten()
    torch.testing.assert_close(got, (v @ J).square().sum() / h.numel(), rtol=1e-9, atol=0)


def test_jacobian_fro_source_gamma_schedule_is_the_scripts():
    assert [jfs.gamma(s, 300_000) for s in (32_000, 34_999, 35_000, 69_999, 70_000, 299_999)] == pytest.approx(
        [1.9, 1.9, 2.0, 2.0, 2.1, 2.7])
    assert not jfs.penalised(31_999, 300_000) and jfs.penalised(32_000, 300_000)
    assert not jfs.penalised(31, 300) and jfs.penalised(32, 300) and jfs.gamma(35, 300) == pytest.approx(2.0)
    ce, pen = torch.tensor(2.5), torch.tensor(7.0)
    assert jfs.objective(ce, pen, 40, 300).item() == pytest.approx(2.5 + 2.0 * 7.0)
    assert jfs.objective(ce, pen, 40, 300, 0.5).item() == pytest.approx(2.5 + 1.0 * 7.0)


def test_jacobian_fro_source_takes_the_penalty_on_35_percent_of_the_steps_past_the_pretraining():
    steps, seed = 30_000, 3
    gate = lambda s: jfs.penalty_on(s, steps, stabiliser_step.generator(seed, s, 0, "gate"))  # noqa: E731
    assert not any(gate(s) for s in range(0, 3200, 7))  # the first 32 / 300 of the steps: none
    taken = np.array([gate(s) for s in range(3200, steps)])
    assert abs(taken.mean() - 0.35) < 4 * math.sqrt(0.35 * 0.65 / taken.size)


def test_jacobian_fro_source_skipped_step_is_the_cross_entropy():
    model, h, J = penalty_model("jacobian-fro-source")
    ce = torch.tensor(2.5, dtype=torch.float64)
    steps, seed = 100, 0
    taken = {s: jfs.penalty_on(s, steps, stabiliser_step.generator(seed, s, 0, "gate")) for s in range(11, 40)}
    off = next(s for s, on in taken.items() if not on)
    target, pen = stabiliser_step.objective(model, ce, seed, off, 0, steps)
    assert pen is None and target is ce and model.penalty_inputs is None
    for s in (s for s, on in taken.items() if not on):  # one draw a step: every micro-batch of it skips alike
        assert stabiliser_step.objective(model, ce, seed, s, 1, steps)[1] is None
    on = next(s for s, on in taken.items() if on)
    model(tokens(1, T=3), tokens(1, T=3))
    target, pen = stabiliser_step.objective(model, ce, seed, on, 0, steps)
    assert pen is not None and target.item() == pytest.approx(2.5 + jfs.gamma(on, steps) * pen.item())


def test_parcae_source_records_its_no_gradient_loops_as_zero_activation_gradient(tmp_path):
    """The first max(n) loops of a step run under no_grad by design (not a reentrant checkpoint): their activation
    gradient is recorded as 0, the last max(k) loops' as measured (> 0), and nothing is `not_recorded`. n and k are
    drawn again by hand: r = max(1, Poisson(3)) per sequence, k = min(r, ceil(3 / 2)), n = r - k."""
    cfg = tiny_config(variant="parcae-source", loops=3, steps=2, batch_size=4, diagnostics=dict(dynamics_every=0))
    Trainer(cfg, tmp_path / "run").fit()
    m = load_metrics(tmp_path / "run")
    a = m[m.metric == M.ACT_GRAD_NORM]
    for step in range(2):
        gen = torch.Generator().manual_seed(hash((cfg.train.seed, step, 0, 0x4C4F4F50)) & (2 ** 63 - 1))
        r = torch.poisson(torch.full((4,), 3.0, dtype=torch.float64), generator=gen).clamp_min(1)
        k = r.clamp(max=2)
        n_max, k_max = int((r - k).max()), int(k.max())
        at = a[a.step == step]
        assert sorted(set(at.loop)) == list(range(1, n_max + k_max + 1))
        assert (at[at.loop <= n_max].value == 0).all() and (at[at.loop > n_max].value > 0).all()
    assert not any(n.startswith("act_grad_norm") for n in load_summary(tmp_path / "run").evidence.not_recorded or {})


# ----------------------------------------------------------------------------- all three
@pytest.mark.parametrize("name", ["parcae-source", "stars-source", "jacobian-fro-source"])
def test_each_source_recipe_trains_through_the_trainer(tmp_path, name):
    cfg = tiny_config(variant=name, loops=2, steps=4, diagnostics=dict(dynamics_every=0))
    Trainer(cfg, tmp_path / "run").fit()
    m = load_metrics(tmp_path / "run")
    assert np.isfinite(m[m.metric == M.LOSS].value).all() and len(m[m.metric == M.LOSS]) == 4
    assert (len(m[m.metric == M.LOOPS_RUN]) == 4) == (name != "jacobian-fro-source")
    stab = STABILISERS[name]
    assert stab.strength and stab.ours  # what --strength scales, and flt-diag's choices, declared


def test_zero_strength_is_the_cross_entropy_and_bad_depths_are_refused():
    ce, pen = torch.tensor(2.5), torch.tensor(7.0)
    assert stars_source.objective(ce, pen, 9000, 10_000, 0.0).item() == 2.5
    assert jfs.objective(ce, pen, 299, 300, 0.0).item() == 2.5
    model, idx = make("parcae-source", K=3), tokens(2)
    for bad in [(torch.tensor([1]), torch.tensor([1])), (torch.tensor([1, -1]), torch.tensor([1, 1]))]:
        with pytest.raises(ValueError, match="depths: n and k must be"):
            model(idx, depths=bad)
    with pytest.raises(ValueError, match="no loops="):
        model(idx, loops=2, depths=(torch.tensor([1, 1]), torch.tensor([1, 1])))


def test_a_stabiliser_with_depths_takes_no_loop_hooks_and_penalty_on_needs_a_penalty():
    from flt_diag.model.stabilisers import Stabiliser
    one = dict(name="x", description="", source="")
    with pytest.raises(ValueError, match="takes no `enter`"):
        Stabiliser(**one, depths=parcae_source.sample_depths, enter=lambda part, x, t: x)
    with pytest.raises(ValueError, match="gates a `penalty`"):
        Stabiliser(**one, penalty_on=jfs.penalty_on)
