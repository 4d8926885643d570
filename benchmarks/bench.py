"""Performance benchmarks of the looped transformer, in one process, interleaved.

    python benchmarks/bench.py [--preset tiny|mid|gpu] [--variants lt flt ...] [--loops 3 6 9 12]
                               [--step-loops K] [--repeats N] [--out results.json] [--toy]
                               [--device cpu|cuda] [--threads N] [--quick] [--profile]
                               [--eager-variants V ...]
    python benchmarks/bench.py --flops [--loops 3 6 9 12] [--variants flt] [--preset tiny]
    python benchmarks/bench.py --flops --sweep runs/ablation-tiny

What is measured (README.md in this folder has the formulas and the measured numbers):

  a. training-step time of each variant (flt_diag.training.trainer.Trainer.run_step, the step `fit` runs:
     forward, backward, clipping, the Muon/AdamW recipe of flt_diag.training.optim.build_optimizers, + the
     per-step host transfer) against an UNROLLED reference: L*K distinct flt_diag.model.transformer.Block
     modules run as one plain pass, same embedding / head / softcap, same optimizer recipe, trained
     by the same Trainer (`Trainer(..., model=UnrolledTransformer)`); with --eager-variants, also
     the step with compilation off (compiled vs eager on CUDA);
  b. the same step with full diagnostics (DiagnosticsCallback, default DiagnosticsConfig, recording
     every step, exactly as the Trainer runs it) against the step without;
  c. achieved FLOP/s of the step (analytic matmul FLOPs, `train_flops`) against this machine's own
     measured matmul rate (`--peak-size`, fp32 on CPU, bf16 on CUDA) -> MFU;
  d. peak activation memory of one forward+backward against K, with and without per-loop
     activation checkpointing (`model.checkpoint_loops`).
  --flops: only the achieved FLOP rate per K against the measured matmul peak (a table K -> step
     time, GFLOP/s, % of peak): of the Trainer's step with diagnostics, timed here at each K of
     --loops, or with --sweep of the runs of a finished sweep (wall time / steps, from summary.json).

Timing is round-robin: every round runs one sample (`steps_per_sample` steps) of every
configuration, in a freshly shuffled order, and ratios are taken within a round (paired), so
drifts of a shared machine cancel. Reported: median and interquartile range over the rounds.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/bench.py` from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules

from common import *  # noqa: E402,F401,F403  (re-exported: tests and scripts use bench.<name>)
from common import BENCH_PRESETS, QUICK, QUICK_VARIANTS, VARIANTS, environment, toy  # noqa: E402
from flops import *  # noqa: E402,F401,F403
from breakdown import breakdown_main  # noqa: E402
from flops import flops_main, matmul_peak  # noqa: E402
from memory import *  # noqa: E402,F401,F403
from steps import *  # noqa: E402,F401,F403
from steps import format_table, run_benchmarks  # noqa: E402

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(BENCH_PRESETS))
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="variants to time [default: all five; --quick: lt flt]")
    p.add_argument("--diag-variants", nargs="*", default=None,
                   help="variants (among --variants) whose step is also timed with diagnostics "
                        "[default: --variants]")
    p.add_argument("--loops", nargs="+", type=int, default=None,
                   help="K of the memory sweep [default: 3 6 9 12; --quick: 3 12]")
    p.add_argument("--step-loops", type=int, default=None, help="K of the timed steps [default: per preset]")
    p.add_argument("--eager-variants", nargs="*", default=[], choices=list(VARIANTS),
                   help="variants (among --variants) whose step is also timed with compilation off "
                        "(on CUDA: compiled vs eager)")
    p.add_argument("--memory-variant", default="flt", choices=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=None, help="rounds of the round-robin [default: per preset]")
    p.add_argument("--steps-per-sample", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads [default: 1 on cpu (see README: 2 threads on a shared 2-core box "
                        "are 2-40x slower under contention), torch's default on cuda]")
    p.add_argument("--quick", action="store_true", help="a smoke-test size: < 2 minutes on 2 cores")
    p.add_argument("--toy", action="store_true",
                   help="the preset's code path at toy size (d=64, L=2, batch 4): e.g. --preset gpu --toy "
                        "runs the GPU preset's compiled blocks, diagnostics and eager comparison on a CPU")
    p.add_argument("--profile", action="store_true", help="also profile one looped and the unrolled step")
    p.add_argument("--no-fwd-bwd", action="store_true", help="skip the forward+backward-only timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flops", action="store_true",
                   help="only the achieved FLOP rate per K (--loops) against the measured matmul peak")
    p.add_argument("--breakdown", action="store_true",
                   help="only where the step's time goes, by stage and by kind of work, at each K of --loops "
                        "(eager and compiled)")
    p.add_argument("--sweep", type=Path, default=None,
                   help="with --flops: the rate a finished sweep (or run) folder achieved, from its summaries")
    args = p.parse_args(argv)
    if args.sweep is not None:
        args.flops = True
    for k in args.loops or []:
        if k < 1:
            p.error(f"loops must be >= 1, got {k}")
    if args.diag_variants:
        bad = [v for v in args.diag_variants if v not in VARIANTS]
        if bad:
            p.error(f"unknown variant {bad[0]!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda requested but CUDA is not available on this machine", file=sys.stderr)
        return 2
    spec = replace(BENCH_PRESETS[args.preset])
    if args.quick:
        spec = replace(spec, **QUICK)
    if args.toy:
        spec = toy(spec)
    overrides = dict(step_loops=args.step_loops, repeats=args.repeats, steps_per_sample=args.steps_per_sample,
                     mem_loops=tuple(args.loops) if args.loops else None)
    spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    if args.flops:
        return flops_main(args, spec)
    if args.breakdown:
        peak = matmul_peak(spec.peak_size, args.device)
        rows = breakdown_main(spec, (args.variants or ["flt"])[0], args.loops or [3, 12], args.device, peak["peak"])
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(dict(peak=peak, rows=rows, env=environment(args.device)), indent=1))
        return 0
    variants = args.variants or (QUICK_VARIANTS if args.quick else list(VARIANTS))
    diag_variants = args.diag_variants if args.diag_variants is not None else variants
    if len(spec.mem_loops) < 2:
        print("error: --loops needs at least two loop counts for the memory ratio", file=sys.stderr)
        return 2
    if args.device == "cuda" or spec.compile:
        import importlib
        dynamo = importlib.import_module("torch._dynamo")
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo.config, name):  # L*K compiled blocks must not fall back to eager
                setattr(dynamo.config, name, max(getattr(dynamo.config, name), 1024))
    t0 = time.perf_counter()
    res = run_benchmarks(spec, variants, args.device, diag_variants, args.memory_variant, args.seed, args.profile,
                         fwd_bwd=not args.no_fwd_bwd, eager_variants=[v for v in args.eager_variants if v in variants])
    res["preset"] = args.preset
    res["quick"] = args.quick
    res["toy"] = args.toy
    res["command"] = "python benchmarks/bench.py " + " ".join(shlex.quote(a) for a in
                                                            (sys.argv[1:] if argv is None else argv))
    res["env"] = environment(args.device)
    res["wall_s"] = time.perf_counter() - t0
    print(format_table(res))
    print(f"\nwall time {res['wall_s']:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
