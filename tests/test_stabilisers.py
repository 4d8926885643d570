"""The field's stabilisers as variants (issue 56), against independent computations: each reduces to its base
bit for bit at zero strength; the loss terms' values and gradients against the exact Jacobian of one loop
(torch.autograd.functional.jacobian of the written-out loop in tests/equations.py) and torch.autograd; the
loop-count samplers against their distributions (scipy); Parcae's rho(Abar) < 1; the extra parameters counted by
hand. (Every variant's forward against its written-out equations: tests/test_model.py, all of VARIANTS.)"""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import tiny_config
from equations import block_forward, randomize, rms
from flt_diag.config.variants import COMPOSED, PAPER_VARIANTS, STABILISERS, VARIANTS, VariantRule, base_of
from flt_diag.model.stabilisers import huginn, jacobian_fro, stars
from flt_diag.model.transformer import LoopedTransformer, ModelConfig, extra_parameters, parameter_groups
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics
from flt_diag.training.trainer import Trainer


def make(variant, K=3, d=32, L=2, seed=0, dtype=torch.float32):
    cfg = ModelConfig(vocab_size=50, depth=L, width=d, heads=2, seq_len=16, variant=variant, loops=K)
    torch.manual_seed(seed)
    return randomize(LoopedTransformer(cfg), seed).to(dtype)


def idx(B=2, T=10, seed=1):
    return torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))


def same_weights(model, base_variant):
    """A model of `base_variant` holding `model`'s shared weights."""
    other = LoopedTransformer(model.cfg.model_copy(update=dict(variant=base_variant))).to(model.embed.weight.dtype)
    missing = other.load_state_dict(model.state_dict(), strict=False)
    assert not missing.missing_keys
    return other


# ----------------------------------------------------------------------------- zero strength
@pytest.mark.parametrize("name", [f"{b}+loop-embed" for b in PAPER_VARIANTS if b != "lt"] + ["loop-embed"])
def test_a_zero_loop_embedding_is_its_base_bit_for_bit(name):
    model = make(name)
    with torch.no_grad():
        model.loop_embed.weight.zero_()  # its initialisation (randomize made it non-zero)
    base = same_weights(model, base_of(name))
    assert torch.equal(model(idx()), base(idx()))
    assert torch.count_nonzero(LoopedTransformer(model.cfg).loop_embed.weight) == 0  # zero at init


@pytest.mark.parametrize("name", [f"{b}+residual-scale" for b in PAPER_VARIANTS if b != "lt"] + ["residual-scale"])
def test_residual_scale_one_is_its_base_bit_for_bit(name):
    model = make(name, K=4)
    assert all(b.scale == pytest.approx(1 / (4 * math.sqrt(2))) for b in model.blocks)
    base = same_weights(model, base_of(name))
    assert not torch.equal(model(idx()), base(idx()))
    for b in model.blocks:
        b.scale = 1.0
    assert torch.equal(model(idx()), base(idx()))


def test_deeploop_at_alpha_1_is_the_post_norm_lt_and_beta_scales_the_init():
    model = make("deeploop", K=3)
    assert all(b.alpha == pytest.approx(math.sqrt(2 * 3 * 2)) and b.post_norm for b in model.blocks)
    post_norm_lt = same_weights(model, "lt")
    for b in post_norm_lt.blocks:
        b.post_norm = True
    for b in model.blocks:
        b.alpha = 1.0
    assert torch.equal(model(idx()), post_norm_lt(idx()))
    # beta: a fresh deeploop's v and up are the same seed's LT weights times (8 K L)^(-1/2)
    cfg = dict(vocab_size=50, depth=2, width=32, heads=2, seq_len=16, loops=3)
    torch.manual_seed(4)
    deep = LoopedTransformer(ModelConfig(variant="deeploop", **cfg))
    torch.manual_seed(4)
    plain = LoopedTransformer(ModelConfig(variant="lt", **cfg))
    beta = (8 * 3 * 2) ** -0.5
    for a, b in zip(deep.blocks, plain.blocks):
        torch.testing.assert_close(a.attn.v.weight, b.attn.v.weight * beta, rtol=1e-6, atol=0)
        torch.testing.assert_close(a.mlp.up.weight, b.mlp.up.weight * beta, rtol=1e-6, atol=0)
        assert torch.equal(a.attn.q.weight, b.attn.q.weight)


def test_deeploops_strength_multiplies_the_exponent_of_its_init_scale():
    cfg = dict(vocab_size=50, depth=2, width=32, heads=2, seq_len=16, loops=3)
    torch.manual_seed(4)
    deep = LoopedTransformer(ModelConfig(variant="deeploop", strength=3.0, **cfg))
    torch.manual_seed(4)
    plain = LoopedTransformer(ModelConfig(variant="lt", **cfg))
    beta = (8 * 3 * 2) ** -1.5  # e = 3 x 1/2
    assert all(b.alpha == pytest.approx((2 * 3 * 2) ** 1.5) for b in deep.blocks)
    for a, b in zip(deep.blocks, plain.blocks):
        torch.testing.assert_close(a.mlp.up.weight, b.mlp.up.weight * beta, rtol=1e-6, atol=0)


def test_parcae_at_abar_1_and_b_0_starts_each_loop_from_the_raw_state():
    model = make("parcae")
    with torch.no_grad():
        model.injection.A_log.fill_(-math.inf)  # exp(-dt * 0) = 1
        model.injection.B.weight.zero_()
    x = torch.randn(2, 10, 32)
    assert torch.equal(model.injection(x, rms(x)), x)
    out = model(idx())
    model.injection.forward = lambda x_prev, e: x_prev  # the identity, by hand
    assert torch.equal(model(idx()), out)


def test_parcae_initialisation_is_the_sources():
    P = LoopedTransformer(ModelConfig(variant="parcae", width=16, heads=2, loops=3)).injection
    abar, dt = P.decay()
    torch.testing.assert_close(abar, torch.full((16,), 0.447), rtol=1e-6, atol=0)
    assert torch.equal(P.B.weight, torch.eye(16)) and torch.all(dt > 0)


@pytest.mark.parametrize("strength", [0.5, 4.0, 0.0])
def test_parcaes_strength_multiplies_minus_log_abar_at_init(strength):
    P = LoopedTransformer(ModelConfig(variant="parcae", width=16, heads=2, loops=3, strength=strength)).injection
    abar, dt = P.decay()
    torch.testing.assert_close(abar, torch.full((16,), math.exp(strength * math.log(0.447))), rtol=1e-6, atol=0)
    torch.testing.assert_close(dt, torch.full((16,), -strength * math.log(0.447)), rtol=1e-6, atol=1e-12)


def test_the_loss_terms_at_zero_weight_are_the_cross_entropy():
    ce, pen = torch.tensor(2.5), torch.tensor(7.0)
    assert torch.equal(stars.objective(ce, pen, 0, 2000), ce)  # lambda ramps from 0
    assert stars.objective(ce, pen, 200, 2000).item() == pytest.approx(0.9 * 2.5 + 0.1 * 7.0)
    assert stars.objective(ce, pen, 100, 2000).item() == pytest.approx(0.95 * 2.5 + 0.05 * 7.0)
    assert jacobian_fro.objective(ce, pen, 0, 10).item() == pytest.approx(2.5 + 0.1 * 7.0)


# ----------------------------------------------------------------------------- the penalties
def written_out_loop(model, h, base):
    """g(h) = rms(loop(h)) of an LT-based model, from tests/equations.py (not the model's code)."""
    x = h
    for block in model.blocks:
        x = block_forward(block, x, model.cfg.heads)
    return rms(x)


def exact_jacobian(model, h):
    n = h.numel()
    return torch.autograd.functional.jacobian(lambda z: written_out_loop(model, z.view_as(h), "lt").flatten(),
                                              h.flatten(), create_graph=True).reshape(n, n)


def tiny_penalty_model(variant):
    model = make(variant, K=3, d=8, L=1, dtype=torch.float64)
    model.train()
    tokens = idx(B=1, T=3)
    model(tokens, tokens)  # the training forward keeps its final state for the penalty
    h = model.penalty_inputs[0].detach().clone()
    return model, h


def test_jacobian_fro_value_and_gradient_against_the_exact_jacobian():
    model, h = tiny_penalty_model("jacobian-fro")
    blocks = list(model.blocks.parameters())
    got = jacobian_fro.penalty(model, torch.Generator().manual_seed(3))
    g_got = torch.autograd.grad(got, blocks)
    J = exact_jacobian(model, h)  # (n, n): J[i, j] = d g_i / d h_j
    gen = torch.Generator().manual_seed(3)
    vs = [torch.randn(h.shape, generator=gen, dtype=h.dtype).flatten() for _ in range(2)]
    want = sum((v @ J).square().sum() for v in vs) / (2 * h.numel())
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for a, b in zip(g_got, torch.autograd.grad(want, blocks)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    # and the Hutchinson estimate is |J|_F^2 / n in expectation: many probes against the exact norm
    many = jacobian_fro.penalty(tiny_penalty_model("jacobian-fro")[0], torch.Generator().manual_seed(0), probes=4000)
    assert many.item() == pytest.approx((J.square().sum() / h.numel()).item(), rel=0.1)


def test_stars_value_and_gradient_against_the_exact_jacobian():
    model, h = tiny_penalty_model("stars")
    blocks = list(model.blocks.parameters())
    got = stars.penalty(model, torch.Generator().manual_seed(5))
    g_got = torch.autograd.grad(got, blocks)
    J = exact_jacobian(model, h)
    v0 = torch.randn(h.shape, generator=torch.Generator().manual_seed(5), dtype=h.dtype).flatten()
    v0 = v0 / v0.norm()
    w = J.detach() @ (J.detach().T @ v0)  # one power step of J J^T
    v = w / w.norm()
    want = (v @ J).square().sum()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
    for a, b in zip(g_got, torch.autograd.grad(want, blocks)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    top = torch.linalg.svdvals(J.detach())[0] ** 2
    assert got.item() <= top.item() * (1 + 1e-9)  # a lower bound of the top squared singular value


def test_the_penalty_reaches_the_weights_not_the_state_and_is_not_seen_by_the_hooks(tmp_path):
    cfg = tiny_config(variant="jacobian-fro", loops=3, steps=3, diagnostics=dict(dynamics_every=0))
    Trainer(cfg, tmp_path / "run").fit()
    m = load_metrics(tmp_path / "run")
    pen = m[m.metric == M.STABILISER_PENALTY]
    assert len(pen) == 3 and (pen.value > 0).all()
    assert sorted(m[m.metric == M.RESID_NORM].loop.unique()) == [1, 2, 3]  # the penalty's extra loop unseen


# ----------------------------------------------------------------------------- loop counts
def pmf_mean_var(pmf: dict[int, float]):
    ks = np.array(list(pmf)), np.array(list(pmf.values()))
    mean = (ks[0] * ks[1]).sum()
    return mean, ((ks[0] - mean) ** 2 * ks[1]).sum()


def huginn_pmf(K, sigma=0.5):
    """P(r = k) of clip(Poisson(lambda) + 1, 1, 2K), lambda ~ LogNormal(ln K - sigma^2/2, sigma), by quadrature."""
    lam = stats.lognorm(s=sigma, scale=math.exp(math.log(K) - sigma ** 2 / 2))
    grid = lam.ppf(np.linspace(0.00005, 0.99995, 20000))  # equal-probability nodes
    p = {k: float(stats.poisson.pmf(k - 1, grid).mean()) for k in range(1, 2 * K)}
    p[2 * K] = 1 - sum(p.values())
    return p


def stars_pmf(K, sigma=0.5):
    """P(r = k) of clip(round(LogNormal(ln K - sigma^2/2, sigma)), 1, 2K), from the log-normal's CDF."""
    lam = stats.lognorm(s=sigma, scale=math.exp(math.log(K) - sigma ** 2 / 2))
    p = {k: lam.cdf(k + 0.5) - lam.cdf(k - 0.5) for k in range(2, 2 * K)}
    p[1], p[2 * K] = lam.cdf(1.5), lam.sf(2 * K - 0.5)
    return p


@pytest.mark.parametrize("sampler,pmf", [(huginn.sample_loops, huginn_pmf), (stars.sample_loops, stars_pmf)])
@pytest.mark.parametrize("K", [4, 12])
def test_loop_count_samplers_against_their_distributions(sampler, pmf, K):
    gen = torch.Generator().manual_seed(11)
    draws = np.array([sampler(K, gen) for _ in range(20000)])
    assert draws.min() >= 1 and draws.max() <= 2 * K
    mean, var = pmf_mean_var(pmf(K))
    assert abs(draws.mean() - mean) < 4 * math.sqrt(var / len(draws))
    assert draws.var() == pytest.approx(var, rel=0.06)
    p = pmf(K)
    observed = np.bincount(draws, minlength=2 * K + 1)[1:]
    expected = np.array([p[k] for k in range(1, 2 * K + 1)]) * len(draws)
    keep = expected > 5
    assert stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue > 1e-4


def test_a_sampled_loop_count_is_recorded_and_its_loops_are_recorded(tmp_path):
    cfg = tiny_config(variant="huginn", loops=3, steps=4, diagnostics=dict(dynamics_every=0))
    Trainer(cfg, tmp_path / "run").fit()
    m = load_metrics(tmp_path / "run")
    loops = m[m.metric == M.LOOPS_RUN].set_index("step").value
    gen = [huginn.sample_loops(3, __import__("flt_diag.training.stabiliser_step", fromlist=["x"]).generator(
        cfg.train.seed, s, 0, "loops")) for s in range(4)]
    assert list(loops) == gen
    for s, r in enumerate(gen):
        assert sorted(m[(m.metric == M.RESID_NORM) & (m.step == s)].loop.unique()) == list(range(1, r + 1))


# ----------------------------------------------------------------------------- Parcae, parameters, optimizer
def test_parcae_rho_is_below_one_at_init_and_after_100_steps(tmp_path):
    cfg = tiny_config(variant="parcae", loops=3, steps=100, width=16, heads=2, seq_len=16, batch_size=4,
                      diagnostics=dict(diagnostics=False))
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.model.injection.rho().item() == pytest.approx(0.447, abs=1e-6)
    B0 = trainer.model.injection.B.weight.detach().clone()
    trainer.fit()
    rho = load_metrics(tmp_path / "run").query("metric == @M.INJECTION_RHO").value.to_numpy()
    assert len(rho) == 100 and (rho < 1).all()
    assert trainer.model.injection.rho().item() < 1
    abar = torch.exp(-torch.nn.functional.softplus(trainer.model.injection.dt) * trainer.model.injection.A_log.exp())
    assert trainer.model.injection.rho().item() == pytest.approx(abar.max().item())
    assert not torch.equal(trainer.model.injection.B.weight, B0)  # the optimizer trains the stabiliser's parameters


@pytest.mark.parametrize("name", list(VARIANTS))
def test_extra_parameters_counted_by_hand(name):
    d, K, L = 16, 3, 2
    cfg = ModelConfig(vocab_size=64, depth=L, width=d, heads=2, variant=name, loops=K)
    by_hand = {"parcae": 2 * d + d * d, "parcae-source": 2 * d + d * d, "huginn": 2 * d * d}.get(name, 0)
    if "loop-embed" in name or "loop-gate" in name:  # (a_t, e_t in R^d per loop)
        by_hand += K * d
    assert extra_parameters(cfg) == by_hand
    model = LoopedTransformer(cfg)
    grouped = sum(p.numel() for ps in parameter_groups(model).values() for p in ps)
    assert grouped == sum(p.numel() for p in model.parameters())  # every parameter in a group the optimizer sees


@pytest.mark.parametrize("field, value", [("start", "embed-prev"), ("start", "parcae"), ("query_from_prev", "last"),
                                          ("add_prev_before_block", 1)])  # (a stabiliser is no rule: its own file)
def test_a_rule_with_a_value_outside_its_choices_is_refused_where_it_is_written(field, value):
    with pytest.raises(ValueError, match=f"variant rule: {field}="):
        VariantRule(**{"start": "prev", field: value})


def test_every_stabiliser_and_composition_is_a_variant_with_a_description():
    from flt_diag.config.variants import SOURCES, VARIANT_DESCRIPTIONS
    assert set(STABILISERS) == {"parcae", "huginn", "stars", "jacobian-fro", "residual-scale", "deeploop", "loop-embed",
                                "loop-gate", "parcae-source", "stars-source", "jacobian-fro-source"}
    assert all(n in VARIANT_DESCRIPTIONS and n in SOURCES for n in list(PAPER_VARIANTS) + list(STABILISERS))
    assert all(n in VARIANT_DESCRIPTIONS for n in COMPOSED)


def test_the_loop_dynamics_of_a_loop_embedding_take_each_loops_own_map():
    """The every-N records follow the loop embedding: loop t's map adds e_t (one map per loop, against the
    written-out loop with e_t added by hand)."""
    from flt_diag.instruments import loop_dynamics as D
    from flt_diag.instruments.looped import LoopStep
    model = make("loop-embed", K=3, dtype=torch.float64)
    tokens = idx()
    states = D.loop_states(model, tokens)
    steps = LoopStep.of(model, tokens).maps()
    assert len(steps) == 2
    for t, (f, h) in enumerate(zip(steps, states[:-1]), start=1):
        x = h + model.loop_embed.weight[t]
        for block in model.blocks:
            x = block_forward(block, x, model.cfg.heads)
        torch.testing.assert_close(f(h), rms(x))
        torch.testing.assert_close(f(h), states[t])  # the trajectory's own next state
    stats = D.loop_map_stats(model, tokens, iters=2, krylov_dim=4, dirs=1, generator=torch.Generator().manual_seed(0))
    assert stats[M.LOOP_SPECTRAL_RADIUS].shape == (2,)


def test_the_variants_command_lists_every_stabiliser_with_its_parameters_and_source(capsys):
    from flt_diag.cli import main
    assert main(["variants"]) == 0
    out = capsys.readouterr().out
    d, K = 64, 12  # the tiny preset's shape the command names
    for name, extra in {"parcae": 2 * d + d * d, "huginn": 2 * d * d, "loop-embed": K * d, "stars": 0}.items():
        line = out[out.index(f"  {name} "):].splitlines()[1]
        assert f"+{extra:,} parameters" in line and ("arXiv" in line or "PR" in line)
    assert "flt+residual-scale" in out


def test_a_loop_embedding_beyond_its_table_reuses_its_last_row():
    """Evaluation at more loops than trained (eval-loops runs 1 ... 2K): loop t > K adds e_K."""
    model = make("flt+loop-embed", K=3, dtype=torch.float64)
    tokens = idx()
    out = model(tokens, loops=5)
    last = model.loop_embed.weight[-1].detach().clone()
    with torch.no_grad():
        model.loop_embed.weight.data = torch.cat([model.loop_embed.weight, last[None], last[None]])
    assert torch.equal(model(tokens, loops=5), out)


@pytest.mark.parametrize("name", ["parcae", "huginn", "loop-embed", "flt+loop-embed"])
def test_a_seed_gives_a_stabiliser_the_same_shared_weights_as_its_base(name):
    cfg = dict(vocab_size=50, depth=2, width=16, heads=2, seq_len=8, loops=3)
    torch.manual_seed(7)
    model = LoopedTransformer(ModelConfig(variant=name, **cfg))
    torch.manual_seed(7)
    base = LoopedTransformer(ModelConfig(variant=base_of(name), **cfg))
    shared = dict(base.named_parameters())
    for n, p in model.named_parameters():
        if n in shared:
            assert torch.equal(p, shared[n]), n


def test_the_loop_count_of_a_step_is_a_function_of_seed_and_step_alone():
    """What a resumed run draws: the same count for (seed, step), whatever was drawn before."""
    from flt_diag.training.stabiliser_step import step_loops
    model = LoopedTransformer(ModelConfig(variant="huginn", width=16, heads=2, loops=6))
    first = [step_loops(model, 3, s) for s in range(50)]
    torch.manual_seed(123)
    torch.randn(10)
    assert [step_loops(model, 3, s) for s in reversed(range(50))][::-1] == first
    assert first != [step_loops(model, 4, s) for s in range(50)]
    assert step_loops(LoopedTransformer(ModelConfig(variant="lt", width=16, heads=2, loops=6)), 3, 0) is None


# ----------------------------------------------------------------------------- --strength (issue 66)
@pytest.mark.parametrize("strength", [2.5, 0.0])
def test_strength_multiplies_the_jacobian_penalty_weight(strength):
    """The step's objective at --strength s: CE + s * 0.1 * pen, the penalty written out from the exact Jacobian
    (as above, the same probes); s = 0 is the base's CE alone."""
    from flt_diag.training.stabiliser_step import generator, objective
    model, h = tiny_penalty_model("jacobian-fro")
    model.cfg = model.cfg.model_copy(update={"strength": strength})
    ce = torch.tensor(2.5, dtype=torch.float64)
    got, pen = objective(model, ce, seed=4, step=7, micro=0, steps=10)
    J = exact_jacobian(model, h)
    gen = generator(4, 7, 0, "penalty")
    vs = [torch.randn(h.shape, generator=gen, dtype=h.dtype).flatten() for _ in range(2)]
    want_pen = sum((v @ J).square().sum() for v in vs) / (2 * h.numel())
    torch.testing.assert_close(got, ce + strength * 0.1 * want_pen, rtol=1e-9, atol=1e-12)
    if strength == 0:
        assert got.item() == 2.5


def test_strength_is_refused_where_it_scales_nothing():
    from pydantic import ValidationError
    assert ModelConfig(variant="jacobian-fro", strength=3.0).strength == 3.0
    assert ModelConfig(variant="flt", strength=1.0).strength == 1.0
    for variant in ("flt", "lt", "huginn"):
        with pytest.raises(ValidationError, match="has no meaning"):
            ModelConfig(variant=variant, strength=2.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValidationError):
            ModelConfig(variant="jacobian-fro", strength=bad)


def test_strength_is_compared_on_resume_and_old_folders_still_resume():
    from flt_diag.training.settle import comparable, differences
    new = {"model": {"variant": "jacobian-fro", "loops": 3, "strength": 1.0}, "train": {"seed": 0}}
    old = {"model": {"variant": "jacobian-fro", "loops": 3}, "train": {"seed": 0}}  # written before --strength
    assert differences(comparable(old), comparable(new)) == []
    other = {"model": {"variant": "jacobian-fro", "loops": 3, "strength": 2.0}, "train": {"seed": 0}}
    assert differences(comparable(other), comparable(new)) and differences(comparable(old), comparable(other))


def test_strength_multiplies_stars_lambda():
    ce, pen = torch.tensor(2.5), torch.tensor(7.0)  # at step 200 of 2000 lambda has ramped to 0.1
    assert stars.objective(ce, pen, 200, 2000, 3.0).item() == pytest.approx(0.7 * 2.5 + 0.3 * 7.0)
    assert stars.objective(ce, pen, 200, 2000, 0.0).item() == pytest.approx(2.5)
    assert ModelConfig(variant="stars", strength=3.0).strength == 3.0


@pytest.mark.parametrize("name", ["stars", "stars-source"])
def test_stars_strength_stops_where_lambda_reaches_one(name):
    """lambda = 0.1 S: at S = 10 the objective is the penalty alone, (1 - 1) CE + 1 pen (written out); above 10,
    (1 - lambda) < 0 would weigh the cross-entropy negatively, so the config refuses it in one line."""
    from flt_diag.config.run_config import build_config
    from flt_diag.model.stabilisers import stars, stars_source
    module = {"stars": stars, "stars-source": stars_source}[name]
    ce, pen = torch.tensor(2.5), torch.tensor(7.0)
    assert module.objective(ce, pen, 999, 1000, 10.0).item() == pytest.approx(7.0)
    build_config("tiny", model=dict(variant=name, strength=10.0), train=dict(device="cpu"))
    with pytest.raises(Exception, match=f"variant {name}: --strength 10.5 is above 10, the largest with a meaning"):
        build_config("tiny", model=dict(variant=name, strength=10.5), train=dict(device="cpu"))
