"""Loop dynamics: the loop seen as a map h(t-1) -> h(t), measured from outside the model.

Pure functions (definitions and cost: DESIGN.md §3, "Loop dynamics"), usable on any looped model given a
loop-step callable `step(h_prev) -> h_next`, a head callable `head(h) -> logits` and a loss: the exit loss, the
loop map's gain and spectral radius (by Jacobian-vector products), its mean gain and perturbation growth, the
streams' similarity (its per-sequence functions those of flt_diag.records.token_similarity, the record that takes
it), each loop's own gradient and its agreement (the sharpness: flt_diag.instruments.sharpness). The fixed-point
residual is a record: flt_diag.records.fixed_point_residual. For a model of the instruments' protocol (flt_diag.instruments.looped.LoopedModel:
flt-diag's own): `loop_states`, `loop_map_stats`, `looped_loss` (one alias of the block weights per loop).
Everything that differentiates runs inside `transparent()`; random start vectors come from the caller's generator,
never the global RNG; nothing is left on any `.grad`. The records that take the every-N ones: flt_diag.records.loop_map
and loop_map_agreement, through the step's loop map of the training callback flt_diag.instruments.dynamics_callback.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flt_diag.config.run_config import loss_loops
from flt_diag.instruments.looped import LoopedModel, LoopStep
from flt_diag.records.token_similarity import effective_rank_per_sequence, token_cosine_per_sequence
from flt_diag.storage import metric_names as M

Tensor = torch.Tensor


@contextlib.contextmanager
def transparent(model: LoopedModel | None = None):
    """Ops that torch.func transforms and double backward differentiate: the model's own (its `differentiable()`,
    where it is a LoopedModel: flt-diag's written-out norm), math attention, compiled blocks run eagerly (no
    recompilation for the aliases and dual tensors)."""
    own = model.differentiable() if isinstance(model, LoopedModel) else contextlib.nullcontext()
    with own, sdpa_kernel(SDPBackend.MATH), torch.compiler.set_stance("force_eager"):
        yield


# ----------------------------------------------------------------------------- cheap: every recorded step
def exit_loss(h: Tensor, head: Callable[[Tensor], Tensor], targets: Tensor) -> Tensor:
    """Cross-entropy of head(h) against targets (-100 ignored), no gradient. One head matmul of the
    stream (B*T*d*V multiply-adds) per loop."""
    with torch.no_grad():
        logits = head(h.detach())
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


# ----------------------------------------------------------------------------- the loop as a map
def loop_states(model: LoopedModel, idx: Tensor) -> list[Tensor]:
    """h(1), ..., h(K) of a batch, as the forward computes them (fp32 embedding), no gradient."""
    return LoopStep.of(model, idx).states()


def _unit(v: Tensor) -> Tensor:
    return v / torch.linalg.vector_norm(v).clamp_min(1e-30)


class Linearized:
    """The Jacobian J of `step` at h from one forward and one backward kept as graphs: `vjp(u)` = J^T u, and
    `jvp(v)` = J v by double backward (g(w) = J^T w is linear in w, so d<g(w), v>/dw = J v). Every product
    reuses them (torch.func.jvp reruns the forward: ~4x the cost; DESIGN.md §3). Run inside `transparent()`."""

    def __init__(self, step: Callable[[Tensor], Tensor], h: Tensor):
        self.h = h.detach().requires_grad_()
        with torch.enable_grad():
            self.y = step(self.h)
            self.w = torch.zeros_like(self.y, requires_grad=True)
            g = torch.autograd.grad(self.y, self.h, self.w, create_graph=True, allow_unused=True)[0]
        self.g = g if g is not None and g.requires_grad else None  # None: J (or J^T w's dependence on w) is 0

    def jvp(self, v: Tensor) -> Tensor:
        if self.g is None:
            return torch.zeros_like(self.y)
        return torch.autograd.grad(self.g, self.w, v, retain_graph=True)[0].detach()

    def vjp(self, u: Tensor) -> Tensor:
        if not self.y.requires_grad:
            return torch.zeros_like(self.h)
        g = torch.autograd.grad(self.y, self.h, u, retain_graph=True, allow_unused=True)[0]
        return torch.zeros_like(self.h) if g is None else g.detach()


def loop_map_gain(step: Callable[[Tensor], Tensor], h: Tensor, iters: int,
                  generator: torch.Generator | None = None) -> Tensor:
    """sigma_max of the Jacobian J of `step` at h (the whole tensor as one vector): power iteration on J^T J
    (v <- J^T J v / ||.||, each a jvp then a vjp of `Linearized`), reported as ||J v|| of the last unit v, a lower
    bound that converges to the largest singular value. It bounds how much any direction can grow in one
    loop; it is NOT whether the loop contracts (a non-normal map can have sigma_max > 1 and converge):
    that is the spectral radius and the perturbation growth below. Cost: iters jvp + iters vjp."""
    J = Linearized(step, h)
    with torch.no_grad():
        v = _unit(torch.randn(h.shape, generator=generator, device=h.device, dtype=h.dtype))
        sigma = torch.zeros((), device=h.device)
        for _ in range(iters):
            jv = J.jvp(v)
            sigma = torch.linalg.vector_norm(jv)
            v = _unit(J.vjp(jv))
    return sigma


def spectral_radius(step: Callable[[Tensor], Tensor], h: Tensor, dim: int,
                    generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(rho, residual): the largest-magnitude eigenvalue of the Jacobian J of `step` at h, by Arnoldi.

    `dim` Jacobian-vector products build an orthonormal Krylov basis Q of span{v, Jv, J^2 v, ...} (classical
    Gram-Schmidt in matrix form, done twice: as orthogonal as modified Gram-Schmidt twice, and one host transfer a
    product, not one per inner product) and the Hessenberg matrix H = Q^T J Q; rho = max |eig(H)| (the Ritz values
    tend to J's outer eigenvalues first). residual = ||J y - theta y|| / |theta| of that Ritz pair
    (= H[m+1, m] |s_m| / |theta|, s the unit eigenvector of H): 0 when the basis spans an invariant
    subspace (then rho is exact), below ~0.01 when the estimate has converged. In float64 on the host
    (H is dim x dim). Cost: dim jvp of one loop on h."""
    h = h.detach()
    n = h.numel()
    m = min(dim, n)
    J = Linearized(step, h)
    with torch.no_grad():
        Q = torch.empty(m, n, device=h.device, dtype=h.dtype)  # the basis, one row a vector
        Q[0] = _unit(torch.randn(h.shape, generator=generator, device=h.device, dtype=h.dtype)).flatten()
        H = torch.zeros(m + 1, m, dtype=torch.float64)
        for j in range(m):
            w = J.jvp(Q[j].view_as(h)).flatten()
            basis, coef = Q[:j + 1], torch.zeros(j + 1, device=h.device, dtype=h.dtype)
            scale = torch.linalg.vector_norm(w)
            for _ in range(2):  # twice is enough (Kahan's rule)
                c = basis @ w
                w = w - basis.T @ c
                coef += c
            column = torch.cat([coef, torch.linalg.vector_norm(w)[None], scale[None]]).to("cpu", torch.float64)
            H[:j + 2, j] = column[:-1]
            if not math.isfinite(H[j + 1, j].item()):
                nan = torch.tensor(math.nan, device=h.device)
                return nan, nan
            if H[j + 1, j] <= 1e-7 * max(column[-1].item(), 1e-30) or j == m - 1:
                m = j + 1
                break
            Q[j + 1] = w / H[j + 1, j].item()
        evals, evecs = torch.linalg.eig(H[:m, :m])
        k = int(evals.abs().argmax())
        theta = evals[k].abs().item()
        residual = H[m, m - 1].item() * evecs[m - 1, k].abs().item() / max(theta, 1e-300)
    return torch.tensor(theta, device=h.device), torch.tensor(residual, device=h.device)


def mean_gain(step: Callable[[Tensor], Tensor], h: Tensor, dirs: int,
              generator: torch.Generator | None = None) -> Tensor:
    """Mean of ||J v|| over `dirs` random unit directions v at h (E||Jv||^2 = ||J||_F^2 / n: the root-mean-square
    singular value). What a typical perturbation does in one loop, where sigma_max is the worst one."""
    h = h.detach()
    J = Linearized(step, h)
    with torch.no_grad():
        gains = [torch.linalg.vector_norm(J.jvp(_unit(torch.randn(
            h.shape, generator=generator, device=h.device, dtype=h.dtype)))) for _ in range(dirs)]
    return torch.stack(gains).mean()


def _per_loop(step, n_states: int) -> list[Callable[[Tensor], Tensor]]:
    """`step` as one map per transition h(t-1) -> h(t): a list is taken as it is, one map is repeated."""
    return list(step) if isinstance(step, (list, tuple)) else [step] * (n_states - 1)


def perturbation_growth(step, states: Sequence[Tensor], dirs: int,
                        generator: torch.Generator | None = None) -> Tensor:
    """(K-1,): ||d(t)|| / ||d(t-1)|| for t = 2..K of a perturbation d carried along the trajectory
    h(1), ..., h(K) (d(t) = J(h(t-1)) d(t-1), renormalised each loop, d(1) a random unit direction), the
    geometric mean over `dirs` directions. The product over loops t..t+m-1 is ||J_m ... J_1 v||, and the
    mean of the logs over m loops the local (finite-time) Lyapunov exponent: below 0 the loop contracts
    perturbations along the path it actually takes. Cost: dirs * (K-1) jvp."""
    if len(states) < 2:
        return torch.zeros(0, device=states[0].device if states else None)
    logs = torch.zeros(dirs, len(states) - 1, device=states[0].device)
    with torch.no_grad():
        d = [_unit(torch.randn(states[0].shape, generator=generator, device=states[0].device,
                               dtype=states[0].dtype)) for _ in range(dirs)]
        for t, (h, f) in enumerate(zip(states[:-1], _per_loop(step, len(states)))):  # (one loop's maps at a time)
            J = Linearized(f, h)
            for r in range(dirs):
                jd = J.jvp(d[r])
                n = torch.linalg.vector_norm(jd)
                logs[r, t] = torch.log(n.clamp_min(1e-30))
                d[r] = jd / n.clamp_min(1e-30)
    return torch.exp(logs.mean(0))


def loop_map_stats(model: LoopedModel, idx: Tensor, iters: int, krylov_dim: int = 24, dirs: int = 4,
                   generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """The loop map of a LoopedModel at h(t-1), t = 2..K, of a batch: `loop_map_records` of its loop states."""
    loop = LoopStep.of(model, idx)
    with transparent(model):
        return loop_map_records(loop.maps(), loop.states(), iters, krylov_dim, dirs, generator)


def loop_map_records(step: Callable[[Tensor], Tensor] | Sequence[Callable[[Tensor], Tensor]], states: Sequence[Tensor],
                     iters: int, krylov_dim: int, dirs: int,
                     generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """The loop map `step` (or one per loop) at h(t-1), t = 2..K, of a trajectory h(1..K): metric name -> tensor of
    K-1 (loop_gain,
    loop_spectral_radius, loop_spectral_residual, loop_mean_gain, loop_perturbation_growth; metric_names)."""
    names = (M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN)
    device = states[0].device
    if len(states) < 2:
        empty = torch.zeros(0, device=device)
        return {n: empty for n in names + (M.LOOP_PERTURBATION_GROWTH,)}
    rows, steps = [], _per_loop(step, len(states))
    for h, f in zip(states[:-1], steps):
        rho, res = spectral_radius(f, h, krylov_dim, generator)
        rows.append((loop_map_gain(f, h, iters, generator), rho, res, mean_gain(f, h, dirs, generator)))
    out = {n: torch.stack([r[i].to(device).float() for r in rows]) for i, n in enumerate(names)}
    out[M.LOOP_PERTURBATION_GROWTH] = perturbation_growth(step, states, dirs, generator).float()
    return out


# ----------------------------------------------------------------------------- the degenerate fixed point
def stream_similarity(h: Tensor) -> tuple[Tensor, Tensor]:
    """(token_cosine, effective_rank) of a stream h (B, T, d), each the mean over the B sequences.

    token_cosine: the mean over position pairs i != j of cos(h_i, h_j) (1: every position holds the same
    vector, the stream has forgotten its tokens). effective_rank: exp(-sum p log p) of the singular values
    of the (T, d) matrix normalised to p = sigma / sum(sigma) (Roy and Vetterli 2007): 1 for a rank-one
    stream, min(T, d) for a flat spectrum. Per sequence (h (..., T, d) flattened to (N,) sequences; a (T, d) h: one
    sequence): `token_cosine_per_sequence` and `effective_rank_per_sequence`, those of the record that takes them at
    each loop end (flt_diag.records.token_similarity)."""
    return token_cosine_per_sequence(h).mean(), effective_rank_per_sequence(h).mean()


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
    gradient (the sum over loops). A loop that sends no gradient has cosine 0.

    Each vector is divided by its largest entry before the products, so that the squared norms neither underflow
    nor overflow in float32: a plain x.y / sqrt(|x|^2 |y|^2) gave |cosine| up to 10^10 where early loops send
    gradients of 10^-20 (the product of the squared norms underflows to 0: LT-II at lr x 32 in the benchmark)."""
    columns = []
    for names in groups.values():
        per = torch.stack([torch.cat([g[n].flatten().float() for n in names]) for g in per_loop])  # (loops, size)
        total = per.sum(0)
        unit = per / per.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(per.dtype).tiny)
        total = total / total.abs().max().clamp_min(torch.finfo(per.dtype).tiny)
        norms = unit.norm(dim=-1) * total.norm()
        dots = unit @ total
        columns.append(torch.where(norms > 0, dots / norms.clamp_min(torch.finfo(per.dtype).tiny), 0.0).clamp(-1, 1))
    return torch.stack(columns, -1)


class _LoopCall(nn.Module):
    """A loop's pass as a module call on the model, so that torch.func.functional_call can swap the block weights."""

    def __init__(self, model: nn.Module, run):
        super().__init__()
        self.model, self.run = model, run

    def forward(self, *args):
        return self.run(*args)


def loss_of_loops(logits: Sequence[Tensor], targets: Tensor, loss_on: str = "end") -> Tensor:
    """The training loss from every loop's logits, as LoopedTransformer.forward takes it."""
    logits = logits[-loss_loops(loss_on, len(logits)):]
    return torch.stack([F.cross_entropy(lg.flatten(0, 1), targets.flatten()) for lg in logits]).mean()


def block_weights(model: LoopedModel) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """The shared block weights by name, and the names of each block's ("block1" ... "blockL")."""
    shared: dict[str, Tensor] = {f"model.blocks.{n}": p for n, p in model.blocks.named_parameters()}
    groups = {f"block{i + 1}": [f"model.blocks.{i}.{n}" for n, _ in b.named_parameters()]
              for i, b in enumerate(model.blocks)}
    return shared, groups


def looped_loss(model: LoopedModel, idx: Tensor, targets: Tensor, loss_on: str = "end"):
    """loss_fn(aliases) for `per_loop_gradients`: the training loss of the batch with loop t's blocks
    running on aliases[t] (the embedding detached, the head the model's own). Under the model's truncated
    backpropagation (`grad_loops`) the stream is detached where the training forward detaches it, so the
    detached loops' contributions are 0."""
    loop = LoopStep.of(model, idx)
    call = _LoopCall(model, loop.run)  # type: ignore[arg-type]  # (a LoopedModel is an nn.Module)

    def loss_fn(aliases: list[dict[str, Tensor]]) -> Tensor:
        x, h, logits = loop.start, None, []
        for t, params in enumerate(aliases):
            if t == model.detached_loops and h is not None:
                x, h = x.detach(), h.detach()
            x = torch.func.functional_call(call, params, (x, h, t))
            h = loop.state(x)
            logits.append(model.loop_head(h))
        return loss_of_loops(logits, targets, loss_on)
    return loss_fn


def loop_gradient_agreement(model: LoopedModel, idx: Tensor, targets: Tensor, loss_on: str = "end") -> Tensor:
    """(K, L): cosine between loop t's contribution to block l's weight gradient and the total.
    Cost: one forward and backward of the batch (K loops)."""
    shared, groups = block_weights(model)
    with transparent(model):
        per_loop = per_loop_gradients(looped_loss(model, idx, targets, loss_on), shared, LoopStep.of(model, idx).loops)
    return gradient_agreement(per_loop, groups)
