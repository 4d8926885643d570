import math

import pytest
import torch
import torch.nn.functional as F

from flt_diag.config.variants import PAPER_VARIANTS
from flt_diag.model.transformer import VARIANTS, LoopedTransformer, ModelConfig, parameter_groups

from equations import forward as eq_forward, randomize
from numerics import U32, assert_close64, exact_rotary_tables, float64_model, record, softcap_fp32_atol

ALL = list(VARIANTS)


def make(variant="flt", loops=3, seed=0, **kw):
    cfg = ModelConfig(vocab_size=50, depth=2, width=32, heads=2, seq_len=16, variant=variant,
                      loops=loops, **kw)
    torch.manual_seed(seed)
    return randomize(LoopedTransformer(cfg), seed)


def assert_matches_equations(model, idx, variant, K, **forward_kwargs):
    """float64 model against the float64 equations: the residual stream at every loop's end and the
    pre-soft-cap logits to RTOL64; the fp32 logits to the rounding of their fp32 soft-cap."""
    out, streams, heads = record(model, idx, **forward_kwargs)
    rec = []
    z = eq_forward(model, idx, variant, K, record=rec, softcap=False)
    ends = [x for _, layer, x in rec if layer is None]
    assert len(streams) == len(ends) == K
    for got, want in zip(streams, ends):
        assert_close64(got, want)
    assert_close64(heads[-1], z)
    assert out.dtype == torch.float32  # forward soft-caps in fp32, as the reference does
    torch.testing.assert_close(out.double(), 15.0 * torch.tanh(z / 15.0), rtol=0, atol=softcap_fp32_atol(z))


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("K", [1, 2, 4])
def test_forward_matches_written_out_equations(variant, K):
    model = float64_model(make(variant, K))
    idx = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    assert_matches_equations(model, idx, variant, K)


@pytest.mark.parametrize("variant", ["residual-scale", "flt+residual-scale", "deeploop"])
@pytest.mark.parametrize("strength", [0.5, 4.0])
def test_a_strength_matches_the_written_out_equations(variant, strength):
    """--strength S: s = S / (K sqrt(L)) for residual-scale, alpha = (2KL)^(S/2) for DeepLoop (equations.py)."""
    model = float64_model(make(variant, 3, strength=strength))
    idx = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    assert_matches_equations(model, idx, variant, 3)


@pytest.mark.parametrize("head_dim,seq_len", [(16, 16), (32, 64), (24, 1024)])
def test_fp32_rotary_tables(head_dim, seq_len):
    """The model's own tables (fp32 angles, cos and sin; the float64 tests swap in exact ones)
    against float64 ones. The fp32 angle t * base^(-2i/D) is within (ln(base) + 10) U32 relative of
    the exact one (the exponent 2i/D rounded, times the slope ln(base) of base^x; pow within 4 ulps;
    reciprocal and product), an error cos and sin pass on with slope <= 1; they add <= 4 ulps (8 U32)."""
    model = LoopedTransformer(ModelConfig(width=2 * head_dim, heads=2, seq_len=seq_len))
    cos, sin = exact_rotary_tables(seq_len, head_dim)
    assert model.cos.dtype == model.sin.dtype == torch.float32 and model.cos.shape == cos.shape
    max_angle = seq_len - 1.0  # t / base^0
    atol = (math.log(model.cfg.rotary_base) + 10) * U32 * max_angle + 8 * U32
    torch.testing.assert_close(model.cos.double(), cos, rtol=0, atol=atol)
    torch.testing.assert_close(model.sin.double(), sin, rtol=0, atol=atol)


def test_fp32_rmsnorm_against_float64():
    """The hand-written fp32 RMSNorm (forward and backward; the path training takes on CPU) against
    F.rms_norm and autograd in float64 on the same fp32 inputs, with the same eps. Bound per entry:
    mean(x^2) over d terms carries <= (d + 1) U32 relative error, rsqrt halves it and adds two
    roundings, the product one more, so y is within (d/2 + 4) U32 |y|; the backward
    r * (g - y * mean(g * y)) adds a d-term mean with cancellation: within
    2 (d + 8) U32 * r * (|g| + |y| * mean|g * y|). Rows from 1e-3 to 1e3 in scale."""
    from flt_diag.model.transformer import norm
    d = 64
    gen = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.linspace(-3, 3, 12).view(3, 4, 1)
    x = (torch.randn(3, 4, d, generator=gen) * scale).requires_grad_()
    g = torch.randn(3, 4, d, generator=gen)
    y = norm(x)
    (gx,) = torch.autograd.grad(y, x, g)

    x64 = x.detach().double().requires_grad_()
    y64 = F.rms_norm(x64, (d,), eps=torch.finfo(torch.float32).eps)
    (gx64,) = torch.autograd.grad(y64, x64, g.double())
    assert y.dtype == gx.dtype == torch.float32
    assert ((y.double() - y64).abs() <= (d / 2 + 4) * U32 * y64.abs()).all()
    r = torch.rsqrt(x64.detach().square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
    bound = 2 * (d + 8) * U32 * r * (g.double().abs() + y64.abs() * (g.double() * y64).abs().mean(-1, keepdim=True))
    assert ((gx.double() - gx64).abs() <= bound.detach()).all()


def test_variants_differ_after_loop_one():
    idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    outs = {v: make(v, 3)(idx) for v in ALL}

    def forward_of(v):  # a loss term changes the training objective, not the forward: stars is LT's forward
        v = v.removesuffix("-source").replace("+stars", "").replace("+jacobian-fro", "")  # (a source recipe: its
        # round-one name's forward)
        return "lt" if v in ("stars", "jacobian-fro") else v
    for a in ALL:
        for b in ALL:
            if a < b and forward_of(a) != forward_of(b):
                assert not torch.allclose(outs[a], outs[b], atol=1e-3), (a, b)
            elif a < b:
                assert torch.equal(outs[a], outs[b]), (a, b)


def test_loop_one_identical_for_all_variants():
    idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    ref = make("lt", 1)
    state = ref.state_dict()
    for v in PAPER_VARIANTS + ["parcae", "stars", "jacobian-fro"]:  # (the others change the block or loop 1's start)
        m = make(v, 5)
        assert all(k.startswith("injection.") for k in m.load_state_dict(state, strict=False).missing_keys)
        torch.testing.assert_close(m(idx, loops=1), ref(idx), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("K", [1, 3, 6])
def test_causal(variant, K):
    model = make(variant, K)
    idx = torch.randint(0, 50, (1, 14), generator=torch.Generator().manual_seed(4))
    base = model(idx)
    for j in (0, 5, 13):
        changed = idx.clone()
        changed[0, j] = (changed[0, j] + 7) % 50
        out = model(changed)
        torch.testing.assert_close(out[:, :j], base[:, :j], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, j], base[:, j])


def test_identical_parameters_across_variants():
    shapes = {v: [(n, tuple(p.shape)) for n, p in make(v).named_parameters()] for v in PAPER_VARIANTS}  # (the
    # stabilisers' extra parameters: tests/test_stabilisers.py)
    assert all(s == shapes["lt"] for s in shapes.values())
    d, L, V = 32, 2, 50
    expected = 2 * V * d + L * (4 * d * d + 8 * d * d)  # embedding + head + (q,k,v,o + up,down) per block
    assert sum(p.numel() for p in make("flt").parameters()) == expected


def test_loops_changeable_at_call_time():
    model = float64_model(make("flt", 3))
    idx = torch.randint(0, 50, (2, 8))
    assert_matches_equations(model, idx, "flt", 5, loops=5)
    with pytest.raises(ValueError):
        model(idx, loops=0)


def test_loss_modes_against_per_loop_forwards():
    model = make("flt", 4)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(6))
    ce = [F.cross_entropy(model(idx, loops=k).flatten(0, 1), y.flatten()) for k in range(1, 5)]
    torch.testing.assert_close(model(idx, y)[1], ce[-1])
    torch.testing.assert_close(model(idx, y, loss_on="all")[1], torch.stack(ce).mean())
    torch.testing.assert_close(model(idx, y, loss_on="last-third")[1], torch.stack(ce[-2:]).mean())  # ceil(4/3)=2
    model5 = make("flt", 5)  # K = 5 tells ceil(K/3) = 2 from floor (1) and from half (3)
    ce5 = [F.cross_entropy(model5(idx, loops=k).flatten(0, 1), y.flatten()) for k in range(1, 6)]
    torch.testing.assert_close(model5(idx, y, loss_on="last-third")[1], torch.stack(ce5[-2:]).mean())
    with pytest.raises(ValueError, match="loss_on"):
        model(idx, y, loss_on="first")


def test_initialisation_follows_design():
    torch.manual_seed(0)
    m = LoopedTransformer(ModelConfig(vocab_size=256, depth=2, width=64, heads=2))
    assert abs(m.embed.weight.std().item() - 1.0) < 0.02
    assert abs(m.head.weight.std().item() - 0.001) < 0.0001
    for b in m.blocks:
        assert b.attn.o.weight.abs().max() == 0 and b.mlp.down.weight.abs().max() == 0
        for w in (b.attn.q.weight, b.attn.k.weight, b.attn.v.weight, b.mlp.up.weight):
            assert w.abs().max() <= math.sqrt(3 / 64) + 1e-6
            assert abs(w.std().item() - 1 / 8) < 0.01


def test_softcap_bounds_logits():
    model = make("lt", 2)
    with torch.no_grad():
        model.head.weight.mul_(1e4)
    assert model(torch.randint(0, 50, (1, 8))).abs().max() <= 15.0


@pytest.mark.parametrize("variant", ["flt", "lt"])
def test_activation_checkpointing_same_logits_and_grads(variant):
    """Bit for bit, in fp32 (the training path): non-reentrant checkpointing backpropagates through
    the same graph, only with its saved tensors recomputed by the same ops on the same inputs."""
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(7))
    a, b = make(variant, 4), make(variant, 4)
    b.checkpoint_loops = True
    la, lb = a(idx, idx)[1], b(idx, idx)[1]
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert pa.dtype == torch.float32
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0)


def test_parameter_groups_cover_everything_once():
    m = make()
    groups = parameter_groups(m)
    ids = [id(p) for ps in groups.values() for p in ps]
    assert sorted(ids) == sorted(id(p) for p in m.parameters())
    assert set(groups) == {"embedding", "head", "block0.attn", "block0.mlp", "block1.attn", "block1.mlp"}


def test_bad_config():
    """`of` (what build_config and the command line build with) says one line naming the flag."""
    with pytest.raises(ValueError, match=r"^--variant must be one of lt, lt-ii, lt-ai, fla, flt, parcae, .*flt\+stars\b.*, got 'nope'$"):
        ModelConfig.of(variant="nope")
    with pytest.raises(ValueError, match=r"^--loops must be in 1\.\.1024, got 0$"):
        ModelConfig.of(loops=0)
    with pytest.raises(ValueError, match=r"^--depth must be in 1\.\.1024, got 0$"):
        ModelConfig.of(depth=0)


@pytest.mark.parametrize("variant,reaches", [("flt", False), ("lt-ai", False), ("lt", True), ("lt-ii", True),
                                             ("fla", True)])
def test_position_zero_is_out_of_the_loops_reach_where_h_enters_only_through_queries(variant, reaches):
    """DESIGN.md §2, position 0: in flt and lt-ai, h(t-1) enters only through attention queries, and a
    query with one key (position 0) gets that key's value whatever it is: position 0's logits are the
    same at every loop. Random weights (the real init zeroes W_O and W_down), K=12."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, depth=2, width=32, heads=2, seq_len=16, variant=variant, loops=12)
    model = randomize(LoopedTransformer(cfg))
    idx = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = torch.stack(model.forward_loops(idx, keep="all"))  # (K, B, T, V)
    change = (logits[1:] - logits[:-1]).abs()
    first, rest = change[:, :, 0].max().item(), change[:, :, 1:].max().item()
    assert rest > 0.1  # the loop moves every later position in every variant
    if reaches:
        assert first > 0.1
    else:
        assert first < 1e-4
