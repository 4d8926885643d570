"""Muon on CPU: torch.optim.Muon (bf16 Newton-Schulz) against flt_diag's BatchedMuon (the same
update as fp32 matmuls of bf16 values, same-shape matrices batched), on the block matrices of a
preset's model, interleaved in one process and paired per round (so a shared machine's drift
cancels in the ratio), one thread. Also the raw bf16 vs fp32 matmul time of one of its shapes.

    python benchmarks/muon_cpu.py [--preset tiny] [--rounds 15]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flt_diag.config.run_config import build_config  # noqa: E402
from flt_diag.model.transformer import LoopedTransformer, parameter_groups  # noqa: E402
from flt_diag.training.optim import BatchedMuon  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = build_config(args.preset, model=dict(vocab_size=256))
    model = LoopedTransformer(cfg.model)
    mats = [q for name, ps in parameter_groups(model).items() if name.startswith("block") for q in ps]
    opts = {}
    for name, cls in (("torch.optim.Muon", torch.optim.Muon), ("BatchedMuon", BatchedMuon)):
        params = [torch.nn.Parameter(m.detach().clone()) for m in mats]
        for q in params:
            q.grad = torch.randn_like(q)
        opts[name] = cls(params, lr=0.02, momentum=0.95, weight_decay=0.0)
    for o in opts.values():  # warm-up
        o.step()
    times = {n: [] for n in opts}
    for _ in range(args.rounds):
        for name, o in opts.items():
            t = time.perf_counter()
            o.step()
            times[name].append(time.perf_counter() - t)
    ratio = statistics.median(a / b for a, b in zip(times["torch.optim.Muon"], times["BatchedMuon"]))
    d = cfg.model.width
    a32, b32 = torch.randn(d, 4 * d), torch.randn(4 * d, d)
    mm = {}
    for dt in (torch.float32, torch.bfloat16):
        a, b = a32.to(dt), b32.to(dt)
        a @ b
        t = time.perf_counter()
        for _ in range(50):
            a @ b
        mm[dt] = (time.perf_counter() - t) / 50
    print(f"{args.preset}: {len(mats)} matrices; Muon step median over {args.rounds} rounds: "
          + ", ".join(f"{n} {statistics.median(v) * 1e3:.1f} ms" for n, v in times.items())
          + f"; paired ratio {ratio:.1f}x")
    print(f"matmul ({d}x{4 * d}) @ ({4 * d}x{d}), one thread: fp32 {mm[torch.float32] * 1e6:.0f} us, "
          f"bf16 {mm[torch.bfloat16] * 1e6:.0f} us ({mm[torch.bfloat16] / mm[torch.float32]:.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
