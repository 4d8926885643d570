"""The power of the head-to-head's round two (issue 66), by simulation from round one's archive. No torch.

    python analysis/benchmark_power.py docs/data/runs/stabiliser-map [--trials 4000] [--out FILE]

Round two's primary (docs/plans/2026-12-05-stabiliser-benchmark-2.md) compares each variant's val loss at its best
lr against FLT's with a two-sided exact Mann-Whitney test, Holm-corrected over the family of comparisons. How many
seeds that needs depends on the seed-to-seed spread of the val loss, which round one's archive measures: its probes
at lr scale <= 4 that were `stable` (verdict v3), per (variant, lr) cell with at least four such seeds.

The simulation draws n seeds per arm from normal distributions of one standard deviation (the spread measured, its
median over the cells and its largest) whose means differ by delta, runs the exact test, and counts how often the
p-value clears the first step of Holm's procedure over `family` comparisons (alpha / family: the case where this is
the family's only true difference, the hardest for Holm). It prints Markdown: the spreads measured, then the power
per (n, delta, spread).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.stats import mannwhitneyu  # noqa: E402

from flt_diag.results.report import markdown  # noqa: E402
from script_exit import Parser, emit, guarded, whole  # noqa: E402
from stabiliser_benchmark import probes_table  # noqa: E402

ALPHA = 0.05
FAMILY = 11  # the eleven variants against FLT
SEEDS = (6, 8)
DELTAS = (0.01, 0.02, 0.03, 0.05)  # nats: a difference in val loss a researcher would care about at this scale


def seed_spreads(probes: pd.DataFrame, max_lr: float = 4.0, min_seeds: int = 4) -> pd.DataFrame:
    """Per (variant, lr) cell of stable probes at lr <= max_lr with >= min_seeds seeds: the val loss's sample
    standard deviation over seeds (ddof 1) and the number of seeds."""
    kept = probes[(probes.lr <= max_lr) & (probes.verdict == "stable") & probes.val_loss.notna()]
    cells = kept.groupby(["variant", "lr"]).val_loss.agg(sd="std", seeds="count").reset_index()
    return cells[cells.seeds >= min_seeds].reset_index(drop=True)


def power(n: int, delta: float, sd: float, trials: int, family: int = FAMILY, alpha: float = ALPHA,
          seed: int = 0) -> float:
    """The share of `trials` simulated experiments (n seeds per arm, normal noise of `sd`, means `delta` apart)
    whose two-sided exact Mann-Whitney p is at most alpha / family."""
    rng = np.random.default_rng(seed)
    a = rng.normal(0.0, sd, size=(trials, n))
    b = rng.normal(delta, sd, size=(trials, n))
    hits = sum(mannwhitneyu(x, y, alternative="two-sided", method="exact").pvalue <= alpha / family
               for x, y in zip(a, b))
    return hits / trials


def report(root: Path, trials: int) -> str:
    spreads = seed_spreads(probes_table(root))
    if spreads.empty:
        raise ValueError(f"{root}: no (variant, lr) cell with four or more stable seeds at lr <= 4")
    sds = {"median": float(spreads.sd.median()), "largest": float(spreads.sd.max())}
    lines = ["Seed-to-seed spread of the val loss, round one's stable probes at lr <= 4 (verdict v3):", "",
             markdown(spreads.assign(sd=spreads.sd.round(4))), "",
             f"Spread used: median {sds['median']:.4f}, largest {sds['largest']:.4f} nats over "
             f"{len(spreads)} cells. Power of the two-sided exact Mann-Whitney at alpha / {FAMILY} = "
             f"{ALPHA / FAMILY:.4f} (Holm's first step), {trials} simulated experiments each:", ""]
    rows = [dict(seeds=n, delta=d, **{f"power (sd {k})": round(power(n, d, s, trials), 3) for k, s in sds.items()})
            for n in SEEDS for d in DELTAS]
    lines += [markdown(pd.DataFrame(rows)), ""]
    return "\n".join(lines)


@guarded
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("archive", type=Path, help="round one's archive (docs/data/runs/stabiliser-map)")
    p.add_argument("--trials", type=whole(100, 100_000), default=4000, help="simulated experiments per setting")
    p.add_argument("--out", type=Path, default=None, help="write the Markdown here instead of printing it")
    args = p.parse_args(argv)
    return emit(report(args.archive, args.trials), args.out)


if __name__ == "__main__":
    sys.exit(main())
