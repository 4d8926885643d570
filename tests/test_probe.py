"""flt_diag.watch on models flt-diag did not write, from a plain PyTorch loop; its records against
independent computations, and against the built-in path on flt-diag's own model."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

import flt_diag
from flt_diag.instruments.loop_hooks import NOT_LOOPED_AFTER
from conftest import tiny_config
from probe_models import D, T, V, UniversalTransformer, batches, check_folder, lm_loss, looped_gpt2
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_config, load_metrics, load_summary
from flt_diag.instruments.callbacks import Callback
from flt_diag.training.trainer import train


def train_plain(model, folder, steps=5, **options):
    """The plain loop of docs/api.md; returns (probe, [per-step hand records at the recorded forward])."""
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    by_hand = []
    with flt_diag.watch(model, folder=folder, optimizer=opt, **options) as probe:
        for x in batches(steps):
            loss = lm_loss(model(x), x)
            loss.backward()
            by_hand.append(dict(grad_norm=math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters()
                                                        if p.grad is not None))))
            opt.step()
            probe.step(loss=loss)
            opt.zero_grad()
    return probe, by_hand


def value(df, step, metric, loop=M.NONE, layer=M.NONE):
    sel = df[(df.step == step) & (df.metric == metric) & (df.loop == loop) & (df.layer == layer)]
    assert len(sel) == 1, (metric, loop, layer, len(sel))
    return float(sel.value.iloc[0])


def test_universal_transformer_plain_loop(tmp_path):
    torch.manual_seed(0)
    model = UniversalTransformer(loops=3)
    x = batches(1)[0]
    # by hand, with the weights of step 0: the stream after each loop and d(loss)/d(stream)
    hs, h = [], model.embed(x)
    for _ in range(3):
        h = model.layer(h)
        hs.append(h)
    grads = torch.autograd.grad(lm_loss(model.head(h), x), hs)
    probe, by_hand = train_plain(model, tmp_path / "ut", blocks=[model.layer])
    df = load_metrics(tmp_path / "ut")
    for k in range(3):
        norm = float(torch.linalg.vector_norm(hs[k].detach(), dim=-1).mean())
        assert value(df, 0, M.RESID_NORM, k + 1, 1) == pytest.approx(norm, rel=1e-5)
        assert value(df, 0, M.RESID_NORM_LOOP_END, k + 1) == pytest.approx(norm, rel=1e-5)
        assert value(df, 0, M.ACT_GRAD_NORM, k + 1, 1) == pytest.approx(float(grads[k].norm()), rel=1e-5)
    assert not ((df.metric == M.RESID_NORM) & (df.loop == 4)).any()
    for s, hand in enumerate(by_hand):
        assert value(df, s, M.GRAD_NORM) == pytest.approx(hand["grad_norm"], rel=1e-5)
        assert value(df, s, M.LOOPS_RUN) == 3
    cfg = load_config(tmp_path / "ut")
    assert (cfg.model.loops, cfg.model.depth, cfg.model.width) == (3, 1, D)
    assert cfg.model.heads == 2 and cfg.model.seq_len == T
    assert load_summary(tmp_path / "ut").verdict == probe.summary.verdict == "stable"
    check_folder(tmp_path / "ut")


def test_update_ratio_against_the_parameters(tmp_path):
    """step() alone (no after_backward): the update ratio against the weights kept from the step before."""
    torch.manual_seed(0)
    model = UniversalTransformer(loops=2)
    before = [p.detach().clone() for p in model.head.parameters()]
    train_plain(model, tmp_path / "r", steps=1, blocks=[model.layer])
    after = list(model.head.parameters())
    delta = math.sqrt(sum(float((a.detach() - b).square().sum()) for a, b in zip(after, before)))
    weight = math.sqrt(sum(float(b.square().sum()) for b in before))
    assert value(load_metrics(tmp_path / "r"), 0, "update_ratio/head") == pytest.approx(delta / weight, rel=1e-5)


def test_a_sampled_loop_count_is_recorded_per_step(tmp_path):
    """A Huginn-style model samples its loop count each forward: loops_run is that count, and the stored
    loop count is the most frequent one."""
    torch.manual_seed(0)
    model = UniversalTransformer(loops=4, sample_loops=True)
    train_plain(model, tmp_path / "h", steps=6, blocks=[model.layer])
    df = load_metrics(tmp_path / "h")
    runs = df[df.metric == M.LOOPS_RUN].value.to_numpy()
    assert list(runs) == model.sampled
    for s, k in enumerate(model.sampled):
        assert df[(df.step == s) & (df.metric == M.RESID_NORM)].loop.max() == k
    counts = pd.Series(model.sampled).value_counts()
    assert load_config(tmp_path / "h").model.loops in set(counts[counts == counts.max()].index)


def test_hugging_face_blocks_in_a_plain_loop(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = looped_gpt2(loops=3)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(0)
    with flt_diag.watch(model, blocks="gpt.transformer.h.*", folder=tmp_path / "gpt2", head=model.gpt.lm_head,
                        loss=lambda out: out["loss"]) as probe:
        for _ in range(4):
            x = torch.randint(0, 64, (2, 16), generator=g)
            model(x, labels=x)["loss"].backward()
            probe.after_backward()
            opt.step()
            probe.step()
            opt.zero_grad()
    df = load_metrics(tmp_path / "gpt2")
    assert set(df[df.metric == M.RESID_NORM].loop) == {1, 2, 3}
    assert set(df[df.metric == M.RESID_NORM].layer) == {1, 2}
    assert "grad_norm/attn" in set(df.metric) and (df.metric == M.LOSS).sum() == 4
    assert load_config(tmp_path / "gpt2").probe["blocks"] == ["gpt.transformer.h.0", "gpt.transformer.h.1"]
    check_folder(tmp_path / "gpt2")


# ---------------------------------------------------------------- flt-diag's own model: the built-in path

class ProbeBridge(Callback):
    """The public API driven from the Trainer's moments (diagnostics off in that Trainer)."""

    def __init__(self, folder, at_loop_end: bool):
        self.folder, self.at_loop_end = folder, at_loop_end

    def on_start(self, trainer):
        m = trainer.model
        self.probe = flt_diag.watch(m, blocks=m.blocks, folder=self.folder, head=m.head, loss=lambda out: out[1],
                                    loop_boundary=m.loop_end if self.at_loop_end else None,
                                    optimizer=trainer.optimizers[0], diagnostics=trainer.cfg.diagnostics,
                                    steps=trainer.cfg.train.steps, grad_scale=trainer.cfg.train.grad_accum,
                                    variant=trainer.cfg.model.variant,
                                    unigram_entropy=trainer.train_data.unigram_entropy)

    def after_backward(self, trainer, step):
        self.probe.after_backward()

    def after_step(self, trainer, step):
        self.probe.step()

    def on_end(self, trainer):
        self.probe.close()
        m = trainer.model  # every hook of the probe gone (the Trainer's own diagnostics are off)
        assert not (m._forward_pre_hooks or m._forward_hooks or m.loop_end._forward_hooks)


def test_the_trainer_and_watch_run_their_instruments_through_one_probe(tmp_path):
    """The Trainer's instruments and watch's are one Probe each, of the same parts in the same order (the diagnostics,
    the loop dynamics, the early warning), on one record guard."""
    from flt_diag.instruments.diagnostics import DiagnosticsCallback
    from flt_diag.instruments.dynamics_callback import LoopDynamicsCallback
    from flt_diag.instruments.warning_callback import CollapseWarning
    from flt_diag.integrations.probe import Probe
    from flt_diag.training.trainer import Trainer
    trainer = Trainer(tiny_config(steps=2, diagnostics=dict(warn=True)), tmp_path / "t")
    model = UniversalTransformer()
    with flt_diag.watch(model, blocks=[model.layer], folder=tmp_path / "w", warn=True) as probe:
        pass
    parts = [DiagnosticsCallback, LoopDynamicsCallback, CollapseWarning]
    for p in (trainer.probe, probe.probe):
        assert type(p) is Probe and [type(x) for x in p.parts] == parts and all(x.records is p.records for x in p.parts)
    assert trainer.callbacks[0] is trainer.probe


@pytest.mark.parametrize("boundary", ["calls", "loop_end"])
def test_own_model_through_the_api_equals_the_built_in_path(tmp_path, boundary):
    cfg = tiny_config(variant="lt-ii", loops=3, steps=6, seed=1)
    train(cfg, tmp_path / "builtin")
    train(cfg, tmp_path / "plain", diagnostics=False, callbacks=[ProbeBridge(tmp_path / "api", boundary == "loop_end")])
    a, b = load_metrics(tmp_path / "builtin"), load_metrics(tmp_path / "api")
    assert set(a.metric) - set(b.metric) <= {M.VAL_LOSS, M.MOMENTUM}  # the Trainer's own, not diagnostics
    assert set(b.metric) - set(a.metric) == {M.LOOPS_RUN} and (b[b.metric == M.LOOPS_RUN].value == 3).all()
    a, b = a[a.metric.isin(set(b.metric))].reset_index(drop=True), b[b.metric != M.LOOPS_RUN].reset_index(drop=True)
    assert len(a) == len(b) > 6 * 40
    pd.testing.assert_frame_equal(a.drop(columns="value"), b.drop(columns="value"))
    np.testing.assert_allclose(b.value.to_numpy(), a.value.to_numpy(), rtol=1e-5, atol=1e-7)
    sa, sb = load_summary(tmp_path / "builtin"), load_summary(tmp_path / "api")
    assert (sa.verdict, sa.evidence.reason) == (sb.verdict, sb.evidence.reason)
    assert sa.osc_cv == pytest.approx(sb.osc_cv, rel=1e-5)


# ---------------------------------------------------------------- wrong use: one clear error

class Unlooped(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class TwoCallSites(Unlooped):
    """Block 1 runs twice in every loop (from two places)."""

    def forward(self, x):
        for _ in range(2):
            x = self.blocks[1](self.blocks[0](self.blocks[0](x)))
        return x


def one_line(excinfo, kind, words):
    text = str(excinfo.value)
    assert isinstance(excinfo.value, kind) and isinstance(excinfo.value, ValueError)
    assert "\n" not in text and words in text, text


def test_wrong_use_is_one_clear_error(tmp_path):
    x = torch.randn(2, T, D)
    model = TwoCallSites()
    with pytest.raises(flt_diag.BlocksNotFound) as e:
        flt_diag.watch(model, blocks=[nn.Linear(D, D)], folder=tmp_path / "a")
    one_line(e, flt_diag.BlocksNotFound, "is not a submodule of TwoCallSites")
    with pytest.raises(flt_diag.BlocksNotFound) as e:
        flt_diag.watch(model, blocks="layers.*", folder=tmp_path / "b")
    one_line(e, flt_diag.BlocksNotFound, "no module of TwoCallSites matches")
    with pytest.raises(flt_diag.BlocksNotFound) as e:
        flt_diag.watch(model, blocks=[], folder=tmp_path / "c")
    one_line(e, flt_diag.BlocksNotFound, "empty")
    with pytest.raises(flt_diag.NotLooped) as e:  # (auto: after NOT_LOOPED_AFTER training forwards reusing nothing)
        with flt_diag.watch(unlooped := Unlooped(), folder=tmp_path / "e") as probe:
            for _ in range(NOT_LOOPED_AFTER):
                probe.step(loss=unlooped(x).mean())
    one_line(e, flt_diag.NotLooped, "no block of Unlooped was called more than once")
    assert not (tmp_path / "e").exists()  # (the held rows were never written)
    assert not unlooped._forward_hooks and not unlooped.blocks[0]._forward_pre_hooks  # the hooks are gone
    with pytest.raises(flt_diag.BlockCalledTwice) as e:
        with flt_diag.watch(model, folder=tmp_path / "f"):
            model(x)
    one_line(e, flt_diag.BlockCalledTwice, "blocks.0 ran 2 times while blocks.1 ran 0 times")
    with pytest.raises(flt_diag.BlockCalledTwice) as e:
        with flt_diag.watch(model, folder=tmp_path / "g", loop_boundary=model.blocks[1]):
            model(x)
    one_line(e, flt_diag.BlockCalledTwice, "blocks.0 was called twice in loop 1")


def test_import_flt_diag_stays_torch_free():
    import subprocess
    import sys
    code = "import sys, flt_diag; assert 'torch' not in sys.modules; flt_diag.watch; assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_a_non_finite_loss_stops_a_run_that_asked_for_it(tmp_path):
    """stop_on_collapse: the step whose loss is NaN is the warning's check (P 1, the evidence naming it), the run
    stops there, and the verdict stays the loss rules' own."""
    torch.manual_seed(0)
    model = UniversalTransformer(loops=2)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    stopped_at = None
    with flt_diag.watch(model, blocks=[model.layer], folder=tmp_path / "nan", optimizer=opt,
                        stop_on_collapse=True) as probe:
        for s, x in enumerate(batches(10)):
            loss = lm_loss(model(x), x)
            loss.backward()
            opt.step()
            probe.step(loss=loss * float("nan") if s >= 4 else loss)
            opt.zero_grad()
            if probe.should_stop:
                stopped_at = s
                break
    assert stopped_at == 4
    w = probe.warning()
    assert w.step == 5 and w.p_collapse == 1.0 and "not finite" in w.evidence
    assert probe.summary.verdict == "diverged" and "non-finite" in probe.summary.stop_reason


class Huginn(nn.Module):
    """A prelude of two blocks, a recurrent core of one block run r times on [h, e] (a concat adapter), a coda."""

    def __init__(self, r: int = 3):
        super().__init__()
        self.r, self.embed, self.head = r, nn.Embedding(V, D), nn.Linear(D, V)
        self.prelude = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.adapter = nn.Linear(2 * D, D)
        self.core = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh())])
        self.coda = nn.Linear(D, D)

    def forward(self, x):
        e = self.embed(x)
        for b in self.prelude:
            e = b(e)
        h = torch.zeros_like(e)
        for _ in range(self.r):
            h = self.core[0](self.adapter(torch.cat([h, e], -1)))
        return self.head(self.coda(h))


def test_auto_finds_the_blocks_the_forward_reuses(tmp_path):
    """blocks="auto" picks the modules called more than once (not the larger prelude), the layers of a repeated
    layer list once each, and a lone looped layer without any ModuleList; the training forward is unchanged."""
    torch.manual_seed(0)
    model = Huginn(r=3)
    probe, _ = train_plain(model, tmp_path / "h", steps=2)
    assert probe.names == ["adapter", "core.0"]  # (the core block with the adapter that feeds it)
    assert load_config(tmp_path / "h").model.loops == 3
    torch.manual_seed(0)
    ut = UniversalTransformer(loops=3, sample_loops=True)
    probe, _ = train_plain(ut, tmp_path / "u", steps=3)
    assert probe.names == ["layer"]
    df = load_metrics(tmp_path / "u")
    assert list(df[df.metric == M.LOOPS_RUN].value) == ut.sampled[1:]  # (the search's forward drew the same r)
    assert ut.sampled[0] == ut.sampled[1]

    class Repeated(nn.Module):
        def __init__(self):
            super().__init__()
            layers = [nn.Linear(D, D), nn.Linear(D, D)]
            self.layers = nn.ModuleList(layers * 3)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x
    model = Repeated()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with flt_diag.watch(model, folder=tmp_path / "r", optimizer=opt) as probe:
        for _ in range(2):
            model(torch.randn(2, T, D)).square().mean().backward()
            opt.step()
            probe.step(loss=1.0)
            opt.zero_grad()
    assert probe.names == ["layers.0", "layers.1"] and load_config(tmp_path / "r").model.loops == 3
