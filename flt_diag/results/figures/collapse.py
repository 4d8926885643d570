"""The variant x loops grid coloured by verdict (majority over finished seeds, "running" while none
finished, "pending" before a cell starts), one grid per lr scale; a depth-axis map's columns are the depths L,
one grid per K. What a cell reads, and how `behind` and "no loop gain" cells look: docs/DESIGN.md section 3,
"Comparing variants" (* marks a residual explosion).
"""
from __future__ import annotations

import math

import pandas as pd
from matplotlib.patches import Patch, Rectangle

from flt_diag.judge.peers import gap_text
from flt_diag.results.tables import GRID_COLUMNS, Study, summary_table
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import (BEHIND_COLOR, BEHIND_HATCH, OTHER_COLOR, VERDICT_COLORS, finish, new_figure,
                                            text_color, variants)

NOT_DONE = ("running", "failed", "pending")
NOTE = ("top: gap to the best variant's val loss at this K and L (nats; best outlined); * residual explosion\n"
        "below: val loss (mean over finished seeds); hatched: behind the best by more than the seed noise")
SEEDS_NOTE = "\nk/n failed: k of the n finished seeds not stable; (+u): u seeds unfinished, not counted"


def data(study: Study) -> pd.DataFrame:
    """GRID_COLUMNS (lr_scale, variant, loops, depth, width, verdict, agree, runs, finished, failed,
    residual_explosion, ...), final_loss, val_loss, val_gap, behind, no_loop_gain: the collapse grid's cells
    (see flt_diag.results.tables.summary_table)."""
    return summary_table(study)[GRID_COLUMNS + ["final_loss", "val_loss", "val_gap", "behind", "no_loop_gain"]]


def cell_text(row, multi_seed: bool) -> str:
    """The text of one grid cell (a row of `data`)."""
    if row.verdict in NOT_DONE:
        return row.verdict
    lines = [f"{row.val_loss:.2f}" if math.isfinite(row.val_loss) else f"train {row.final_loss:.2f}"]
    if math.isfinite(row.val_gap):
        lines.insert(0, gap_text(row.val_gap, 2))
    lines[0] += "*" if row.residual_explosion else ""
    if row.no_loop_gain:
        lines.append("no loop gain")
    if multi_seed:
        lines.append(f"{row.failed}/{row.finished} failed" + (f" (+{row.runs - row.finished})"
                                                             if row.runs > row.finished else ""))
    return "\n".join(lines)


def cell_color(row) -> str:
    """The fill of a grid cell: its verdict's colour, amber for a stable cell that is behind its peers."""
    if row.verdict == "stable" and row.behind:
        return BEHIND_COLOR
    return VERDICT_COLORS.get(row.verdict, OTHER_COLOR)


def column_axis(df: pd.DataFrame) -> str:
    """"depth" where the cells hold several depths L, else "loops": what the grid's columns are."""
    return "depth" if df.depth.dropna().nunique() > 1 else "loops"


def _panels(df: pd.DataFrame, column: str) -> list[tuple[pd.DataFrame, str]]:
    """One (cells, title) per lr scale and the value of the axis that is not the columns (depth, or loops
    where the columns are depth)."""
    other = "loops" if column == "depth" else "depth"
    keys = sorted({(r.lr_scale, getattr(r, other)) for r in df.itertuples()},
                  key=lambda k: (k[0], -1 if pd.isna(k[1]) else k[1]))
    multi_lr = len({k[0] for k in keys}) > 1
    multi_other = len({k[1] for k in keys}) > 1 or other == "loops"  # K is shown nowhere else
    label = "K" if other == "loops" else "L"
    out = []
    for lr, value in keys:
        title = ", ".join(([f"lr×{lr:g}"] if multi_lr else []) + ([f"{label}={value}"] if multi_other else []))
        same = df[other].isna() if pd.isna(value) else df[other] == value
        out.append((df[(df.lr_scale == lr) & same], title))
    return out


def _draw_cells(ax, cells: pd.DataFrame, names: list[str], columns: list, column: str, multi_seed: bool) -> None:
    for row in cells.itertuples():
        x, y = columns.index(getattr(row, column)), names.index(row.variant)
        fill = cell_color(row)
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=fill, edgecolor="white", lw=2,
                               hatch=BEHIND_HATCH if row.behind else None))
        ax.text(x, y, cell_text(row, multi_seed), ha="center", va="center", fontsize="small", color=text_color(fill))
    for row in cells[cells.val_gap == 0].itertuples():  # over the white edges of the neighbours
        x, y = columns.index(getattr(row, column)), names.index(row.variant)
        ax.add_patch(Rectangle((x - 0.45, y - 0.45), 0.9, 0.9, fill=False, edgecolor="black", lw=1.5, zorder=3))


def draw(df: pd.DataFrame):
    column = column_axis(df)
    panels = _panels(df, column)
    names, columns = variants(df), sorted(int(v) for v in df[column].unique())
    multi_seed = bool((df.runs > 1).any())
    row_height = 0.8 if multi_seed else 0.6
    fig, axes = new_figure(1, len(panels), panel=(1.0 * len(columns) + 1.4, row_height * len(names) + 1.2))
    for ax, (cells, title) in zip(axes[0], panels):
        _draw_cells(ax, cells, names, columns, column, multi_seed)
        ax.set_xlim(-0.5, len(columns) - 0.5)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_xticks(range(len(columns)), columns)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("loops K" if column == "loops" else "depth L (distinct blocks)")
        ax.grid(False)
        ax.set_title(title)
    shown = [v for v in VERDICT_COLORS if v in set(df.verdict)]
    handles = [Patch(color=VERDICT_COLORS[v]) for v in shown]
    if df.behind.any():
        handles.append(Patch(facecolor=BEHIND_COLOR, hatch=BEHIND_HATCH, edgecolor="white"))
        shown = shown + ["behind"]
    fig.legend(handles, shown, loc="outside lower center", ncols=len(shown), fontsize="small", handlelength=1.2,
               title=NOTE + (SEEDS_NOTE if multi_seed else ""), title_fontsize="small")
    return finish(fig, "Verdict by variant and " + ("loops" if column == "loops" else "depth"))


register(Figure("collapse", (), data, draw, empty="no runs"))
