"""Precision helpers for the numerical tests: float64 models and tolerances derived from magnitudes.

Two kinds of numerical comparison, and how each gets its tolerance:

* Against an independent computation (written-out equations, the nanochat-style reference,
  torch.autograd.grad, ...): both sides run in float64 (`float64_model`), so that the different
  fp32 rounding of CPU kernels (vendor BLAS paths, vector width, thread count) cannot show; they
  then agree to RTOL64 relative to the largest magnitude compared.
* Of an fp32 path itself (the fp32 RMSNorm, a statistic a hook computes in fp32, a training run's
  fp32 reductions): a bound of the form c * U32 * magnitude, with c counted from the operations.

Bit-identical expectations (a run against itself on one machine) stay exact and need none of this.
"""
from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24  # unit roundoff of float32: |fl(x) - x| <= U32 |x| (torch.finfo(torch.float32).eps / 2)
U64 = 2.0 ** -53  # unit roundoff of float64

# Two float64 computations of the same formulas in different orders differ by rounding steps of
# size U64 ~ 1e-16; a K-loop pass has of the order of K * L * 4d (<= 6 * 2 * 256 ~ 3e3) of them
# in sequence, ~3e-13 even before any amplification by the loops. 1e-10 leaves a margin of ~300
# for that amplification, while a slip in the formulas shows at 1e-3 or more.
RTOL64 = 1e-10

# fp32 tanh on CPU is within 1 ulp (SLEEF u10 in the vectorised path) or 2 ulps (libm, scalar
# path); 4 covers either with a margin.
TANH_ULPS = 4


def exact_rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0):
    """float64 cos/sin tables with angles t / base^(2i/D) computed in float64, in the layout
    flt_diag.model.transformer.apply_rotary documents: cos = [c, c], sin = [s, -s] over the last dim,
    shaped (1, T, 1, D) like the model's buffers."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] / base ** (2 * i / head_dim)  # (T, D/2)
    c, s = angles.cos(), angles.sin()
    return torch.cat([c, c], -1)[None, :, None, :], torch.cat([s, -s], -1)[None, :, None, :]


def float64_model(model):
    """The model in float64, with exact float64 rotary tables in place of its fp32-rounded ones
    (whose construction test_model.test_fp32_rotary_tables checks on its own).

    The model's final logits stay fp32 (forward casts head(h) with .float() before the soft-cap,
    as the reference does); compare its float64 internals through `record`."""
    model.double()
    cfg = model.cfg
    model.cos, model.sin = exact_rotary_tables(model.cos.shape[1], cfg.head_dim, cfg.rotary_base)
    return model


def record(model, idx, **forward_kwargs):
    """(output, loop-end streams, head outputs) of one forward: the streams (where the model has a
    `loop_end`) and the head's pre-soft-cap logits in the model's own dtype, read with forward hooks."""
    streams, heads = [], []
    hooks = [model.head.register_forward_hook(lambda m, a, o: heads.append(o.detach()))]
    if hasattr(model, "loop_end"):
        hooks.append(model.loop_end.register_forward_hook(lambda m, a, o: streams.append(o.detach())))
    try:
        out = model(idx, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, streams, heads


def assert_close64(got, want, rtol: float = RTOL64):
    """float64 against float64: rtol, and the same fraction of max|want| as atol (an entry near
    zero carries the rounding of the larger terms it was summed from)."""
    assert got.dtype == want.dtype == torch.float64, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def softcap_fp32_atol(z: torch.Tensor, softcap: float = 15.0) -> float:
    """Bound on |fp32 soft-cap of z - exact soft-cap of z| for exact pre-soft-cap logits z.

    The model (and the reference) cast head(h) to fp32 and compute softcap * tanh(z / softcap) in
    fp32: the cast and the division each move z by <= U32 |z| and the soft-cap has slope <= 1
    (2 U32 |z|); tanh is within TANH_ULPS ulps of t = tanh(z / softcap) (an ulp is <= 2 U32 |t|)
    and the final product adds U32 |softcap * t|, where |softcap * t| <= min(|z|, softcap)."""
    m = z.abs().max().item()
    return U32 * (2 * m + (2 * TANH_ULPS + 1) * min(m, softcap))


def fp32_positive_sum_rtol(n: int, lam: float = 5.0) -> float:
    """Relative error of an fp32 sum of n terms of one sign, in any summation order: lam * sqrt(n) * U32,
    which holds with probability >= 1 - 2 exp(-lam^2 / 2) (~7e-6 for lam = 5) under the
    probabilistic rounding-error analysis of Higham & Mary (SIAM J. Sci. Comput. 41, 2019). The
    worst-case bound (n - 1) U32 is reached only if every rounding goes the same way."""
    return lam * math.sqrt(n) * U32
