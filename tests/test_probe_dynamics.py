"""The loop dynamics through flt_diag.watch on a looped model flt-diag did not write
(flt_diag.instruments.dynamics_callback): each record against an independent computation from the loop-end
streams a separate forward hook captures, and the training trajectory unchanged by them."""
import json
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flt_diag
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics
from flt_diag.config.run_config import DiagnosticsConfig

V, D, T, B = 8, 6, 3, 2


class Cell(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.lin, self.drop = nn.Linear(D, D), nn.Dropout(dropout)

    def forward(self, h):
        return torch.tanh(self.lin(self.drop(h))) + 0.5 * h


class PlainLoop(nn.Module):
    """One nn.Linear + tanh looped K times; `end` (an nn.Identity) ends each loop, and with `manual` set the
    forward calls it with each loop's end (probe.end_loop)."""

    def __init__(self, loops: int = 4, dropout: float = 0.0):
        super().__init__()
        self.loops = loops
        self.embed = nn.Embedding(V, D)
        self.cell = Cell(dropout)
        self.end = nn.Identity()
        self.head = nn.Linear(D, V)
        self.manual = None

    def step(self, h):  # the loop map h(t-1) -> h(t)
        return self.cell(h)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(self.loops):
            h = self.end(self.step(h))
            if self.manual is not None:
                self.manual(h)
        return self.head(h)


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (B, T), generator=g) for _ in range(n)]


def run(folder, model, steps=3, probe_targets=False, capture=None, boundary="module", **options):
    """The plain loop; returns (losses, loop-end streams of each step's training forward)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    streams: list[list[torch.Tensor]] = []
    handle = model.end.register_forward_hook(
        lambda m, a, out: streams[-1].append(out.detach().clone()) if torch.is_grad_enabled() else None)
    losses = []
    cfg = DiagnosticsConfig(exit_loss_every=1, dynamics_every=1, dynamics_batch=1, krylov_dim=B * T * D,
                            dynamics_iters=60)
    loop_boundary = model.end if boundary == "module" else boundary
    probe = flt_diag.watch(model, blocks=[model.cell], folder=folder, loop_boundary=loop_boundary, diagnostics=cfg,
                           **options) if folder is not None else None
    if boundary == "manual":
        model.manual = probe.end_loop
    try:
        for x in data(steps):
            streams.append([])
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            if probe is not None:
                if capture is not None:
                    capture.append([p.grad.clone() for p in model.parameters()])
                probe.after_backward()
                if capture is not None:
                    capture.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            if probe is not None:
                probe.step(loss=loss, targets=x if probe_targets else None)
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        handle.remove()
        if probe is not None:
            probe.close()
    return losses, streams


def value(df, step, metric, loop):
    sel = df[(df.step == step) & (df.metric == metric) & (df.loop == loop) & (df.layer == M.NONE)]
    assert len(sel) == 1, (metric, loop, len(sel))
    return float(sel.value.iloc[0])


@pytest.mark.parametrize("boundary, keep, batch", [("module", None, None), ("manual", None, None), (None, None, None),
                                                   ("module", 0, None), ("module", None, 2 * T * D)])
def test_fixed_point_residual_and_stream_similarity_from_the_captured_streams(tmp_path, boundary, keep, batch,
                                                                              monkeypatch):
    """keep 0: each loop's similarity at its loop end; batch 2 T D: the loops' kept streams two at a time."""
    from flt_diag.records import token_similarity
    if keep is not None:
        monkeypatch.setattr(token_similarity, "KEEP", keep)
    if batch is not None:
        monkeypatch.setattr(token_similarity, "BATCH", batch)
    torch.manual_seed(0)
    model = PlainLoop()
    _, streams = run(tmp_path / "r", model, boundary=boundary)
    df = load_metrics(tmp_path / "r")
    assert not (df.metric == M.FIXED_POINT_RESIDUAL)[df.loop == 1].any()
    for s, hs in enumerate(streams):
        hs = [h.numpy().astype(np.float64) for h in hs]
        for t in range(1, len(hs)):
            ratio = (np.linalg.norm(hs[t] - hs[t - 1], axis=-1) / np.linalg.norm(hs[t - 1], axis=-1)).mean()
            assert value(df, s, M.FIXED_POINT_RESIDUAL, t + 1) == pytest.approx(ratio, rel=1e-5)
        for t, h in enumerate(hs):
            h = h[:1]  # the first dynamics_batch (1) sequences of the B = 2
            u = h / np.linalg.norm(h, axis=-1, keepdims=True)
            cos = [u[b, i] @ u[b, j] for b in range(len(h)) for i in range(T) for j in range(T) if i != j]
            assert value(df, s, M.TOKEN_COSINE, t + 1) == pytest.approx(np.mean(cos), rel=1e-5, abs=1e-6)
            ranks = []
            for b in range(len(h)):
                sv = np.linalg.svd(h[b], compute_uv=False)
                p = sv / sv.sum()
                ranks.append(np.exp(-(p * np.log(p)).sum()))
            assert value(df, s, M.EFFECTIVE_RANK, t + 1) == pytest.approx(np.mean(ranks), rel=1e-5)
    assert not (df.metric == M.EXIT_LOSS).any() and not (df.metric == M.LOOP_GAIN).any()  # no head=, no loop_step=


class ShrinkingLoop(PlainLoop):
    """PlainLoop whose third loop drops the last position: the stream changes shape between loops 2 and 3."""

    def forward(self, x):
        h = self.embed(x)
        for k in range(self.loops):
            h = self.step(h)
            h = self.end(h[:, :-1] if k == 2 else h)
        return self.head(h)


def test_fixed_point_residual_where_the_stream_changes_shape_between_loops(tmp_path, capsys):
    """No residual across the change (said once); the loops before and after it, of two shapes, each against the
    captured streams; the loop-end norms of both shapes too (their means taken in runs of one shape)."""
    torch.manual_seed(0)
    model = ShrinkingLoop(loops=5)
    streams = []
    model.end.register_forward_hook(lambda m, a, out: streams[-1].append(out.detach().double().numpy()))
    probe = flt_diag.watch(model, blocks=[model.cell], folder=tmp_path / "r", loop_boundary=model.end,
                           diagnostics=DiagnosticsConfig(exit_loss_every=1, dynamics_batch=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data(2):
        streams.append([])
        loss = F.cross_entropy(model(x).flatten(0, 1), x[:, :-1].flatten())
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        opt.zero_grad()
    probe.close()
    df = load_metrics(tmp_path / "r")
    assert capsys.readouterr().err.count("changed shape") == 1
    for s, hs in enumerate(streams):
        assert not ((df.metric == M.FIXED_POINT_RESIDUAL) & (df.step == s) & df.loop.isin([1, 3])).any()
        for t in (2, 4, 5):  # (loop t against loop t - 1; 1-based)
            a, b = hs[t - 1], hs[t - 2]
            ratio = (np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).mean()
            assert value(df, s, M.FIXED_POINT_RESIDUAL, t) == pytest.approx(ratio, rel=1e-5)
        for t, h in enumerate(hs, 1):  # (the shapes differ: the similarity taken in runs of one shape)
            assert value(df, s, M.RESID_NORM_LOOP_END, t) == pytest.approx(
                np.linalg.norm(h, axis=-1).mean(), rel=1e-5)
            want = []
            for seq in h[:2]:  # (the first dynamics_batch (2) sequences: both of the B = 2)
                u = seq / np.linalg.norm(seq, axis=-1, keepdims=True)
                want.append((u @ u.T)[~np.eye(len(u), dtype=bool)].mean())
            assert value(df, s, M.TOKEN_COSINE, t) == pytest.approx(np.mean(want), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("given", ["watch", "step"])
def test_exit_loss_against_the_head_by_hand(tmp_path, given):
    torch.manual_seed(0)
    model = PlainLoop()
    weights = []  # the head's weights at each step's forward
    head = lambda h: model.head(h)  # noqa: E731 (a plain callable, not a module)
    orig = model.forward

    def forward(x):
        weights.append((model.head.weight.detach().clone(), model.head.bias.detach().clone()))
        return orig(x)
    model.forward = forward
    options = dict(targets=lambda x: x) if given == "watch" else dict(probe_targets=True)
    _, streams = run(tmp_path / given, model, head=head, **options)
    df = load_metrics(tmp_path / given)
    weights.append((model.head.weight.detach().clone(), model.head.bias.detach().clone()))
    for s, (hs, x) in enumerate(zip(streams, data(3))):
        # watch(targets=): in the forward's hook, the head of the forward; step(targets=): the head at step(),
        # after the optimizer step (the weights the next forward sees)
        w, b = weights[s if given == "watch" else s + 1]
        for t, h in enumerate(hs):
            by_hand = F.cross_entropy((h @ w.T + b).flatten(0, 1), x.flatten())
            assert value(df, s, M.EXIT_LOSS, t + 1) == pytest.approx(float(by_hand), rel=1e-5)


def test_spectral_radius_with_loop_step_against_the_jacobian(tmp_path):
    torch.manual_seed(0)
    model = PlainLoop(loops=3)
    weights, grads = [], []
    orig = model.forward

    def forward(x):
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return orig(x)
    model.forward = forward
    _, streams = run(tmp_path / "j", model, capture=grads, loop_step=model.step)
    df = load_metrics(tmp_path / "j")
    probe_model = PlainLoop(loops=3)
    for s, hs in enumerate(streams):
        probe_model.load_state_dict(weights[s])
        for t in range(1, len(hs)):
            h = hs[t - 1][:1]  # dynamics_batch=1
            J = torch.autograd.functional.jacobian(probe_model.step, h).reshape(h.numel(), h.numel())
            rho = float(torch.linalg.eigvals(J.double()).abs().max())
            sigma = float(torch.linalg.svdvals(J.double()).max())
            assert value(df, s, M.LOOP_SPECTRAL_RADIUS, t + 1) == pytest.approx(rho, rel=1e-4)
            assert value(df, s, M.LOOP_SPECTRAL_RESIDUAL, t + 1) < 1e-3
            gain = value(df, s, M.LOOP_GAIN, t + 1)  # power iteration: a lower bound converging to sigma_max
            assert sigma * 0.98 <= gain <= sigma * (1 + 1e-5)
            assert value(df, s, M.LOOP_MEAN_GAIN, t + 1) <= sigma * (1 + 1e-5)
        assert not ((df.step == s) & (df.metric == M.LOOP_GAIN) & (df.loop == 1)).any()
        assert ((df.step == s) & (df.metric == M.LOOP_PERTURBATION_GROWTH)).sum() == len(hs) - 1
    for before, after in zip(grads[::2], grads[1::2]):  # nothing left on any .grad
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_training_trajectory_unchanged_by_the_records(tmp_path):
    def trajectory(folder, records: bool):
        torch.manual_seed(1)
        model = PlainLoop(dropout=0.2)  # the loop map draws dropout masks: the records must not move the RNG
        options = dict(head=model.head, targets=lambda x: x, loop_step=model.step) if records else {}
        losses, _ = run(folder, model, steps=4, **options)
        return losses, [p.detach().clone() for p in model.parameters()]

    plain, plain_params = trajectory(None, False)  # no probe at all
    recorded, params = trajectory(tmp_path / "all", True)
    assert recorded == plain  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    df = load_metrics(tmp_path / "all")
    for metric in (M.FIXED_POINT_RESIDUAL, M.EXIT_LOSS, M.TOKEN_COSINE, M.LOOP_GAIN, M.LOOP_PERTURBATION_GROWTH):
        assert (df.metric == metric).any(), metric


def test_a_stream_that_is_not_batch_seq_dim_skips_those_records(tmp_path, capsys):
    class Flat(PlainLoop):
        def forward(self, x):
            h = self.embed(x).flatten(0, 1)  # (B*T, D): no sequence axis
            for _ in range(self.loops):
                h = self.end(self.step(h))
            return self.head(h).view(B, T, V)

    torch.manual_seed(0)
    model = Flat()
    run(tmp_path / "f", model, head=model.head, targets=lambda x: x)
    df = load_metrics(tmp_path / "f")
    assert (df.metric == M.FIXED_POINT_RESIDUAL).any()
    assert not (df.metric == M.TOKEN_COSINE).any() and not (df.metric == M.EXIT_LOSS).any()
    assert capsys.readouterr().err.count("is not (batch, seq, dim)") == 1


class AttentionCell(nn.Module):
    """A loop map through torch's own attention layer, whose fast CPU kernel has no forward-mode AD."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)

    def forward(self, h):
        return self.layer(h)


def test_spectral_radius_through_torchs_attention_layer_against_the_jacobian(tmp_path):
    """torch.func's jvp fails on the fast CPU attention kernel (forward-mode AD not implemented): the probe
    computes the records under math attention, and the radius equals the exact Jacobian's."""
    torch.manual_seed(0)
    model = PlainLoop(loops=3)
    model.cell = AttentionCell()
    weights = []
    orig = model.forward

    def forward(x):
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return orig(x)
    model.forward = forward
    _, streams = run(tmp_path / "a", model, steps=1, loop_step=model.step)
    df = load_metrics(tmp_path / "a")
    check = PlainLoop(loops=3)
    check.cell = AttentionCell()
    check.load_state_dict(weights[0])
    h = streams[0][0][:1]
    J = torch.autograd.functional.jacobian(check.step, h).reshape(h.numel(), h.numel())
    assert value(df, 0, M.LOOP_SPECTRAL_RADIUS, 2) == pytest.approx(float(torch.linalg.eigvals(J.double()).abs().max()),
                                                                   rel=1e-3)


def test_a_loop_step_that_fails_is_said_once_and_the_training_goes_on(tmp_path, capsys):
    torch.manual_seed(0)
    model = PlainLoop(loops=3)

    def broken(h):
        raise RuntimeError("shapes do not match\nmore detail")
    losses, _ = run(tmp_path / "b", model, steps=3, loop_step=broken)
    err = capsys.readouterr().err
    assert len(losses) == 3 and err.count("loop_step= failed") == 1 and "RuntimeError: shapes do not match" in err
    df = load_metrics(tmp_path / "b")
    assert not (df.metric == M.LOOP_GAIN).any() and (df.metric == M.FIXED_POINT_RESIDUAL).any()
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["steps_done"] == 3


def test_each_loop_end_is_normed_once_by_the_hooks_and_the_dynamics_together(tmp_path, monkeypatch):
    """The block output, the loop boundary's output (the same tensor: nn.Identity) and the loop dynamics all need
    the per-token norms of a loop end: one vector_norm over the last dim of it, plus one of each consecutive
    difference (the fixed-point residual); the residual itself is checked against the captured streams above."""
    calls = []
    real = torch.linalg.vector_norm

    def counted(x, *args, **kwargs):
        if kwargs.get("dim") == -1 and tuple(x.shape) == (B, T, D):
            calls.append(x)
        return real(x, *args, **kwargs)
    monkeypatch.setattr(torch.linalg, "vector_norm", counted)
    model = PlainLoop(loops=4)
    run(tmp_path / "r", model, steps=2)
    assert len(calls) == 2 * (2 * model.loops - 1)


def test_per_token_norms_against_numpy_kept_for_the_same_unchanged_tensor_only():
    from flt_diag.instruments.loop_hooks import per_token_norms
    x = torch.randn(2, 3, 5)
    first = per_token_norms(x)
    np.testing.assert_allclose(first.numpy(), np.linalg.norm(x.numpy().astype(np.float64), axis=-1), rtol=1e-6)
    assert per_token_norms(x) is first  # the same tensor, unchanged: kept
    x.mul_(2)  # changed in place: taken anew
    np.testing.assert_allclose(per_token_norms(x).numpy(), 2 * first.numpy(), rtol=1e-6)
    y = x.clone()  # equal values, another tensor: taken anew
    assert per_token_norms(y) is not per_token_norms(x)
    with torch.inference_mode():
        z = torch.ones(1, 2, 4)
        assert per_token_norms(z).tolist() == [[2.0, 2.0]]
        z.mul_(3)
        assert per_token_norms(z).tolist() == [[6.0, 6.0]]  # (no version counter: never kept)
    import weakref
    w = torch.randn(4, 4)
    ref = weakref.ref(w)
    per_token_norms(w)
    del w
    assert ref() is None  # not kept alive by the memo
