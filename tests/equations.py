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


def attention(block, q_src, x, n_head):
    """Causal attention of stream x with queries from q_src (both already normed)."""
    B, T, d = x.shape
    hd = d // n_head
    W = block.attn
    q = rms(rotary((q_src @ W.q.weight.T).view(B, T, n_head, hd)))
    k = rms(rotary((x @ W.k.weight.T).view(B, T, n_head, hd)))
    v = (x @ W.v.weight.T).view(B, T, n_head, hd)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    y = torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, d)
    return y @ W.o.weight.T


def block_forward(block, x, n_head, query=None):
    z = rms(x)
    x = x + attention(block, z if query is None else rms(query), z, n_head)
    u = rms(x) @ block.mlp.up.weight.T
    return x + torch.relu(u).pow(2) @ block.mlp.down.weight.T


def forward(model, idx, variant, K, record=None, softcap=True):
    """Logits of the final loop (before the soft-cap if softcap=False). `record`, if a list, receives
    (loop, layer, stream) after every block and (loop, None, stream) at each loop's end (loops and
    layers counted from 1). Computed in the dtype of the model's weights."""
    cfg = model.cfg
    e = rms(model.embed.weight[idx])
    h = None
    for t in range(1, K + 1):
        if t == 1:
            x = e
        elif variant == "lt":
            x = h
        elif variant == "lt-ii":
            x = rms(model.embed.weight[idx] + h)
        elif variant in ("lt-ai", "fla", "flt"):
            x = e
        else:
            raise ValueError(variant)
        for i, block in enumerate(model.blocks):
            query = None
            if t >= 2 and variant == "fla":
                x = rms(x + h)
            if t >= 2 and (variant == "flt" or (variant == "lt-ai" and i == 0)):
                query = rms(h)
            x = block_forward(block, x, cfg.n_head, query)
            if record is not None:
                record.append((t, i + 1, x))
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
