"""The achieved FLOP rate per K against this machine's measured matmul peak (`bench.py --flops`): the
Trainer's step with diagnostics, timed here (eager and, on a CPU with a compiler, compiled), or the step
times of a finished sweep (`--sweep`)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from common import BenchSpec, MatmulJob, StepJob, _log, _sync, bench_config, environment, time_interleaved, train_flops
from breakdown import compile_modes
from flt_diag.config.run_config import RunConfig

def process_clock(device: str):
    """The clock of a CPU measurement at one thread: this process's CPU time (what another process
    takes of the core is left out); wall time on CUDA or with several threads."""
    return time.process_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def matmul_peak(n: int, device: str, repeats: int = 5) -> dict:
    """This machine's measured matmul rate: an n x n torch.mm (fp32 on CPU at the current thread
    count, bf16 on CUDA), timed `repeats` times after a warm-up. `peak` is the best rate (sharing
    the machine only slows a matmul down), `median` the median."""
    job = MatmulJob(n, device)
    job()
    rates = []
    clock = process_clock(device)
    for _ in range(repeats):
        _sync(device)
        t0 = clock()
        job()
        rates.append(job.flops * job.inner / (clock() - t0))
    return dict(peak=max(rates), median=statistics.median(rates), size=n, repeats=repeats,
                dtype="bfloat16" if device == "cuda" else "float32")


def flops_rows(runs: list[tuple[RunConfig, float]], peak: float) -> list[dict]:
    """One row per K from (config, seconds per step) pairs: median step time, analytic GFLOP per
    step (`train_flops`, per process), achieved GFLOP/s and its share of `peak` (medians over the
    runs at that K)."""
    by_k: dict[int, list[tuple[float, float]]] = {}
    for cfg, step_s in runs:
        t = cfg.train
        by_k.setdefault(cfg.model.loops, []).append(
            (step_s, train_flops(cfg.model, t.batch_size, grad_accum=t.grad_accum)["total"]))
    rows = []
    for K, xs in sorted(by_k.items()):
        rate = statistics.median(f / s for s, f in xs)
        rows.append(dict(loops=K, runs=len(xs), step_s=statistics.median(s for s, _ in xs),
                         gflop_per_step=statistics.median(f for _, f in xs) / 1e9,
                         gflops=rate / 1e9, pct_of_peak=100 * rate / peak))
    return rows


def sweep_step_times(sweep: Path) -> list[tuple[RunConfig, float]]:
    """(config, seconds per step) of every finished run of a sweep (or one run) folder: its training
    wall time over its steps - evaluation, diagnostics and checkpoints included, as the sweep ran."""
    from flt_diag.storage.folders import load_config, load_summary, run_dirs
    out = []
    for d in run_dirs(sweep):
        s = load_summary(d)
        if s and s.wall_time and s.steps_done:
            out.append((load_config(d).run_config(), s.wall_time / s.steps_done))
    return out


def timed_step_times(spec: BenchSpec, variant: str, loops: list[int], device: str, seed: int = 0,
                     log: Callable[[str], None] = lambda m: None,
                     compile: bool | None = None) -> list[tuple[RunConfig, float]]:
    """(config, median seconds per step) at each K: the Trainer's step with its default diagnostics,
    as a sweep runs it, timed round-robin over the K."""
    with tempfile.TemporaryDirectory(prefix="flt-bench-") as tmp:
        jobs = {K: StepJob(bench_config(spec, variant, K, device, compile=compile), Path(tmp) / f"K{K}", diagnostics=True)
                for K in loops}
        wall, cpu = time_interleaved(jobs, spec.repeats, spec.steps_per_sample, spec.warmup, device, seed, progress=log)
        for job in jobs.values():
            job.close()
    times = cpu if process_clock(device) is time.process_time else wall  # the same clock as the peak's
    return [(jobs[K].trainer.cfg, statistics.median(times[K])) for K in loops]


def format_flops(res: dict) -> str:
    pk = res["peak"]
    lines = [f"achieved FLOP rate per K ({res['source']}); analytic matmul FLOPs (train_flops: 6 N tokens "
             f"+ attention) against the measured matmul peak {pk['peak'] / 1e9:.1f} GFLOP/s "
             f"({pk['size']}^2 {pk['dtype']} torch.mm, best of {pk['repeats']}; median {pk['median'] / 1e9:.1f}), "
             f"{res['threads']} thread(s); times are {res.get('clock', 'wall')} time",
             f"{'K':>4s} {'step':>9s} {'runs':>5s} {'step ms':>10s} {'GFLOP/step':>11s} {'GFLOP/s':>9s} {'% of peak':>10s}"]
    lines += [f"{r['loops']:4d} {r.get('mode', 'sweep'):>9s} {r['runs']:5d} {1e3 * r['step_s']:10.1f} "
              f"{r['gflop_per_step']:11.3f} {r['gflops']:9.2f} {r['pct_of_peak']:9.1f}%" for r in res["rows"]]
    return "\n".join(lines)


def flops_main(args: argparse.Namespace, spec: BenchSpec) -> int:
    """`--flops`: time the step at each K of --loops (first of --variants, default flt); `--sweep DIR`:
    the step times a finished sweep achieved. Either way a table K -> step time, GFLOP/s, % of peak."""
    if args.sweep is not None:
        runs = sweep_step_times(args.sweep)
        if not runs:
            print(f"error: {args.sweep} has no finished runs with a wall time", file=sys.stderr)
            return 2
        source = f"sweep {args.sweep}"
    else:
        loops = args.loops or [3, 6, 9, 12]
        variant = (args.variants or ["flt"])[0]
        source = (f"{variant}, preset {args.preset}, {args.device}, diagnostics on, {spec.repeats} rounds x "
                  f"{spec.steps_per_sample} steps")
        modes = {}
        for compiled in compile_modes(args.device):  # eager, and compiled where the machine can compile
            modes["compiled" if compiled else "eager"] = timed_step_times(spec, variant, loops, args.device,
                                                                          args.seed, _log, compile=compiled)
    peak = matmul_peak(spec.peak_size, args.device)
    if args.sweep is not None:
        rows = flops_rows(runs, peak["peak"])
    else:
        rows = [dict(r, mode=m) for m, runs in modes.items() for r in flops_rows(runs, peak["peak"])]
        rows.sort(key=lambda r: (r["loops"], r["mode"] != "eager"))
    res = dict(source=source, peak=peak, threads=torch.get_num_threads(), rows=rows, env=environment(args.device),
               clock="process CPU" if process_clock(args.device) is time.process_time else "wall")
    print(format_flops(res))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str))
        print(f"results: {args.out}")
    return 0

