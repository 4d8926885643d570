"""What flt_diag.watch costs a training step of a looped model of one's own, paired in one process.

    python benchmarks/probe_overhead.py [--steps-per-sample 20] [--repeats 10] [--width 64] [--ablate] [--out r.json]

The model is Huginn-style (issue 42): a prelude block, a recurrent core (a concat adapter of the stream and
the embedded input, then one transformer layer) run r times, r drawn per forward from 4..8, a coda block and
a head. Two copies with the same initial weights and the same draws of r train side by side on the same
batches: `plain` (no probe) and `watched` (flt_diag.watch on the core, its defaults: the hooks on every
recorded step, the loop dynamics on at their defaults, with head= and targets= so that the exit loss of
every loop is recorded too). common.time_interleaved times `--steps-per-sample` steps of each per round, in
a shuffled order, `--repeats` rounds, after one warm-up step each (step 0, where the probe's every-500 record
(loop_step=: spectral radius, gains) falls: it is timed once on its own and amortised over 500 steps).
Reported: the paired ratio watched / plain (process CPU time, one thread; wall too) and the overhead at the
defaults = ratio - 1 + (the every-500 record's extra time) / plain step / 500, beside the matmul peak
measured in the same run (flops.matmul_peak). `--ablate` adds watched arms with one default changed each (ABLATIONS:
what a piece's share of the step is, paired in the same rounds; their every-500 record is off, so compare their
ratios with `watched`'s ratio, not with the overhead at the defaults).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, paired, positive_int, stats, time_interleaved  # noqa: E402
from flt_diag.instruments.loop_hooks import ProbeError  # noqa: E402,F401  (the package imports as users do)
from flops import matmul_peak  # noqa: E402
import flt_diag  # noqa: E402
from flt_diag.config.run_config import DiagnosticsConfig  # noqa: E402

VOCAB, WIDTH, SEQ, BATCH, R = 256, 64, 64, 8, (4, 8)
ABLATIONS = {"exit-loss-every-50": dict(exit_loss_every=50), "no-exit-loss-or-similarity": dict(exit_loss_every=0),
             "no-loop-dynamics": dict(loop_dynamics=False),
             "no-recorded-step": dict(dense_steps=0, record_every=10**9)}  # (--ablate; each also with dynamics_every=0)
# (no-recorded-step: the hooks attached but never armed after step 0: what remains is the loss, the total gradient
# norm, the rows and their flushes)


class Huginn(nn.Module):
    """Prelude, a recurrent core of r loops (r drawn per forward from `R`, by the model's own generator),
    coda, head: the shape of the recurrent-depth models the probe is meant for."""

    def __init__(self, seed: int, width: int = WIDTH):
        super().__init__()
        def layer():
            return nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.embed, self.prelude, self.coda = nn.Embedding(VOCAB, width), layer(), layer()
        self.adapter, self.core = nn.Linear(2 * width, width), layer()
        self.head = nn.Linear(width, VOCAB)
        self.draws = random.Random(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        e = self.prelude(self.embed(x), src_mask=mask, is_causal=True)
        self.held = e, mask  # (what loop_step holds fixed between two loop ends)
        h = torch.zeros_like(e)
        for _ in range(self.draws.randint(*R)):
            h = self.loop_step(h)
        return self.head(self.coda(h, src_mask=mask, is_causal=True))

    def loop_step(self, h: torch.Tensor) -> torch.Tensor:
        e, mask = self.held  # (the probe's every-N records pass the first dynamics_batch sequences only)
        return self.core(self.adapter(torch.cat([h, e[:h.shape[0]]], -1)), src_mask=mask, is_causal=True)


class Arm:
    """One copy of the model, its optimizer and the shared batch stream; `step()` is one training step."""

    def __init__(self, model: Huginn, batches: list, probe=None):
        self.model, self.batches, self.probe, self.i = model, batches, probe, 0
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        self.opt.step()
        if self.probe is not None:
            self.probe.step(loss=loss)
        self.opt.zero_grad()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps-per-sample", type=positive_int, default=20)
    p.add_argument("--repeats", type=positive_int, default=10, help="rounds (>= 2: the ratio's quartiles)")
    p.add_argument("--width", type=positive_int, default=WIDTH, help="the model's width d, even (heads: 2, MLP: 2d)")
    p.add_argument("--ablate", action="store_true", help="also the arms of ABLATIONS (one default changed each)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.repeats < 2 or args.width % 2:
        p.error("--repeats must be >= 2" if args.repeats < 2 else f"--width must be even (2 heads), got {args.width}")
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: no folder {args.out.parent}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    steps = 1 + args.steps_per_sample * args.repeats
    batches = [(x, torch.roll(x, 1, dims=1)) for x in torch.randint(0, VOCAB, (steps, BATCH, SEQ), generator=gen)]
    plain = Huginn(seed=1, width=args.width)
    watched = Huginn(seed=1, width=args.width)
    watched.load_state_dict(plain.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"plain": Arm(plain, batches)}
        probe = flt_diag.watch(watched, blocks=[watched.core], folder=Path(tmp) / "run", head=watched.head,
                               targets=lambda x: torch.roll(x, 1, dims=1), loop_step=watched.loop_step, steps=steps)
        arms["watched"] = Arm(watched, batches, probe)
        probes = [probe]
        for name, change in (ABLATIONS.items() if args.ablate else ()):
            model = Huginn(seed=1, width=args.width)
            model.load_state_dict(plain.state_dict())
            probes.append(flt_diag.watch(model, blocks=[model.core], folder=Path(tmp) / name, head=model.head,
                                         targets=lambda x: torch.roll(x, 1, dims=1), loop_step=model.loop_step,
                                         steps=steps, diagnostics=DiagnosticsConfig(dynamics_every=0, **change)))
            arms[name] = Arm(model, batches, probes[-1])
        first = {}
        for name, arm in arms.items():  # step 0: the every-500 record falls here for the watched arm
            t0 = time.process_time()
            arm.step()
            first[name] = time.process_time() - t0
        wall, cpu = time_interleaved({n: a.step for n, a in arms.items()}, args.repeats, args.steps_per_sample,
                                     warmup=0, device="cpu")
        for each in probes:
            each.close()
        verdict = probe.summary.verdict if probe.summary is not None else None
    ratio = paired(cpu["watched"], cpu["plain"])
    plain_step = stats(cpu["plain"])["median"]
    every_n = max(0.0, first["watched"] - first["plain"] - (ratio["median"] - 1) * plain_step)
    result = dict(env=environment("cpu"), matmul_peak_gflops=matmul_peak(512, "cpu")["peak"] / 1e9,
                  width=args.width, steps_per_sample=args.steps_per_sample, repeats=args.repeats, cpu_ratio=ratio,
                  wall_ratio=paired(wall["watched"], wall["plain"]), plain_step_s=plain_step,
                  every_500_record_s=every_n, overhead_at_defaults=ratio["median"] - 1 + every_n / plain_step / 500,
                  verdict=verdict, ablations={n: paired(cpu[n], cpu["plain"]) for n in arms if n in ABLATIONS})
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
