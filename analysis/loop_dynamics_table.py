"""What the loop-dynamics records show on finished runs (issue 32; plan: docs/plans/2026-12-01-loop-dynamics-
measurement.md): per run, when the loop-map gain first exceeds 1 against when the loss starts to climb; per
variant, the final fixed-point residual and exit-loss gap; and how well each record separates failing runs
(AUROC with a bootstrap interval) at a few steps. No torch.

    python analysis/loop_dynamics_table.py runs/d-k12 runs/d-k9 --at 100 200 300 500

Labels are the summary.json verdicts (run `flt-diag summary --recompute` first).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # (a checkout)

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from flt_diag.results.warning_evaluation import auroc, bootstrap_interval  # noqa: E402
from flt_diag.storage import metric_names as M  # noqa: E402
from flt_diag.storage.folders import atomic_path, load_config, load_metrics, load_summary, refuse_links, run_dirs  # noqa: E402
from flt_diag.storage.safe_files import new_file  # noqa: E402
from script_exit import Parser, guarded, whole, source  # noqa: E402  (analysis/script_exit.py: the one error path)

WINDOW = 50  # the plan's window [s - 50, s)
FINAL_STEPS = 100  # "final": the records of the last 100 steps


def per_loop(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One metric as a table: rows = step, columns = loop."""
    sel = df[df.metric == metric]
    return sel.pivot_table(index="step", columns="loop", values="value", aggfunc="last").sort_index()


def quantities(df: pd.DataFrame, loops: int) -> dict[str, pd.Series]:
    """Step-indexed series of each record the plan names."""
    gain = per_loop(df, M.LOOP_GAIN)
    fpr = per_loop(df, M.FIXED_POINT_RESIDUAL)
    exit_loss = per_loop(df, M.EXIT_LOSS)
    norms = df[df.metric.isin([f"{M.PARAM_NORM}/attn", f"{M.PARAM_NORM}/mlp"])]  # the shared block matrices
    block_norm = norms.groupby("step").value.apply(lambda v: float(np.sqrt((v ** 2).sum())))
    out = {"max loop gain": gain.max(axis=1) if len(gain) else pd.Series(dtype=float),
           "fixed-point residual (last loop)": fpr[loops] if loops in fpr else pd.Series(dtype=float),
           "exit-loss gap (last - best loop)": (exit_loss[loops] - exit_loss.min(axis=1)) if loops in exit_loss
           else pd.Series(dtype=float),
           "block weight norm": block_norm}
    sharp = df[df.metric == M.SHARPNESS].set_index("step").value
    if len(sharp):
        out["sharpness"] = sharp
    return out


def window_mean(s: pd.Series, at: int) -> float:
    w = s[(s.index >= at - WINDOW) & (s.index < at)]
    if not len(w):  # a record taken every N steps: the last value before s
        w = s[s.index < at].tail(1)
    return float(w.mean()) if len(w) else math.nan


def run_row(d: Path, steps: list[int]) -> dict:
    cfg, summary = load_config(d), load_summary(d)
    loops = cfg.model.loops
    df = load_metrics(d)
    q = quantities(df, loops)
    gain = q["max loop gain"]
    above = gain[gain > 1]
    ev = summary.evidence
    climbed = (ev.climb or 0) > (math.inf if ev.rebound_threshold is None else ev.rebound_threshold)
    row = dict(run=d.name, variant=cfg.model.variant, loops=loops, seed=cfg.train.seed,
               verdict=summary.verdict, failed=int(summary.verdict != "stable"),
               gain_above_1_at=int(above.index[0]) if len(above) else None,
               gain_first=float(gain.iloc[0]) if len(gain) else math.nan,
               gain_last=float(gain.iloc[-1]) if len(gain) else math.nan,
               climb_start=int(ev.climb_start_step) if climbed and ev.climb_start_step is not None else None)
    for name, s in q.items():
        # the last 100 steps (records every step or every 10th alike); the gain: its last two estimates
        tail = s[s.index > s.index.max() - FINAL_STEPS] if name != "max loop gain" and len(s) else s.tail(2)
        row[f"final {name}"] = float(tail.mean()) if len(tail) else math.nan
        for at in steps:
            row[f"{name} @{at}"] = window_mean(s, at)
    return row


@guarded
def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=source)
    ap.add_argument("--at", nargs="+", type=whole(1), default=[100, 200, 300, 500],
                    help="steps to score at (1 or more: the records before each)")
    ap.add_argument("--csv", type=Path)
    args = ap.parse_args(argv)
    if args.csv:  # refused before any folder is read: a link, a FIFO, a folder (as flt-diag's --csv)
        refuse_links(new_file(args.csv))
    rows = [run_row(d, args.at) for f in args.folders for d in run_dirs(f) if load_summary(d) is not None]
    if not rows:
        raise ValueError("no finished run in the given folders")
    t = pd.DataFrame(rows)
    if args.csv:  # as flt-diag writes: a temporary file renamed into place, never through a link
        with atomic_path(new_file(args.csv)) as tmp:
            t.to_csv(tmp, index=False)
    pd.set_option("display.width", 200)
    print(t[["run", "verdict", "gain_first", "gain_last", "gain_above_1_at", "climb_start"]].to_string(index=False))
    finals = [c for c in t.columns if c.startswith("final ")]
    print("\n" + t.groupby(["variant", "loops"])[finals].agg(["min", "max"]).round(4).to_string())
    print("\nAUROC (failed = verdict not stable) [95 % bootstrap interval]")
    names = [c.split(" @")[0] for c in t.columns if " @" in c]
    for subset, rows_ in (("all", t), ("LT only", t[t.variant == "lt"])):
        y = rows_.failed.to_numpy()
        if not len(y):
            print(f"  {subset}: no run")
            continue
        if y.min() == y.max():
            print(f"  {subset}: one outcome only ({int(y.sum())} of {len(y)} failed): no AUROC")
            continue
        for name in dict.fromkeys(names):
            cells = []
            for at in args.at:
                x = rows_[f"{name} @{at}"].to_numpy(float)
                ok = np.isfinite(x)
                if len(set(y[ok])) < 2:  # no run has the record there, or only runs of one outcome
                    cells.append(f"@{at}: – (n={ok.sum()}, {int(y[ok].sum())} failed: no AUROC)")
                    continue
                a = auroc(y[ok], x[ok])
                lo, hi = bootstrap_interval(y[ok], x[ok], n=2000)
                cells.append(f"@{at}: {a:.2f} [{lo:.2f}, {hi:.2f}] (n={ok.sum()})")
            print(f"  {subset:8s} {name:34s} " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
