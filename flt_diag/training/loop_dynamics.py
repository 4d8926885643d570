"""Loop dynamics: the loop seen as a map h(t-1) -> h(t), measured from outside the model.

Pure functions (definitions and cost: DESIGN.md §3, "Loop dynamics"), usable on any looped model given
a loop-step callable `step(h_prev) -> h_next`, a head callable `head(h) -> logits` and a loss:

  * `fixed_point_residual(h, h_prev)`: mean over tokens of ||h(t) - h(t-1)|| / ||h(t-1)||;
  * `exit_loss(h, head, targets)`: cross-entropy of the head applied to h(t), no gradient;
  * `loop_map_gain(step, h, iters, generator)`: largest singular value of the Jacobian of `step` at
    h (power iteration on J^T J by torch.func.jvp and vjp) and its spectral radius (power iteration on J);
  * `per_loop_gradients` / `gradient_agreement`: each loop's own contribution to the gradient of the
    shared weights (every loop's call of them gets its own alias), and its cosine with their sum;
  * `top_hessian_eigenvalue(loss_fn, params, iters, generator)`: the sharpness, by Hessian-vector products.

For a LoopedTransformer: `loop_inputs`, `loop_states`, `loop_step`, `model_head`, `looped_loss` (the
training loss with one alias of the block weights per loop) and `model_loss`. Everything that
differentiates runs inside `transparent()`: the written-out norm, the math attention kernel and
compiled blocks run eagerly, since torch.func and double backward need ops they can differentiate
(the fast CPU norm's hand-written backward and the fused attention kernels are not). Random start
vectors come from the caller's generator, never the global RNG; nothing is left on any `.grad`.
The training callback that records them is flt_diag.training.dynamics_callback.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flt_diag.model.transformer import LoopedTransformer, norm, written_out_norm

Tensor = torch.Tensor


@contextlib.contextmanager
def transparent():
    """Ops that torch.func transforms and double backward differentiate: written-out norm, math
    attention, compiled blocks run eagerly (no recompilation for the aliases and dual tensors)."""
    with written_out_norm(), sdpa_kernel(SDPBackend.MATH), torch.compiler.set_stance("force_eager"):
        yield


# ----------------------------------------------------------------------------- cheap: every recorded step
def fixed_point_residual(h: Tensor, h_prev: Tensor) -> Tensor:
    """Mean over tokens of ||h - h_prev|| / ||h_prev|| (norms over the last dim). One subtraction and
    two norms of the stream: no forward, no matmul."""
    h, h_prev = h.detach().float(), h_prev.detach().float()
    num = torch.linalg.vector_norm(h - h_prev, dim=-1)
    return (num / torch.linalg.vector_norm(h_prev, dim=-1).clamp_min(1e-30)).mean()


def exit_loss(h: Tensor, head: Callable[[Tensor], Tensor], targets: Tensor) -> Tensor:
    """Cross-entropy of head(h) against targets (-100 ignored), no gradient. One head matmul of the
    stream (B*T*d*V multiply-adds) per loop."""
    with torch.no_grad():
        logits = head(h.detach())
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def model_head(model: LoopedTransformer) -> Callable[[Tensor], Tensor]:
    """The model's output map: softcap * tanh(head(h) / softcap), as forward_loops applies it."""
    c = model.cfg.softcap
    return lambda h: c * torch.tanh(model.head(h.to(model.head.weight.dtype)).float() / c)  # (a float64 model: its dtype)


# ----------------------------------------------------------------------------- the loop as a map
def loop_inputs(model: LoopedTransformer, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(emb, cos, sin) of a batch: the raw embedding in fp32 (detached) and the rotary tables."""
    T = idx.shape[1]
    if T > model.cos.shape[1]:
        raise ValueError(f"sequence of {T} tokens is longer than the model's rotary tables ({model.cos.shape[1]})")
    dtype = torch.promote_types(model.embed.weight.dtype, torch.float32)  # fp32, or a float64 model's float64
    return model.embed(idx).detach().to(dtype), model.cos[:, :T], model.sin[:, :T]


def loop_step(model: LoopedTransformer, emb: Tensor, cos: Tensor, sin: Tensor) -> Callable[[Tensor], Tensor]:
    """The map h(t-1) -> h(t) of every loop t >= 2, with emb, cos, sin held fixed. (Every variant sets
    its stream at a loop's start from emb and h(t-1), so the map is the same function for all t >= 2.)"""
    return lambda h: norm(model._loop(h, h, emb, cos, sin))


def loop_states(model: LoopedTransformer, idx: Tensor, loops: int | None = None) -> list[Tensor]:
    """h(1), ..., h(K) of a batch, as forward_loops computes them (fp32 embedding), no gradient."""
    emb, cos, sin = loop_inputs(model, idx)
    K = model.cfg.loops if loops is None else loops
    with torch.no_grad():
        x, h, states = norm(emb), None, []
        for _ in range(K):
            x = model._loop(x, h, emb, cos, sin)
            h = norm(x)
            states.append(h)
    return states


def _unit(v: Tensor) -> Tensor:
    return v / torch.linalg.vector_norm(v).clamp_min(1e-30)


def loop_map_gain(step: Callable[[Tensor], Tensor], h: Tensor, iters: int,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(sigma_max, rho) of the Jacobian J of `step` at h (the whole tensor as one vector).

    sigma_max: power iteration on J^T J (v <- J^T J v / ||.||, each a torch.func.jvp then a vjp),
    reported as ||J v|| of the last unit v: a lower bound that converges to the largest singular value.
    rho: power iteration on J alone (v <- J v / ||J v||); the geometric mean of the growth ratios
    ||J v|| over the second half of the iterations, which tends to the spectral radius (also for a
    complex pair of eigenvalues, whose ratios oscillate about it). Cost: 2 * iters jvp + iters vjp
    of one loop on h. Start vectors from `generator` (never the global RNG)."""
    h = h.detach()
    with torch.no_grad():  # torch.func differentiates inside; nothing records a graph over the weights
        _, vjp_fn = torch.func.vjp(step, h)
        v = _unit(torch.randn(h.shape, generator=generator, device=h.device, dtype=h.dtype))
        u = v.clone()
        sigma = torch.zeros((), device=h.device)
        for _ in range(iters):
            _, jv = torch.func.jvp(step, (h,), (v,))
            sigma = torch.linalg.vector_norm(jv)
            v = _unit(vjp_fn(jv)[0])
        logs = []
        for _ in range(iters):
            _, ju = torch.func.jvp(step, (h,), (u,))
            n = torch.linalg.vector_norm(ju)
            logs.append(torch.log(n.clamp_min(1e-30)))
            u = ju / n.clamp_min(1e-30)
        rho = torch.exp(torch.stack(logs[iters // 2:]).mean())
    return sigma, rho


def loop_gains(model: LoopedTransformer, idx: Tensor, iters: int,
               generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(sigma_max, rho) of the loop map at h(t-1) for t = 2..K of a batch: two tensors of K-1."""
    states = loop_states(model, idx)
    emb, cos, sin = loop_inputs(model, idx)
    step = loop_step(model, emb, cos, sin)
    with transparent():
        pairs = [loop_map_gain(step, h, iters, generator) for h in states[:-1]]
    if not pairs:
        empty = torch.zeros(0, device=idx.device)
        return empty, empty
    return torch.stack([s for s, _ in pairs]), torch.stack([r for _, r in pairs])


# ----------------------------------------------------------------------------- per-loop gradient agreement
def per_loop_gradients(loss_fn: Callable[[list[dict[str, Tensor]]], Tensor], shared: dict[str, Tensor],
                       loops: int) -> list[dict[str, Tensor]]:
    """Each loop's contribution to the gradient of the shared weights: loss_fn gets one dict of
    aliases per loop (detached leaves of the same storage) and uses alias t in loop t's call only;
    the gradient w.r.t. alias t is that loop's contribution, and their sum is the total gradient.
    torch.autograd.grad: nothing is accumulated on any parameter's .grad."""
    aliases = [{n: p.detach().requires_grad_() for n, p in shared.items()} for _ in range(loops)]
    loss = loss_fn(aliases)
    flat = [a[n] for a in aliases for n in shared]
    grads = torch.autograd.grad(loss, flat, allow_unused=True)
    out, it = [], iter(grads)
    for _ in range(loops):
        out.append({n: (g if g is not None else torch.zeros_like(shared[n])) for n, g in zip(shared, it)})
    return out


def gradient_agreement(per_loop: list[dict[str, Tensor]], groups: dict[str, list[str]]) -> Tensor:
    """(loops, groups): cosine between loop t's gradient of a group's weights and the group's total
    gradient (the sum over loops). A loop that sends no gradient has cosine 0."""
    columns = []
    for names in groups.values():
        per = torch.stack([torch.cat([g[n].flatten().float() for n in names]) for g in per_loop])  # (loops, size)
        columns.append(F.cosine_similarity(per, per.sum(0, keepdim=True).expand_as(per), dim=-1, eps=1e-30))
    return torch.stack(columns, -1)


class _LoopCall(nn.Module):
    """`model._loop` as a module call, so that torch.func.functional_call can swap the block weights."""

    def __init__(self, model: LoopedTransformer):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model._loop(*args)


def loss_of_loops(logits: Sequence[Tensor], targets: Tensor, loss_on: str = "end") -> Tensor:
    """The training loss from every loop's logits, as LoopedTransformer.forward takes it."""
    if loss_on == "end":
        logits = logits[-1:]
    elif loss_on == "last-third":
        logits = logits[-math.ceil(len(logits) / 3):]
    elif loss_on != "all":
        raise ValueError(f"loss_on must be end, all or last-third, got {loss_on!r}")
    return torch.stack([F.cross_entropy(lg.flatten(0, 1), targets.flatten()) for lg in logits]).mean()


def block_weights(model: LoopedTransformer) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """The shared block weights by name, and the names of each block's ("block1" ... "blockL")."""
    shared = {f"model.blocks.{n}": p for n, p in model.blocks.named_parameters()}
    groups = {f"block{i + 1}": [f"model.blocks.{i}.{n}" for n, _ in b.named_parameters()]
              for i, b in enumerate(model.blocks)}
    return shared, groups


def looped_loss(model: LoopedTransformer, idx: Tensor, targets: Tensor, loss_on: str = "end"):
    """loss_fn(aliases) for `per_loop_gradients`: the training loss of the batch with loop t's blocks
    running on aliases[t] (the embedding detached, the head the model's own)."""
    emb, cos, sin = loop_inputs(model, idx)
    call, head = _LoopCall(model), model_head(model)

    def loss_fn(aliases: list[dict[str, Tensor]]) -> Tensor:
        x, h, logits = norm(emb), None, []
        for params in aliases:
            x = torch.func.functional_call(call, params, (x, h, emb, cos, sin))
            h = norm(x)
            logits.append(head(h))
        return loss_of_loops(logits, targets, loss_on)
    return loss_fn


def loop_gradient_agreement(model: LoopedTransformer, idx: Tensor, targets: Tensor, loss_on: str = "end") -> Tensor:
    """(K, L): cosine between loop t's contribution to block l's weight gradient and the total.
    Cost: one forward and backward of the batch (K loops)."""
    shared, groups = block_weights(model)
    with transparent():
        per_loop = per_loop_gradients(looped_loss(model, idx, targets, loss_on), shared, model.cfg.loops)
    return gradient_agreement(per_loop, groups)


# ----------------------------------------------------------------------------- sharpness
def _power_iteration(hvp: Callable[[list[Tensor]], list[Tensor]], v: list[Tensor], iters: int,
                     shift: Tensor | float = 0.0) -> Tensor:
    """Rayleigh quotient v.(H - shift)v of the power iteration v <- (H - shift) v / ||.|| from v."""
    lam = torch.zeros(())
    for _ in range(iters):
        n = torch.sqrt(sum(x.square().sum() for x in v)).clamp_min(1e-30)
        v = [x / n for x in v]
        hv = [a - shift * b for a, b in zip(hvp(v), v)]
        lam = sum((a * b).sum() for a, b in zip(v, hv))
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


def model_loss(model: LoopedTransformer, idx: Tensor, targets: Tensor, loss_on: str = "end"):
    """(loss_fn(params), params) for `top_hessian_eigenvalue`: the training loss as a function of all
    the model's parameters (torch.func.functional_call, parameters in named_parameters order)."""
    names = [n for n, _ in model.named_parameters()]

    def loss_fn(ps: list[Tensor]) -> Tensor:
        return torch.func.functional_call(model, dict(zip(names, ps)), (idx, targets), {"loss_on": loss_on})[1]
    return loss_fn, [p for _, p in model.named_parameters()]


def sharpness(model: LoopedTransformer, idx: Tensor, targets: Tensor, iters: int, loss_on: str = "end",
              generator: torch.Generator | None = None) -> Tensor:
    """Top Hessian eigenvalue of the training loss of a batch w.r.t. all parameters."""
    loss_fn, params = model_loss(model, idx, targets, loss_on)
    with transparent():
        return top_hessian_eigenvalue(loss_fn, params, iters, generator)
