"""The stability-map figure: a phase diagram per criterion (x = loops K, y = the map's axis).

For every variant, the boundary (median over seeds) is a line with markers; the band around it is
the spread over seeds (or, with one seed, the bracket (last value that held, first that broke]);
the region below the line, where that variant trains, is shaded in its colour. A boundary beyond
the grid is drawn as an arrow at the grid's edge (up: held at every value; down: broke at the
lowest). Data: `flt_diag.stability_map.boundaries` (a pure function of the map folder).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .plotting import VARIANT_ORDER, _figure, _finish, variant_color
from .stability_map import AXES, boundaries, spec_from_folder

CRITERION_TITLES = {"training": "training breaks (verdict not stable)", "collapse": "loss collapses",
                    "explosion": "residual stream explodes (any loop)"}


def map_data(path) -> pd.DataFrame:
    """Per (criterion, variant, loops): median boundary over seeds, its low/high band, and where it lies
    beyond the grid ("above"/"below") when no seed found it inside."""
    b = boundaries(path)
    rows = []
    for (criterion, variant, loops), g in b.groupby(["criterion", "variant", "loops"], sort=False):
        found = g[g.status == "found"]
        if len(found):
            lo, hi = (found.boundary.min(), found.boundary.max()) if len(g) > 1 else (found.last_ok.iloc[0], found.first_broken.iloc[0])
            rows.append(dict(criterion=criterion, variant=variant, loops=loops, value=found.boundary.median(),
                             low=lo, high=hi, beyond=None))
        elif (g.status == "above grid").all():
            rows.append(dict(criterion=criterion, variant=variant, loops=loops, value=g.last_ok.max(),
                             low=math.nan, high=math.nan, beyond="above"))
        elif (g.status == "below grid").all():
            rows.append(dict(criterion=criterion, variant=variant, loops=loops, value=g.first_broken.min(),
                             low=math.nan, high=math.nan, beyond="below"))
    return pd.DataFrame(rows, columns=["criterion", "variant", "loops", "value", "low", "high", "beyond"])


def draw_map(df: pd.DataFrame, axis: str, grid: list[float], loops: list[int]):
    criteria = list(dict.fromkeys(df.criterion)) or ["training"]
    fig, axes = _figure(1, len(criteria), panel=(4.6, 3.6))
    xs = {k: i for i, k in enumerate(loops)}
    variants = sorted(set(df.variant), key=lambda v: VARIANT_ORDER.index(v) if v in VARIANT_ORDER else 99)
    offsets = {v: (j - (len(variants) - 1) / 2) * 0.06 for j, v in enumerate(variants)}
    lo_edge, hi_edge = grid[0] / 1.25, grid[-1] * 1.25
    handles = {}
    for ax, criterion in zip(axes[0], criteria):
        sub = df[df.criterion == criterion]
        for v in variants:
            g = sub[sub.variant == v].assign(x=lambda t: t.loops.map(xs) + offsets[v]).sort_values("x")
            if g.empty:
                continue
            color = variant_color(v)
            y = np.where(g.beyond == "above", hi_edge, np.where(g.beyond == "below", lo_edge, g.value))
            (line,) = ax.plot(g.x, y, color=color, marker="o", ms=4, lw=1.6, label=v, zorder=3)
            handles[v] = line
            ax.fill_between(g.x, lo_edge, y, color=color, alpha=0.07, lw=0)
            inside = g[g.beyond.isna()]
            ax.vlines(inside.x, inside.low, inside.high, color=color, lw=3, alpha=0.35, zorder=2)
            for _, r in g[g.beyond.notna()].iterrows():
                up = r.beyond == "above"
                ax.plot(r.x, hi_edge if up else lo_edge, marker="^" if up else "v", color=color, ms=8, zorder=4)
        ax.set_yscale("log", base=2 if axis == "lr" else 10)
        ax.set_ylim(lo_edge / 1.1, hi_edge * 1.15)
        ax.set_xticks(range(len(loops)), [str(k) for k in loops])
        ax.set_xlim(-0.5, len(loops) - 0.5)
        ax.set_xlabel("loops K")
        ax.set_ylabel(f"{AXES[axis]} at the boundary")
        ax.axhline(grid[-1], color="0.6", lw=0.6, ls=":")
        ax.axhline(grid[0], color="0.6", lw=0.6, ls=":")
        ax.set_title(CRITERION_TITLES.get(criterion, criterion), fontsize=9)
        if axis == "lr":
            from matplotlib.ticker import FuncFormatter
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=len(handles),
                   frameon=False, fontsize=9, title_fontsize=7.5,
                   title="shaded: where each variant trains; bar: spread over seeds (one seed: the bracket); "
                         "arrow: beyond the grid")
    return _finish(fig, "stability map")


def fig_map(path):
    spec = spec_from_folder(path)
    return draw_map(map_data(path), spec["axis"], spec["grid"], spec["loops"])
