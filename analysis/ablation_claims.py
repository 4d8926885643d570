"""The paper's ablation claims at toy scale, regenerated from the run archive (issue 56; part 2 of the plan fixed
before its runs: docs/plans/2026-12-04-stabiliser-benchmark.md). No torch.

    python analysis/ablation_claims.py docs/data/runs [--final] [--out FILE]

Reads, under the archive root: ablation-claims-depth/ (the paper's five at K = 12, L = 6, seeds 11-16, lr x 1),
gradient-path/f-0 and gradient-path-2/f-0-flt (LT and FLT at K = 9, L = 2, full backpropagation) and
stabiliser-map/ (the benchmark's lr x 1 probes at K = 12, L = 2). Prints Markdown: per claim what the archive
shows and the plan's verdict. At L = 6 the primary is each of LT, LT-II, LT-AI and FLA against FLT on the largest
loss climb (one-sided exact Mann-Whitney, Holm over the 4, Hodges-Lehmann shift with its exact 95 % interval), read
once all 30 runs are archived (or with --final at the plan's cut-off).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.stats import PermutationMethod, binomtest, fisher_exact, mannwhitneyu  # noqa: E402

from gradient_path_2 import PARTIAL, hodges_lehmann  # noqa: E402
from stabiliser_benchmark import holm  # noqa: E402
from flt_diag.results.report import markdown  # noqa: E402
from flt_diag.storage.folders import StorageError, load_summary, run_dirs  # noqa: E402
from script_exit import plan_report  # noqa: E402

DEPTH = "ablation-claims-depth"  # L = 6, K = 12, seeds 11-16
SHALLOW = {"K = 9": ("gradient-path/f-0", "gradient-path-2/f-0-flt"), "K = 12": ("stabiliser-map",)}
AGAINST_FLT = ["lt", "lt-ii", "lt-ai", "fla"]
DEPTH_N = 6  # runs per variant (the plan)
FAILED = ("collapsed", "stalled", "diverged", "unstable")  # the plan's secondary: every verdict but stable
ALPHA = 0.05


def runs_of(folder: Path, lr: float | None = 1.0, grad_loops_zero: bool = True) -> pd.DataFrame:
    """One row per finished run of a folder (records or run folders) at lr scale `lr`."""
    rows = []
    for d in run_dirs(folder) if folder.is_dir() else []:
        s = load_summary(d)
        if s is None or (lr is not None and float(s.lr_scale) != lr):
            continue
        rows.append(dict(variant=s.variant, loops=int(s.loops), seed=int(s.seed), verdict=s.verdict,
                         failed=s.verdict in FAILED, climb=math.nan if s.evidence.climb is None else s.evidence.climb, val_loss=s.val_loss,
                         peak_any=s.peak_resid_norm_any, peak=s.peak_resid_norm, run=Path(d).name))
    return pd.DataFrame(rows, columns=["variant", "loops", "seed", "verdict", "failed", "climb", "val_loss",
                                       "peak_any", "peak", "run"])


def interval(k: int, n: int) -> str:
    ci = binomtest(k, n).proportion_ci(method="exact")
    return f"{k}/{n} ({ci.low:.0%}-{ci.high:.0%})"


def climb_tests(runs: pd.DataFrame) -> pd.DataFrame:
    """The plan's primary at L = 6: each of AGAINST_FLT against FLT on the largest climb, Holm over the 4.
    A diverged run (no climb) ranks above every climb."""
    flt = runs[runs.variant == "flt"].climb.fillna(np.inf).to_numpy(float)
    rows = []
    for v in AGAINST_FLT:
        x = runs[runs.variant == v].climb.fillna(np.inf).to_numpy(float)
        p = float(mannwhitneyu(x, flt, alternative="greater", method=PermutationMethod(n_resamples=np.inf)).pvalue)
        shift, low, high = hodges_lehmann(x, flt)
        rows.append(dict(variant=v, runs=f"{len(x)} vs {len(flt)}", median=float(np.median(x)),
                         flt_median=float(np.median(flt)), p=p, shift=shift, low=low, high=high))
    out = pd.DataFrame(rows)
    out["p_holm"] = holm(out.p.tolist())
    out["reading"] = [reading(r) for r in out.itertuples()]
    return out


def reading(r) -> str:
    """The plan's words for one comparison."""
    if r.p_holm < ALPHA:
        return "climbs more than FLT: reproduced"
    if math.isfinite(r.high) and r.high < PARTIAL:
        return f"no climb of {PARTIAL} nats over FLT's: not reproduced"
    return "inconclusive at this power"


def depth_section(runs: pd.DataFrame, final: bool) -> list[str]:
    counts = runs.groupby("variant").size()
    if not len(runs):
        return ["**L = 6, K = 12:** no run archived yet (experiments/ablation-claims-depth.toml)."]
    table = pd.DataFrame([{"variant": v, "failed (95 %)": interval(int(g.failed.sum()), len(g)),
                           "verdicts": " ".join(g.sort_values("seed").verdict),
                           "climb (median)": f"{g.climb.median():.3f}", "val loss (median)": f"{g.val_loss.median():.3f}",
                           "peak any loop ÷ FLT's": ratio(g.peak_any, runs[runs.variant == "flt"].peak_any),
                           "peak final loop ÷ FLT's": ratio(g.peak, runs[runs.variant == "flt"].peak)}
                          for v, g in runs.groupby("variant", sort=False)])
    out = [f"**L = 6, K = 12** (width 64, 600 steps, lr × 1, seeds 11-16): {len(runs)} runs archived.", "",
           markdown(table), ""]
    if not final and not (counts.reindex(AGAINST_FLT + ["flt"]).fillna(0) >= DEPTH_N).all():
        return out + [f"The primary is not read yet ({len(runs)} of {5 * DEPTH_N} runs; the plan reads it when all are "
                      "in, or at its cut-off with --final)."]
    tests = climb_tests(runs)
    shown = pd.DataFrame({"against FLT": tests.variant, "runs": tests.runs,
                          "median climb (vs FLT's)": [f"{a:.3f} ({b:.3f})" for a, b in zip(tests["median"], tests.flt_median)],
                          "p (Holm)": [f"{p:.3g} ({q:.3g})" for p, q in zip(tests.p, tests.p_holm)],
                          "shift [95 %]": [f"{s:+.3f} [{lo:+.3f}, {hi:+.3f}]" for s, lo, hi in
                                           zip(tests["shift"], tests.low, tests.high)],
                          "by the plan": tests.reading})
    out += ["The primary (largest loss climb against FLT, one-sided exact Mann-Whitney, Holm over 4):", "",
            markdown(shown), ""]
    return out + secondary(runs)


def ratio(x: pd.Series, flt: pd.Series) -> str:
    if not len(flt) or not np.isfinite(flt.median()) or flt.median() == 0:
        return "-"
    r = x / flt.median()
    return f"{r.min():.2f}-{r.max():.2f}"


def secondary(runs: pd.DataFrame) -> list[str]:
    flt, fla = runs[runs.variant == "flt"], runs[runs.variant == "fla"]
    k1, k2 = int(fla.failed.sum()), int(flt.failed.sum())
    _, p = fisher_exact([[k1, len(fla) - k1], [k2, len(flt) - k2]], alternative="greater")
    out = [f"Secondary: FLA failed {k1}/{len(fla)}, FLT {k2}/{len(flt)}, one-sided Fisher p = {p:.3g}."]
    for v in ("lt-ii", "lt-ai"):
        x = runs[runs.variant == v].val_loss.to_numpy(float)
        shift, low, high = hodges_lehmann(x, flt.val_loss.to_numpy(float))
        word = "indistinguishable" if low <= 0 <= high else ("FLT lower" if low > 0 else "FLT higher")
        out.append(f"Val loss {v} minus FLT: {shift:+.3f} [{low:+.3f}, {high:+.3f}] nats: {word}.")
    return out + [""]


def shallow_section(root: Path) -> list[str]:
    rows = []
    for label, folders in SHALLOW.items():
        runs = pd.concat([runs_of(root / f) for f in folders], ignore_index=True)
        runs = runs[runs.variant.isin(["lt", "flt"])]
        for v, g in runs.groupby("variant"):
            rows.append({"L = 2": label, "variant": v, "failed (95 %)": interval(int(g.failed.sum()), len(g)),
                         "collapsed": int((g.verdict == "collapsed").sum()), "seeds": len(g)})
    if not rows:
        return ["**L = 2:** no archived run at lr × 1 yet.", ""]
    return ["**L = 2** (tiny preset, lr × 1; K = 9: the gradient-path runs with full backpropagation, seeds 200-209; "
            "K = 12: the benchmark's lr × 1 probes, where its bisection made one):", "", markdown(pd.DataFrame(rows)), ""]


def report(root: Path, final: bool = False) -> str:
    root = Path(root)
    if not root.is_dir():
        raise StorageError(f"no such folder: {root}")
    depth = runs_of(root / DEPTH)
    depth = depth[(depth.loops == 12) & depth.variant.isin(AGAINST_FLT + ["flt"])]
    return "\n".join(shallow_section(root) + depth_section(depth, final)) + "\n"


main = plan_report(__doc__, report, "the run archive (docs/data/runs)")


if __name__ == "__main__":
    sys.exit(main())
