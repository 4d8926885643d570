"""The sharpness of the training loss: its top Hessian eigenvalue w.r.t. the trained parameters, by power iteration
with Hessian-vector products (double backward). Recorded every `--sharpness-every` steps (off by default:
DESIGN.md §3) by the record flt_diag.records.sharpness, through the step's loop map
(flt_diag.instruments.dynamics_callback.LoopMap); inside loop_dynamics.transparent()."""
from __future__ import annotations

from typing import Callable, Sequence, cast

import torch

from flt_diag.instruments.loop_dynamics import transparent
from flt_diag.instruments.looped import LoopedModel

Tensor = torch.Tensor


def _power_iteration(hvp: Callable[[list[Tensor]], list[Tensor]], v: list[Tensor], iters: int,
                     shift: Tensor | float = 0.0) -> Tensor:
    """Rayleigh quotient v.(H - shift)v of the power iteration v <- (H - shift) v / ||.|| from v."""
    lam = torch.zeros(())
    for _ in range(iters):
        n = torch.sqrt(cast(Tensor, sum(x.square().sum() for x in v))).clamp_min(1e-30)  # (v: not empty)
        v = [x / n for x in v]
        hv = [a - shift * b for a, b in zip(hvp(v), v)]
        lam = cast(Tensor, sum((a * b).sum() for a, b in zip(v, hv)))
        v = [x.detach() for x in hv]
    return lam.detach()


def top_hessian_eigenvalue(loss_fn: Callable[[list[Tensor]], Tensor], params: Sequence[Tensor], iters: int,
                           generator: torch.Generator | None = None) -> Tensor:
    """The largest Hessian eigenvalue of loss_fn at params (the sharpness), by power iteration with
    Hessian-vector products (double backward: torch.autograd.grad of g.v, the gradient taken with
    create_graph), reported as the Rayleigh quotient v.Hv. Power iteration finds the eigenvalue of
    largest magnitude; where that one is negative (a saddle), a second run on H - lambda_min I finds
    lambda_max - lambda_min. Cost: one forward + backward with graph, then `iters` double backwards
    (2 * iters where the first run finds a negative eigenvalue)."""
    ps = [p.detach().requires_grad_() for p in params]
    grads = torch.autograd.grad(loss_fn(ps), ps, create_graph=True)

    def hvp(v: list[Tensor]) -> list[Tensor]:
        return list(torch.autograd.grad(grads, ps, grad_outputs=v, retain_graph=True))
    start = [torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) for p in ps]
    lam = _power_iteration(hvp, start, iters)
    if lam < 0:
        lam = _power_iteration(hvp, start, iters, shift=lam) + lam
    return lam


def model_loss(model: torch.nn.Module, idx: Tensor, targets: Tensor, loss_on: str = "end"):
    """(loss_fn(params), params) for `top_hessian_eigenvalue`: the training loss, the second item of
    model(idx, targets, loss_on=) (flt-diag's forward), as a function of the parameters the training updates
    (requires_grad, in named_parameters order; a frozen one, such as `--freeze-embedding`'s embedding, is held at its
    value: the sharpness is the curvature the optimizer sees). torch.func.functional_call."""
    named = list(model.named_parameters())
    trained = [n for n, p in named if p.requires_grad]
    held = {n: p.detach() for n, p in named if not p.requires_grad}

    def loss_fn(ps: list[Tensor]) -> Tensor:
        params = {**held, **dict(zip(trained, ps))}
        return torch.func.functional_call(model, params, (idx, targets), {"loss_on": loss_on})[1]
    return loss_fn, [p for _, p in named if p.requires_grad]


def sharpness(model: LoopedModel, idx: Tensor, targets: Tensor, iters: int, loss_on: str = "end",
              generator: torch.Generator | None = None) -> Tensor:
    """Top Hessian eigenvalue of the training loss of a batch w.r.t. the trained parameters (model_loss)."""
    loss_fn, params = model_loss(model, idx, targets, loss_on)  # type: ignore[arg-type]  # (a LoopedModel module)
    with transparent(model):
        return top_hessian_eigenvalue(loss_fn, params, iters, generator)
