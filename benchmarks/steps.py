"""The training step of each variant against the unrolled reference, with and without diagnostics, its
forward+backward alone, compiled vs eager, the memory sweep, the issue's targets and the printed table
(`bench.py` without --flops)."""
from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from common import (TARGETS, BenchSpec, FwdBwdJob, MatmulJob, StepJob, _log, _quiet_stderr, bench_config, paired, stats,
                    time_interleaved, train_flops)
from memory import memory_sweep

def run_benchmarks(spec: BenchSpec, variants: list[str], device: str = "cpu", diag_variants: list[str] | None = None,
                   memory_variant: str = "flt", seed: int = 0, profile: bool = False,
                   verbose: bool = True, fwd_bwd: bool = True, eager_variants: list[str] = ()) -> dict:
    """Parts a-d. Returns the results as a JSON-ready dict. `eager_variants`: also time their step
    with compilation off (on CUDA: compiled vs eager; on CPU both are eager)."""
    log = _log if verbose else (lambda msg: None)
    diag_variants = variants if diag_variants is None else [v for v in diag_variants if v in variants]
    K = spec.step_loops
    results: dict = dict(spec=asdict(spec), variants=variants, diag_variants=diag_variants, device=device,
                         threads=torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="flt-bench-") as tmp:
        tmp = Path(tmp)
        jobs: dict[str, Callable[[], None]] = {}
        step_jobs: list[StepJob] = []
        log(f"building {len(variants) + len(diag_variants) + 1} trainers (K={K}, {device})")
        for v in variants:
            step_jobs.append(StepJob(bench_config(spec, v, K, device), tmp / f"step-{v}", diagnostics=False))
            jobs[f"step:{v}"] = step_jobs[-1]
            if fwd_bwd:
                jobs[f"fb:{v}"] = FwdBwdJob(step_jobs[-1])
        for v in diag_variants:
            step_jobs.append(StepJob(bench_config(spec, v, K, device), tmp / f"diag-{v}", diagnostics=True))
            jobs[f"diag:{v}"] = step_jobs[-1]
        for v in eager_variants:
            step_jobs.append(StepJob(bench_config(spec, v, K, device, compile=False), tmp / f"eager-{v}",
                                     diagnostics=False))
            jobs[f"eager:{v}"] = step_jobs[-1]
        unrolled = StepJob(bench_config(spec, "lt", K, device), tmp / "unrolled", diagnostics=False, unrolled=True)
        step_jobs.append(unrolled)
        jobs["unrolled"] = unrolled
        if fwd_bwd:
            jobs["fb:unrolled"] = FwdBwdJob(unrolled)
        peak_job = MatmulJob(spec.peak_size, device)
        jobs["matmul"] = peak_job
        model_cfg = step_jobs[0].trainer.cfg.model
        n_blocks = len(unrolled.trainer.model.blocks)
        log(f"timing: {spec.repeats} rounds x {spec.steps_per_sample} steps x {len(jobs)} configurations")
        samples, cpu = time_interleaved(jobs, spec.repeats, spec.steps_per_sample, spec.warmup, device, seed,
                                        progress=log)
        if profile:
            results["profile"] = {name: _profile_step(jobs[name]) for name in
                                  [f"step:{variants[-1]}", "unrolled"] + ([f"diag:{diag_variants[-1]}"]
                                                                           if diag_variants else [])}
        for j in step_jobs:
            j.close()

    t = step_jobs[0].trainer.cfg.train
    flops = train_flops(model_cfg, t.batch_size, K, t.grad_accum)
    peak = [peak_job.flops * peak_job.inner / s for s in samples["matmul"]]
    results["model"] = model_cfg.to_dict()
    results["batch_size"], results["grad_accum"] = t.batch_size, t.grad_accum
    results["unrolled_blocks"] = n_blocks
    results["flops_per_step"] = flops
    results["peak_flops"] = dict(stats(peak), size=spec.peak_size,
                                 dtype="bfloat16" if device == "cuda" else "float32")
    results["samples_s"] = samples
    use_cpu = device == "cpu"
    if use_cpu:
        results["cpu_samples_s"] = cpu

    un = samples["unrolled"]
    rows = []
    for v in variants + ["unrolled"]:
        s = samples["unrolled" if v == "unrolled" else f"step:{v}"]
        row = dict(variant=v, step_s=stats(s), vs_unrolled=paired(s, un),
                   flops_per_s=stats([flops["total"] / x for x in s]),
                   mfu=paired(s, samples["matmul"], lambda x, m: flops["total"] / x / (peak_job.flops * peak_job.inner / m)))
        name = "unrolled" if v == "unrolled" else f"step:{v}"
        if use_cpu:
            row["cpu_step_s"] = stats(cpu[name])
            row["cpu_vs_unrolled"] = paired(cpu[name], cpu["unrolled"])
        if f"fb:{v}" in samples:
            row["fwd_bwd_s"] = stats(samples[f"fb:{v}"])
            if v != "unrolled":
                row["fwd_bwd_vs_unrolled"] = paired(samples[f"fb:{v}"], samples["fb:unrolled"])
                if use_cpu:
                    row["cpu_fwd_bwd_vs_unrolled"] = paired(cpu[f"fb:{v}"], cpu["fb:unrolled"])
        if f"eager:{v}" in samples:
            row["eager_step_s"] = stats(samples[f"eager:{v}"])
            row["compiled_vs_eager"] = paired(s, samples[f"eager:{v}"])
        if f"diag:{v}" in samples:
            d = samples[f"diag:{v}"]
            row["diag_step_s"] = stats(d)
            row["diag_overhead"] = paired(d, s)
            if use_cpu:
                row["cpu_diag_overhead"] = paired(cpu[f"diag:{v}"], cpu[name])
        rows.append(row)
    results["steps"] = rows

    mem_loops = sorted(set(spec.mem_loops))
    log(f"memory: variant {memory_variant}, K in {mem_loops}, with and without checkpointing")
    mem = memory_sweep(spec, memory_variant, mem_loops, device)
    results["memory"] = dict(variant=memory_variant, rows=mem,
                             method="torch.cuda.max_memory_allocated" if device == "cuda" else
                             "torch.profiler allocation records (peak of live bytes)")
    lo, hi = mem_loops[0], mem_loops[-1]
    for ckpt in (False, True):
        by_k = {r["loops"]: r for r in mem if r["checkpoint"] == ckpt}
        key = "checkpoint" if ckpt else "plain"
        results["memory"][f"ratio_{key}"] = dict(
            loops=[lo, hi],
            peak=by_k[hi]["peak_bytes"] / by_k[lo]["peak_bytes"] if by_k[lo]["peak_bytes"] else None,
            saved=by_k[hi]["saved_bytes"] / by_k[lo]["saved_bytes"] if by_k[lo]["saved_bytes"] else None)
    results["targets"] = check_targets(results)
    return results


def _profile_step(job: StepJob, top: int = 15) -> list[dict]:
    """Self time by operator over 3 training steps (torch.profiler), the `top` largest."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with _quiet_stderr(), profile(activities=acts) as prof:
        for _ in range(3):
            job()
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        rows.append(dict(op=e.key, calls=e.count // 3, self_cpu_ms=e.self_cpu_time_total / 3e3))
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 3e3
    return [dict(op="(total self cpu ms per step)", calls=0, self_cpu_ms=total)] + rows


def check_targets(results: dict) -> dict:
    """The issue's targets. Step: the worst variant's median paired ratio. Diagnostics: the median
    paired ratio pooled over every variant and round (per-variant medians are in the table; the
    worst of five noisy medians is biased upwards). Memory: the checkpointed peak, K max / K min."""
    out = {}
    looped = [r for r in results["steps"] if r["variant"] != "unrolled"]
    worst = max(looped, key=lambda r: r["vs_unrolled"]["median"])
    out["step_vs_unrolled"] = dict(target=TARGETS["step_vs_unrolled"], worst=worst["vs_unrolled"]["median"],
                                   worst_variant=worst["variant"],
                                   met=worst["vs_unrolled"]["median"] <= TARGETS["step_vs_unrolled"])
    if "cpu_vs_unrolled" in worst:
        out["step_vs_unrolled"]["worst_cpu"] = max(r["cpu_vs_unrolled"]["median"] for r in looped)
    diag = [r for r in looped if "diag_overhead" in r]
    if diag:
        wall, cpu = results["samples_s"], results.get("cpu_samples_s")
        pooled = lambda xs: stats([a / b for r in diag for a, b in  # noqa: E731
                                   zip(xs[f"diag:{r['variant']}"], xs[f"step:{r['variant']}"])])
        w = max(diag, key=lambda r: r["diag_overhead"]["median"])
        out["diagnostics_overhead"] = dict(target=TARGETS["diagnostics_overhead"], pooled=pooled(wall),
                                           worst=w["diag_overhead"]["median"], worst_variant=w["variant"],
                                           met=pooled(wall)["median"] <= TARGETS["diagnostics_overhead"])
        if cpu:
            out["diagnostics_overhead"]["pooled_cpu"] = pooled(cpu)
    r = results["memory"]["ratio_checkpoint"]["peak"]
    out["checkpoint_memory_ratio"] = dict(target=TARGETS["checkpoint_memory_ratio"], value=r,
                                          loops=results["memory"]["ratio_checkpoint"]["loops"],
                                          met=r is not None and r <= TARGETS["checkpoint_memory_ratio"])
    return out


# --------------------------------------------------------------------------- output

def _ms(s: dict) -> str:
    return f"{1e3 * s['median']:.1f} [{1e3 * s['q25']:.1f}-{1e3 * s['q75']:.1f}]"


def _x(s: dict) -> str:
    return f"{s['median']:.3f} [{s['q25']:.3f}-{s['q75']:.3f}]"


def format_table(res: dict) -> str:
    spec = res["spec"]
    m = res["model"]
    f = res["flops_per_step"]
    pk = res["peak_flops"]
    lines = [
        f"preset {res['preset']}: {spec['description']}; device {res['device']}, {res['threads']} thread(s)",
        f"timed step: K={spec['step_loops']} loops (L*K = {m['depth'] * spec['step_loops']} block passes), "
        f"{spec['repeats']} rounds x {spec['steps_per_sample']} steps, median [q25-q75]",
        f"FLOPs/step (analytic): {f['total'] / 1e9:.2f} GFLOP (blocks {f['blocks'] / 1e9:.2f}, "
        f"attention {f['attention'] / 1e9:.2f}, head {f['head'] / 1e9:.2f}); "
        f"measured peak {pk['median'] / 1e9:.1f} GFLOP/s ({pk['size']}^2 {pk['dtype']} matmul)",
        "",
        f"{'variant':9s} {'step ms':>21s} {'looped/unrolled':>20s} {'(cpu)':>6s} {'fwd+bwd ms':>21s} "
        f"{'looped/unrolled':>20s} {'(cpu)':>6s} {'GFLOP/s':>8s} {'MFU':>6s}",
    ]
    cpu = lambda r, k: f"{r[k]['median']:.3f}" if k in r else ""  # noqa: E731
    for r in res["steps"]:
        unr = "" if r["variant"] == "unrolled" else _x(r["vs_unrolled"])
        fb = _ms(r["fwd_bwd_s"]) if "fwd_bwd_s" in r else ""
        fbr = _x(r["fwd_bwd_vs_unrolled"]) if "fwd_bwd_vs_unrolled" in r else ""
        lines.append(f"{r['variant']:9s} {_ms(r['step_s']):>21s} {unr:>20s} "
                     f"{cpu(r, 'cpu_vs_unrolled') if r['variant'] != 'unrolled' else '':>6s} {fb:>21s} {fbr:>20s} "
                     f"{cpu(r, 'cpu_fwd_bwd_vs_unrolled'):>6s} "
                     f"{r['flops_per_s']['median'] / 1e9:8.1f} {100 * r['mfu']['median']:5.1f}%")
    diag = [r for r in res["steps"] if "diag_overhead" in r]
    if diag:
        lines += ["", "diagnostics (DiagnosticsCallback, default config, recording every step):",
                  f"{'variant':9s} {'off ms':>21s} {'on ms':>21s} {'on/off (paired)':>20s} {'(cpu)':>6s}"]
        for r in diag:
            lines.append(f"{r['variant']:9s} {_ms(r['step_s']):>21s} {_ms(r['diag_step_s']):>21s} "
                         f"{_x(r['diag_overhead']):>20s} {cpu(r, 'cpu_diag_overhead'):>6s}")
        t = res["targets"]["diagnostics_overhead"]
        lines.append(f"{'pooled':9s} {'':>21s} {'':>21s} {_x(t['pooled']):>20s} "
                     f"{cpu(t, 'pooled_cpu'):>6s}")
    eager = [r for r in res["steps"] if "compiled_vs_eager" in r]
    if eager:
        lines += ["", "compiled vs eager (the step as the Trainer runs it, compile on / off):",
                  f"{'variant':9s} {'compiled ms':>21s} {'eager ms':>21s} {'compiled/eager':>20s}"]
        lines += [f"{r['variant']:9s} {_ms(r['step_s']):>21s} {_ms(r['eager_step_s']):>21s} "
                  f"{_x(r['compiled_vs_eager']):>20s}" for r in eager]
    lines.append("(cpu): the same paired ratio from this process's CPU time (leaves out time other processes "
                 "hold the core, not slowdowns from sharing it)" if res["device"] == "cpu" else "")
    mem = res["memory"]
    lines += ["", f"activation memory, variant {mem['variant']}, one forward+backward ({mem['method']}):",
              f"{'K':>4s} {'peak MiB':>10s} {'peak MiB ckpt':>14s} {'saved MiB':>10s} {'saved MiB ckpt':>15s}"]
    by = {(r["loops"], r["checkpoint"]): r for r in mem["rows"]}
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    for K in sorted({r["loops"] for r in mem["rows"]}):
        a, c = by[(K, False)], by[(K, True)]
        lines.append(f"{K:4d} {mib(a['peak_bytes']):>10s} {mib(c['peak_bytes']):>14s} "
                     f"{mib(a['saved_bytes']):>10s} {mib(c['saved_bytes']):>15s}")
    for key in ("plain", "checkpoint"):
        r = mem[f"ratio_{key}"]
        lines.append(f"ratio K={r['loops'][1]}/K={r['loops'][0]} {key:10s}: peak {r['peak']:.2f}x, "
                     f"saved {r['saved']:.2f}x")
    lines += ["", "targets:"]
    t = res["targets"]
    a = t["step_vs_unrolled"]
    lines.append(f"  looped step <= {a['target']}x unrolled: worst {a['worst']:.3f}x ({a['worst_variant']}) "
                 f"-> {'MET' if a['met'] else 'MISSED'}")
    if "worst_cpu" in a:
        lines[-1] += f" (cpu time: worst {a['worst_cpu']:.3f}x)"
    if "diagnostics_overhead" in t:
        b = t["diagnostics_overhead"]
        cpu_txt = f", cpu time {100 * (b['pooled_cpu']['median'] - 1):+.1f}%" if "pooled_cpu" in b else ""
        lines.append(f"  diagnostics overhead <= {100 * (b['target'] - 1):.0f}%: pooled median "
                     f"{100 * (b['pooled']['median'] - 1):+.1f}%{cpu_txt}; worst variant "
                     f"{100 * (b['worst'] - 1):+.1f}% ({b['worst_variant']}) -> {'MET' if b['met'] else 'MISSED'}")
    c = t["checkpoint_memory_ratio"]
    val = "n/a" if c["value"] is None else f"{c['value']:.2f}x"
    lines.append(f"  checkpointed peak memory K={c['loops'][1]} <= {c['target']}x K={c['loops'][0]}: {val} "
                 f"-> {'MET' if c['met'] else 'MISSED'}")
    if "profile" in res:
        for name, rows in res["profile"].items():
            lines += ["", f"profile of {name} (self CPU ms per step, top ops):"]
            lines += [f"  {r['self_cpu_ms']:9.2f}  {r['calls']:5d}  {r['op']}" for r in rows]
    return "\n".join(lines)

