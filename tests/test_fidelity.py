"""Training and measuring like the reference (FuRuF-11/FullyLoopedTransformer, a nanochat fork):
momentum warm-up, paper-sized presets, its instability statistics, its data order and precision,
and its checkpoint metadata. Each expectation is computed independently of the code under test."""
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import tiny_config
from equations import randomize
from flt_diag.data import batches
from flt_diag.data import corpus as D
from flt_diag.storage import metric_names as M
from flt_diag.judge import verdict as X
from flt_diag.config.run_config import RunConfig, build_config, padded_vocab
from flt_diag.instruments.loop_hooks import LoopHooks
from flt_diag.model.transformer import LoopedTransformer, ModelConfig, count_parameters
from flt_diag.training.optim import muon_momentum
from flt_diag.storage.folders import load_metrics, read_json, series
from flt_diag.training.trainer import Trainer, train


def small_run_config(**train_kw):
    """A model small enough for hundreds of steps in a few seconds."""
    cfg = tiny_config(depth=1, width=16, heads=1, loops=1, seq_len=8, batch_size=2,
                      diagnostics=dict(diagnostics=False), **train_kw)
    return cfg


# ------------------------------------------------------------------ 1. Muon momentum warm-up

def test_momentum_schedule_written_out():
    cfg = tiny_config().train
    for step in (0, 1, 75, 150, 299, 300, 301, 1999):
        frac = min(step / 300, 1)
        assert muon_momentum(step, cfg) == pytest.approx((1 - frac) * 0.85 + frac * 0.95, abs=1e-15)
    cfg.momentum_warmup = 0
    assert muon_momentum(0, cfg) == 0.95


def test_run_logs_momentum_085_090_095(tmp_path):
    cfg = small_run_config(steps=310, warmdown_frac=0.0)
    seen = {}  # what the optimizer really used at each step
    tr = Trainer(cfg, tmp_path / "run")
    muon = next(o for o in tr.optimizers if isinstance(o, torch.optim.Muon))
    orig = muon.step

    def step(*a, **k):
        seen[len(seen)] = muon.param_groups[0]["momentum"]
        return orig(*a, **k)

    muon.step = step
    tr.fit()
    m = series(load_metrics(tmp_path / "run"), M.MOMENTUM)
    assert m[0] == pytest.approx(0.85, abs=1e-7) and m[150] == pytest.approx(0.90, abs=1e-7)
    assert np.allclose(m[m.index >= 300].to_numpy(), 0.95, rtol=0, atol=1e-7)  # stored as float32
    assert seen[0] == pytest.approx(0.85) and seen[150] == pytest.approx(0.90) and seen[305] == pytest.approx(0.95)


def test_momentum_warmup_off_and_legacy_configs(tmp_path):
    cfg = small_run_config(steps=3, momentum_warmup=0)
    train(cfg, tmp_path / "run")
    assert np.allclose(series(load_metrics(tmp_path / "run"), M.MOMENTUM).to_numpy(), 0.95, rtol=0, atol=1e-7)
    old = cfg.to_dict()
    del old["train"]["momentum_warmup"], old["train"]["momentum_start"]  # a config.json from before the warm-up
    assert RunConfig.from_dict(old).train.momentum_warmup == 0  # read back as what was run


# ------------------------------------------------------------------ 2. paper-sized presets

@pytest.mark.parametrize("preset, params, heads", [("paper-small", 127_107_072, 3), ("paper-base", 317_915_136, 6)])
def test_paper_presets_count_like_the_paper(preset, params, heads):
    cfg = build_config(preset)
    m = cfg.model
    assert m.vocab_size == 151_680 == padded_vocab(151_669)  # the Qwen3 tokenizer padded to 64
    assert m.heads == heads == math.ceil(m.width / 128)
    d, L, V = m.width, m.depth, m.vocab_size
    assert 2 * V * d + L * 12 * d * d == params  # untied embedding + head, 4d^2 attention + 8d^2 MLP per block
    assert count_parameters(m) == params  # built on the meta device: no memory, no download
    assert round(params / 1e6, 1) in (127.1, 317.9)
    assert cfg.train.tokenizer == "Qwen/Qwen3-4B"


def test_heads_follow_the_reference_ceiling():
    from flt_diag.config.run_config import shape
    for depth in range(1, 13):
        d = 64 * depth
        assert shape(depth, 64, 128)["heads"] == max(1, (d + 127) // 128)


def test_run_stores_and_prints_its_parameter_count(tmp_path, capsys):
    from flt_diag.cli import main
    code = main(["train", "--variant", "lt", "--loops", "2", "--steps", "2", "--device", "cpu",
                 "--out", str(tmp_path / "r"), "--eval-every", "0"])
    assert code == 0
    n = read_json(tmp_path / "r" / "config.json")["n_params"]
    d, V = 64, 256
    assert n == 2 * V * d + 2 * 12 * d * d
    assert f"{n:,} parameters" in capsys.readouterr().out


def test_unreachable_tokenizer_is_one_line(tmp_path, capsys, monkeypatch):
    from flt_diag.cli import main
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    code = main(["train", "--preset", "paper-small", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: cannot load tokenizer 'Qwen/Qwen3-4B'")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ 5. the reference's statistics

def test_milestone_stds_against_numpy_on_a_series():
    rng = np.random.default_rng(0)
    steps, frac = 50, 0.2
    loss = pd.Series(rng.normal(3, 0.5, steps), index=range(steps))
    g = pd.Series(rng.lognormal(0, 1, steps), index=range(steps))
    got = X.milestone_stds(loss, g, steps, frac)
    # base_check.py: milestones at step 0 (no warm-up), 40 (= 50 - round(0.2 * 50)) and the last step;
    # population std over the steps since the previous milestone, the milestone itself included
    assert [m["step"] for m in got] == [0, 40, 49]
    assert got[0]["loss_std"] == 0.0
    assert got[1]["loss_std"] == pytest.approx(float(np.sqrt(np.mean((loss[1:41] - loss[1:41].mean()) ** 2))), rel=1e-12)
    assert got[1]["grad_norm_std"] == pytest.approx(float(np.std(g.to_numpy()[1:41])), rel=1e-12)
    assert got[2]["loss_std"] == pytest.approx(float(np.std(loss.to_numpy()[41:50])), rel=1e-12)


def test_summary_and_sweep_table_carry_loss_and_grad_norm_std(tmp_path):
    cfg = small_run_config(steps=30)
    s = train(cfg, tmp_path / "run")
    df = load_metrics(tmp_path / "run")
    loss, g = series(df, M.LOSS).to_numpy(), series(df, M.GRAD_NORM).to_numpy()
    assert s.loss_std == pytest.approx(float(np.std(loss[1:25])), rel=1e-9)  # steps 1..24: 30 - 6 = 24
    assert s.grad_norm_std == pytest.approx(float(np.std(g[1:25])), rel=1e-9)
    assert s.loss_std_warmdown == pytest.approx(float(np.std(loss[25:30])), rel=1e-9)
    from flt_diag.judge.summary_table import SUMMARY_COLUMNS
    assert {"loss_std", "grad_norm_std"} <= set(SUMMARY_COLUMNS)


def _grab(modules, outs):
    return [m.register_forward_hook(lambda mod, a, o: outs.append(o)) for m in modules]


@pytest.mark.parametrize("variant", ["lt", "flt"])
def test_attention_and_mlp_output_gradients_equal_autograd(variant):
    """In float64 on both sides, so the comparison holds to ~1e-12 on any CPU."""
    torch.manual_seed(0)
    model = randomize(LoopedTransformer(ModelConfig(vocab_size=40, depth=2, width=32, heads=2,
                                                    variant=variant, loops=3))).double()
    idx = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    rows = []
    attn_out, mlp_out = [], []
    grab = _grab([b.attn for b in model.blocks], attn_out) + _grab([b.mlp for b in model.blocks], mlp_out)
    with LoopHooks(model, lambda m, v, lp, ly: rows.append((m, lp, ly, float(v)))) as hooks:
        hooks.arm()
        _, loss = model(idx, idx)
        for h in grab:
            h.remove()
        ga = torch.autograd.grad(loss, attn_out, retain_graph=True)  # loop-major, layer-minor
        gm = torch.autograd.grad(loss, mlp_out, retain_graph=True)
        loss.backward()
    for metric, expected in ((M.ACT_GRAD_NORM_ATTN, ga), (M.ACT_GRAD_NORM_MLP, gm)):
        got = {(lp, ly): v for m, lp, ly, v in rows if m == metric}
        assert len(got) == 3 * 2
        for n, g in enumerate(expected):
            assert got[(n // 2 + 1, n % 2 + 1)] == pytest.approx(g.norm().item(), rel=1e-10)


def test_group_norms_after_clipping(tmp_path):
    cfg = tiny_config(variant="lt", loops=3, steps=1)
    grabbed = {}

    from flt_diag.training.trainer import Callback

    class Grab(Callback):
        def after_backward(self, tr, step):
            grabbed["pre"] = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}

    train(cfg, tmp_path / "run", callbacks=[Grab()])
    df = load_metrics(tmp_path / "run")
    pre = {k: v.double() for k, v in grabbed["pre"].items()}
    total = torch.sqrt(sum(v.square().sum() for v in pre.values()))
    coef = min(1.0, 1.0 / (total.item() + 1e-6))  # torch's clip_grad_norm_ with max_norm 1
    attn0 = torch.sqrt(sum(pre[f"blocks.0.attn.{w}.weight"].square().sum() for w in "qkvo")).item()
    got = df[(df.metric == "grad_norm_clipped/attn") & (df.layer == 1)].value.iloc[0]
    assert got == pytest.approx(attn0 * coef, rel=1e-5)  # fp32 norms of ~1e4 numbers: relative 1e-5
    head = df[df.metric == "grad_norm_clipped/head"].value.iloc[0]
    assert head == pytest.approx(pre["head.weight"].norm().item() * coef, rel=1e-5)
    assert total.item() > 1.0  # the first step's gradient is clipped, so the two sets of norms differ


# ------------------------------------------------------------------ 3. data as the reference reads it

def _bos_tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["alpha beta gamma delta"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<|im_start|>"]))
    tok.save(str(path))
    return tok


def test_documents_are_bos_separated_and_streamed_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("FLT_DIAG_CACHE", str(tmp_path / "cache"))
    tok = _bos_tokenizer(tmp_path / "tokenizer.json")
    bos = tok.token_to_id("<|im_start|>")
    docs = [f"alpha beta {'gamma ' * (i % 5)}delta" for i in range(400)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    data = D.load_tokens(str(tmp_path / "c.jsonl"), str(tmp_path / "tokenizer.json"), "train")
    toks = np.asarray(data.tokens)
    starts = np.flatnonzero(toks == bos)
    assert starts[0] == 0 and len(starts) > 300  # every document of the split starts with BOS
    first_doc = toks[1:starts[1]]
    assert tok.decode(first_doc.tolist()) in docs
    B, T = 3, 5
    x0, y0 = batches.stream_batch(data, B, T, 0)
    x1, _ = batches.stream_batch(data, B, T, 1)
    flat = torch.from_numpy(toks[: 2 * B * T + 1].astype(np.int64))
    assert torch.equal(x0.flatten(), flat[:B * T]) and torch.equal(y0.flatten(), flat[1:B * T + 1])
    assert torch.equal(x1.flatten(), flat[B * T: 2 * B * T])  # micro-batch 1 continues where 0 stopped


def test_stream_sampling_trains_and_resumes_deterministically(tmp_path):
    cfg = small_run_config(steps=6, sampling="stream")
    tr = Trainer(cfg, tmp_path / "a")
    xa, _ = tr.batch(2, 0)
    xb, _ = batches.stream_batch(tr.train_data, 2, 8, 2)
    assert torch.equal(xa, xb)
    assert np.isfinite(train(cfg, tmp_path / "b").final_loss)


def test_fineweb_edu_100b_is_the_reference_corpus():
    spec = D.resolve_corpus("fineweb-edu-100b")
    assert spec.path == "karpathy/fineweb-edu-100b-shuffle" and spec.streaming


# ------------------------------------------------------------------ 4. precision as the reference

def test_reference_precision_on_cpu(tmp_path):
    cfg = tiny_config(variant="flt", loops=2, steps=3, precision="reference")
    tr = Trainer(cfg, tmp_path / "run")
    assert tr.model.embed.weight.dtype == torch.bfloat16 and tr.model.cos.dtype == torch.bfloat16
    seen = {}
    h = tr.model.blocks[0].register_forward_hook(lambda m, a, o: seen.update(dtype=o.dtype))
    s = tr.fit()
    h.remove()
    assert seen["dtype"] == torch.bfloat16  # the residual stream itself is bf16
    assert np.isfinite(s.final_loss)


def test_bf16_rotary_tables_train_on_cpu(tmp_path):
    s = train(tiny_config(variant="lt", loops=2, steps=3, rotary_dtype="bfloat16"), tmp_path / "run")
    assert np.isfinite(s.final_loss)
    m = LoopedTransformer(ModelConfig(rotary_dtype="bfloat16"))
    assert torch.equal(m.cos, m.cos.bfloat16().float())  # table values are bf16-representable


# ------------------------------------------------------------------ 6. import reads the reference's meta

def test_import_reads_model_type_and_K_from_meta(tmp_path, capsys):
    from flt_diag.cli import main
    from flt_diag.training.reference import export_reference
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=256, depth=2, width=64, heads=2, variant="fla", loops=4))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save(export_reference(model), folder / "model_000100.pt")
    (folder / "meta_000100.json").write_text(json.dumps({"step": 100, "model_config": dict(
        model_type="FLT_res", K=4, loss_type="END", sequence_len=64, vocab_size=256, n_layer=2, n_head=2,
        n_kv_head=2, n_embd=64)}))  # (nanochat's names)
    code = main(["import-reference", str(folder / "model_000100.pt"), "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    cfg = read_json(tmp_path / "run" / "config.json")
    assert cfg["model"]["variant"] == "fla" and cfg["model"]["loops"] == 4


# ------------------------------------------------------------------ Muon on CPU

def test_batched_muon_matches_torch_muon():
    """BatchedMuon computes torch.optim.Muon's update (bf16 Newton-Schulz) as fp32 matmuls of bf16
    values, batched by shape. Both are roundings of the same bf16 iteration; once one element rounds
    the other way the difference spreads through the 5 iterations, so they agree to the order of bf16's
    own relative precision (2^-8 ~ 0.4%, measured up to 1.4x that): the bound is 2^-6 relative, in the
    Frobenius norm, for the orthogonalised update and for the parameters' total change."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    from flt_diag.training.optim import BatchedMuon, newton_schulz_bf16
    coeffs = (3.4445, -4.7750, 2.0315)
    for seed in range(3):
        torch.manual_seed(seed)
        for shape in [(64, 64), (256, 64), (64, 256)]:
            G = torch.randn(*shape)
            ref = _zeropower_via_newtonschulz(G, coeffs, 5, 1e-7).float()
            tall = shape[0] > shape[1]
            mine = newton_schulz_bf16((G.T if tall else G)[None], coeffs, 5, 1e-7)[0]
            mine = (mine.T if tall else mine).float()
            assert (mine - ref).norm() <= 2.0 ** -6 * ref.norm()
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(256, 64)),
                                                                          torch.nn.Parameter(torch.randn(64, 256))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    start = [p.detach().clone() for p in ps]
    a = torch.optim.Muon(ps, lr=0.02, momentum=0.9, weight_decay=0.0)
    b = BatchedMuon(qs, lr=0.02, momentum=0.9, weight_decay=0.0)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q, p0 in zip(ps, qs, start):
        assert (p - q).norm() <= 2.0 ** -6 * (p - p0).norm()
    assert a.state_dict()["state"].keys() == b.state_dict()["state"].keys()  # same state: resume works either way
