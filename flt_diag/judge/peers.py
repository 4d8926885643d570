"""How a sweep's variants compare with each other (numpy/pandas only; never torch).

A single run's verdict cannot say that a variant trains worse than the others at the same loop count,
so every row of the sweep tables (flt_diag/results/tables.py) is compared with its *peers*, the rows of the
other variants that share its loops K, depth L and lr scale (and seed, for a run):

    val_gap       its final validation loss minus the lowest among its peers and itself, in nats:
                  0 for the best; NaN for a row without a finite val loss, and for a row with no
                  peer that has one (a lone probe of a map, a one-variant sweep: nothing to be behind)
    resid_vs_flt  its peak final-loop residual norm over FLT's among its peers (1 for FLT itself;
                  NaN where the sweep has no finished FLT there)

Per run (summary.csv) the numbers compare runs of one seed; per cell (summary_table, the grid, the
report) they compare the cells' means over their finished seeds. Both come from the stored summaries
alone, so `summary --recompute` and folders written before these columns existed show them.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

BASELINE_VARIANT = "flt"  # resid_vs_flt divides by this variant's peak residual norm
COMPARISON_COLUMNS = ["val_gap", "resid_vs_flt"]
RUN_PEERS = ["loops", "depth", "seed", "lr_scale"]  # a run is compared with the runs sharing these
CELL_PEERS = ["loops", "depth", "lr_scale"]  # a cell (seeds averaged) with the cells sharing these


def _insert_after(df: pd.DataFrame, anchor: str, column: str, values) -> None:
    df.insert(df.columns.get_loc(anchor) + 1 if anchor in df else len(df.columns), column, values)


def compare_variants(df: pd.DataFrame, peers: list[str]) -> pd.DataFrame:
    """`df` (variant, val_loss, peak_resid_norm and the `peers` columns) with val_gap inserted after
    val_loss and resid_vs_flt after peak_resid_norm, each computed over the rows sharing `peers`."""
    df = df.drop(columns=[c for c in COMPARISON_COLUMNS if c in df]).reset_index(drop=True)
    groups = [df[k] for k in peers]
    val = pd.to_numeric(df.val_loss, errors="coerce").astype(float)
    by_peers = val.where(np.isfinite(val)).groupby(groups, dropna=False)
    best = by_peers.transform("min").where(by_peers.transform("count") > 1)  # no peer: no gap
    peak = pd.to_numeric(df.peak_resid_norm, errors="coerce").astype(float)
    flt = peak.where(df.variant == BASELINE_VARIANT).groupby(groups, dropna=False).transform("first")
    _insert_after(df, "val_loss", "val_gap", val - best)
    _insert_after(df, "peak_resid_norm", "resid_vs_flt", peak / flt)
    return df


def compare_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Per-run rows (a `depth` column anywhere) compared per run: same loops, depth, seed and lr scale;
    depth is moved after loops."""
    df = df.copy()
    depth = df.pop("depth").astype("Int64")
    df.insert(df.columns.get_loc("loops") + 1, "depth", depth)
    return compare_variants(df, RUN_PEERS)


def compare_cells(df: pd.DataFrame) -> pd.DataFrame:
    """Cells compared by their means over finished seeds: same loops, depth and lr scale."""
    return compare_variants(df, CELL_PEERS)


# --------------------------------------------------------------------------- as text

def gap_text(gap, decimals: int = 3) -> str:
    """val_gap as tables and the grid show it: "best" for 0, "+0.273" otherwise, "–" when unknown."""
    if gap is None or not math.isfinite(gap):
        return "–"
    return "best" if gap == 0 else f"+{gap:.{decimals}f}"


def ratio_text(ratio) -> str:
    """resid_vs_flt as tables show it: "5.21", "–" when unknown."""
    return "–" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}"


def failed_text(row) -> str:
    """"k/n" of a cell (failed, finished, runs): k of its n finished seeds failed (verdict not stable);
    runs that have not finished (running, or crashed) are not in n: "(+r unfinished)" follows; "–"
    for a cell with no run yet."""
    if row.runs == 0:
        return "–"
    running = row.runs - row.finished
    return f"{row.failed}/{row.finished}" + (f" (+{running} unfinished)" if running > 0 else "")
