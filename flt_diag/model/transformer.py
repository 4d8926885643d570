"""The looped transformer: one readable file, five variants expressed as data.

Reference formulation: DESIGN.md §2. Notation: L blocks (the config's depth), K loops, d = width,
norm = RMSNorm without a learnable weight, h(t) = norm(stream at the end of loop t).
The model is built from flt-diag's ModelConfig itself, read under the names users type (depth, width, heads,
seq_len): the one place a config becomes a model. Its modules keep nanochat's names where they mirror the
reference's GPT (`Attention.n_head`, as nanochat's CausalSelfAttention).

Loop 1 is a plain pass in every variant. For loops t >= 2 a paper variant is three rules
(flt_diag.config.variants.PAPER): where the stream starts, whether h(t-1) is added before every block,
and which blocks take their attention query from h(t-1) ("attention injection"). A stabiliser
(flt_diag.model.stabilisers, one file each) adds its part (`model.<part>`) and its hooks, which the model
calls at the loop's seams: `start` and `enter` at a loop's start, `update` at its end, `block` and `init`
once at build; `penalty` keeps the final state for the loss term the Trainer adds.

The model has no diagnostic code. It exposes hook points that diagnostics attach to
from outside (flt_diag.instruments.loop_hooks):
  * every block's forward output is the residual stream after that block, and
    `block.after_attn` (an identity) sees the stream after its attention add;
  * `model.loop_end` (an identity) sees the residual stream at the end of each loop;
  * `Attention.query_key(q_src, kv_src)` recomputes the (rotated, normed) q and k.
A block reused K times fires K times per forward; listeners key by (loop, layer).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flt_diag.config.run_config import ModelConfig, loss_loops  # noqa: F401 (ModelConfig re-exported)
from flt_diag.config.variants import VARIANTS  # noqa: F401 (re-exported)
from flt_diag.model.per_sequence import depth_loops
from flt_diag.model.stabilisers import shaped


def _inv_rms(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


class _RMSNorm(torch.autograd.Function):
    """y = x / sqrt(mean(x^2) + eps) with a hand-written backward: the same values as
    F.rms_norm, several times faster on CPU, where F.rms_norm is a chain of small ops."""

    @staticmethod
    def forward(ctx, x):
        r = _inv_rms(x)
        y = x * r
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, g):
        y, r = ctx.saved_tensors
        return r * (g - y * (g * y).mean(-1, keepdim=True))


_WRITTEN_OUT = [False]  # set by `written_out_norm`


@contextlib.contextmanager
def written_out_norm():
    """Within: `norm` is the written-out x * rsqrt(mean(x^2) + eps) on every device, the same values
    by ops that torch.func transforms (jvp, vjp) and double backward differentiate, which the fast CPU
    form's hand-written backward does not (flt_diag.instruments.loop_dynamics uses it)."""
    before = _WRITTEN_OUT[0]
    _WRITTEN_OUT[0] = True
    try:
        yield
    finally:
        _WRITTEN_OUT[0] = before


def norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim, no learnable weight (eps = machine epsilon of x's dtype)."""
    if _WRITTEN_OUT[0] or torch.compiler.is_compiling():  # written out: the compiler fuses it with its neighbours
        return x * _inv_rms(x)
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return _RMSNorm.apply(x)
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) by position-dependent angles.  x: (B, T, H, D)

    cos = [c, c] and sin = [s, -s] over the last dim (see LoopedTransformer._rotary), so
    y[:D/2] = x1*c + x2*s and y[D/2:] = x2*c - x1*s."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.n_head, self.head_dim = cfg.width, cfg.heads, cfg.head_dim
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def query_key(self, q_src, kv_src, cos, sin):
        """Rotated, then RMS-normed queries and keys, each (B, T, H, D).

        q and k are stacked along the head axis so both take one rotary and one norm pass.
        (The order matters once the tables are rounded to bf16: cos^2 + sin^2 != 1.)"""
        B, T, _ = kv_src.shape
        qk = torch.cat([self.q(q_src), self.k(kv_src)], dim=-1).view(B, T, 2 * self.n_head, self.head_dim)
        qk = norm(apply_rotary(qk, cos, sin))
        return qk[:, :, : self.n_head], qk[:, :, self.n_head:]

    def forward(self, q_src, kv_src, cos, sin):
        B, T, C = kv_src.shape
        q, k = self.query_key(q_src, kv_src, cos, sin)  # (B, T, H, D)
        v = self.v(kv_src).view(B, T, self.n_head, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, D): query i sees keys j <= i of the current stream only
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
        self.down = nn.Linear(4 * cfg.width, cfg.width, bias=False)

    def forward(self, x):
        return self.down(F.relu(self.up(x)).square())


class Block(nn.Module):
    """Pre-norm block in two residual halves: x + attn(norm(x)), then x + mlp(norm(x)). With `query`
    given, attention takes its Q from norm(query). Each half is one unit for torch.compile
    (flt_diag.training.compile_precision.compile_blocks); `after_attn`, an identity between them, is the hook
    point for the stream after the attention add (its gradient is the attention output's gradient).

    A stabiliser's `block` hook changes the add (every paper variant has scale = 1, post_norm = False):
    x + scale * F(norm(x)) (residual_scale.py); norm(alpha * x + F(norm(x))) (post_norm: Huginn's sandwich norm
    with alpha = 1, DeepLoop's DeepNorm with alpha = (2KL)^(1/2))."""

    def __init__(self, cfg: ModelConfig, scale: float = 1.0, post_norm: bool = False, alpha: float = 1.0):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.after_attn = nn.Identity()
        self.scale, self.post_norm, self.alpha = scale, post_norm, alpha

    def add(self, x, branch):
        """The residual add of one half (x + branch for every paper variant)."""
        if self.scale != 1.0:
            branch = self.scale * branch
        if self.post_norm:
            return norm(x + branch if self.alpha == 1.0 else self.alpha * x + branch)
        return x + branch

    @staticmethod
    def attention_sources(x, query=None):
        """(q_src, kv_src): keys and values from norm(x); queries from norm(query) if given, else norm(x)."""
        z = norm(x)
        return (z if query is None else norm(query)), z

    def attend(self, x, cos, sin, query=None):
        return self.add(x, self.attn(*self.attention_sources(x, query), cos, sin))

    def feed(self, x):
        return self.add(x, self.mlp(norm(x)))

    def forward(self, x, cos, sin, query=None):
        return self.feed(self.after_attn(self.attend(x, cos, sin, query)))


class LoopedTransformer(nn.Module):
    cos: torch.Tensor  # the rotary tables (buffers: _rotary)
    sin: torch.Tensor
    penalty_inputs: tuple | None
    norm = staticmethod(norm)  # (the stabilisers' hooks take it from the model: they import no model code)
    gradless_loops: bool | None = None  # per_sequence.py's phase: True no-grad loops, False the gradient's, None none

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        spec = VARIANTS[cfg.variant]  # type: ignore[index]  # (None: a watch run's config, never built)
        self.rule, self.stabiliser = spec.rule, spec.stabiliser
        K, L, d = cfg.loops, cfg.depth, cfg.width
        block = hook(self, "block")
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.blocks = nn.ModuleList(Block(cfg, **(block(cfg) if block else {})) for _ in range(L))
        # the stabiliser's own parameters (none for the paper's five), under its part's name; built without
        # drawing from the global generator, so that a seed gives every variant the same shared weights
        if self.stabiliser is not None and self.stabiliser.parameters is not None:
            with torch.random.fork_rng(devices=[]):
                setattr(self, cast(str, self.stabiliser.part), self.stabiliser.parameters(cfg))
        self.loop_end: nn.Module = nn.Identity()  # hook point: residual stream at each loop's end
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.checkpoint_loops = False  # activation checkpointing, one segment per loop
        # truncated backpropagation: gradient through the last k loops only (0 = all; Huginn's default ceil(K/4))
        grad_loops = hook(self, "grad_loops")
        self.grad_loops = grad_loops(K) if grad_loops else 0
        self.penalty_inputs = None  # a loss-term variant's final state and loop inputs (stabilisers/_penalty.py)
        self.table_dtype = torch.float32  # dtype the rotary tables are kept in (bf16 for reference precision)
        self._rotary(cfg.seq_len)
        self.reset_parameters()

    def _rotary(self, seq_len: int) -> None:
        hd = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
        dtype = getattr(torch, self.cfg.rotary_dtype)  # tables rounded to this dtype, as the reference does
        cos, sin = angles.cos().to(dtype).to(self.table_dtype), angles.sin().to(dtype).to(self.table_dtype)
        device = self.embed.weight.device
        self.register_buffer("cos", torch.cat([cos, cos], -1).to(device)[None, :, None, :], persistent=False)
        self.register_buffer("sin", torch.cat([sin, -sin], -1).to(device)[None, :, None, :], persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = math.sqrt(3.0 / self.cfg.width)  # uniform with std 1/sqrt(d)
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.normal_(self.head.weight, std=0.001)
        for block in cast("Iterable[Block]", self.blocks):  # (a ModuleList of Blocks)
            for lin in (block.attn.q, block.attn.k, block.attn.v, block.mlp.up):
                nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.zeros_(block.attn.o.weight)
            nn.init.zeros_(block.mlp.down.weight)
        if init := hook(self, "init"):
            init(self)
        if (reset := getattr(stabiliser_part(self), "reset_parameters", None)) is not None:
            reset()  # (the part's own initialisation)

    def _loop(self, x, h_prev, emb, cos, sin, t: int | None = None):
        """One pass through the L blocks. h_prev is None in loop 1 (a plain pass); x is the raw stream at the
        previous loop's end (a stabiliser's `start` takes it); emb is the raw embedding E[tokens]; t the loop's
        index from 0 (needed by a stabiliser's `enter` and `update` only)."""
        rule, part, enter, update = self.rule, stabiliser_part(self), *hooks(self, "enter", "update")
        if (enter or update) and t is None:
            raise ValueError(f"stabiliser {self.cfg.variant!r} needs the loop's index: call _loop(..., t=...)")
        if h_prev is not None:
            x = self.loop_start(x, h_prev, emb)
        if enter is not None:
            x = shaped(enter(part, x, t), x, self, "enter")
        x_in = x
        for i, block in enumerate(self.blocks):
            query = None
            if h_prev is not None:
                if rule.add_prev_before_block:
                    x = norm(x + h_prev)
                if rule.query_from_prev == "all" or (rule.query_from_prev == "first" and i == 0):
                    query = h_prev
            x = block(x, cos, sin, query)
        if update is not None:
            x = shaped(update(part, x_in, x, t), x, self, "update")
        return self.loop_end(x)

    def loop_start(self, x, h_prev, emb):
        """Loop t >= 2's start: the stabiliser's `start`, else the variant's rule (x, h_prev, emb: as `_loop`)."""
        rule, part, start = self.rule, stabiliser_part(self), hook(self, "start")
        if start is not None:
            return shaped(start(part, x, norm(emb)), x, self, "start")
        if rule.start == "prev":
            return h_prev
        if rule.start == "embed":
            return norm(emb)
        if rule.start == "embed+prev":  # additive input injection
            return norm(emb + h_prev)
        raise ValueError(f"variant {self.cfg.variant!r}: unknown loop start {rule.start!r}")

    def forward_loops(self, idx: torch.Tensor, loops: int | None = None, keep: str = "end",
                      depths: tuple | None = None) -> list[torch.Tensor]:
        """Logits (B, T, V) of the final loop (keep="end") or of every loop (keep="all"); depths = (n, k): sequence
        i runs n_i loops without the gradient, then k_i with it (flt_diag.model.per_sequence; keep="end" only)."""
        K = self.cfg.loops if loops is None else loops
        if K < 1 or (depths is not None and (loops is not None or keep != "end")):
            raise ValueError(f"loops must be >= 1, got {K}" if K < 1 else "depths: no loops= and keep='end' only")
        T = idx.shape[1]
        if T > self.cos.shape[1]:
            self._rotary(T)
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        emb = self.embed(idx)  # (B, T, d)
        if depths is not None:
            return [self.loop_head(depth_loops(self, emb, cos, sin, *depths))]
        x, h = norm(emb), cast(torch.Tensor, None)  # (h: set by loop 1, before any reads it: K >= 1)
        outs = []
        cut = detached_loops(K, self.grad_loops)
        for t in range(K):
            if t == cut and t > 0:  # truncated backpropagation: loops 1..cut send no gradient
                x, h = x.detach(), h.detach()
            if self.checkpoint_loops and torch.is_grad_enabled():
                x = checkpoint(self._loop, x, h, emb, cos, sin, t, use_reentrant=False)
            else:
                x = self._loop(x, h, emb, cos, sin, t)
            h = norm(x)  # h(t)
            if keep == "all" or t == K - 1:
                outs.append(h)
        if hook(self, "penalty") and self.training and torch.is_grad_enabled():
            self.penalty_inputs = (h.detach(), emb, cos, sin, K)  # the loss term's loop runs at h(K) (penalty.py)
        return [self.loop_head(h) for h in outs]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loops: int | None = None,
                loss_on: str = "end", depths: tuple | None = None):
        """Logits (B, T, V) of the final loop; with targets, (logits, loss). Targets of -100
        (F.cross_entropy's ignore_index; a synthetic task's non-answer positions) are left out of the mean.

        loss_on: "end" (final loop), "all" (mean over loops) or "last-third" (mean over the
        last ceil(K/3) loops). depths: a loop count per sequence (forward_loops; loss_on "end" only)."""
        if targets is None:
            return self.forward_loops(idx, loops, depths=depths)[-1]
        n = loss_loops(loss_on, self.cfg.loops if loops is None else loops)
        logits = self.forward_loops(idx, loops, keep="end" if loss_on == "end" else "all", depths=depths)[-n:]
        losses = [F.cross_entropy(lg.flatten(0, 1), targets.flatten()) for lg in logits]
        return logits[-1], torch.stack(losses).mean()

    # the instruments' view of the model (flt_diag.instruments.looped.LoopedModel; blocks and loop_end above)
    @property
    def detached_loops(self) -> int:
        """Loops 1..n of a forward send no gradient (truncated backpropagation, `grad_loops`)."""
        return detached_loops(self.cfg.loops, self.grad_loops)

    def loop_head(self, h: torch.Tensor) -> torch.Tensor:
        """The logits of a loop-end state: softcap * tanh(head(h) / softcap), as forward_loops takes them."""
        c = self.cfg.softcap
        return c * torch.tanh(self.head(h.to(self.head.weight.dtype)).float() / c)

    def loop_step(self, idx: torch.Tensor):
        """(start, run, loops) of a batch: norm of the raw embedding in fp32 (detached), run(x, h_prev, t) =
        `_loop` with that embedding and the rotary tables held fixed, and K."""
        T = idx.shape[1]
        if T > self.cos.shape[1]:
            raise ValueError(f"sequence of {T} tokens is longer than the model's rotary tables ({self.cos.shape[1]})")
        emb = self.embed(idx).detach().to(torch.promote_types(self.embed.weight.dtype, torch.float32))
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        return norm(emb), lambda x, h, t: self._loop(x, h, emb, cos, sin, t), self.cfg.loops

    def loop_state(self, stream: torch.Tensor) -> torch.Tensor:
        """h(t) of a loop-end stream: its norm, in fp32 at least."""
        return norm(stream if stream.dtype in (torch.float32, torch.float64) else stream.float())

    def loop_targets(self, idx, targets=None, *args, **kwargs):
        """The targets among forward's arguments."""
        return targets

    def differentiable(self):
        """The written-out norm, which double backward differentiates (written_out_norm)."""
        return written_out_norm()


def detached_loops(loops: int, grad_loops: int) -> int:
    """How many of `loops` loops send no gradient back under truncated backpropagation through the last
    `grad_loops` (0, or grad_loops >= loops: none)."""
    return loops - grad_loops if 0 < grad_loops < loops else 0


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of a model of this config, counted on the meta device (no memory, no download)."""
    with torch.device("meta"):
        return sum(p.numel() for p in LoopedTransformer(cfg).parameters())


def parameter_groups(model: LoopedTransformer) -> dict[str, list[nn.Parameter]]:
    """Named groups used by the optimizer recipe and by diagnostics: embedding, head,
    and each block's attention and MLP ("block0.attn", "block0.mlp", ...)."""
    groups: dict[str, list[nn.Parameter]] = {  # (torch types a layer's weight as a Tensor; it is its Parameter)
        "embedding": [model.embed.weight], "head": [model.head.weight]}  # type: ignore[list-item]
    for i, block in enumerate(cast("Iterable[Block]", model.blocks)):
        groups[f"block{i}.attn"] = list(block.attn.parameters())
        groups[f"block{i}.mlp"] = list(block.mlp.parameters())
    extra = stabiliser_parameters(model)
    if extra:
        groups["stabiliser"] = extra
    return groups


def hook(model, name: str):
    """The model's stabiliser's hook `name` (flt_diag.model.stabilisers.HOOKS), or None."""
    return getattr(getattr(model, "stabiliser", None), name, None)


def hooks(model, *names: str) -> list:
    return [hook(model, n) for n in names]


def stabiliser_part(model) -> nn.Module | None:
    """The module holding the stabiliser's parameters (`model.<part>`), or None."""
    stab = getattr(model, "stabiliser", None)
    return getattr(model, stab.part) if stab is not None and stab.part is not None else None


def stabiliser_parameters(model: LoopedTransformer) -> list[nn.Parameter]:
    """The parameters a stabiliser adds (Parcae's A_log, dt, B; Huginn's adapter; the loop embedding): none for
    the paper's five (FLT's point: its changes add no parameters)."""
    part = stabiliser_part(model)
    return list(part.parameters()) if part is not None else []


def extra_parameters(cfg: ModelConfig) -> int:
    """Parameters the variant adds to LT of the same shape, counted on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in stabiliser_parameters(LoopedTransformer(cfg)))
