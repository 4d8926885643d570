"""How much a larger compiled region would save: the tiny training step with diagnostics off, compiled
three ways, interleaved in one process (process CPU time, one thread, medians over rounds):

* halves        flt-diag's `compile_blocks`: each block's two residual halves (what runs today);
* whole loop    `model._loop` compiled: one graph per loop (L blocks and the injections);
* whole forward `model.forward` compiled: one graph for all K loops, the head and the loss.

Only the first keeps every diagnostic hook outside compiled code; the other two are measured with
diagnostics off, as the most a design that records inside the graph could gain.

    python benchmarks/compile_scope.py [--loops 3 12] [--rounds 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import BenchSpec, StepJob, bench_config, positive_int  # noqa: E402

SCOPES = ("halves", "whole loop", "whole forward")


def scoped_jobs(spec: BenchSpec, loops: int, tmp: Path, backend: str = "inductor") -> dict[str, StepJob]:
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    jobs = {}
    for scope in SCOPES:
        job = StepJob(bench_config(spec, "flt", loops, "cpu", compile=False), tmp / scope.replace(" ", "_"),
                      diagnostics=False)
        model = job.trainer.model
        if scope == "halves":
            from flt_diag.training.compile_precision import compile_blocks
            compile_blocks(model, backend=backend)
        elif scope == "whole loop":
            model._loop = torch.compile(model._loop, backend=backend)
        else:
            model.forward = torch.compile(model.forward, backend=backend)
        jobs[scope] = job
    return jobs


def measure(spec: BenchSpec, loops: int, rounds: int, backend: str = "inductor") -> dict[str, float]:
    """Median ms per step of each scope at `loops`."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="flt-scope-") as tmp:
        jobs = scoped_jobs(spec, loops, Path(tmp), backend)
        for job in jobs.values():  # compilation and warm-up
            for _ in range(3):
                job()
        times = {s: [] for s in jobs}
        for r in range(rounds):
            for s in SCOPES[r % 3:] + SCOPES[:r % 3]:
                t0 = time.process_time()
                jobs[s]()
                jobs[s]()
                times[s].append((time.process_time() - t0) / 2)
        for job in jobs.values():
            job.close()
    return {s: 1e3 * statistics.median(v) for s, v in times.items()}


def main(argv=None) -> int:
    from bench import BENCH_PRESETS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", type=positive_int, nargs="+", default=[3, 12])
    p.add_argument("--rounds", type=positive_int, default=8)
    args = p.parse_args(argv)
    from flt_diag.config.variants import MAX_LOOPS
    if max(args.loops) > MAX_LOOPS:
        p.error(f"--loops must be <= {MAX_LOOPS}")
    print("tiny step, diagnostics off, one thread, process CPU ms (median); change against halves")
    for K in args.loops:
        ms = measure(BENCH_PRESETS["tiny"], K, args.rounds)
        print(f"  K={K:<3d} " + "   ".join(f"{s}: {v:6.1f} ({100 * (v / ms['halves'] - 1):+.0f} %)" for s, v in ms.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
