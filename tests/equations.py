"""DESIGN.md §2 written out again, independently of flt_diag.model.transformer, for the tests.

Plain tensor algebra on the model's weights: its own RMSNorm, its own pairwise rotary, its
own masked-softmax attention, and each variant's loop rules spelled out with if/elif.
"""
import math

import torch


def rms(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def rotary(x, base=10000.0):
    """x: (B, T, H, D). Pair i is (x[..., i], x[..., i + D/2]), rotated by t / base^(2i/D).

    The angles and their cos/sin are computed in float64 (then rounded to x's dtype), so that in
    float64 this is the exact rotation."""
    B, T, H, D = x.shape
    half = D // 2
    out = torch.empty_like(x)
    for i in range(half):
        theta = torch.arange(T, dtype=torch.float64) / base ** (2 * i / D)  # (T,)
        c, s = theta.cos().to(x.dtype)[None, :, None], theta.sin().to(x.dtype)[None, :, None]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * c + b * s
        out[..., i + half] = b * c - a * s
    return out


def attention(block, q_src, x, heads):
    """Causal attention of stream x with queries from q_src (both already normed)."""
    B, T, d = x.shape
    hd = d // heads
    W = block.attn
    q = rms(rotary((q_src @ W.q.weight.T).view(B, T, heads, hd)))
    k = rms(rotary((x @ W.k.weight.T).view(B, T, heads, hd)))
    v = (x @ W.v.weight.T).view(B, T, heads, hd)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    y = torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, d)
    return y @ W.o.weight.T


def block_forward(block, x, heads, query=None, scale=1.0, post_norm=False, alpha=1.0):
    """x + s f(rms(x)) per half; post_norm: rms(alpha x + f(rms(x))) (Huginn's sandwich, DeepLoop's DeepNorm)."""
    def add(x, branch):
        return rms(alpha * x + scale * branch) if post_norm else x + scale * branch
    z = rms(x)
    x = add(x, attention(block, z if query is None else rms(query), z, heads))
    u = rms(x) @ block.mlp.up.weight.T
    return add(x, torch.relu(u).pow(2) @ block.mlp.down.weight.T)


PAPER = ("lt", "lt-ii", "lt-ai", "fla", "flt")


def parts(variant):
    """(base, stabiliser) of a variant name: "flt+loop-embed" -> ("flt", "loop-embed"); "parcae" -> ("lt", "parcae")."""
    variant = variant.removesuffix("-source")  # (a source recipe's forward is its round-one name's: it changes how
    # it trains, its sampled depths and its loss term, not the K-loop forward)
    if variant in PAPER:
        return variant, None
    if "+" in variant:
        return tuple(variant.split("+"))
    return "lt", variant


def forward(model, idx, variant, K, record=None, softcap=True):
    """Logits of the final loop (before the soft-cap if softcap=False). `record`, if a list, receives
    (loop, layer, stream) after every block and (loop, None, stream) at each loop's end (loops and
    layers counted from 1). Computed in the dtype of the model's weights. The stabilisers (issue 56) written out
    from their equations (docs/DESIGN.md §2b), on their base's rules."""
    cfg = model.cfg
    base, stab = parts(variant)
    L = cfg.depth
    E = model.embed.weight[idx]
    e = rms(E)
    S = getattr(cfg, "strength", 1.0)  # --strength: residual-scale's lambda, DeepLoop's exponent over 1/2
    scale = S / (cfg.loops * math.sqrt(L)) if stab == "residual-scale" else 1.0
    post_norm = stab in ("huginn", "deeploop")
    alpha = (2 * cfg.loops * L) ** (S / 2) if stab == "deeploop" else 1.0
    h = x = None
    for t in range(1, K + 1):
        if t == 1:
            x = e
        elif stab == "parcae":
            P = model.injection
            dt = torch.log1p(torch.exp(P.dt))  # softplus
            x = torch.exp(-dt * torch.exp(P.A_log)) * x + dt * (e @ P.B.weight.T)
        elif stab == "huginn":
            x = torch.cat([x, e], dim=-1) @ model.adapter.W.weight.T
        elif base == "lt":
            x = h
        elif base == "lt-ii":
            x = rms(E + h)
        elif base in ("lt-ai", "fla", "flt"):
            x = e
        else:
            raise ValueError(variant)
        if stab == "loop-embed":
            x = x + model.loop_embed.weight[t - 1]
        x_in = x
        for i, block in enumerate(model.blocks):
            query = None
            if t >= 2 and base == "fla":
                x = rms(x + h)
            if t >= 2 and (base == "flt" or (base == "lt-ai" and i == 0)):
                query = rms(h)
            x = block_forward(block, x, cfg.heads, query, scale, post_norm, alpha)
            if record is not None:
                record.append((t, i + 1, x))
        if stab == "loop-gate":  # x_in + sigmoid(a_t) (F(x_in) - x_in)
            g = 1 / (1 + torch.exp(-model.gate.a[t - 1]))
            x = x_in + g * (x - x_in)
        if record is not None:
            record.append((t, None, x))
        h = rms(x)
    z = h @ model.head.weight.T
    return 15.0 * torch.tanh(z / 15.0) if softcap else z


def randomize(model, seed=0, scale=0.3):
    """Non-zero weights everywhere (the real init zeroes W_O and W_down, hiding bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        model.embed.weight.mul_(1 / scale)
        model.head.weight.mul_(10)
    return model
