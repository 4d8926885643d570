"""The look every figure shares: seaborn paper style, one colour per variant (VARIANT_COLORS,
Okabe-Ito, colour-blind safe), one line style per seed, one shared legend below the panels (never
over data or tables), and a grid of panels with one row per lr scale and one column per loops K.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Sequence

import matplotlib

if "matplotlib.pyplot" not in sys.modules:  # headless by default; leave an interactive session alone
    matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from flt_diag.results.tables import variant_rank  # noqa: E402
from flt_diag.storage.folders import StorageError  # noqa: E402
from flt_diag.config.variants import VARIANT_COLORS  # noqa: E402

OTHER_COLOR = "#7f7f7f"
VERDICT_COLORS = {"stable": "#a6d96a", "unstable": "#fee08b", "stalled": "#c2a5cf", "collapsed": "#fdae61",
                  "diverged": "#d7191c", "running": "#c6dbef", "failed": "#969696", "pending": "#f0f0f0"}
BEHIND_COLOR = "#e0b050"  # a stable cell flagged `behind` its peers: amber and hatched, never green
BEHIND_HATCH = "//"
# Line styles that tell seeds apart; dotted is left out: the loop-dynamics figure draws sigma_max dotted. With more
# seeds than styles a style would repeat (seed 0 and seed 3 alike), so every seed is drawn solid, one line each.
LINESTYLES = ["-", "--", "-."]
DPI = 150


class NoData(StorageError):
    """The folder holds nothing this figure can draw (yet)."""


@contextmanager
def style():
    """The look of every figure: seaborn paper context, white grid, readable at paper size."""
    with sns.axes_style("whitegrid"), sns.plotting_context("paper", font_scale=1.25), \
            matplotlib.rc_context({"legend.frameon": False, "axes.titleweight": "bold", "figure.dpi": 100}):
        yield


# Colours of labels that are no variant (runs laid side by side, labelled by folder: results.tables._labelled),
# none of VARIANT_COLORS' (seaborn's "dark" palette but its grey, which reads as FLT's black); each new label
# takes the next, in the order first drawn.
LABEL_COLORS = [c for c in sns.color_palette("dark").as_hex() if c != "#3c3c3c"]
_LABELS: dict[str, str] = {}


def variant_color(variant: str) -> str:
    if variant in VARIANT_COLORS:
        return VARIANT_COLORS[variant]
    return _LABELS.setdefault(variant, LABEL_COLORS[len(_LABELS) % len(LABEL_COLORS)])


def variants(df: pd.DataFrame) -> list[str]:
    """The variants of a table in the project's order."""
    return sorted(df.variant.unique(), key=lambda v: (variant_rank(v), v))


def new_figure(nrows: int, ncols: int, panel=(3.6, 2.7), **kw) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(panel[0] * ncols + 0.6, panel[1] * nrows + 1.0), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def _title(k: int, lr: float, multi_lr: bool) -> str:
    return f"K={k}" + (f", lr×{lr:g}" if multi_lr else "")


def panels(df: pd.DataFrame, xlabel: str, ylabel: str, panel=(3.6, 2.7), **kw):
    """A grid of panels, one row per lr scale and one column per loops K, `xlabel` below the bottom row and
    `ylabel` beside the first column: (fig, axes, cells), cells a list of (ax, rows of df in that panel, title)."""
    lrs, ks = sorted(df.lr_scale.unique()), sorted(df.loops.unique())
    fig, axes = new_figure(len(lrs), len(ks), panel, **kw)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    cells = [(axes[i, j], df[(df.lr_scale == lr) & (df.loops == k)], _title(k, lr, len(lrs) > 1))
             for i, lr in enumerate(lrs) for j, k in enumerate(ks)]
    return fig, axes, cells


def cell_rows(df: pd.DataFrame) -> list[tuple[pd.DataFrame, str]]:
    """One (rows of df, title) per (lr scale, loops K) present, for figures with a row of panels each."""
    keys = sorted({(r.lr_scale, r.loops) for r in df[["lr_scale", "loops"]].drop_duplicates().itertuples()})
    multi_lr = len({lr for lr, _ in keys}) > 1
    return [(df[(df.lr_scale == lr) & (df.loops == k)], _title(k, lr, multi_lr)) for lr, k in keys]


def row_grid(rows: list[tuple[pd.DataFrame, str]], headings: Sequence[str], xlabels: Sequence[str], panel, **kw):
    """A figure with a row of panels per (rows of df, title) of `rows` (e.g. cell_rows(df)) and a column per
    heading: the headings above the top row, each row's title (bold) beside its first panel, `xlabels` below
    the bottom row. (fig, axes)."""
    fig, axes = new_figure(len(rows), len(headings), panel, **kw)
    for ax, heading in zip(axes[0], headings):
        ax.set_title(heading)
    for ax, (_, title) in zip(axes[:, 0], rows):
        ax.set_ylabel(title, fontweight="bold")
    for ax, label in zip(axes[-1], xlabels):
        ax.set_xlabel(label)
    return fig, axes


def seed_styles(df: pd.DataFrame) -> dict[str, str]:
    """Line style per run, by seed (solid when there is one, or more seeds than LINESTYLES)."""
    seeds = sorted(df.seed.unique())
    styled = len(seeds) <= len(LINESTYLES)
    return {r.run: LINESTYLES[seeds.index(r.seed)] if styled else "-" for r in df.drop_duplicates("run").itertuples()}


def lines_by_run(ax, df: pd.DataFrame, x: str, y: str = "value", **kw) -> None:
    """One line per run of `df`, coloured by variant, styled by seed (unless `kw` gives `ls`)."""
    styles = seed_styles(df)
    for run, g in df.groupby("run", sort=False):
        ax.plot(g[x], g[y], color=variant_color(g.variant.iloc[0]), **{"ls": styles[run], **kw})


def legend(fig: Figure, df: pd.DataFrame, extra: Sequence[tuple] = (), title: str | None = None) -> None:
    """The figure's one legend, below every panel: a line per variant (colour), per seed where there
    are several and no more than LINESTYLES (line style; more: one entry saying so), then `extra`
    (handle, label) pairs."""
    handles = [(Line2D([], [], color=variant_color(v), lw=2), v) for v in variants(df)]
    seeds = sorted(df.seed.unique()) if "seed" in df else []
    if 1 < len(seeds) <= len(LINESTYLES):
        handles += [(Line2D([], [], color="0.3", ls=LINESTYLES[i]), f"seed {s}") for i, s in enumerate(seeds)]
    elif len(seeds) > len(LINESTYLES):
        handles.append((Line2D([], [], color="0.3", lw=0.8), f"{len(seeds)} seeds, one solid line each"))
    handles += list(extra)
    fig.legend([h for h, _ in handles], [label for _, label in handles], loc="outside lower center",
               ncols=min(len(handles), 8), fontsize="small", title=title, title_fontsize="small")


class _PlainLogFormatter(ticker.LogFormatter):
    """Log-axis tick labels as plain numbers (0.5, 20, 1e-05), labelling minor ticks on short ranges."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:.3g}"


def log_y(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_PlainLogFormatter())
    ax.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))


def auto_yscale(ax, values) -> None:
    """Log scale when the values span more than a factor of 5."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v) and v.max() / v.min() > 5:
        log_y(ax)


def empty(ax, text="no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax.set_axis_off()  # (not set_*ticks([]), which would clear the ticks of every shared axis)


def finish(fig: Figure, title: str) -> Figure:
    fig.suptitle(title, fontweight="bold")
    return fig


def text_color(fill: str) -> str:
    """Black or white, whichever reads better on `fill`."""
    r, g, b = mcolors.to_rgb(fill)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def filled(cells):
    """The panels of `panels(...)` with data: each titled, an empty one marked "no data" and skipped."""
    for ax, cell, title in cells:
        ax.set_title(title)
        if cell.empty:
            empty(ax)
            continue
        yield ax, cell
