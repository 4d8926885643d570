"""Task accuracy by variant and training loops: the held-out exact-match accuracy (val_accuracy, mean
over a cell's finished seeds) against the loops K the runs were trained with, one line per variant,
one panel per lr scale; a cross marks a cell whose majority verdict is stalled, collapsed or diverged. Only
runs of a synthetic task (`--data phop`, `--data addition`) have an accuracy."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from flt_diag.results.tables import Study, summary_table
from flt_diag.storage.predictor_names import COLLAPSE
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import finish, legend, new_figure, variant_color, variants

COLUMNS = ["lr_scale", "variant", "loops", "verdict", "finished", "val_accuracy"]


def data(study: Study) -> pd.DataFrame:
    """lr_scale, variant, loops, verdict, finished, val_accuracy: the cells of the grid that have an accuracy."""
    df = summary_table(study)
    return df[np.isfinite(df.val_accuracy.astype(float))][COLUMNS].reset_index(drop=True)


def on_a_task(study: Study) -> bool:
    """Whether a run trains on a synthetic task (its config.json's "corpus" names the task)."""
    return any(run.config.corpus is not None and run.config.corpus.task for run in study.runs)


def draw(df: pd.DataFrame):
    lrs, ks = sorted(df.lr_scale.unique()), sorted(df.loops.unique())
    fig, axes = new_figure(1, len(lrs), sharey=True)
    for ax, lr in zip(axes[0], lrs):
        cell = df[df.lr_scale == lr]
        for v in variants(cell):
            line = cell[cell.variant == v].sort_values("loops")
            ax.plot(line.loops, line.val_accuracy, color=variant_color(v), marker="o", ms=4, lw=1.6)
            failed = line[line.verdict.isin(COLLAPSE)]
            ax.plot(failed.loops, failed.val_accuracy, ls="none", marker="X", ms=9, color=variant_color(v),
                    mec="black", mew=0.5)
        ax.set_xticks(ks)
        ax.set_xlabel("loops K (training)")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"lr×{lr:g}" if len(lrs) > 1 else "")
    axes[0, 0].set_ylabel("held-out accuracy (exact match)")
    legend(fig, df, [(Line2D([], [], ls="none", marker="X", ms=8, mfc="0.6", mec="black"), "collapsed / diverged")])
    return finish(fig, "Task accuracy by variant and loops")


register(Figure("accuracy", (), data, draw, applies=on_a_task,
                empty="no accuracy: only runs of a synthetic task (--data phop, addition) have one"))
