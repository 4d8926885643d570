"""Importing reference (nanochat-based) checkpoints gives the reference's logits.

The reference forward pass below is written independently of flt_diag.model.transformer, in nanochat's style:
it works directly on a reference-layout state dict, with its own rotary (bfloat16 tables,
half-split convention, applied before the QK-norm), F.rms_norm, a (B, T, H, D) layout and a
padded vocabulary sliced at the end. The loop rules are spelled out from DESIGN.md §2.
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from flt_diag.model.transformer import LoopedTransformer, ModelConfig
from flt_diag.training.reference import (REFERENCE_VARIANTS, ReferenceImportError, convert_state_dict, export_reference,
                                import_reference)
from flt_diag.training.reference import write_imported_run
from numerics import assert_close64, record, softcap_fp32_atol

VOCAB, PADDED, N_LAYER, N_EMBD, N_HEAD = 200, 256, 2, 64, 2


# --------------------------------------------------------------------------- independent reference

def ref_norm(x):
    return F.rms_norm(x, (x.size(-1),))


def ref_rotary_tables(T, head_dim, base=10000, dtype=torch.bfloat16):
    channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / (base ** (channel_range / head_dim))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)  # (T, D/2)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)  # the reference keeps them in bf16
    return cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, D/2)


def ref_apply_rotary(x, cos, sin):  # x: (B, T, H, D)
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3).to(x.dtype)


def ref_attention(sd, i, q_src, kv_src, cos, sin):
    B, T, C = kv_src.shape
    hd = C // N_HEAD
    w = lambda name: sd[f"transformer.h.{i}.attn.{name}.weight"]  # noqa: E731
    q = (q_src @ w("c_q").T).view(B, T, N_HEAD, hd)
    k = (kv_src @ w("c_k").T).view(B, T, N_HEAD, hd)
    v = (kv_src @ w("c_v").T).view(B, T, N_HEAD, hd)
    q, k = ref_apply_rotary(q, cos, sin), ref_apply_rotary(k, cos, sin)
    q, k = ref_norm(q), ref_norm(k)  # QK-norm after the rotary, as nanochat does
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return y @ w("c_proj").T


def ref_mlp(sd, i, x):
    h = F.relu(x @ sd[f"transformer.h.{i}.mlp.c_fc.weight"].T).square()
    return h @ sd[f"transformer.h.{i}.mlp.c_proj.weight"].T


def ref_block(sd, i, x, cos, sin, q_src=None):
    """Pre-norm block; with q_src given, attention takes its queries from q_src (already normed)."""
    z = ref_norm(x)
    x = x + ref_attention(sd, i, z if q_src is None else q_src, z, cos, sin)
    return x + ref_mlp(sd, i, ref_norm(x))


def ref_forward(sd, idx, variant, K, table_dtype=torch.bfloat16, softcap=True):
    """Logits (B, T, VOCAB) of the reference's looped GPT after K loops; variant in reference names.
    Computed in the dtype of sd (the tables stay table_dtype); with softcap=False, the sliced head
    output before the fp32 cast and the soft-cap."""
    T = idx.shape[1]
    cos, sin = ref_rotary_tables(T, N_EMBD // N_HEAD, dtype=table_dtype)
    emb = F.embedding(idx, sd["transformer.wte.weight"])  # E[tok], (B, T, d)
    e = ref_norm(emb)  # norm(E[tok])
    x, h = e, None
    for t in range(1, K + 1):
        if t >= 2:  # where the stream starts
            if variant == "LT":
                x = h  # h(t-1)
            elif variant == "LT_i":
                x = ref_norm(emb + h)  # additive input injection: norm(E[tok] + h(t-1))
            elif variant in ("LT_ia", "FLT_res", "FLT"):
                x = e
            else:
                raise AssertionError(variant)
        for i in range(N_LAYER):
            q_src = None
            if t >= 2:
                if variant == "FLT_res":
                    x = ref_norm(x + h)  # previous loop's output before every block
                if variant == "FLT" or (variant == "LT_ia" and i == 0):
                    q_src = ref_norm(h)  # attention injection: Q from norm(h(t-1))
            x = ref_block(sd, i, x, cos, sin, q_src)
        h = ref_norm(x)  # h(t)
    logits = h @ sd["lm_head.weight"].T  # (B, T, PADDED)
    if not softcap:
        return logits[..., :VOCAB]
    logits = logits[..., :VOCAB].float()
    return 15 * torch.tanh(logits / 15)


def assert_matches_reference(model, sd, idx, ref_variant, K, table_dtype, **forward_kwargs):
    """float64 model against the float64 reference on the same (float64) weights: the head outputs
    to RTOL64; the logits, which both soft-cap in fp32, to twice the rounding bound of that step."""
    model.double()
    sd64 = {k: v.double() for k, v in sd.items()}
    with torch.no_grad():
        got, _, heads = record(model, idx, **forward_kwargs)
        z = ref_forward(sd64, idx, ref_variant, K, table_dtype, softcap=False)
        assert_close64(heads[-1], z)
        torch.testing.assert_close(got, ref_forward(sd64, idx, ref_variant, K, table_dtype),
                                   rtol=0, atol=2 * softcap_fp32_atol(z))


def reference_state_dict(seed=0):
    """nanochat-like init, but non-zero c_proj and a larger head so the logits say something."""
    g = torch.Generator().manual_seed(seed)
    d = N_EMBD
    s = math.sqrt(3.0 / d)

    def uniform(*shape, scale=s):
        return (torch.rand(*shape, generator=g) * 2 - 1) * scale

    sd = {"transformer.wte.weight": torch.randn(PADDED, d, generator=g)}
    for i in range(N_LAYER):
        sd[f"transformer.h.{i}.attn.c_q.weight"] = uniform(d, d)
        sd[f"transformer.h.{i}.attn.c_k.weight"] = uniform(d, d)
        sd[f"transformer.h.{i}.attn.c_v.weight"] = uniform(d, d)
        sd[f"transformer.h.{i}.attn.c_proj.weight"] = uniform(d, d, scale=0.5 * s)
        sd[f"transformer.h.{i}.mlp.c_fc.weight"] = uniform(4 * d, d)
        sd[f"transformer.h.{i}.mlp.c_proj.weight"] = uniform(d, 4 * d, scale=0.25 * s)
    sd["lm_head.weight"] = torch.randn(PADDED, d, generator=g) * 0.3
    return sd


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is far faster than several fighting over shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ref_sd():
    return reference_state_dict()


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------- tests

def test_reference_forward_is_sensitive(ref_sd, idx):
    """Guards the comparisons below: variants, loop counts and padded rows all change the output."""
    a = ref_forward(ref_sd, idx, "FLT", 2)
    assert a.shape == (2, 24, VOCAB) and a.abs().max() > 1.0
    assert not torch.allclose(a, ref_forward(ref_sd, idx, "FLT", 3), atol=1e-3)
    outs = [ref_forward(ref_sd, idx, v, 3) for v in REFERENCE_VARIANTS]
    for j in range(len(outs)):
        for k in range(j):
            assert not torch.allclose(outs[j], outs[k], atol=1e-3)


@pytest.mark.parametrize("ref_variant", list(REFERENCE_VARIANTS))
def test_converted_weights_and_loop_rules_match_reference(ref_sd, idx, ref_variant):
    """With float32 rotary tables on both sides (both build them with the same fp32 recipe, used as
    they are in float64): the name mapping, vocab slicing and every variant's loop rules agree
    with the reference, both run in float64."""
    state, dims = convert_state_dict(ref_sd, vocab_size=VOCAB)
    model = LoopedTransformer(ModelConfig(vocab_size=VOCAB, depth=N_LAYER, width=N_EMBD, heads=N_HEAD,
                                          variant=REFERENCE_VARIANTS[ref_variant], loops=3, rotary_dtype="float32"))
    model.load_state_dict(state)
    for K in (1, 3, 5):
        assert_matches_reference(model, ref_sd, idx, ref_variant, K, torch.float32, loops=K)


# The reference rotates q and k and then RMS-normalises them (DESIGN.md §2, nanochat), with bf16 tables.
@pytest.mark.parametrize("ref_variant", list(REFERENCE_VARIANTS))
def test_import_matches_reference_logits(ref_sd, idx, ref_variant):
    model = import_reference(ref_sd, ref_variant, loops=3, n_head=N_HEAD, vocab_size=VOCAB)
    assert model.cfg.variant == REFERENCE_VARIANTS[ref_variant] and model.cfg.rotary_dtype == "bfloat16"
    assert model.cfg.vocab_size == VOCAB
    for K in (1, 3, 5):  # 3 = the checkpoint's K; 1 and 5 chosen at test time
        # bf16 tables on both sides, the same bf16 values used in float64
        assert_matches_reference(model, ref_sd, idx, ref_variant, K, torch.bfloat16, **({"loops": K} if K != 3 else {}))


def test_flt_diag_names_and_meta(ref_sd, idx, tmp_path):
    torch.save({"_orig_mod." + k: v.bfloat16() for k, v in ref_sd.items()}, tmp_path / "model_000500.pt")
    meta = {"step": 500, "model_config": {"sequence_len": 32, "vocab_size": VOCAB, "n_layer": N_LAYER,
                                          "n_head": N_HEAD, "n_kv_head": N_HEAD, "n_embd": N_EMBD,
                                          "n_loops": 4, "variant": "LT_ia"}}
    (tmp_path / "meta_000500.json").write_text(json.dumps(meta))
    model = import_reference(tmp_path / "model_000500.pt")  # everything from the meta file beside it
    assert (model.cfg.variant, model.cfg.loops, model.cfg.seq_len, model.cfg.heads) == ("lt-ai", 4, 32, 2)
    bf16_sd = {k: v.bfloat16().float() for k, v in ref_sd.items()}
    same = import_reference(bf16_sd, "LT_ia", loops=4, n_head=N_HEAD, vocab_size=VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), same(idx), rtol=0, atol=0)
    # explicit arguments win over the meta file; flt-diag names are accepted; a folder means its newest file
    model = import_reference(tmp_path, "flt", loops=2)
    assert (model.cfg.variant, model.cfg.loops) == ("flt", 2)


def test_prefixes_are_stripped(ref_sd):
    plain, dims = convert_state_dict(ref_sd, vocab_size=VOCAB)
    for prefix in ("_orig_mod.", "module.", "module._orig_mod."):
        got, _ = convert_state_dict({prefix + k: v for k, v in ref_sd.items()}, vocab_size=VOCAB)
        assert got.keys() == plain.keys()
        assert all(torch.equal(got[k], plain[k]) for k in plain)
    assert dims == dict(n_layer=N_LAYER, n_embd=N_EMBD, vocab_size=VOCAB, padded_vocab_size=PADDED)
    assert plain["embed.weight"].shape == (VOCAB, N_EMBD) and plain["head.weight"].shape == (VOCAB, N_EMBD)
    kept, dims = convert_state_dict(ref_sd)  # without a vocab size the padded rows stay
    assert kept["head.weight"].shape == (PADDED, N_EMBD) and dims["vocab_size"] == PADDED


def test_bad_checkpoints_give_one_line_errors(ref_sd):
    def err(sd, **kw):
        with pytest.raises(ReferenceImportError) as e:
            import_reference(sd, "FLT", loops=2, **({"n_head": N_HEAD} | kw))
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    missing = {k: v for k, v in ref_sd.items() if k != "transformer.h.1.mlp.c_fc.weight"}
    assert "missing transformer.h.1.mlp.c_fc.weight" in err(missing)
    extra = {**ref_sd, "transformer.h.0.attn.ve_gate.weight": torch.zeros(2, 2)}
    assert "unexpected transformer.h.0.attn.ve_gate.weight" in err(extra)
    gqa = {**ref_sd, "transformer.h.0.attn.c_k.weight": torch.zeros(32, N_EMBD),
           "transformer.h.0.attn.c_v.weight": torch.zeros(32, N_EMBD)}
    assert "grouped-query" in err(gqa)
    assert "grouped-query" in err(ref_sd, meta={"model_config": {"n_head": 2, "n_kv_head": 1}})
    assert "flt-diag state dict" in err(import_reference(ref_sd, "FLT", 2, n_head=N_HEAD).state_dict())
    assert "heads" in err(ref_sd, n_head=None)
    assert "vocab_size" in err(ref_sd, vocab_size=PADDED + 1)
    with pytest.raises(ReferenceImportError, match="unknown variant"):
        import_reference(ref_sd, "FLT_x", loops=2, n_head=N_HEAD)


def test_export_import_round_trip(ref_sd, idx):
    model = import_reference(ref_sd, "FLT_res", loops=3, n_head=N_HEAD, vocab_size=VOCAB)
    exported = export_reference(model)
    assert exported.keys() == ref_sd.keys()
    assert exported["lm_head.weight"].shape == (PADDED, N_EMBD)
    assert not exported["transformer.wte.weight"][VOCAB:].any()  # zero padding rows
    again = import_reference(exported, "FLT_res", loops=3, n_head=N_HEAD, vocab_size=VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(again(idx), model(idx), rtol=0, atol=0)


def test_write_imported_run_reloads(ref_sd, idx, tmp_path):
    from flt_diag.config.run_config import RunConfig
    from flt_diag.storage.folders import CHECKPOINT, CONFIG, StorageError

    model = import_reference(ref_sd, "FLT", loops=3, n_head=N_HEAD, vocab_size=VOCAB)
    run = write_imported_run(model, tmp_path / "run", source="model_000500.pt", step=500)
    cfg = json.loads((run / CONFIG).read_text())
    assert cfg["imported_from"] == "model_000500.pt" and "note" in cfg  # vocab 200: tokenizer unknown
    assert RunConfig.from_dict(cfg).model == model.cfg
    ckpt = torch.load(run / CHECKPOINT, weights_only=False)  # as evaluation.eval_loops reads it
    assert ckpt["step"] == 500
    reloaded = LoopedTransformer(ModelConfig(**ckpt["model_config"]))
    reloaded.load_state_dict(ckpt["model"])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx, loops=4), model(idx, loops=4), rtol=0, atol=0)
    with pytest.raises(StorageError):
        write_imported_run(model, run, source="again")

    byte_model = import_reference(ref_sd, "FLT", loops=3, n_head=N_HEAD, vocab_size=256)
    cfg = json.loads((write_imported_run(byte_model, tmp_path / "bytes", "x") / CONFIG).read_text())
    assert cfg["train"]["tokenizer"] == "bytes" and cfg["train"]["data"] == "stdlib" and "note" not in cfg
