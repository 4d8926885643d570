"""The variant x loops grid coloured by verdict (majority over finished seeds, "running" while none
finished, "pending" before a cell starts), annotated with the mean final smoothed loss (and, with
several seeds, how many agree); one grid per lr scale."""
from __future__ import annotations

import pandas as pd
from matplotlib.patches import Patch, Rectangle

from flt_diag.analysis.results import GRID_COLUMNS, Study, seeds_text, summary_table
from flt_diag.analysis.figures import Figure, register
from flt_diag.analysis.figures.style import OTHER_COLOR, VERDICT_COLORS, finish, new_figure, style, text_color, variants


def data(study: Study) -> pd.DataFrame:
    """lr_scale, variant, loops, verdict, agree, runs, finished, residual_explosion, final_loss: the
    collapse grid's cells (see flt_diag.analysis.results.summary_table)."""
    return summary_table(study)[GRID_COLUMNS + ["final_loss"]]


def _cell_text(row) -> str:
    if row.verdict in ("running", "failed", "pending"):
        return row.verdict
    text = f"{row.final_loss:.2f}" + ("*" if row.residual_explosion else "")
    return text + (f"\n{seeds_text(row)}" if row.runs > 1 else "")


def draw(df: pd.DataFrame):
    lrs = sorted(df.lr_scale.unique())
    names, loops_values = variants(df), sorted(df.loops.unique())
    with style():
        fig, axes = new_figure(1, len(lrs), panel=(0.9 * len(loops_values) + 1.4, 0.6 * len(names) + 1.2))
        for ax, lr in zip(axes[0], lrs):
            for row in df[df.lr_scale == lr].itertuples():
                x, y = loops_values.index(row.loops), names.index(row.variant)
                fill = VERDICT_COLORS.get(row.verdict, OTHER_COLOR)
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=fill, edgecolor="white", lw=2))
                ax.text(x, y, _cell_text(row), ha="center", va="center", fontsize="small", color=text_color(fill))
            ax.set_xlim(-0.5, len(loops_values) - 0.5)
            ax.set_ylim(len(names) - 0.5, -0.5)
            ax.set_xticks(range(len(loops_values)), loops_values)
            ax.set_yticks(range(len(names)), names)
            ax.set_xlabel("loops K")
            ax.grid(False)
            ax.set_title(f"lr×{lr:g}" if len(lrs) > 1 else "")
        shown = [v for v in VERDICT_COLORS if v in set(df.verdict)]
        note = "numbers: final smoothed loss (mean over seeds); * residual explosion"
        if (df.runs > 1).any():
            note += "; n/m: seeds agreeing / finished (+running)"
        fig.legend([Patch(color=VERDICT_COLORS[v]) for v in shown], shown, loc="outside lower center",
                   ncols=len(shown), fontsize="small", handlelength=1.2, title=note, title_fontsize="small")
    return finish(fig, "Verdict by variant and loops")


register(Figure("collapse", "variant x loops grid coloured by verdict, annotated with the final loss",
                (), data, draw, empty="no runs", order=50))
