import math

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import tiny_config
from equations import forward as eq_forward, randomize
from flt_diag.records import attention as ATTENTION
from flt_diag.storage import metric_names as M
from flt_diag.judge import verdict as X
from flt_diag.judge.verdict import Recipe
from flt_diag.config.run_config import DiagnosticsConfig, VerdictConfig
from flt_diag.instruments.diagnostics import DiagnosticsCallback, should_record
from flt_diag.instruments.loop_hooks import LoopHooks
from flt_diag.instruments.gradient_pairs import consecutive_stats, pair_sums
from flt_diag.model.transformer import LoopedTransformer, ModelConfig, parameter_groups
from flt_diag.storage.folders import load_metrics, load_summary, series
from flt_diag.instruments.records import StepLog
from flt_diag.training.trainer import Callback, Trainer, train
from numerics import RTOL64, U32, float64_model, fp32_positive_sum_rtol


def make(variant="flt", K=3):
    torch.manual_seed(0)
    return randomize(LoopedTransformer(ModelConfig(vocab_size=40, depth=2, width=32, heads=2,
                                                   variant=variant, loops=K)))


class Recorder:
    def __init__(self):
        self.rows = []

    def __call__(self, metric, value, loop, layer):
        self.rows.append((metric, loop, layer, float(value)))

    def get(self, metric):
        return {(lp, ly): v for m, lp, ly, v in self.rows if m == metric}


IDX = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))


def started_callback(model):
    """A DiagnosticsCallback started on `model` with a stand-in trainer (no training loop): the test
    sets gradients and weights by hand and calls the callback's moments itself."""
    log = StepLog()
    trainer = type("T", (), {"model": model, "log": log, "recipe": Recipe.of(tiny_config()), "is_main": True,
                              "run_dir": None})()
    cb = DiagnosticsCallback(DiagnosticsConfig(), parameter_groups(model))
    cb.on_start(trainer)
    return cb, trainer, log


@pytest.mark.parametrize("variant", ["lt", "lt-ii", "fla", "flt"])
def test_residual_norms_equal_independent_forward(variant):
    model, rec = float64_model(make(variant, 3)), Recorder()  # hooks and equations both in float64
    with LoopHooks(model, rec) as hooks:
        hooks.arm()
        model(IDX)
    streams = []
    eq_forward(model, IDX, variant, 3, record=streams)
    expected = {(t, i or M.NONE): x.norm(dim=-1).mean().item() for t, i, x in streams}
    got = {**rec.get(M.RESID_NORM), **rec.get(M.RESID_NORM_LOOP_END)}
    assert set(got) == set(expected)  # K*L block records + K loop ends: every loop kept, none overwritten
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=RTOL64)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_gradients_equal_autograd(checkpointing):
    model, rec = float64_model(make("flt", 3)), Recorder()  # hooks and autograd.grad both in float64
    model.checkpoint_loops = checkpointing
    outs = []
    grab = [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.blocks]
    with LoopHooks(model, rec) as hooks:
        hooks.arm()
        _, loss = model(IDX, IDX)
        for h in grab:
            h.remove()
        expected = torch.autograd.grad(loss, outs, retain_graph=True)  # order: loop-major, layer-minor
        loss.backward()
    got = rec.get(M.ACT_GRAD_NORM)
    assert len(got) == 3 * 2 and len(rec.get(M.RESID_NORM)) == 3 * 2  # recomputation is not counted
    for n, g in enumerate(expected):
        loop, layer = n // 2 + 1, n % 2 + 1
        assert g.dtype == torch.float64 and got[(loop, layer)] == pytest.approx(g.norm().item(), rel=RTOL64)


def test_checkpointing_gives_same_records():
    """Bit for bit, in fp32: non-reentrant checkpointing runs the same graph (saved tensors are
    recomputed by the same ops), and the hooks do not record the recomputation."""
    recs = []
    for ckpt in (False, True):
        model, rec = make("lt", 4), Recorder()
        model.checkpoint_loops = ckpt
        with LoopHooks(model, rec) as hooks:
            hooks.arm()
            model(IDX, IDX)[1].backward()
        recs.append(sorted(rec.rows))
    assert [r[:3] for r in recs[0]] == [r[:3] for r in recs[1]]
    assert [r[3] for r in recs[0]] == [r[3] for r in recs[1]]


def test_only_armed_forwards_record_and_hooks_are_removed():
    model, rec = make(), Recorder()
    with LoopHooks(model, rec, block_records=[ATTENTION.RECORD]) as hooks:
        model(IDX)  # not armed
        assert rec.rows == []
        hooks.arm()
        model(IDX)
        n = len(rec.rows)
        model(IDX)  # armed for one forward only
        assert len(rec.rows) == n
    model(IDX)
    assert len(rec.rows) == n
    modules = [model, model.loop_end, *model.blocks, *(b.attn for b in model.blocks),
               *(b.after_attn for b in model.blocks)]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)


def test_attention_statistics_against_manual_softmax():
    model, rec = float64_model(make("flt", 2)), Recorder()
    with LoopHooks(model, rec, block_records=[ATTENTION.RECORD]) as hooks:
        hooks.arm()
        model(IDX)
    ent, mx = rec.get(ATTENTION.ENTROPY), rec.get(ATTENTION.MAX_LOGIT)
    assert set(ent) == set(mx) == {(t, i) for t in (1, 2) for i in (1, 2)}
    # loop 1, block 1: queries and keys both from norm(E), here in float64
    from equations import rms, rotary
    B, T, H, D = 2, 10, 2, 16
    e = rms(model.embed.weight[IDX])
    W = model.blocks[0].attn
    q = rms(rotary((e @ W.q.weight.T).view(B, T, H, D)))
    k = rms(rotary((e @ W.k.weight.T).view(B, T, H, D)))
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    s = s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
    p = s.softmax(-1)
    assert s.dtype == torch.float64
    # The hook computes its statistics in fp32 from q and k cast to fp32 (|q| = |k| = sqrt(D) after
    # the QK-norm). A score q.k / sqrt(D) is then within (D + 3) U32 sqrt(D) of the exact one: two
    # casts, a D-term dot product of |q||k| = D, the division.
    score_atol = (D + 3) * U32 * math.sqrt(D)
    # A row's entropy moves by <= 2 log(T) times its largest score error (dH/ds_j = -p_j (log p_j + H));
    # evaluating it in fp32 adds (H + 1)(2 sqrt(D) + T + 3) U32 for the softmax (exp of arguments
    # up to 2 sqrt(D), a T-term sum, a division) and H (T + B H T) U32 for the sums and the mean.
    H_max = math.log(T)
    ent_atol = 2 * math.log(T) * score_atol + ((H_max + 1) * (2 * math.sqrt(D) + T + 3) + H_max * (T + B * H * T)) * U32
    assert mx[(1, 1)] == pytest.approx(s.max().item(), rel=0, abs=score_atol)
    assert ent[(1, 1)] == pytest.approx((-(p * p.clamp_min(1e-30).log()).sum(-1)).mean().item(), rel=0, abs=ent_atol)
    # loop 2, block 1 of FLT: queries from norm(h(1)), keys from norm(E) (attention injection)
    from equations import forward
    stream = []
    forward(model, IDX, "flt", 2, record=stream)
    h1 = rms([x for t, layer, x in stream if t == 1 and layer is None][0])
    q2 = rms(rotary((rms(h1) @ W.q.weight.T).view(B, T, H, D)))
    s2 = torch.einsum("bthd,bshd->bhts", q2, k) / math.sqrt(D)
    s2 = s2.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
    assert mx[(2, 1)] == pytest.approx(s2.max().item(), rel=0, abs=score_atol)
    assert abs(s2.max().item() - s.max().item()) > 10 * score_atol  # the query source matters here


def test_cosine_and_sign_flips_on_hand_made_gradients():
    g, prev = torch.tensor([1.0, -1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, 1.0, -2.0])
    cos, flip = consecutive_stats(pair_sums(g, prev, None, torch.empty(4)))
    assert cos.item() == pytest.approx(-4 / math.sqrt(6 * 7))
    assert flip.item() == pytest.approx(2 / 4)  # coordinates 2 and 4; a zero is not a flip


@pytest.mark.parametrize("scale", [1e-12, 1e-3, 1e12])
def test_cosine_of_tiny_and_huge_gradients_stays_a_cosine(scale):
    """Squared norms of ~1e-20 multiply to ~1e-40 (a float32 underflow) and of ~1e24 to an overflow: the cosine
    is still the float64 one (before, a tiny gradient compared with itself gave ~1e6)."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(64, generator=gen) * scale
    prev = (0.6 * g + 0.8 * torch.randn(64, generator=gen) * scale)
    for other, expected in ((g, 1.0), (prev, (g.double() @ prev.double() / (g.double().norm() * prev.double().norm())).item())):
        cos, _ = consecutive_stats(pair_sums(g, other, None, torch.empty(64)))
        assert cos.item() == pytest.approx(expected, abs=1e-5)
    cos, _ = consecutive_stats(pair_sums(g, torch.zeros(64), None, torch.empty(64)))
    assert cos.item() == 0.0  # a zero gradient: no direction to compare
    cos, _ = consecutive_stats(pair_sums(torch.full((64,), math.nan), g, None, torch.empty(64)))
    assert math.isnan(cos.item())  # a diverged step says so (not a cosine of 0)


def test_callback_global_and_group_cosines():
    """Two steps of hand-set gradients through the callback; global figures over all groups.

    The callback works in fp32. The gradients are small integers, so every product and every sum
    it forms (< 2^24) is exact in fp32 in any summation order; what remains are a handful of
    correctly rounded operations (two square roots, their product, the division: <= 2 U32), so
    it must match the float64 figures to 4 U32 on any machine."""
    model = make("lt", 1)
    params = list(model.parameters())
    cb, trainer, log = started_callback(model)
    gen = torch.Generator().manual_seed(0)
    steps = [[torch.randint(-3, 4, p.shape, generator=gen).float() for p in params] for _ in range(2)]
    assert sum(p.numel() for p in params) * 3 * 3 < 2 ** 24  # exact sums of squares and products
    for step, grads in enumerate(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        cb.before_step(trainer, step)
        cb.after_backward(trainer, step)
        cb.after_step(trainer, step)
    cb.on_end(trainer)
    rows = {(m, ly): v for _, m, lp, ly, v in log.collect(1)}
    a = torch.cat([g.flatten() for g in steps[0]]).double()
    b = torch.cat([g.flatten() for g in steps[1]]).double()
    rtol = 4 * U32
    assert ((a * b) == 0).any()  # zeros, which do not count as flips
    assert rows[(M.GRAD_COSINE, M.NONE)] == pytest.approx(torch.nn.functional.cosine_similarity(a, b, 0).item(), rel=rtol)
    assert rows[(M.SIGN_FLIP, M.NONE)] == pytest.approx(((a * b) < 0).double().mean().item(), rel=rtol)
    head_a, head_b = steps[0][-1].flatten().double(), steps[1][-1].flatten().double()  # head is the last parameter
    assert rows[("grad_cosine/head", M.NONE)] == pytest.approx(
        torch.nn.functional.cosine_similarity(head_a, head_b, 0).item(), rel=rtol)
    assert rows[("grad_norm/attn", 1)] == pytest.approx(
        torch.cat([g.flatten() for g in steps[1][1:5]]).double().norm().item(), rel=rtol)


def test_callback_update_ratios_and_clipped_norms_per_group():
    """The per-group update ratio ||W_after - W_before|| / ||W_before|| and the post-clipping gradient
    norm, against float64 figures of hand-set weights, updates and gradients (small integers and
    halves: exact in fp32; what remains are a few rounded operations: <= 8 U32)."""
    model = make("flt", 2)
    cb, trainer, log = started_callback(model)
    gen = torch.Generator().manual_seed(1)
    groups = parameter_groups(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-4, 5, p.shape, generator=gen).float())
            p.grad = torch.randint(-3, 4, p.shape, generator=gen).float()
    before = {name: torch.cat([p.detach().flatten() for p in ps]).double() for name, ps in groups.items()}
    grads = {name: torch.cat([p.grad.flatten() for p in ps]).double() for name, ps in groups.items()}
    cb.before_step(trainer, 0)
    cb.after_backward(trainer, 0)
    cb.after_clip(trainer, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randint(-2, 3, p.shape, generator=gen).float() / 2)
    cb.after_step(trainer, 0)
    cb.on_end(trainer)
    rows = {(m, ly): v for _, m, lp, ly, v in log.collect(0)}
    for name, ps in groups.items():
        after = torch.cat([p.detach().flatten() for p in ps]).double()
        ratio_key = M.group_key(M.UPDATE_RATIO, name)
        assert rows[ratio_key] == pytest.approx(((after - before[name]).norm() / before[name].norm()).item(), rel=8 * U32)
        norm = math.sqrt(sum(float(x) ** 2 for x in before[name]))  # the weights the step's gradient was taken at
        assert rows[M.group_key(M.PARAM_NORM, name)] == pytest.approx(norm, rel=8 * U32)
        assert rows[M.group_key(M.GRAD_NORM_CLIPPED, name)] == pytest.approx(grads[name].norm().item(), rel=8 * U32)
        assert rows[M.group_key(M.GRAD_NORM, name)] == pytest.approx(grads[name].norm().item(), rel=8 * U32)


def test_a_saved_state_outlives_the_steps_after_it_and_resumes_the_cosine():
    """state_dict() copies the previous gradient out of the buffers the next steps overwrite (two buffers swap:
    step 2 writes where step 0's gradient was), and a callback loaded from it takes the next step's cosine
    against that gradient (torch's cosine_similarity of the two flat gradients)."""
    model = make("lt", 1)
    params = list(model.parameters())
    cb, trainer, _ = started_callback(model)
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(3)]
    for step, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        cb.before_step(trainer, step)
        cb.after_backward(trainer, step)
        cb.after_step(trainer, step)
        if step == 0:
            saved = cb.state_dict()
    cb.on_end(trainer)
    groups = parameter_groups(model)
    index = {id(p): i for i, p in enumerate(params)}
    for name, ps in groups.items():
        assert torch.equal(saved["prev"][name], torch.cat([grads[0][index[id(p)]].flatten() for p in ps]))
    fresh, trainer, log = started_callback(model)
    fresh.load_state_dict(saved)
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    fresh.before_step(trainer, 1)
    fresh.after_backward(trainer, 1)
    fresh.on_end(trainer)
    rows = {(m, ly): v for _, m, lp, ly, v in log.collect(1)}
    flat = lambda gs: torch.cat([gs[index[id(p)]].flatten() for ps in groups.values() for p in ps]).double()
    assert rows[(M.GRAD_COSINE, M.NONE)] == pytest.approx(
        torch.nn.functional.cosine_similarity(flat(grads[0]), flat(grads[1]), 0).item(), rel=1e-5)


def test_recording_schedule():
    cfg = DiagnosticsConfig(dense_steps=5, record_every=3)
    assert [s for s in range(15) if should_record(s, cfg)] == [0, 1, 2, 3, 4, 5, 8, 11, 14]
    assert not should_record(0, DiagnosticsConfig(diagnostics=False))


# ---------------------------------------------------------------- derived metrics

def test_oscillation_indices_known_answers():
    alt = [1.0, 2.0] * 10
    assert X.coefficient_of_variation(alt) == pytest.approx(0.5 / 1.5)
    assert X.mean_abs_dlog(alt) == pytest.approx(math.log(2))
    assert X.sign_alternation(alt) == 1.0
    mono = np.linspace(1, 2, 20)
    assert X.sign_alternation(mono) == 0.0
    assert X.mean_abs_dlog(np.exp(np.arange(5) * 0.3)) == pytest.approx(0.3)
    assert X.coefficient_of_variation([3.0] * 5) == 0.0
    assert X.neg_cosine_share([-1, 0.5, -0.2, 0.9]) == 0.5


def test_windowed_oscillation():
    g = pd.Series([1.0, 2.0] * 50 + list(np.linspace(1, 2, 100)), index=range(200))
    w = X.windowed_oscillation(g, None, 100)
    assert list(w.start) == [0, 100]
    assert w.sign_alternation.tolist() == [1.0, 0.0]


def curve(values):
    return pd.Series(values, index=range(len(values)), dtype=float)


def test_verdicts_on_synthetic_curves():
    steps = np.arange(800)
    smooth = curve(5.5 * np.exp(-steps / 100) + 1.5)
    rebound = curve(np.where(steps < 400, 5.5 - steps * 0.007, 2.7 + (steps - 400) * 0.0015))
    flat = curve(np.full(800, 5.4) + 0.01 * np.sin(steps))
    nan = curve(list(smooth.iloc[:300]) + [float("nan")] * 10)
    assert X.verdict(smooth, 3.2)[0] == "stable"
    v, ev = X.verdict(rebound, 3.2)
    trailing = np.convolve(rebound.to_numpy(), np.ones(50) / 50, mode="valid")  # 50-step trailing means
    assert v == "collapsed" and ev["rebound"] == pytest.approx(trailing[-1] - trailing.min())
    v, ev = X.verdict(flat, 3.2)  # verdict v3: a plateau above the unigram entropy is stalled (v2: collapsed)
    assert v == "stalled" and "unigram" in ev["reason"]
    v, ev = X.verdict(nan, 3.2)
    assert v == "diverged" and ev["nonfinite_step"] == 300
    # thresholds are options
    # (not collapsed with these; it ends at 3.3, above 3.2 - 0.16: verdict v3 calls it stalled, v2 stable)
    assert X.verdict(rebound, 3.2, VerdictConfig(rebound_abs=1.0, rebound_rel=0.5))[0] == "stalled"


def test_a_loss_spike_that_recovers_is_unstable_and_says_how_far_it_climbed_and_recovered():
    steps = np.arange(800)
    dip = np.where(steps < 200, 5.5 - steps * 0.015, 2.5)  # falls to 2.5 by step 200, then flat
    bump = 0.6 * np.exp(-((steps - 400) / 60.0) ** 2)  # a 0.6-nat spike centred on step 400
    v, ev = X.verdict(curve(dip + bump), 3.2)
    s = pd.Series(dip + bump).rolling(50).mean().dropna()  # the 50-step trailing mean, by hand
    assert v == "unstable" and ev["transient_rebound"] and "spike" in ev["reason"]
    assert ev["climb"] == pytest.approx((s - s.cummin()).max())
    assert ev["climb_step"] == int((s - s.cummin()).idxmax()) and 400 < ev["climb_step"] < 440
    assert ev["recovered"] == pytest.approx(s.loc[ev["climb_step"]] - s.iloc[-1]) and 200 <= ev["climb_start_step"] < 400
    # one that only partly recovers has collapsed
    partial = dip + np.where(steps < 400, bump, 0.6 - (steps - 400) * 0.001)  # ends 0.2 above its best
    v, ev = X.verdict(curve(partial), 3.2)
    assert v == "collapsed" and ev["rebound"] == pytest.approx(0.2, abs=0.03) and ev["climb"] > 0.55


def test_a_plateau_above_the_unigram_entropy_stalled_and_a_clean_descent_is_stable():
    steps = np.arange(800)
    plateau = np.where(steps < 100, 5.5 - steps * 0.02, 3.5) + 0.01 * np.sin(steps)  # stuck at 3.5 > 3.2
    assert X.verdict(curve(plateau), 3.2)[0] == "stalled"  # verdict v3 (v2 called it collapsed)
    noisy_descent = 5.5 * np.exp(-steps / 100) + 1.5 + 0.05 * np.sin(steps * 1.7)  # wiggles < the threshold
    v, ev = X.verdict(curve(noisy_descent), 3.2)
    assert v == "stable" and not ev["transient_rebound"] and ev["reason"] == "loss fell and stayed down"


# ---------------------------------------------------------------- end to end

class PoisonAt(Callback):
    def __init__(self, step):
        self.step = step

    def after_step(self, trainer, step):
        if step == self.step:
            with torch.no_grad():
                trainer.model.head.weight.fill_(float("nan"))


def test_nan_run_is_diverged_without_crashing(tmp_path):
    cfg = tiny_config(variant="lt", loops=2, steps=20)
    summary = Trainer(cfg, tmp_path / "r", callbacks=[PoisonAt(4)]).fit()
    assert summary.verdict == "diverged" and summary.evidence.nonfinite_step == 5
    assert summary.steps_done == 6 and load_summary(tmp_path / "r").verdict == "diverged"


def test_run_folder_contents(tmp_path):
    cfg = tiny_config(variant="flt", loops=2, steps=6, diagnostics=dict(flush_every=2, attention_stats=True))
    summary = train(cfg, tmp_path / "r")
    df = load_metrics(tmp_path / "r")
    assert list(df.columns) == ["step", "metric", "loop", "layer", "value"]
    assert len(list((tmp_path / "r" / "metrics").glob("part-*.parquet"))) >= 3  # appended while training
    step3 = df[df.step == 3]
    assert len(step3[step3.metric == M.RESID_NORM]) == 2 * 2
    assert len(step3[step3.metric == M.ACT_GRAD_NORM]) == 2 * 2
    assert len(step3[step3.metric == ATTENTION.ENTROPY]) == 2 * 2
    for m in (M.LOSS, M.LR, M.GRAD_NORM, M.GRAD_COSINE, M.SIGN_FLIP, "update_ratio/attn", "grad_norm/head"):
        assert m in set(df.metric), m
    assert not df[(df.step == 0) & (df.metric == M.GRAD_COSINE)].size  # no previous step at step 0
    # the global grad norm is the root of the summed squared group norms. Both are fp32 norms of the
    # same gradients, grouped differently (per parameter, per group): a norm of n entries is within
    # half the relative error of an n-term positive fp32 sum, n at most the largest group's size.
    g = df[(df.step == 3) & df.metric.str.startswith("grad_norm/")].value
    largest = max(sum(p.numel() for p in ps) for ps in parameter_groups(LoopedTransformer(cfg.model)).values())
    rtol = 2 * 0.5 * fp32_positive_sum_rtol(largest)  # two norms, each within half a sum's error
    assert series(df, M.GRAD_NORM)[3] == pytest.approx(math.sqrt((g ** 2).sum()), rel=rtol)
    cfg_json = __import__("json").loads((tmp_path / "r" / "config.json").read_text())
    assert cfg_json["env"]["torch"] == torch.__version__ and cfg_json["train"]["seed"] == 0
    # 6 steps < smooth_window: the smoothed loss is one mean of every step's loss; the run is judged
    # against the unigram entropy its config.json records (what a 6-step run's verdict is: below)
    assert summary.final_loss == pytest.approx(series(df, M.LOSS).mean(), rel=1e-12)
    assert summary.evidence.unigram_entropy == cfg_json["corpus"]["unigram_entropy"] > 0
    assert load_summary(tmp_path / "r").verdict == summary.verdict


def _clean_run(steps: int, last_loss: float) -> pd.DataFrame:
    """A metrics table of a clean descent to `last_loss` (training loss), with a steady gradient
    norm (1 +- 2 %) whose cosine with the previous step's stays positive, residual norms flat."""
    t = np.arange(steps)
    loss = last_loss + 3.0 * np.exp(-t / 40) - 3.0 * math.exp(-(steps - 1) / 40)
    rows = [(s, M.LOSS, M.NONE, M.NONE, v) for s, v in zip(t, loss)]
    rows += [(s, M.GRAD_NORM, M.NONE, M.NONE, 1 + 0.02 * math.sin(s)) for s in t]
    rows += [(s, M.GRAD_COSINE, M.NONE, M.NONE, 0.5) for s in t[1:]]
    rows += [(s, M.RESID_NORM_LOOP_END, k, M.NONE, 5.0) for s in t for k in (1, 2)]
    return pd.DataFrame(rows, columns=["step", "metric", "loop", "layer", "value"])


def test_the_summary_of_a_constructed_clean_descent_is_stable_and_of_a_nan_loss_diverged():
    """The whole verdict (loss rules, gradient-oscillation test) on runs made by hand: a descent that
    ends 1.5 nats below the unigram entropy with no climb and a steady gradient norm is stable; the
    same run with a NaN loss at step 250 is diverged there."""
    cfg = tiny_config(variant="flt", loops=2, steps=400)
    df = _clean_run(400, last_loss=1.5)
    summary = X.summarize(df, cfg, unigram_entropy=3.0)
    assert summary.verdict == "stable", summary.evidence
    poisoned = df.copy()
    poisoned.loc[(poisoned.metric == M.LOSS) & (poisoned.step == 250), "value"] = float("nan")
    summary = X.summarize(poisoned, cfg, unigram_entropy=3.0)
    assert summary.verdict == "diverged" and summary.evidence.nonfinite_step == 250


@pytest.mark.slow
@pytest.mark.parametrize("variant,expected", [("lt", "collapsed"), ("flt", "stable")])
def test_tiny_preset_contrast(tmp_path, variant, expected):
    """The headline phenomenon (minutes): 12-loop LT collapses on tiny, FLT does not.

    Seed 1, 2,000 steps (the default run length): 12-loop LT fails in 8 of 8 seeds there (docs/results.md).
    At 800 steps seed 1 was borderline on one CPU: on an AVX-512 Xeon its LT climbed 0.27 nats (threshold
    0.25) and recovered, residual peak 605 < 800, where an AVX2 EPYC saw a collapse; at 2,000 steps both
    machines see it collapse with every margin below holding by 2x or more."""
    cfg = tiny_config(variant=variant, loops=12, steps=2000, eval_every=0, seed=1)
    s = train(cfg, tmp_path / variant)
    assert s.verdict == expected
    assert s.residual_explosion == (variant == "lt")
    # Long fp32 runs amplify rounding differences between CPUs, so a verdict that only scraped past
    # a threshold could flip on another machine: require each criterion it rests on to hold by a
    # factor of 2 (by 0.5 nats below the unigram entropy). Measured on an AVX-512 Xeon (seed 1, 2,000
    # steps, `flt-diag run-ablation --variants lt flt --loops 12 --seeds 1`): lt climb 0.94 vs 0.25,
    # rebound 0.65 vs 0.12, peak residual 14,184 vs 800; flt climb 0.07, best smoothed loss 1.37 vs
    # unigram entropy 3.25, peak residual 477, gradient-norm CV 0.31 vs 3 ("unstable").
    ev, peak, limit = s.evidence, s.peak_resid_norm, s.explosion_threshold
    if variant == "lt":
        assert ev.climb > 2 * ev.rebound_threshold and ev.rebound > 2 * ev.recovery_tolerance, ev
        assert peak > 2 * limit, (peak, limit)
    else:
        assert ev.climb < ev.rebound_threshold / 2, ev
        assert ev.min_smoothed_loss < ev.unigram_entropy - 0.5, ev
        assert s.osc_dlog_median < cfg.verdict.osc_dlog_threshold / 2, s.osc_dlog_median
        # FLT's stream grows to 369-496 over 2,000 steps at K=12 (8 seeds, and 416-437 at K=3..12, seed 0):
        # bounded, but not within 2x of the 800 threshold; 1.5x keeps the margin such a run has on any CPU
        assert peak < limit / 1.5, (peak, limit)


def test_callback_with_a_parameter_without_gradient():
    """A frozen or unused parameter (grad None): its group is left out, every other group is recorded."""
    model = make("flt", 2)
    cb, trainer, log = started_callback(model)
    gen = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.grad = torch.randint(-3, 4, p.shape, generator=gen).float()
    model.head.weight.grad = None
    cb.before_step(trainer, 0)
    cb.after_backward(trainer, 0)
    cb.after_clip(trainer, 0)
    cb.after_step(trainer, 0)
    cb.on_end(trainer)
    rows = {(m, ly): v for _, m, lp, ly, v in log.collect(0)}
    assert ("grad_norm/head", M.NONE) not in rows and ("grad_norm_clipped/head", M.NONE) not in rows
    mlp = torch.cat([p.grad.flatten() for p in model.blocks[1].mlp.parameters()]).double().norm().item()
    assert rows[("grad_norm_clipped/mlp", 2)] == pytest.approx(mlp, rel=8 * U32)
    assert rows[("grad_norm/mlp", 2)] == pytest.approx(mlp, rel=8 * U32)
    assert rows[("update_ratio/head", M.NONE)] == 0.0  # the weights did not move


def test_the_step_log_gives_every_value_in_the_order_added_through_float32():
    """Numbers, 0-d tensors of several dtypes, one-element and longer vectors, interleaved: each row is the value
    added at that place, rounded to float32 (written out with numpy, not the log's own cast)."""
    log = StepLog()
    added = [("a", torch.tensor(0.1, dtype=torch.float64)), ("b", 0.1), ("c", torch.tensor(3)), ("d", 1e40),
             ("e", torch.tensor(2.5, requires_grad=True) * 2), ("f", torch.tensor([7.25])), ("h", torch.tensor(-1e-3)),
             ("g", True), ("j", torch.tensor(1.5, dtype=torch.float16)), ("i", torch.tensor(70000)),
             ("k", torch.tensor([70001])), ("l", torch.tensor([0.5], dtype=torch.float16))]  # (no int to float16)
    expected = []
    for i, (name, value) in enumerate(added):
        log.add(name, value, loop=i, layer=-1)
        plain = value.item() if torch.is_tensor(value) else float(value)
        with np.errstate(over="ignore"):
            expected.append((5, name, i, -1, float(np.float32(plain))))
        if i == 3:
            log.add_vector([("v", 0, 1), ("v", 0, 2)], torch.tensor([1 / 3, 2 / 3], dtype=torch.float64))
            expected += [(5, "v", 0, 1, float(np.float32(1 / 3))), (5, "v", 0, 2, float(np.float32(2 / 3)))]
    assert [tuple(r) for r in log.collect(5)] == expected
    assert log.collect(6) == []  # (emptied by collect)
    log.add("a", 1.0)
    with pytest.raises(RuntimeError):
        log.add("x", torch.ones(2))  # (one scalar a name)
    log.add("c", torch.tensor(3.0))
    assert [(r.metric, r.value) for r in log.collect(7)] == [("a", 1.0), ("c", 3.0)]  # (the refused one left no key)


def test_token_norm_means_in_runs_of_one_shape_against_numpy():
    """token_norm_means: each tensor's mean per-token norm, whatever the runs of shapes (the resid_norm records
    of a forward are taken together at its end)."""
    from flt_diag.instruments.loop_hooks import per_token_norms, token_norm_means
    gen = torch.Generator().manual_seed(3)
    streams = [torch.randn(s, generator=gen) * (i + 1) for i, s in
               enumerate([(2, 3, 4), (2, 3, 4), (1, 3, 4), (2, 3, 4), (2, 5, 4), (2, 5, 4), (2, 5, 4), (4,), (4,)])]
    streams[3:5] = [streams[3].double(), streams[4].double()]  # (a run of another dtype: kept apart, its dtype kept)
    means = token_norm_means([per_token_norms(x) for x in streams])
    assert len(means) == len(streams) and all(m.dim() == 0 for m in means)
    assert [m.dtype for m in means] == [x.dtype for x in streams]
    for x, m in zip(streams, means):
        want = np.linalg.norm(x.double().numpy(), axis=-1).mean()
        assert float(m) == pytest.approx(want, rel=1e-6)
    assert token_norm_means([]) == []
