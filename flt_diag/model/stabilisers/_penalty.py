"""What the two loss-term stabilisers share (stars.py, jacobian_fro.py): the map g of one loop at the final
state, and the ops that let its vector-Jacobian products be differentiated again (the penalty's gradient is a
double backward through one loop).

    g(h) = norm(loop(h)),  h = h(K) = norm(x(K)) detached:  g is the map h(t-1) -> h(t) of every loop t >= 2
    (flt_diag.instruments.loop_dynamics.loop_step takes the same map), run once more at the final state.

The penalty is computed after the model's forward has returned (the Trainer calls it), so the loop hooks,
armed only inside that forward, do not see the extra loop; its gradient reaches the block weights (and the
embedding, where the variant injects it), never the state: h is detached, as both sources prescribe.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable


@contextlib.contextmanager
def differentiable(model):
    """The written-out norm (the fast CPU norm's backward is not differentiable again), math attention and eager
    blocks (a compiled block is not double-differentiable)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with model.differentiable(), sdpa_kernel(SDPBackend.MATH), torch.compiler.set_stance("force_eager"):
        yield


def final_loop_map(model) -> tuple[Callable, Any]:
    """(g, h): the loop map at the last training forward's inputs and its final state h(K), detached, as a leaf
    that requires grad (so g's vector-Jacobian products can be taken)."""
    if model.penalty_inputs is None:
        raise RuntimeError("no training forward to take the penalty at (the model ran no loops with grad enabled)")
    h, emb, cos, sin, t = model.penalty_inputs
    model.penalty_inputs = None  # (taken once a forward: nothing kept alive past the step)
    return (lambda z: model.norm(model._loop(z, z, emb, cos, sin, t))), h.detach().clone().requires_grad_()


def vjp(y, h, v, create_graph: bool):
    """v^T J = J^T v for y = g(h)."""
    import torch
    return torch.autograd.grad(y, h, v, retain_graph=True, create_graph=create_graph)[0]
