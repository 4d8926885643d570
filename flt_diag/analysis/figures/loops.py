"""Test-time loops: validation loss against the number of inference loops (eval_loops.csv), one
panel per trained loop count with a dashed line (and a star) at it, one line per variant."""
from __future__ import annotations

import pandas as pd
from matplotlib import ticker
from matplotlib.lines import Line2D

from flt_diag.analysis.results import Study, concat
from flt_diag.analysis.figures import Figure, register
from flt_diag.analysis.figures.style import auto_yscale, finish, legend, lines_by_run, new_figure, style, variant_color

COLUMNS = ["inference_loops", "trained_loops", "val_loss", "perplexity"]


def data(study: Study) -> pd.DataFrame:
    """run, ..., inference_loops, trained_loops, val_loss, perplexity: each run's eval_loops.csv."""
    frames = []
    for run in study.runs:
        ev = run.eval_loops
        if ev is not None and not ev.empty:
            frames.append(run.tag(ev.rename(columns={"loops": "inference_loops"}).sort_values("inference_loops")[COLUMNS]))
    return concat(frames, COLUMNS)


def draw(df: pd.DataFrame):
    trained = sorted(df.trained_loops.unique())
    with style():
        fig, axes = new_figure(1, len(trained), sharey=True)
        for ax, k in zip(axes[0], trained):
            ax.axvline(k, color="0.3", ls="--", lw=1)
            cell = df[df.trained_loops == k]
            lines_by_run(ax, cell, "inference_loops", "val_loss", marker="o", ms=3.5)
            at = cell[cell.inference_loops == k]
            for r in at.itertuples():
                ax.plot(r.inference_loops, r.val_loss, ls="none", marker="*", ms=11, color=variant_color(r.variant),
                        mec="black", mew=0.5)
            ax.set_title(f"trained with K={k}")
            ax.set_xlabel("inference loops")
            ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        axes[0, 0].set_ylabel("validation loss")
        auto_yscale(axes[0, 0], df.val_loss)
        legend(fig, df, [(Line2D([], [], color="0.3", ls="--", marker="*", mfc="0.6", mec="black", ms=9),
                          "trained loop count")])
    return finish(fig, "Test-time loops")


register(Figure("loops", "validation loss against inference loops (after `flt-diag eval-loops`)",
                (), data, draw, empty="no eval_loops.csv; run `flt-diag eval-loops` first", order=60))
