"""How often each cell fails, over every seed run of it: the table of docs/results.md, from the folders alone.

    python analysis/failure_rates.py SWEEP [SWEEP ...] [--csv FILE]

Sweeps of one setting are pooled (`flt-diag summary A B`: a cell and seed finished in two folders counts
once). Per (lr scale, depth, width, variant, K) cell: the seeds finished, how many failed (verdict not `stable`)
with the exact (Clopper-Pearson) 95 % interval of the failure rate, each seed's verdict, and the means over
seeds of the gap to the best variant's val loss and of the peak residual norm over FLT's. Printed as a
Markdown table. Imports only the torch-free layers of flt_diag (results, storage): never the training code.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
from scipy.stats import binomtest

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # (a checkout)

from flt_diag.results.report import markdown  # noqa: E402
from flt_diag.results.tables import pooled_summary, variant_rank  # noqa: E402
from flt_diag.storage.folders import atomic_path, refuse_links  # noqa: E402
from flt_diag.storage.safe_files import new_file  # noqa: E402
from script_exit import Parser, guarded, source  # noqa: E402  (analysis/script_exit.py: the one error path)

SHORT = {"stable": "s", "unstable": "U", "stalled": "T", "collapsed": "C", "diverged": "D"}  # a seed's verdict in one letter (T: stalled)


def failure_rates(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell of `runs` (pooled_summary's rows): seeds, failed k/n, its 95 % interval, verdicts."""
    rows = []
    for (lr, depth, width, variant, loops), g in runs.groupby(["lr_scale", "depth", "width", "variant", "loops"],
                                                              dropna=False):
        g = g.sort_values("seed")
        n, k = len(g), int((g.verdict != "stable").sum())
        ci = binomtest(k, n).proportion_ci(method="exact")
        rows.append(dict(variant=variant, K=int(loops), L=depth, d=width, lr_scale=lr, seeds=_ranges(g.seed.tolist()),
                         failed=f"{k}/{n}", rate=k / n, ci_low=ci.low, ci_high=ci.high,
                         verdicts=" ".join(f"{s}:{SHORT.get(v, v)}" for s, v in zip(g.seed, g.verdict)),
                         val_gap=g.val_gap.mean(), resid_vs_flt=g.resid_vs_flt.mean()))
    table = pd.DataFrame(rows)
    order = table.assign(_r=table.variant.map(variant_rank)).sort_values(["lr_scale", "L", "K", "_r"]).index
    return table.loc[order].reset_index(drop=True)


def _ranges(seeds: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, s in enumerate(seeds):
        if start is None:
            start = s
        if i + 1 == len(seeds) or seeds[i + 1] != s + 1:
            out.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out)


def as_text(table: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "cell": [f"{r.variant}, K={r.K}" + (f", L={r.L}" if table.L.nunique() > 1 else "")
                 + (f", d={r.d}" if table.d.nunique() > 1 else "")
                 + (f", lr x{r.lr_scale:g}" if table.lr_scale.nunique() > 1 else "") for r in table.itertuples()],
        "seeds": table.seeds, "failed": table.failed,
        "95 % interval": [f"{lo:.0%}-{hi:.0%}" for lo, hi in zip(table.ci_low, table.ci_high)],
        "verdict per seed": table.verdicts,
        "gap to best (mean)": [f"{x:+.3f}" if pd.notna(x) else "–" for x in table.val_gap],
        "peak ÷ FLT (mean)": [f"{x:.2f}" if pd.notna(x) else "–" for x in table.resid_vs_flt]})


@guarded
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", type=source, nargs="+")
    parser.add_argument("--csv", type=Path, help="also write the table at full precision")
    args = parser.parse_args(argv)
    if args.csv:  # refused before anything is read or printed: a link, a FIFO, a folder (as flt-diag's --csv)
        refuse_links(new_file(args.csv))
    table = failure_rates(pooled_summary(args.sweeps))
    if table.empty:
        print("no finished runs", file=sys.stderr)
        return 1
    print(markdown(as_text(table)))
    print("\nverdicts: s stable, U unstable, T stalled, C collapsed, D diverged; interval: exact (Clopper-Pearson) 95 %")
    if args.csv:  # as flt-diag writes: a temporary file renamed into place, never through a link
        with atomic_path(new_file(args.csv)) as tmp:
            table.to_csv(tmp, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
