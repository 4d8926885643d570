"""The gradient-path contrast with the embedding held equal (issue 53; plan fixed before its runs:
docs/plans/2026-12-04-gradient-path-frozen-embedding.md). No torch.

    python analysis/gradient_path_2.py docs/data/runs/gradient-path-2 [--final] [--out FILE]

Reads the plan's archive (g53-0: LT K = 9, embedding frozen, full backpropagation; g53-2: the same with the
gradient through the last 2 loops; f-0-flt: the first factorial's FLT full arm). Prints Markdown: the runs
archived, the code that made them, and, once all 20 LT runs are in (or with --final at the plan's final cut-off),
the primary: the largest loss climbs (summary.json's evidence.climb), the one-sided exact Mann-Whitney U test
(H1: full backpropagation climbs more), the Hodges-Lehmann shift with its exact 95 % interval, and the plan's
reading of it; then the secondaries (failures with exact intervals, the oscillation index, losses, FLT full
against the factorial's FLT k=2).
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

from factorial import FAILURES  # noqa: E402
from flt_diag.results.report import markdown  # noqa: E402
from flt_diag.storage import archive  # noqa: E402
from flt_diag.storage.code_version import describe  # noqa: E402
from flt_diag.storage.folders import StorageError, atomic_write_text, load_config, load_summary, run_dirs  # noqa: E402
from script_exit import Parser, guarded, folder  # noqa: E402

ARMS = {"g53-0": "LT full, frozen E", "g53-2": "LT k=2, frozen E", "f-0-flt": "FLT full"}
# What each arm's runs are, read from their stored config (never from a folder's or file's name): the plan's shared
# settings (K = 9, L = 2, d = 64, 2,000 steps at lr x 1), then the arm's variant, embedding and gradient path
PLAN = dict(loops=9, depth=2, width=64, steps=2000, lr_scale=1.0)
ARM_RUNS = {"g53-0": dict(PLAN, variant="lt", freeze_embedding=True, grad_loops=0),
            "g53-2": dict(PLAN, variant="lt", freeze_embedding=True, grad_loops=2),
            "f-0-flt": dict(PLAN, variant="flt", freeze_embedding=False, grad_loops=0)}
FLT_K2_RUNS = dict(PLAN, variant="flt", freeze_embedding=False, grad_loops=2)  # the first factorial's FLT k=2
PRIMARY_N = 10  # runs per LT arm (the plan)
PARTIAL = 0.15  # nats: the plan's partial effect (the interval's upper end below it: no effect of that size)
FACTORIAL_FLT_K2 = Path(__file__).resolve().parents[1] / "docs" / "data" / "runs" / "gradient-path" / "f-2"


def u_null_counts(m: int, n: int) -> np.ndarray:
    """counts[u] = the number of the C(m+n, m) orderings with Mann-Whitney U = u (no ties), u = 0 .. m n."""
    f = {(0, j): np.array([1], dtype=object) for j in range(n + 1)}
    for i in range(1, m + 1):
        f[(i, 0)] = np.array([1], dtype=object)
        for j in range(1, n + 1):  # the largest value is from the first sample (adds j to U) or from the second
            a, b = f[(i - 1, j)], f[(i, j - 1)]
            out = np.zeros(i * j + 1, dtype=object)
            out[j:j + len(a)] += a
            out[:len(b)] += b
            f[(i, j)] = out
    return f[(m, n)]


def hodges_lehmann(x: np.ndarray, y: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(shift, low, high): the median of all x_i - y_j and the exact distribution-free interval: the order
    statistics D_(C+1) and D_(mn-C) of the mn sorted differences, C the largest u with P(U <= u) <= (1 - level) / 2."""
    d = np.subtract.outer(x, y).ravel()
    d = np.sort(np.where(np.isnan(d), 0.0, d))  # (two diverged runs, inf - inf: a tie)
    counts = u_null_counts(len(x), len(y))
    cdf = np.cumsum(counts) / counts.sum()
    c = int(np.searchsorted(cdf, (1 - level) / 2, side="right"))  # P(U <= c - 1) <= alpha/2 < P(U <= c)
    if c == 0:  # too few runs for any interval at this level
        return float(np.median(d)), -math.inf, math.inf
    return float(np.median(d)), float(d[c - 1]), float(d[len(d) - c])  # D_(c), D_(mn-c+1), 1-based


def settings(cfg) -> dict:
    """The settings of a run that place it in an arm (ARM_RUNS), from its stored config."""
    m, t = cfg.model, cfg.train
    return dict(loops=m.loops, depth=m.depth, width=m.width, steps=t.steps, lr_scale=t.lr_scale, variant=m.variant,
                freeze_embedding=bool(t.freeze_embedding), grad_loops=t.grad_loops)


def run_rows(folder: Path, arm: str, want: dict, others: str = "refuse") -> list[dict]:
    """The finished runs of `folder` whose stored config is `want`'s; another run there is one line
    (`others="refuse"`: a plan's folder holds its arm's runs only) or left out (`"skip"`: a folder shared by
    arms, the factorial's)."""
    rows = []
    for d in run_dirs(folder):
        cfg = load_config(d)
        if (got := settings(cfg)) != want:
            if others == "skip":
                continue
            diff = ", ".join(f"{k} {got[k]!r}, not {want[k]!r}" for k in want if got[k] != want[k])
            raise StorageError(f"{d} is not a run of the arm {arm!r} its folder holds ({diff}, by its stored config): "
                               f"move it out of {folder}")
        summary = load_summary(d)
        if summary is None:
            continue
        ev, nan = summary.evidence, (lambda x: math.nan if x is None else x)
        code = archive.read_meta(d).code if archive.is_record(d) else None
        rows.append(dict(arm=arm, run=Path(d).stem, seed=int(cfg.train.seed), verdict=summary.verdict,
                         failed=summary.verdict in FAILURES, climb=nan(ev.climb), osc=nan(ev.osc_dlog_median),
                         final_loss=summary.final_loss, val_loss=summary.val_loss, wall=nan(summary.wall_time),
                         code=describe((code or {}).get("run")), frozen=bool(cfg.train.freeze_embedding)))
    return rows


def runs_table(root: Path) -> pd.DataFrame:
    rows = [r for sub, arm in ARMS.items() if (Path(root) / sub).is_dir()
            for r in run_rows(Path(root) / sub, arm, ARM_RUNS[sub])]
    if not rows:
        raise StorageError(f"no finished runs of the plan in {root} (expected {', '.join(ARMS)})")
    return pd.DataFrame(rows).sort_values(["arm", "seed"]).reset_index(drop=True)


def primary(runs: pd.DataFrame) -> tuple[dict, str]:
    """The plan's test on the two LT arms (a diverged run, with no climb, ranks above every climb)."""
    full, trunc = (runs[runs.arm == a] for a in ("LT full, frozen E", "LT k=2, frozen E"))
    if not (len(full) and len(trunc)):  # (no test, and no interval, of an arm without runs)
        raise StorageError(f"the primary compares the two LT arms, and {'LT full' if not len(full) else 'LT k=2'} has "
                           "no finished run")
    x, y = (g.climb.fillna(np.inf).to_numpy(float) for g in (full, trunc))
    # exact over every split of the runs, ties (diverged runs, equal climbs) included (scipy's "exact" assumes none)
    p = float(mannwhitneyu(x, y, alternative="greater", method=PermutationMethod(n_resamples=np.inf)).pvalue)
    shift, low, high = hodges_lehmann(x, y)
    res = dict(n_full=len(x), n_trunc=len(y), p=p, shift=shift, low=low, high=high,
               median_full=float(np.median(x)), median_trunc=float(np.median(y)))
    if p < 0.05:
        reading = ("p < 0.05: with the embedding held equal, full backpropagation makes LT's loss climb more: the "
                   "gradient path through the first K - 2 loops takes part in the instability")
    elif high < 0:
        reading = "the truncated arm climbs more (interval below 0): reported as measured, no mechanism claimed"
    elif not math.isfinite(low) or not math.isfinite(high) or math.isnan(shift):
        reading = "p >= 0.05 and no finite interval (diverged runs, or too few runs): inconclusive"
    elif high < PARTIAL:
        reading = (f"p >= 0.05 and the interval's upper end is below {PARTIAL} nats: no effect the size of a partial "
                   "one; the climbs happen as much with the gradient through the last two loops only")
    else:
        reading = f"p >= 0.05 and the interval reaches {PARTIAL} nats or more: inconclusive at this power"
    if res["median_full"] < 0.25:
        reading += ("; LT full with a frozen embedding climbed less than the rebound threshold (median below 0.25): "
                    "the frozen embedding changed the regime, and the answer holds for that regime only")
    return res, reading


def arms_table(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for arm, g in runs.groupby("arm", sort=False):
        n, k = len(g), int(g.failed.sum())
        ci = binomtest(k, n).proportion_ci(method="exact")
        rows.append({"arm": arm, "runs": n, "failed": f"{k}/{n}", "95 % interval": f"{ci.low:.0%}-{ci.high:.0%}",
                     "unstable": int((g.verdict == "unstable").sum()), "stable": int((g.verdict == "stable").sum()),
                     "climb (median, range)": f"{g.climb.median():.3f} ({g.climb.min():.3f}-{g.climb.max():.3f})",
                     "oscillation index (range)": f"{g.osc.min():.3f}-{g.osc.max():.3f}",
                     "final loss (median)": f"{g.final_loss.median():.3f}", "val loss (median)": f"{g.val_loss.median():.3f}",
                     "wall time (median)": f"{g.wall.median():.0f} s"})
    return pd.DataFrame(rows)


def report(root: Path, final: bool = False) -> str:
    runs = runs_table(root)
    lt = runs[runs.arm.str.startswith("LT")]
    out = [f"Runs archived: {len(runs)} ({', '.join(f'{a}: {int((runs.arm == a).sum())}' for a in ARMS.values())}).",
           "", "Code: " + "; ".join(f"{c} ({n} runs)" for c, n in runs.code.value_counts().items()), "",
           markdown(arms_table(runs)), "",
           "Per run (seed: verdict, climb): " + "; ".join(
               f"{r.arm} {r.seed}: {r.verdict} {r.climb:.3f}" for r in runs.itertuples()), ""]
    complete = all((lt.arm == a).sum() >= PRIMARY_N for a in ("LT full, frozen E", "LT k=2, frozen E"))
    if not (complete or final):
        out += [f"The primary is not analysed yet: {len(lt)} of {2 * PRIMARY_N} LT runs archived (the plan analyses it "
                "when all are in, or at its final cut-off with --final)."]
        return "\n".join(out)
    res, reading = primary(runs)
    out += ["Primary (the plan's): largest loss climb, LT full vs LT k=2, embedding frozen in both:", "",
            markdown(pd.DataFrame([{
                "runs": f"{res['n_full']} vs {res['n_trunc']}",
                "median climb": f"{res['median_full']:.3f} vs {res['median_trunc']:.3f}",
                "one-sided exact Mann-Whitney p": f"{res['p']:.3g}",
                "Hodges-Lehmann shift [95 % interval]": f"{res['shift']:+.3f} [{res['low']:+.3f}, {res['high']:+.3f}]"}])),
            "", f"By the plan: {reading}.", ""]
    flt = runs[runs.arm == "FLT full"]
    if len(flt) and FACTORIAL_FLT_K2.is_dir():
        k2 = pd.DataFrame(run_rows(FACTORIAL_FLT_K2, "FLT k=2", FLT_K2_RUNS, others="skip"))
        ka, kb = int(k2.failed.sum()), int(flt.failed.sum())
        _, p = fisher_exact([[ka, len(k2) - ka], [kb, len(flt) - kb]], alternative="greater")
        out += [f"Secondary (the first factorial's FLT test): FLT k=2 failed {ka}/{len(k2)}, FLT full {kb}/{len(flt)}; "
                f"one-sided Fisher p = {p:.3g} (H1: truncated fails more). Climbs: k=2 median {k2.climb.median():.3f}, "
                f"full {flt.climb.median():.3f}.", ""]
    return "\n".join(out)


@guarded
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=folder, help="the plan's archive folder (holding g53-0, g53-2, f-0-flt)")
    parser.add_argument("--final", action="store_true", help="the plan's final cut-off: analyse what is archived")
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    args = parser.parse_args(argv)
    text = report(args.root, args.final)
    print(text)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
