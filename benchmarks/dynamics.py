"""The cost of the loop-dynamics records (flt_diag.instruments.loop_dynamics), paired in one process.

    python benchmarks/dynamics.py [--preset tiny] [--variant lt] [--loops 12] [--repeats 7] [--out r.json]

Interleaved rounds (common.time_interleaved) of four timed jobs on one variant at K loops:
  off      the training step with diagnostics off;
  diag     the step with the diagnostics of before (DiagnosticsCallback; loop dynamics off);
  cheap    the step with the default diagnostics, exit loss and every-N records off (+ fixed-point residual);
  exit     the cheap step with the exit loss of every loop (--exit-loss-every 1);
  every-N  on the cheap step's model and batch: one loop-map gain + gradient agreement call
           (--dynamics-batch sequences, --dynamics-iters iterations), and one sharpness call.
Reported: paired ratios to `off`, and the overhead at the defaults = (cheap - off) / off
+ (exit - cheap) / off / exit_loss_every + the every-N call's cost / off / dynamics_every (every
recorded step: the first 2,000 steps record all).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_PRESETS, StepJob, bench_config, environment, paired, stats, time_interleaved  # noqa: E402
from flt_diag.instruments import loop_dynamics as D  # noqa: E402
from flt_diag.instruments.sharpness import sharpness  # noqa: E402
from flt_diag.config.run_config import DiagnosticsConfig, with_overrides  # noqa: E402


def _job(spec, variant: str, K: int, tmp: Path, name: str, diagnostics: bool, **options) -> StepJob:
    cfg = bench_config(spec, variant, K, "cpu")
    cfg = with_overrides(cfg, diagnostics=options)
    return StepJob(cfg, tmp / name, diagnostics=diagnostics)


def _every_n_job(job: StepJob, what: str):
    trainer, d = job.trainer, DiagnosticsConfig()
    idx, targets = trainer.batch(0)
    idx, targets = idx[:d.dynamics_batch], targets[:d.dynamics_batch]
    gen = torch.Generator().manual_seed(0)

    def run() -> None:
        if what == "gain":
            D.loop_map_stats(trainer.model, idx, d.dynamics_iters, d.krylov_dim, d.perturbation_dirs, gen)
            D.loop_gradient_agreement(trainer.model, idx, targets)
        else:
            sharpness(trainer.model, idx, targets, d.dynamics_iters, generator=gen)
    return run


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=list(BENCH_PRESETS))
    p.add_argument("--variant", default="lt")
    p.add_argument("--loops", type=int, default=12)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps-per-sample", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    spec, d = BENCH_PRESETS[a.preset], DiagnosticsConfig()
    with tempfile.TemporaryDirectory(prefix="flt-dyn-") as tmp:
        tmp = Path(tmp)
        off = _job(spec, a.variant, a.loops, tmp, "off", False)
        diag = _job(spec, a.variant, a.loops, tmp, "diag", True, loop_dynamics=False, dynamics_every=0)
        cheap = _job(spec, a.variant, a.loops, tmp, "cheap", True, exit_loss_every=0, dynamics_every=0)
        exit_ = _job(spec, a.variant, a.loops, tmp, "exit", True, exit_loss_every=1, dynamics_every=0)
        jobs = {"off": off, "diag": diag, "cheap": cheap, "exit": exit_, "gain+agreement": _every_n_job(off, "gain"),
                "sharpness": _every_n_job(off, "sharpness")}
        wall, cpu = time_interleaved(jobs, a.repeats, a.steps_per_sample, warmup=1, device="cpu")
        for job in (off, diag, cheap, exit_):
            job.close()
    res = dict(env=environment("cpu"), preset=a.preset, variant=a.variant, loops=a.loops, defaults=dict(
        exit_loss_every=d.exit_loss_every, dynamics_every=d.dynamics_every, dynamics_batch=d.dynamics_batch, dynamics_iters=d.dynamics_iters),
        step_off_ms=stats([1e3 * x for x in wall["off"]]))
    for name in ("diag", "cheap", "exit", "gain+agreement", "sharpness"):
        res[name] = dict(wall=paired(wall[name], wall["off"]), cpu=paired(cpu[name], cpu["off"]))
    for clock, samples in (("wall", wall), ("cpu", cpu)):
        res[f"overhead_at_defaults_{clock}"] = stats(
            [(c - o) / o + (e - c) / o / d.exit_loss_every + g / o / d.dynamics_every
             for c, e, o, g in zip(samples["cheap"], samples["exit"], samples["off"], samples["gain+agreement"])])
        res[f"overhead_before_{clock}"] = stats([(x - o) / o for x, o in zip(samples["diag"], samples["off"])])
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
