"""The gradient-path factorial (issue 40; plan fixed before its runs: docs/plans/2026-12-01-gradient-path-factorial.md):
LT and FLT, full backpropagation and truncated (`--grad-loops k`), from run or archive folders. No torch.

    python analysis/factorial.py docs/data/runs/gradient-path/f-0 docs/data/runs/gradient-path/f-2 [--out FILE]

Prints (and with --out writes) Markdown: per arm the failures (verdict v3 collapsed, stalled or diverged)
with exact 95 % intervals and the `unstable` count beside them; the plan's one-sided Fisher exact tests;
and the descriptive secondaries: the per-loop gradient agreement before the climb, the degenerate fixed
point (final-loop token cosine), and the contraction records at the last snapshot. Labels are the
summary.json verdicts (run `flt-diag summary --recompute` first if the verdict changed).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # (a checkout)

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.stats import binomtest, fisher_exact  # noqa: E402

from flt_diag.judge.verdict import smoothed  # noqa: E402
from flt_diag.results.report import markdown  # noqa: E402
from flt_diag.storage import metric_names as M  # noqa: E402
from flt_diag.storage.folders import StorageError, atomic_write_text, load_config, load_metrics, load_summary, run_dirs, run_name, series  # noqa: E402
from script_exit import Parser, guarded, source  # noqa: E402  (analysis/script_exit.py: the one error path)

FAILURES = ("collapsed", "stalled", "diverged")  # the plan's primary label
DEGENERATE = 0.9  # final-loop token cosine at or above: "degenerate" (fixed in the plan)
AGREEMENT_DROP = 0.1  # A(last snapshot <= onset) below A(step 200) by more than this (fixed in the plan)
AGREEMENT_FROM = 200  # the plan's reference snapshot (step 0 is the initialisation, where every A is 1)
RECORDS = [M.TOKEN_COSINE, M.EFFECTIVE_RANK, M.LOOP_GRAD_COSINE, M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS,
           M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN, M.LOOP_PERTURBATION_GROWTH, M.FIXED_POINT_RESIDUAL, M.LOSS]


def arm_name(variant: str, loops: int, grad_loops: int) -> str:
    full = grad_loops == 0 or grad_loops >= loops
    return f"{variant.upper()} {'full' if full else f'k={grad_loops}'}"


def climb_onset(loss: pd.Series, window: int) -> tuple[int | None, float]:
    """(onset step, climb): the smoothed loss's largest rise above its running minimum, and the step of the
    running minimum it rose from (the verdict's climb, DESIGN.md §3)."""
    s = smoothed(loss[np.isfinite(loss.to_numpy())], window).dropna()
    if not len(s):
        return None, math.nan
    running = s.cummin()
    rise = s - running
    peak = rise.idxmax()
    before = s.loc[:peak]
    return int(before.idxmin()), float(rise.max())


def agreement_series(df: pd.DataFrame, detached: int) -> pd.Series:
    """A(s): mean over loops (the differentiated ones) and blocks of loop_grad_cosine, per snapshot step."""
    sel = df[(df.metric == M.LOOP_GRAD_COSINE) & (df.loop > detached)]
    return sel.groupby("step").value.mean()


def final_loop(df: pd.DataFrame, metric: str, loops: int) -> pd.Series:
    return series(df, metric, loop=loops)


def run_row(run) -> dict:
    cfg, summary = load_config(run), load_summary(run)
    K, k = cfg.model.loops, cfg.run_config().train.grad_loops
    detached = K - k if 0 < k < K else 0
    df = load_metrics(run, RECORDS)
    window = cfg.run_config().verdict.smooth_window
    onset, climb = climb_onset(series(df, M.LOSS), window)
    A = agreement_series(df, detached)
    A = A[A.index >= AGREEMENT_FROM]
    before = A[A.index <= onset] if onset is not None else A.iloc[:0]
    cosine = final_loop(df, M.TOKEN_COSINE, K)
    degenerate_at = cosine[cosine >= DEGENERATE]
    last = df[df.metric == M.LOOP_SPECTRAL_RADIUS].step.max() if (df.metric == M.LOOP_SPECTRAL_RADIUS).any() else None

    def at_last(metric):
        sel = df[(df.metric == metric) & (df.step == last)]
        return sel.set_index("loop").value.sort_index() if last is not None else pd.Series(dtype=float)
    growth = at_last(M.LOOP_PERTURBATION_GROWTH)
    return dict(
        run=run_name(run), arm=arm_name(cfg.model.variant, K, k),
        variant=cfg.model.variant, seed=int(cfg.train.seed), verdict=summary.verdict,
        failed=summary.verdict in FAILURES, onset=onset, climb=climb,
        A_first=float(A.iloc[0]) if len(A) else math.nan, A_before=float(before.iloc[-1]) if len(before) else math.nan,
        agreement_fell=bool(len(A) and len(before) and before.iloc[-1] < A.iloc[0] - AGREEMENT_DROP),
        token_cosine=float(cosine.iloc[-1]) if len(cosine) else math.nan,
        degenerate=bool(len(cosine) and cosine.iloc[-1] >= DEGENERATE),
        degenerate_from=int(degenerate_at.index[0]) if len(degenerate_at) else None,
        effective_rank=float(final_loop(df, M.EFFECTIVE_RANK, K).iloc[-1]) if len(final_loop(df, M.EFFECTIVE_RANK, K)) else math.nan,
        sigma_max=float(at_last(M.LOOP_GAIN).get(K, math.nan)),
        spectral_radius=float(at_last(M.LOOP_SPECTRAL_RADIUS).get(K, math.nan)),
        spectral_residual=float(at_last(M.LOOP_SPECTRAL_RESIDUAL).get(K, math.nan)),
        mean_gain=float(at_last(M.LOOP_MEAN_GAIN).get(K, math.nan)),
        growth=float(np.exp(np.log(growth.clip(lower=1e-30)).mean())) if len(growth) else math.nan,
        final_loss=summary.final_loss)


def runs_table(folders: list[Path]) -> pd.DataFrame:
    rows = [run_row(d) for f in folders for d in run_dirs(f) if load_summary(d) is not None]
    return pd.DataFrame(rows)


def _interval(k: int, n: int) -> str:
    ci = binomtest(k, n).proportion_ci(method="exact")
    return f"{ci.low:.0%}-{ci.high:.0%}"


def arms_table(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for arm, g in runs.groupby("arm", sort=False):
        n, k = len(g), int(g.failed.sum())
        rows.append({"arm": arm, "runs": n, "failed (collapsed, stalled or diverged)": f"{k}/{n}",
                     "95 % interval": _interval(k, n), "unstable": int((g.verdict == "unstable").sum()),
                     "stable": int((g.verdict == "stable").sum()),
                     "verdicts": " ".join(f"{s}:{v[0].upper() if v != 'stalled' else 'T'}"
                                          for s, v in sorted(zip(g.seed, g.verdict))),
                     "final loss (median)": f"{g.final_loss.median():.3f}"})
    return pd.DataFrame(rows)


def fisher(runs: pd.DataFrame, more: str, less: str) -> dict | None:
    """One-sided Fisher exact test, H1: arm `more` fails more often than arm `less`."""
    a, b = runs[runs.arm == more], runs[runs.arm == less]
    if not len(a) or not len(b):
        return None
    ka, kb = int(a.failed.sum()), int(b.failed.sum())
    _, p = fisher_exact([[ka, len(a) - ka], [kb, len(b) - kb]], alternative="greater")
    return dict(test=f"{more} fails more often than {less}", counts=f"{ka}/{len(a)} vs {kb}/{len(b)}",
                p=float(p))


def secondary_table(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for arm, g in runs.groupby("arm", sort=False):
        f, s = g[g.failed], g[~g.failed]
        rows.append({"arm": arm,
                     "agreement fell before the climb (failing runs)": f"{int(f.agreement_fell.sum())}/{len(f)}",
                     "A(200) (median)": f"{g.A_first.median():.3f}",
                     "degenerate, failing": f"{int(f.degenerate.sum())}/{len(f)}",
                     "degenerate, not failing": f"{int(s.degenerate.sum())}/{len(s)}",
                     "token cosine (median)": f"{g.token_cosine.median():.3f}",
                     "effective rank (median)": f"{g.effective_rank.median():.2f}",
                     "sigma_max": f"{g.sigma_max.median():.3g}", "spectral radius": f"{g.spectral_radius.median():.3g}",
                     "its residual": f"{g.spectral_residual.median():.2g}", "mean gain": f"{g.mean_gain.median():.3g}",
                     "perturbation growth": f"{g.growth.median():.3g}"})
    return pd.DataFrame(rows)


def onsets_table(runs: pd.DataFrame) -> pd.DataFrame:
    f = runs[runs.failed].sort_values(["arm", "seed"])
    return pd.DataFrame({"arm": f.arm, "run": f.run, "verdict": f.verdict, "climb onset": f.onset,
                         "final-loop token cosine >= 0.9 from": [("-" if x is None or pd.isna(x) else int(x))
                                                                 for x in f.degenerate_from],
                         f"A({AGREEMENT_FROM})": [f"{x:.3f}" for x in f.A_first], "A before onset": [f"{x:.3f}" for x in f.A_before]})


def report(folders: list[Path]) -> str:
    runs = runs_table(folders)
    if runs.empty:
        raise StorageError("no finished runs in " + ", ".join(map(str, folders)))
    order = {name: i for i, name in enumerate(["LT full", "LT k=2", "FLT k=2", "FLT full"])}
    runs = runs.assign(_o=runs.arm.map(lambda a: order.get(a, 99))).sort_values(["_o", "seed"]).drop(columns="_o")
    out = ["Failures per arm (verdict v3 at the run's length; T = stalled):", "", markdown(arms_table(runs)), ""]
    tests = [t for t in (fisher(runs, "LT full", "LT k=2"), fisher(runs, "FLT k=2", "FLT full")) if t]
    if tests:
        out += ["One-sided Fisher exact tests (the plan's):", "", markdown(pd.DataFrame(tests).assign(
            p=lambda t: t.p.map(lambda p: f"{p:.3g}"))), ""]
    out += ["Secondary (descriptive; last snapshot, final loop; medians over the arm's runs):", "",
            markdown(secondary_table(runs)), ""]
    if runs.failed.any():
        out += ["Failing runs: climb onset, degenerate fixed point and gradient agreement A (mean cosine of the "
                "differentiated loops' gradients with their total):", "", markdown(onsets_table(runs)), ""]
    return "\n".join(out)


@guarded
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=source, nargs="+", help="sweep or archive folders of the factorial")
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    args = parser.parse_args(argv)
    text = report(args.folders)
    print(text)
    if args.out:
        atomic_write_text(args.out, text + "\n")  # as flt-diag writes: never through a link, never half a file
    return 0


if __name__ == "__main__":
    sys.exit(main())
