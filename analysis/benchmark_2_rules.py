"""The rules of round two's plan (docs/plans/2026-12-05-stabiliser-benchmark-2.md), as pure functions of tables of
runs (one row per run: variant, seed, lr, strength, verdict, val_loss). No torch, no files.

* `choose(runs, key)`: stage A's rule (key "strength") and stage B's (key "lr"): the value with the lowest mean
  val loss over the two selection seeds among the values where both seeds are `stable`; None when none is. The
  plan is silent on an exact tie of means: the value nearest the recipe's (x 1, on the log2 scale) is taken, then
  the lower, and the tie is said.
* `primary(runs)`: stage C's test: each variant against FLT, two-sided exact Mann-Whitney on the val loss, Holm over
  the family, Hodges-Lehmann shift (variant - FLT) with its exact 95 % interval; medians, ranges, sd, failures.
* `breaking(runs)`: stage D's line: the lowest grid lr not `stable`, finished when the grid value below it held;
  `line_cost(runs)`: the probes and probe-hours of its finished lines (issue 64's measure).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.stats import PermutationMethod, mannwhitneyu  # noqa: E402

from gradient_path_2 import hodges_lehmann  # noqa: E402  (the exact Mann-Whitney inversion)
from stabiliser_benchmark import holm  # noqa: E402

SELECTION_SEEDS = (101, 102)
ALPHA = 0.05
GRID_D = [2.0 ** i for i in range(-4, 9)]  # stage D: 1/16 ... 256, ratio 2


def choose(runs: pd.DataFrame, key: str) -> dict:
    """One variant's runs on the selection seeds -> {value, mean, tie, stable_values}; value None: none stable
    on both seeds; `means`: the mean val loss of every value that counts. A value counts only with both selection
    seeds archived and `stable`."""
    means = {}
    for value, g in runs.groupby(key):
        by_seed = {int(s): (v, x) for s, v, x in zip(g.seed, g.verdict, g.val_loss)}
        if all(s in by_seed and by_seed[s][0] == "stable" for s in SELECTION_SEEDS):
            means[float(value)] = float(np.mean([by_seed[s][1] for s in SELECTION_SEEDS]))
    if not means:
        return dict(value=None, mean=math.nan, tie=False, stable_values=[], means={})
    low = min(means.values())
    best = sorted((v for v, m in means.items() if m == low), key=lambda v: (abs(math.log2(v)), v))
    return dict(value=best[0], mean=low, tie=len(best) > 1, stable_values=sorted(means), means=means)


def exact_p(x: np.ndarray, y: np.ndarray) -> float:
    """Two-sided Mann-Whitney, exact over every split (ties included; a NaN val loss, a diverged run, ranks above
    every finite one)."""
    x, y = np.nan_to_num(x, nan=np.inf), np.nan_to_num(y, nan=np.inf)
    return float(mannwhitneyu(x, y, alternative="two-sided", method=PermutationMethod(n_resamples=np.inf)).pvalue)


def reading(p_holm: float, shift: float) -> str:
    """The plan's words for one comparison."""
    if p_holm < ALPHA:
        return "lower than FLT" if shift < 0 else "higher than FLT"
    return "indistinguishable"


def primary(runs: pd.DataFrame, against: str = "flt") -> pd.DataFrame:
    """Stage C: each variant but `against` (in the order first seen) against it; Holm over the family."""
    ref = runs[runs.variant == against]
    y = ref.val_loss.to_numpy(float)
    rows = []
    for v, g in runs[runs.variant != against].groupby("variant", sort=False):
        x = g.val_loss.to_numpy(float)
        shift, low, high = hodges_lehmann(np.nan_to_num(x, nan=np.inf), np.nan_to_num(y, nan=np.inf))
        rows.append(dict(variant=v, n=len(x), median=float(np.nanmedian(x)), min=float(np.nanmin(x)),
                         max=float(np.nanmax(x)), sd=float(np.nanstd(x, ddof=1)) if len(x) > 1 else math.nan,
                         failed=int((g.verdict != "stable").sum()), flt_median=float(np.nanmedian(y)),
                         p=exact_p(x, y), shift=shift, low=low, high=high))
    out = pd.DataFrame(rows)
    if len(out):
        out["p_holm"] = holm(out.p.tolist())
        out["reading"] = [reading(p, s) for p, s in zip(out.p_holm, out["shift"])]
    return out


def breaking(runs: pd.DataFrame) -> dict:
    """One (variant, seed) line of stage D (lr, verdict) -> breaking lr (the lowest grid value not `stable`; None
    when every probe held), the verdict there (its failure kind), and whether the bracket is closed (the grid's
    lowest value broke, or the value just below the breaking one held; held at the grid's top), and the step the
    breaking probe ended at where the table has `steps_done` (its failure kind is the verdict there: a probe stopped
    once decided is judged at its stop, not at the schedule's end)."""
    held = {float(lr) for lr, v in zip(runs.lr, runs.verdict) if v == "stable"}
    broke = {float(lr): v for lr, v in zip(runs.lr, runs.verdict) if v != "stable"}
    if not broke:
        return dict(breaking=None, kind="held", finished=GRID_D[-1] in held, stop=None)
    b = min(broke)
    i = GRID_D.index(b) if b in GRID_D else None
    stop = None
    if "steps_done" in runs:  # the step the breaking probe ended at (before `steps`: it stopped once decided)
        done = float(runs[runs.lr.astype(float) == b].steps_done.iloc[0])
        stop = int(done) if math.isfinite(done) else None
    return dict(breaking=b, kind=broke[b], finished=i == 0 or (i is not None and GRID_D[i - 1] in held), stop=stop)


def log2_median(values) -> float:
    """The median on the log2 scale (an even count: the geometric middle of the middle two)."""
    return float(2.0 ** np.median(np.log2(np.asarray(values, float))))


def long_runs(runs: pd.DataFrame, against: str = "flt", n: int = 3) -> list[str]:
    """The plan's 2,000-step runs: the `n` variants with the lowest stage-C median val loss (an exact tie: the one
    seen first), and `against` where it is not among them."""
    medians = runs.groupby("variant", sort=False).val_loss.median().dropna()  # (no val loss at all: not a candidate)
    order = sorted(range(len(medians)), key=lambda i: (medians.iloc[i], i))
    chosen = [str(medians.index[i]) for i in order[:n]]
    return chosen + ([against] if against not in chosen else [])


def line_cost(runs: pd.DataFrame) -> str:
    """Stage D's cost per finished line (issue 64's measure), beside round one's 312 probes and 18.6 probe-hours
    over 72 lines (means of 4.3 probes and 0.26 probe-hours a line): the probes and lane-hours (each probe's own
    wall time, summed: round one's probe-hours) of the finished lines, in all and as means and medians a line."""
    lines = [(breaking(g)["finished"], len(g), g.wall_time.sum() / 3600) for _, g in runs.groupby(["variant", "seed"])]
    done = [(n, h) for finished, n, h in lines if finished]
    if not done:
        return f"; no line finished ({len(lines)} started)"
    probes, hours = [n for n, _ in done], [h for _, h in done]
    return (f"; of the {len(lines)} lines started, {len(done)} are finished, with {sum(probes)} probes and "
            f"{sum(hours):.1f} lane-hours: a mean of {np.mean(probes):.1f} probes and {np.mean(hours):.2f} lane-hours "
            f"a line (medians {np.median(probes):g} and {np.median(hours):.2f})")
