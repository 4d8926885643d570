"""The stability-map figure: a phase diagram per criterion (x = loops K, y = the map's axis).

For every variant, the boundary (median over seeds) is a line with markers; the band around it is
the spread over seeds (or, with one seed, the bracket (last value that held, first that broke]);
the region below the line, where that variant trains, is shaded in its colour. A boundary beyond
the grid is drawn as an arrow at the grid's edge (up: held at every value; down: broke at the
lowest). A non-monotone line (it breaks, holds higher up, and breaks again: the 12-loop LT along depth)
counts where it first breaks, its lowest broken value (below the grid where that is the grid's
lowest), and its point wears a ring. Data: `flt_diag.grids.stability_map.boundaries` (a pure function
of the map folder).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from flt_diag.judge.map_boundaries import AXES, boundaries, spec_from_folder
from flt_diag.results.tables import Study
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import finish, legend, new_figure, variant_color, variants

CRITERION_TITLES = {"training": "training breaks (verdict not stable)", "collapse": "loss collapses",
                    "explosion": "residual stream explodes (any loop)"}
COLUMNS = ["criterion", "variant", "loops", "value", "low", "high", "beyond", "non_monotone"]


def first_break(lines: pd.DataFrame) -> pd.DataFrame:
    """`lines` (rows of `boundaries`) with each non-monotone line counted where it first breaks: "below
    grid" where nothing below its lowest broken value held, else "found" in (last_ok, first_broken]."""
    nm = lines.status == "non-monotone"
    if not nm.any():
        return lines
    lines = lines.copy()
    lines.loc[nm, "status"] = np.where(lines.loc[nm, "last_ok"].isna(), "below grid", "found")
    found = nm & (lines.status == "found")
    lines.loc[found, "boundary"] = np.sqrt(lines.loc[found, "last_ok"] * lines.loc[found, "first_broken"])
    return lines


def _boundary(criterion, variant, loops, g: pd.DataFrame) -> dict | None:
    non_monotone = bool((g.status == "non-monotone").any())
    g = first_break(g)
    found = g[g.status == "found"]
    row = dict(criterion=criterion, variant=variant, loops=loops, low=math.nan, high=math.nan, beyond=None,
               non_monotone=non_monotone)
    if len(found):
        lo, hi = ((found.boundary.min(), found.boundary.max()) if len(g) > 1
                  else (found.last_ok.iloc[0], found.first_broken.iloc[0]))
        return {**row, "value": found.boundary.median(), "low": lo, "high": hi}
    if (g.status == "above grid").all():
        return {**row, "value": g.last_ok.max(), "beyond": "above"}
    if (g.status == "below grid").all():
        return {**row, "value": g.first_broken.min(), "beyond": "below"}
    return None


def map_data(src) -> pd.DataFrame:
    """Per (criterion, variant, loops): median boundary over seeds, its low/high band, and where it lies
    beyond the grid ("above"/"below") when no seed found it inside. attrs: the map's axis, grid, loops."""
    path = src.path if isinstance(src, Study) else Path(src)
    spec = spec_from_folder(path)
    rows = [_boundary(*key, g) for key, g in  # type: ignore[call-arg]  # (key: the three grouped columns)
            boundaries(path).groupby(["criterion", "variant", "loops"], sort=False)]
    df = pd.DataFrame([r for r in rows if r], columns=COLUMNS)
    df.attrs.update(axis=spec.axis, grid=list(spec.grid), loops=list(spec.loops))
    return df


def _panel(ax, sub: pd.DataFrame, names: list[str], xs: dict, edges: tuple[float, float]) -> None:
    offsets = {v: (j - (len(names) - 1) / 2) * 0.06 for j, v in enumerate(names)}
    lo_edge, hi_edge = edges
    for v in names:
        g = sub[sub.variant == v].assign(x=lambda t: t.loops.map(xs) + offsets[v]).sort_values("x")
        if g.empty:
            continue
        color = variant_color(v)
        y = np.where(g.beyond == "above", hi_edge, np.where(g.beyond == "below", lo_edge, g.value))
        ax.plot(g.x, y, color=color, marker="o", ms=4, lw=1.6, zorder=3)
        ax.fill_between(g.x, lo_edge, y, color=color, alpha=0.07, lw=0)
        inside = g[g.beyond.isna()]
        ax.vlines(inside.x, inside.low, inside.high, color=color, lw=3, alpha=0.35, zorder=2)
        for _, r in g[g.beyond.notna()].iterrows():
            up = r.beyond == "above"
            ax.plot(r.x, hi_edge if up else lo_edge, marker="^" if up else "v", color=color, ms=8, zorder=4)
        rings = g.non_monotone.astype(bool).to_numpy()
        ax.plot(g.x[rings], y[rings], ls="none", marker="o", ms=13, mfc="none", mec=color, mew=1.4, zorder=5)


def draw(df: pd.DataFrame):
    axis, grid, loops = df.attrs["axis"], df.attrs["grid"], df.attrs["loops"]
    criteria = list(dict.fromkeys(df.criterion)) or ["training"]
    names, xs = variants(df), {k: i for i, k in enumerate(loops)}
    edges = (grid[0] / 1.25, grid[-1] * 1.25)
    fig, axes = new_figure(1, len(criteria), panel=(4.6, 3.6))
    for ax, criterion in zip(axes[0], criteria):
        _panel(ax, df[df.criterion == criterion], names, xs, edges)
        ax.set_yscale("log", base=2 if axis == "lr" else 10)
        ax.set_ylim(edges[0] / 1.1, edges[1] * 1.15)
        ax.set_xticks(range(len(loops)), [str(k) for k in loops])
        ax.set_xlim(-0.5, len(loops) - 0.5)
        ax.set_xlabel("loops K")
        ax.set_ylabel(f"{AXES[axis]} at the boundary")
        for edge in (grid[0], grid[-1]):
            ax.axhline(edge, color="0.6", lw=0.6, ls=":")
        ax.set_title(CRITERION_TITLES.get(criterion, criterion))
        if axis == "lr":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        else:  # depth: the grid's own values, as plain integers (not "2x10^0")
            ax.set_yticks(grid, [f"{v:g}" for v in grid])
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if len(df):
        legend(fig, df, title="shaded: where each variant trains; bar: spread over seeds (one seed: the "
                              "bracket); arrow: beyond the grid; dotted: the grid's ends"
                              + ("\nring: a seed's line is non-monotone (breaks, holds higher, breaks "
                                 "again), counted where it first breaks" if df.non_monotone.any() else ""))
    return finish(fig, "Stability map")


register(Figure("map", (), map_data, draw, empty="not a stability map (made by `flt-diag map`)",
                applies=lambda study: study.kind == "map"))
