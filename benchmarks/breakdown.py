"""Where one training step's time goes (`bench.py --breakdown`), for the tiny preset at each K.

Two views of the same step, both measured in one process, one thread:

1. By stage, from differences of interleaved timings (process CPU time, paired by round, so a shared
   machine's drifts cancel): forward (the model's forward with autograd recording, hooks off),
   backward (forward+backward minus forward), optimizer + clipping + step bookkeeping (the step without
   diagnostics minus forward+backward), diagnostics (the step with every diagnostic minus without).
2. By kind of work, from torch.profiler's self CPU time over the full step: matmuls (aten::mm, addmm,
   bmm), attention kernels (scaled_dot_product_*), every other operator (elementwise, reductions,
   copies, the optimizer's small ops) and what no operator accounts for (Python, dispatch, autograd
   bookkeeping): the step's time minus the operators' self time.

`floor` is the analytic matmul FLOPs of the step at the measured matmul peak: the step could take no
less; `share of peak` = floor / step time, the number `--flops` reports. `ceiling` = floor / (matmul +
attention kernel time): the share a step would reach if everything but those kernels (elementwise work,
the optimizer, diagnostics, Python) cost nothing; at small widths the kernels themselves run below the
2048^2 peak, so this is the most any overhead removal can reach without faster kernels.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import BenchSpec, FwdBwdJob, StepJob, _quiet_stderr, bench_config, time_interleaved, train_flops

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


class ForwardJob(FwdBwdJob):
    """The model's forward with autograd recording (as in training), graph dropped: no backward."""

    backward = False


def op_kinds(job: StepJob, steps: int = 3) -> dict:
    """Shares of a profiled step by kind of work (torch.profiler over `steps` steps of `job`): each
    kind's operator self time over the profiled wall time; `unattributed` is the rest. (Shares, not
    ms: the profiler slows the step down, so its milliseconds are not the step's.)"""
    import time
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            job()
        wall_us = (time.perf_counter() - t0) * 1e6
    kinds = dict(matmul=0.0, attention=0.0, other_ops=0.0)
    for e in prof.key_averages():
        kind = ("matmul" if e.key in MATMUL_OPS else "attention" if "scaled_dot_product" in e.key
                else "other_ops")
        kinds[kind] += e.self_cpu_time_total / wall_us
    kinds["unattributed"] = max(0.0, 1.0 - sum(kinds.values()))
    return kinds


def breakdown(spec: BenchSpec, variant: str, loops: int, device: str, compile: bool, peak: float,
              seed: int = 0) -> dict:
    """One row: the step's stages and kinds of work in ms, its floor and share of the peak."""
    with tempfile.TemporaryDirectory(prefix="flt-breakdown-") as tmp:
        cfg = bench_config(spec, variant, loops, device, compile=compile)
        plain = StepJob(cfg, Path(tmp) / "plain", diagnostics=False)
        diag = StepJob(cfg, Path(tmp) / "diag", diagnostics=True)
        jobs = dict(forward=ForwardJob(plain), fwd_bwd=FwdBwdJob(plain), step=plain, diag=diag)
        _, cpu = time_interleaved(jobs, spec.repeats, spec.steps_per_sample, spec.warmup, device, seed)
        kinds = op_kinds(diag)
        for job in (plain, diag):
            job.close()
    med = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    floor = 1e3 * train_flops(cfg.model, cfg.train.batch_size)["total"] / peak
    stages = dict(forward=med["forward"], backward=med["fwd_bwd"] - med["forward"],
                  optimizer_clip_log=med["step"] - med["fwd_bwd"], diagnostics=med["diag"] - med["step"])
    kernels_ms = (kinds["matmul"] + kinds["attention"]) * med["diag"]
    return dict(loops=loops, compiled=compile, step_ms=med["diag"], floor_ms=floor,
                pct_of_peak=100 * floor / med["diag"], kernel_ceiling_pct=100 * floor / kernels_ms,
                **{f"{k}_ms": v for k, v in stages.items()},
                **{f"{k}_ms": share * med["diag"] for k, share in kinds.items()})


def format_breakdown(rows: list[dict], peak: float) -> str:
    cols = ["step", "floor", "forward", "backward", "optimizer_clip_log", "diagnostics", "matmul", "attention",
            "other_ops", "unattributed"]
    head = f"{'K':>3s} {'compiled':>8s} {'% peak':>7s} {'ceiling':>7s} " + " ".join(f"{c[:12]:>12s}" for c in cols)
    lines = [f"step breakdown, ms per step (process CPU time, 1 thread); floor = analytic matmul FLOPs at the "
             f"measured peak {peak / 1e9:.1f} GFLOP/s", head]
    for r in rows:
        lines.append(f"{r['loops']:3d} {str(r['compiled']):>8s} {r['pct_of_peak']:6.1f}% {r['kernel_ceiling_pct']:6.1f}% "
                     + " ".join(f"{r[c + '_ms']:12.1f}" for c in cols))
    lines.append("ceiling = floor / (matmul + attention): the share of the peak a step made of nothing but its matmul "
                 "and attention kernels, as they run at these shapes, would reach")
    return "\n".join(lines)


def compile_modes(device: str) -> list[bool]:
    from flt_diag.training.compile_precision import cpu_compiler_available
    return [False, True] if device == "cuda" or cpu_compiler_available() else [False]


def breakdown_main(spec: BenchSpec, variant: str, loops: list[int], device: str, peak: float) -> list[dict]:
    rows = [breakdown(spec, variant, K, device, c, peak) for K in loops for c in compile_modes(device)]
    print(format_breakdown(rows, peak))
    return rows

