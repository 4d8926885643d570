"""The head-to-head figure (issue 56): each variant's breaking point on a stability map, sorted, with its seed
spread; a panel per loops K and criterion. One dot per seed at its boundary (the geometric middle of the bracket
(last value that held, first that broke]); a seed that held at the grid's top is drawn at the top edge as an up
arrow, one that broke at its lowest value at the bottom edge as a down arrow; the bar is the median over seeds
on the log scale the axis draws (2 ** median of log2: with an even count, the geometric middle of the middle two; a
line with a seed beyond the grid takes the grid's edge there). Variants are sorted by that median, highest
(held longest) first; the paper's five are named in bold. Data: `flt_diag.judge.map_boundaries.boundaries`
(a pure function of the map folder).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from flt_diag.config.variants import PAPER_VARIANTS
from flt_diag.judge.map_boundaries import AXES, boundaries, log_median, spec_from_folder
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.map import CRITERION_TITLES, first_break
from flt_diag.results.figures.style import finish, new_figure, variant_color
from flt_diag.results.tables import Study


def breaking_data(src) -> pd.DataFrame:
    """One row per (criterion, loops, variant, seed): `value` (the boundary, or the grid's edge beyond it),
    `beyond` ("above", "below" or None), `median` over the line's seeds (on the log scale), `rank` (0 = highest
    median at that criterion and K) and `paper` (one of the paper's five). attrs: the axis and the grid. Open or
    failed searches are left out."""
    path = src.path if isinstance(src, Study) else Path(src)
    spec = spec_from_folder(path)
    b = first_break(boundaries(path))
    b = b[b.status.isin(["found", "above grid", "below grid"])].copy()
    grid = list(spec.grid)
    b["beyond"] = b.status.map({"above grid": "above", "below grid": "below"})
    b["value"] = np.where(b.status == "above grid", grid[-1], np.where(b.status == "below grid", grid[0], b.boundary))
    b["median"] = b.groupby(["criterion", "loops", "variant"]).value.transform(log_median)
    b["rank"] = b.groupby(["criterion", "loops"])["median"].rank(method="dense", ascending=False).astype(int) - 1
    b["paper"] = b.variant.isin(PAPER_VARIANTS)
    out = b[["criterion", "loops", "variant", "seed", "value", "beyond", "median", "rank", "paper"]]
    out = out.sort_values(["criterion", "loops", "rank", "variant", "seed"]).reset_index(drop=True)
    out.attrs.update(axis=spec.axis, grid=grid)
    return out


# What breaking means on each criterion's panel (its y label); a criterion not named here: "<criterion> breaks".
BREAKS = {"training": "training breaks", "explosion": "the residual stream explodes"}


def _panel(ax, sub: pd.DataFrame, axis: str, grid: list[float], criterion: str) -> None:
    order = list(dict.fromkeys(sub.sort_values(["rank", "variant"]).variant))
    for i, v in enumerate(order):
        g = sub[sub.variant == v]
        color = variant_color(v)
        jitter = np.linspace(-0.15, 0.15, len(g)) if len(g) > 1 else np.zeros(1)
        for (_, r), dx in zip(g.iterrows(), jitter):
            marker = {"above": "^", "below": "v"}.get(r.beyond, "o")
            ax.plot(i + dx, r.value, marker=marker, color=color, ms=6, ls="none", zorder=3)
        ax.hlines(g["median"].iloc[0], i - 0.3, i + 0.3, color=color, lw=2.4, zorder=2)
    ax.set_xticks(range(len(order)), order, rotation=35, ha="right")
    for label, v in zip(ax.get_xticklabels(), order):
        label.set_fontweight("bold" if v in PAPER_VARIANTS else "normal")
    ax.set_yscale("log", base=2 if axis == "lr" else 10)
    for edge in (grid[0], grid[-1]):
        ax.axhline(edge, color="0.6", lw=0.6, ls=":")
    ax.set_ylim(grid[0] / 1.4, grid[-1] * 1.4)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_ylabel(f"{AXES[axis]} where {BREAKS.get(criterion, criterion + ' breaks')}")


def draw(df: pd.DataFrame):
    axis, grid = df.attrs["axis"], df.attrs["grid"]
    panels = list(dict.fromkeys(zip(df.criterion, df.loops)))
    fig, axes = new_figure(1, len(panels), panel=(max(4.0, 0.55 * df.variant.nunique() + 1.5), 3.8))
    for ax, (criterion, loops) in zip(axes[0], panels):
        _panel(ax, df[(df.criterion == criterion) & (df.loops == loops)], axis, grid, criterion)
        ax.set_title(f"{CRITERION_TITLES.get(criterion, criterion)}, K={loops}")
    fig.text(0.5, -0.02, "dot: one seed, at the geometric middle of its bracket (last value held, first broken]; "
             "bar: median over seeds (log scale);\narrow: beyond the grid (held at its top, broke at its bottom); "
             "dotted: the grid's ends; bold: the paper's five", ha="center", va="top", fontsize=8)
    return finish(fig, "Where each variant breaks (sorted: held longest first)")


register(Figure("breaking", (), breaking_data, draw, empty="not a stability map (made by `flt-diag map`)",
                applies=lambda study: study.kind == "map"))
