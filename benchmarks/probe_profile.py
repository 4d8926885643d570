"""Where flt_diag.watch's cost goes inside a training step: the share of sampled time spent in flt_diag's own
frames (and the native operations they call), by the probe's entry point, on the Huginn-style toy of
probe_overhead.py.

    py-spy record -r 100 --native -f raw -o raw.txt -- python benchmarks/probe_profile.py --steps 300
    python benchmarks/probe_profile.py --read raw.txt [--depth 2] [--top 25]

The first line runs the watched arm of probe_overhead.py alone (two warm-up steps, step 0's every-500 record
among them, then `--steps` steps inside `timed_steps`) under py-spy (`pip install py-spy`: a profiler, not a
dependency of the project). The second reads py-spy's raw output (one line a stack: frames joined by ';', then
the sample count) and counts only the samples inside `timed_steps`: the share with a flt_diag frame on the
stack, and that share split by the first `--depth` flt_diag frames (outermost first). A sampling profile, not a
paired timing: it says which pieces to cut, the paired ratio of probe_overhead.py says whether a cut paid.
At 500 samples a second with --native, py-spy falls minutes behind on 2 cores (it says so) and its counts
are not to be trusted: keep -r at 100.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import positive_int  # noqa: E402

TIMED = "timed_steps"  # the function whose samples are counted


def timed_steps(arm, steps: int) -> None:
    for _ in range(steps):
        arm.step()


def run(steps: int) -> None:
    import torch
    import flt_diag
    from probe_overhead import BATCH, SEQ, VOCAB, Arm, Huginn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batches = [(x, torch.roll(x, 1, dims=1)) for x in torch.randint(0, VOCAB, (50, BATCH, SEQ), generator=gen)]
    model = Huginn(seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        probe = flt_diag.watch(model, blocks=[model.core], folder=Path(tmp) / "run", head=model.head,
                               targets=lambda x: torch.roll(x, 1, dims=1), loop_step=model.loop_step,
                               steps=steps + 2)
        arm = Arm(model, batches, probe)
        arm.step()
        arm.step()
        timed_steps(arm, steps)
        probe.close()


def shares(lines, depth: int = 2) -> tuple[int, int, Counter]:
    """(samples inside TIMED, of them with a flt_diag frame, those by their first `depth` flt_diag frames)."""
    total, ours, pieces = 0, 0, Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or not any(f.split(" (")[0] == TIMED for f in frames):
            continue
        n = int(count)
        total += n
        mine = [f.split(" (")[0] for f in frames if "flt_diag" in f]
        if mine:
            ours += n
            pieces[" > ".join(mine[:depth])] += n
    return total, ours, pieces


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=300, help="steps run (without --read)")
    p.add_argument("--read", type=Path, help="py-spy's raw output (record -f raw) to read instead of running")
    p.add_argument("--depth", type=positive_int, default=2)
    p.add_argument("--top", type=positive_int, default=25)
    args = p.parse_args(argv)
    if args.read is None:
        run(args.steps)
        return 0
    if not args.read.is_file():
        p.error(f"--read: no file {args.read}")
    with args.read.open(errors="replace") as f:
        total, ours, pieces = shares(f, args.depth)
    if not total:
        p.error(f"--read: no sample inside {TIMED} in {args.read} (py-spy record -f raw of this script?)")
    print(f"samples in {TIMED}: {total}; in flt_diag frames: {ours} ({100 * ours / total:.1f} %, an overhead of "
          f"+{100 * ours / max(total - ours, 1):.1f} % over the rest)")
    for piece, n in pieces.most_common(args.top):
        print(f"{100 * n / total:6.2f} %  {piece}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
