"""The streams' similarity (of the loop dynamics, switched by `loop_dynamics`; DESIGN.md §3, "Loop dynamics", "the
degenerate fixed point"): at each recorded loop end t of the steps the exit loss is taken at (`exit_loss_every`),
of the first `dynamics_batch` sequences of h(t) (B, T, d), each the mean over those sequences:

  token_cosine    the mean over position pairs i != j of cos(h_i, h_j) (1: every position holds one vector, the
                  stream has forgotten its tokens);
  effective_rank  exp(-sum p log p) of the singular values of the (T, d) matrix, normalised to p = sigma / sum(sigma)
                  (Roy and Vetterli 2007): 1 for a rank-one stream, min(T, d) for a flat spectrum.

Up to KEEP elements a loop end's sequences are copied (fp32) and taken for all the forward's loops together at its
end (`finish`, in calls of up to BATCH elements); a larger one at its loop end. A stream that is not (B, T, d) has
none (said once); a non-finite one has no effective rank there (its token cosine is taken)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flt_diag.records import Record, RecordContext, RecordOptions, Unrecordable

TOKEN_COSINE, EFFECTIVE_RANK = "token_cosine", "effective_rank"
KEEP = 1 << 20  # elements: a loop end's first dynamics_batch sequences up to this size are kept for the forward's end
BATCH = 1 << 22  # elements a call at the forward's end


def sequences(h: Any) -> Any:
    """h (..., T, d) as (N, T, d) in fp32, detached (a (T, d) h: one sequence)."""
    h = h.detach().float()
    return (h[None] if h.dim() == 2 else h).flatten(0, -3)


def token_cosine_per_sequence(h: Any) -> Any:
    """(N,): the mean cosine of each sequence's position pairs. Cost: the unit rows' sum (the pairs' cosines add up
    to its squared norm less the diagonal: no T x T product)."""
    import torch
    h = sequences(h)
    T = h.shape[-2]
    u = h / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp_min(1e-30)
    # sum over all pairs i, j of u_i . u_j = |sum_i u_i|^2; the pairs i = j add |u_i|^2 (1, or 0 for a zero row)
    pairs = torch.linalg.vector_norm(u.sum(-2), dim=-1) ** 2 - (u * u).sum((-1, -2))
    return pairs / max(T * (T - 1), 1)


def effective_rank_per_sequence(h: Any) -> Any:
    """(N,): each sequence's effective rank, from the eigenvalues of the smaller Gram matrix of h (sigma^2, in
    float64: cheaper than an SVD of (T, d), to ~1e-7 of sigma_max), one batched call for all the sequences. A
    non-finite h has none (linalg.eigh fails on it: `similarity` checks first)."""
    import torch
    h = sequences(h)
    hd = h.double()
    small = hd @ hd.transpose(-1, -2) if h.shape[-2] <= h.shape[-1] else hd.transpose(-1, -2) @ hd
    sv = torch.linalg.eigvalsh(small).clamp_min(0).sqrt()
    p = sv / sv.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum(-1)).float()


def similarity(loops: list[int], x: Any) -> dict:
    """{metric: {loop: value}} of `x`, the first sequences of the loop ends `loops` laid end to end; a metric that
    fails is its error instead (the record guard skips it alone: a non-finite stream has no effective rank)."""
    def per_loop(fn) -> Any:
        try:
            return dict(zip(loops, fn(x).reshape(len(loops), -1).mean(1).unbind()))
        except Exception as e:  # (named by the guard, this metric only)
            return e
    out = {TOKEN_COSINE: per_loop(token_cosine_per_sequence)}
    out[EFFECTIVE_RANK] = per_loop(effective_rank_per_sequence) if bool(x.isfinite().all()) else Unrecordable(
        "the loop-end stream is not finite (NaN or inf): its singular values, and so its effective rank, are not "
        "defined")
    return out


@dataclass
class Kept:
    """The recorded forward's loop ends kept for its end: (loop, its first sequences in fp32)."""
    loops: list[tuple[int, Any]] = field(default_factory=list)


def compute(loop: int, h, ctx: RecordContext[Kept]) -> dict:
    import torch
    state, cfg = ctx.state, ctx.cfg
    assert state is not None  # (a state it keeps)
    if loop == 1:
        state.loops = []
    if h.dim() != 3:
        raise Unrecordable(f"a loop-end stream of shape {tuple(h.shape)} is not (batch, seq, dim)")
    first = h[:cfg.dynamics_batch]
    if first.numel() > KEEP:  # (one copy, any dtype)
        return {metric: by_loop if isinstance(by_loop, Exception) else by_loop[loop]
                for metric, by_loop in similarity([loop], first).items()}
    state.loops.append((loop, first.to(torch.float32, copy=True)))
    return {}


def finish(loops: int, state: Kept) -> dict:
    """The kept loop ends: one call of each per-sequence function for each run of loops whose kept sequences have
    one shape, up to BATCH elements at a time."""
    import torch
    kept, state.loops = state.loops, []
    out: dict[str, dict] = {TOKEN_COSINE: {}, EFFECTIVE_RANK: {}}
    while kept:
        shape, n = kept[0][1].shape, 0
        while n < len(kept) and kept[n][1].shape == shape and (n == 0 or (n + 1) * kept[0][1].numel() <= BATCH):
            n += 1
        chunk, kept = kept[:n], kept[n:]
        loops_of = [loop for loop, _ in chunk]
        got = similarity(loops_of, torch.cat([h for _, h in chunk]) if n > 1 else chunk[0][1])
        for metric, by_loop in got.items():
            out[metric].update(dict.fromkeys(loops_of, by_loop) if isinstance(by_loop, Exception) else by_loop)
    return out


RECORD = Record(options=RecordOptions, switched_by="loop_dynamics", every="exit_loss_every", moment="loop_end",
                compute=compute, finish=finish, state=Kept, context=True,
                metrics={TOKEN_COSINE: "mean cosine between two positions' h(t) of a sequence (i != j), loop t",
                         EFFECTIVE_RANK: "exp(entropy of the normalised singular values) of a sequence's (T, d) h(t), "
                                         "loop t"})
