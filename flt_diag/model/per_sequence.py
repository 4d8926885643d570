"""A loop count per sequence (a stabiliser's `depths` hook: Parcae's "per-sequence" recurrence, stabilisers/
parcae_source.py): sequence i of the batch runs n_i loops without the gradient, then k_i loops with it.

    phase 1 (no_grad), step j = 0 .. max(n) - 1:  x_i <- loop(x_i) if j < n_i, else x_i
    phase 2 (grad),    step j = 0 .. max(k) - 1:  x_i <- loop(x_i) if j < k_i, else x_i     (torch.where)

as the source's iterate_forward does. A sequence's first loop (the first step at which it moves: step 0 of phase 1
where n_i > 0, else step 0 of phase 2) is the base's loop 1, a plain pass from norm(E); each later one starts by
the variant's rule for loop t >= 2 (the stabiliser's `start`, model.loop_start), whatever step it falls in. The
rows' starts are chosen per row (torch.where) and the whole batch then runs one plain pass through the blocks: one
`_loop` call a step, so the loop hooks see one full-batch loop end per step (a training step's per-loop records
index these steps). That needs blocks that do not read h(t-1): a variant whose rule adds it before a block or takes
queries from it (FLA, LT-AI, FLT) is refused. A batch whose rows start together is the model's ordinary forward of
r loops, truncated to its last k.
The result is h = norm(x) at each sequence's end (B, T, d).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def depth_loops(model, emb: torch.Tensor, cos, sin, n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """h at the end of sequence i's n_i + k_i loops, its gradient through the last k_i (emb: E[tokens], (B, T, d);
    n, k: (B,) long)."""
    norm, stab, rule = model.norm, model.stabiliser, model.rule  # (the model's own: this module imports no model code)
    if (stab is not None and (stab.enter or stab.update)) or rule.add_prev_before_block or rule.query_from_prev != "none":
        raise ValueError(f"variant {model.cfg.variant!r}: a loop count per sequence takes no enter/update hooks and "
                         "no blocks that read h(t-1)")
    if n.shape != (emb.shape[0],) or k.shape != n.shape or bool((n < 0).any() or (k < 0).any()):
        raise ValueError(f"depths: n and k must be ({emb.shape[0]},) non-negative counts, got {tuple(n.shape)}, "
                         f"{tuple(k.shape)}")
    n, k = n.to(emb.device), k.to(emb.device)
    x, started = norm(emb), torch.zeros_like(n, dtype=torch.bool)  # (x: every row's loop-1 input)
    try:  # (what the instruments read: which phase runs, so that they take its loops' gradient as it is)
        model.gradless_loops = True
        with torch.no_grad():
            x, started = _phase(model, x, started, n, emb, cos, sin)
        model.gradless_loops = False
        x, _ = _phase(model, x, started, k, emb, cos, sin)
    finally:
        model.gradless_loops = None
    return norm(x)


def _phase(model, x, started, counts, emb, cos, sin):
    """max(counts) steps, row i moving while the step is below counts[i]; returns (x, which rows have moved)."""
    for step in range(int(counts.max()) if counts.numel() else 0):
        active = step < counts
        x = torch.where(active[:, None, None], _step(model, x, started, emb, cos, sin), x)
        started = started | active
    return x, started


def _step(model, x, started, emb, cos, sin):
    """One loop of every row: loop 1 (from norm(E)) for the rows not started, loop t >= 2 for the others."""
    norm = model.norm
    if bool(started.any()):
        x_in = model.loop_start(x, norm(x), emb)
        x_in = x_in if bool(started.all()) else torch.where(started[:, None, None], x_in, norm(emb))
    else:
        x_in = norm(emb)
    if model.checkpoint_loops and torch.is_grad_enabled():
        return checkpoint(model._loop, x_in, None, emb, cos, sin, use_reentrant=False)
    return model._loop(x_in, None, emb, cos, sin)  # (h_prev None: a plain pass from x_in)
