"""How a sweep's variants compare with each other (numpy/pandas only; never torch).

Every row of the sweep tables (flt_diag/results/tables.py) is compared with its *peers*, the other variants' rows
sharing its loops, depth, width and lr scale (and seed, for a run): COMPARISON_COLUMNS, defined in docs/DESIGN.md
section 3, "Comparing variants", with the reasons for the flags' numbers. Computed from the stored summaries alone.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

BASELINE_VARIANT = "flt"  # resid_vs_flt divides by this variant's peak residual norm
COMPARISON_COLUMNS = ["val_gap", "resid_vs_flt", "behind_margin", "behind", "loop_gain", "no_loop_gain"]
RUN_PEERS = ["loops", "depth", "width", "seed", "lr_scale"]  # a run is compared with the runs sharing these
CELL_PEERS = ["loops", "depth", "width", "lr_scale"]  # a cell (seeds averaged) with the cells sharing these
MARGIN_FLOOR = 0.02  # nats: below this size docs/results.md makes no claim
MARGIN_ONE_SEED = 0.10  # nats, with no cell of >= 2 seeds among the peers: about 3x FLT's seed spread
MIN_POOLED_SEEDS = 2


def _insert_after(df: pd.DataFrame, anchor: str, column: str, values) -> None:
    df.insert(df.columns.get_loc(anchor) + 1 if anchor in df else len(df.columns), column, values)


def peer_margin(s_p: float, n_row: float, n_other: float, scale: float = 1.0) -> float:
    """max(MARGIN_FLOOR, 2 s_p sqrt(1/n_row + 1/n_other)), or MARGIN_ONE_SEED without s_p; times `scale`."""
    if not math.isfinite(s_p) or not n_row or not n_other:
        return scale * MARGIN_ONE_SEED
    return scale * max(MARGIN_FLOOR, 2 * s_p * math.sqrt(1 / n_row + 1 / n_other))


def _noise_of_others(cells: pd.DataFrame, groups: list[str]) -> pd.Series:
    """Per cell (rows with `val_sd`, `val_n` and the `groups` keys): the pooled sd over the OTHER cells of its group."""
    ok = (cells.val_n >= MIN_POOLED_SEEDS) & np.isfinite(cells.val_sd)
    ss = ((cells.val_n - 1) * cells.val_sd ** 2).where(ok, 0.0)
    dof = (cells.val_n - 1).where(ok, 0.0)
    keys = [cells[k] for k in groups]
    others_ss = ss.groupby(keys, dropna=False).transform("sum") - ss
    others_dof = dof.groupby(keys, dropna=False).transform("sum") - dof
    return np.sqrt(others_ss / others_dof.where(others_dof > 0))


def peer_flags(df: pd.DataFrame, peers: list[str], noise: pd.Series, n: pd.Series, scale: float = 1.0) -> pd.DataFrame:
    """behind_margin, behind, loop_gain and no_loop_gain of each row of `df` (val_loss, val_gap, variant and the
    `peers` columns), given each row's peers' pooled sd `noise` and its seed count `n` (index-aligned)."""
    val = pd.to_numeric(df.val_loss, errors="coerce").astype(float)
    finite = val.where(np.isfinite(val))
    keys = [df[k] for k in peers]
    best_n = n.where(finite == finite.groupby(keys, dropna=False).transform("min")).groupby(keys, dropna=False) \
        .transform("max")
    margin = pd.Series([peer_margin(s, a, b, scale) for s, a, b in zip(noise, n, best_n)], index=df.index)
    behind = (df.val_gap > margin).fillna(False).astype(bool)
    same = [k for k in peers if k != "loops"]
    one = df.assign(_v=finite, _n=n)[df.loops == 1].drop_duplicates(["variant", *same]).set_index(["variant", *same])
    at_one = pd.MultiIndex.from_frame(df[["variant", *same]])
    n_one = one._n.reindex(at_one).to_numpy()
    gain = (pd.Series(one._v.reindex(at_one).to_numpy(), index=df.index) - finite).where(df.loops != 1)
    one_margin = pd.Series([peer_margin(s, a, b, scale) for s, a, b in zip(noise, n, n_one)], index=df.index)
    return pd.DataFrame(dict(behind_margin=margin, behind=behind, loop_gain=gain,
                             no_loop_gain=(gain <= one_margin).fillna(False).astype(bool)), index=df.index)


def compare_variants(df: pd.DataFrame, peers: list[str], noise: pd.Series, n: pd.Series | None = None,
                     margin_scale: float = 1.0) -> pd.DataFrame:
    """`df` (variant, val_loss, peak_resid_norm and the `peers` columns) with val_gap inserted after
    val_loss, resid_vs_flt after peak_resid_norm and the flags (behind_margin, behind, loop_gain,
    no_loop_gain) at the end, each computed over the rows sharing `peers`; `noise` and `n` as peer_flags's
    (default n: one seed per row); `margin_scale` multiplies the flags' margins."""
    df = df.drop(columns=[c for c in COMPARISON_COLUMNS if c in df]).reset_index(drop=True)
    groups = [df[k] for k in peers]
    val = pd.to_numeric(df.val_loss, errors="coerce").astype(float)
    by_peers = val.where(np.isfinite(val)).groupby(groups, dropna=False)
    best = by_peers.transform("min").where(by_peers.transform("count") > 1)  # no peer: no gap
    peak = pd.to_numeric(df.peak_resid_norm, errors="coerce").astype(float)
    flt = peak.where(df.variant == BASELINE_VARIANT).groupby(groups, dropna=False).transform("first")
    _insert_after(df, "val_loss", "val_gap", val - best)
    _insert_after(df, "peak_resid_norm", "resid_vs_flt", peak / flt)
    noise = pd.Series(noise.to_numpy(), index=df.index)
    n = pd.Series(1.0, index=df.index) if n is None else pd.Series(n.to_numpy(dtype=float), index=df.index)
    return pd.concat([df, peer_flags(df, peers, noise, n, margin_scale)], axis=1)


def compare_runs(df: pd.DataFrame, margin_scale: float = 1.0) -> pd.DataFrame:
    """Per-run rows (`depth` and `width` columns anywhere) compared per run: same loops, depth, width, seed
    and lr scale; the seed noise is pooled over the seeds of the other variants' cells in the table.
    depth and width are moved after loops."""
    df = df.copy()
    for anchor, column in (("loops", "depth"), ("depth", "width")):
        _insert_after(df, anchor, column, df.pop(column).astype("Int64"))
    df = df.reset_index(drop=True)
    cell = ["variant", *[k for k in RUN_PEERS if k != "seed"]]
    val = pd.to_numeric(df.val_loss, errors="coerce").astype(float)
    val = val.where(np.isfinite(val))
    by_cell = val.groupby([df[k] for k in cell], dropna=False)
    cells = df[cell].assign(val_sd=by_cell.transform("std"), val_n=by_cell.transform("count")) \
        .drop_duplicates(cell).reset_index(drop=True)
    cells["noise"] = _noise_of_others(cells, cell[1:])
    noise = df[cell].merge(cells[[*cell, "noise"]], on=cell, how="left").noise
    return compare_variants(df, RUN_PEERS, noise=noise, margin_scale=margin_scale)


def compare_cells(df: pd.DataFrame, margin_scale: float = 1.0) -> pd.DataFrame:
    """Cells compared by their means over finished seeds (val_sd, val_n: the sd and count of their val
    losses): same loops, depth, width and lr scale."""
    noise = _noise_of_others(df, CELL_PEERS)
    return compare_variants(df, CELL_PEERS, noise=noise, n=df.val_n, margin_scale=margin_scale)


# --------------------------------------------------------------------------- as text

def gap_text(gap, decimals: int = 3) -> str:
    """val_gap as tables and the grid show it: "best" for 0, "+0.273" otherwise, "–" when unknown."""
    if gap is None or not math.isfinite(gap):
        return "–"
    return "best" if gap == 0 else f"+{gap:.{decimals}f}"


def ratio_text(ratio) -> str:
    """resid_vs_flt as tables show it: "5.21", "–" when unknown."""
    return "–" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}"


def flags_text(row) -> str:
    """The flags of a row (a dict or a namedtuple) as tables show them: "behind (+0.550 > 0.100)" (its gap and
    margin), "no loop gain (+0.004 vs K=1)", both joined by "; ", or "" for none."""
    get = row.get if isinstance(row, dict) else lambda k, d=None: getattr(row, k, d)
    flags = []
    if get("behind") is True or get("behind") == 1:
        flags.append(f"behind (+{get('val_gap'):.3f} > {get('behind_margin'):.3f})")
    if get("no_loop_gain") is True or get("no_loop_gain") == 1:
        flags.append(f"no loop gain ({get('loop_gain'):+.3f} vs K=1)")
    return "; ".join(flags)


def failed_text(row) -> str:
    """"k/n" of a cell (failed, finished, runs): k of its n finished seeds failed (verdict not stable);
    runs that have not finished (running, or crashed) are not in n: "(+r unfinished)" follows; "–"
    for a cell with no run yet."""
    if row.runs == 0:
        return "–"
    running = row.runs - row.finished
    return f"{row.failed}/{row.finished}" + (f" (+{running} unfinished)" if running > 0 else "")
