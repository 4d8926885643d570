"""Causal attention at a preset's shapes on CPU, forward + backward, one thread: torch's
scaled_dot_product_attention (the model's kernel; flash on CPU), SDPA's math backend, and the
explicit form (q @ k^T, causal mask, softmax, @ v) eager and compiled. Interleaved in one process,
medians over rounds of process CPU time, with each one's share of the measured matmul peak (its
FLOPs counted as train_flops counts attention: 6 B T^2 d per call, the causal half).

    python benchmarks/attention_cpu.py [--preset tiny] [--rounds 15] [--calls 50]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import positive_int  # noqa: E402
from flt_diag.config.run_config import build_config  # noqa: E402


def explicit(q, k, v):
    T = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1) @ v


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_math(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def forms(compile: bool) -> dict:
    out = {"sdpa (the model's)": sdpa, "sdpa, math backend": sdpa_math, "explicit, eager": explicit}
    if compile:
        out["explicit, compiled"] = torch.compile(explicit)
    return out


def measure(B: int, H: int, T: int, D: int, rounds: int, calls: int, compile: bool = True) -> list[dict]:
    """One row per form: median ms per forward + backward call and its share of the matmul peak."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, H, T, D, generator=g)
    fs = forms(compile)
    ref = sdpa(q, k, v)
    for name, f in fs.items():  # warm-up (compilation) and agreement with the model's kernel
        torch.testing.assert_close(f(q, k, v), ref, rtol=1e-4, atol=1e-5)
    a = torch.randn(2048, 2048, generator=g)
    times = {name: [] for name in fs}
    peaks = []
    for r in range(rounds):
        t0 = time.process_time()
        a @ a
        peaks.append(2 * 2048 ** 3 / (time.process_time() - t0))
        for name in (list(fs)[r % len(fs):] + list(fs)[:r % len(fs)]):
            f = fs[name]
            t0 = time.process_time()
            for _ in range(calls):
                f(q, k, v).backward(grad)
            times[name].append((time.process_time() - t0) / calls)
    peak = max(peaks)
    flops = 6 * B * T * T * (H * D)
    return [dict(form=name, ms=1e3 * statistics.median(ts), pct_of_peak=100 * flops / statistics.median(ts) / peak,
                 peak_gflops=peak / 1e9) for name, ts in times.items()]


def main(argv=None) -> int:
    from flt_diag.config.run_config import PRESETS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=[n for n in PRESETS if n != "auto"])
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="sequences per call [default: 16, the benchmarks' tiny batch]")
    p.add_argument("--rounds", type=positive_int, default=15)
    p.add_argument("--calls", type=positive_int, default=50, help="calls per timed sample")
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled explicit form")
    args = p.parse_args(argv)
    m = build_config(args.preset, model=dict(vocab_size=256)).model
    rows = measure(args.batch_size, m.heads, m.seq_len, m.head_dim, args.rounds, args.calls,
                   compile=not args.no_compile)
    print(f"causal attention, forward + backward, B={args.batch_size} H={m.heads} T={m.seq_len} "
          f"D={m.head_dim}, one thread, process CPU time; matmul peak {rows[0]['peak_gflops']:.1f} GFLOP/s")
    for r in rows:
        print(f"  {r['form']:<22s} {r['ms']:8.3f} ms per call   {r['pct_of_peak']:5.1f} % of peak")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
