"""The exit loss as a record file (flt_diag.records.exit_loss): a short flt_diag.watch run's exit_loss rows, sorted,
equal those recomputed by hand from the loop-end states a separate forward hook keeps, with the model's head and
F.cross_entropy, on the steps exit_loss_every names: the targets of the forward (watch(targets=): the head of the
forward) and those given at the step (probe.step(targets=): the head at the step, after the optimizer step)."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flt_diag
from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics

V, D, T, B, K, STEPS, EVERY = 8, 6, 3, 2, 3, 5, 2


class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.cell, self.end, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Identity(), \
            nn.Linear(D, V)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(K):
            h = self.end(torch.tanh(self.cell(h)) + 0.5 * h)
        return self.head(h)


@pytest.mark.parametrize("given", ["watch", "step"])
def test_exit_loss_rows_equal_the_cross_entropy_by_hand(tmp_path, given):
    torch.manual_seed(0)
    model = Loop()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[list[torch.Tensor]] = []
    model.end.register_forward_hook(lambda m, a, out: kept[-1].append(out.detach().clone()))
    options = dict(targets=lambda x: x) if given == "watch" else {}
    probe = flt_diag.watch(model, blocks=[model.cell], folder=tmp_path / "run", optimizer=opt, head=model.head,
                           loop_boundary=model.end, diagnostics=DiagnosticsConfig(exit_loss_every=EVERY), **options)
    g = torch.Generator().manual_seed(0)
    by_hand = []
    for step in range(STEPS):
        x = torch.randint(0, V, (B, T), generator=g)
        kept.append([])
        head = (model.head.weight.detach().clone(), model.head.bias.detach().clone())  # (the forward's)
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        if given == "step":
            head = (model.head.weight.detach().clone(), model.head.bias.detach().clone())  # (the step's)
        probe.step(targets=x if given == "step" else None)
        opt.zero_grad()
        if step % EVERY == 0:
            w, b = head
            by_hand += [(step, t + 1, float(torch.tensor(float(F.cross_entropy(
                (h @ w.T + b).flatten(0, 1), x.flatten())), dtype=torch.float32)))
                for t, h in enumerate(kept[-1])]
    probe.close()
    df = load_metrics(tmp_path / "run")
    df = df[df.metric == M.EXIT_LOSS]
    rows = sorted((int(r.step), int(r.loop), float(np.float32(r.value))) for r in df.itertuples())
    assert len(rows) == len(range(0, STEPS, EVERY)) * K
    assert [r[:2] for r in rows] == [r[:2] for r in sorted(by_hand)]
    for (_, _, got), (_, _, want) in zip(rows, sorted(by_hand)):
        assert got == pytest.approx(want, rel=1e-6, abs=0)
