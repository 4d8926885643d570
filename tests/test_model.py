import math

import pytest
import torch
import torch.nn.functional as F

from flt_diag.model import VARIANTS, LoopedTransformer, ModelConfig, parameter_groups

from equations import forward as eq_forward, randomize

ALL = list(VARIANTS)


def make(variant="flt", loops=3, seed=0, **kw):
    cfg = ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2, sequence_len=16, variant=variant,
                      loops=loops, **kw)
    torch.manual_seed(seed)
    return randomize(LoopedTransformer(cfg), seed)


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("K", [1, 2, 4])
def test_forward_matches_written_out_equations(variant, K):
    model = make(variant, K)
    idx = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(idx), eq_forward(model, idx, variant, K), rtol=1e-4, atol=1e-4)


def test_variants_differ_after_loop_one():
    idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    outs = {v: make(v, 3)(idx) for v in ALL}
    for a in ALL:
        for b in ALL:
            if a < b:
                assert not torch.allclose(outs[a], outs[b], atol=1e-3), (a, b)


def test_loop_one_identical_for_all_variants():
    idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    ref = make("lt", 1)
    state = ref.state_dict()
    for v in ALL:
        m = make(v, 5)
        m.load_state_dict(state)
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
    shapes = {v: [(n, tuple(p.shape)) for n, p in make(v).named_parameters()] for v in ALL}
    assert all(s == shapes["lt"] for s in shapes.values())
    d, L, V = 32, 2, 50
    expected = 2 * V * d + L * (4 * d * d + 8 * d * d)  # embedding + head + (q,k,v,o + up,down) per block
    assert sum(p.numel() for p in make("flt").parameters()) == expected


def test_loops_changeable_at_call_time():
    model = make("flt", 3)
    idx = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(model(idx, loops=5), eq_forward(model, idx, "flt", 5), rtol=1e-4, atol=1e-4)
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


def test_initialisation_follows_design():
    torch.manual_seed(0)
    m = LoopedTransformer(ModelConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=2))
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


def test_activation_checkpointing_same_logits_and_grads():
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(7))
    a, b = make("flt", 4), make("flt", 4)
    b.checkpoint_loops = True
    la, lb = a(idx, idx)[1], b(idx, idx)[1]
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


def test_parameter_groups_cover_everything_once():
    m = make()
    groups = parameter_groups(m)
    ids = [id(p) for ps in groups.values() for p in ps]
    assert sorted(ids) == sorted(id(p) for p in m.parameters())
    assert set(groups) == {"embedding", "head", "block0.attn", "block0.mlp", "block1.attn", "block1.mlp"}


def test_bad_config():
    with pytest.raises(ValueError, match="unknown variant"):
        ModelConfig(variant="nope")
    with pytest.raises(ValueError, match="loops"):
        ModelConfig(loops=0)
