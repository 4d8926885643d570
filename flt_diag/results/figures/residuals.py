"""Final-loop residual norm against step: one panel per loops K (and lr scale), one line per variant,
the verdict's explosion threshold (explosion_ratio * sqrt(d)) dashed."""
from __future__ import annotations

import pandas as pd
from matplotlib.lines import Line2D

from flt_diag.storage import metric_names as M
from flt_diag.results.tables import Study, concat
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import filled, finish, legend, lines_by_run, log_y, panels


def data(study: Study) -> pd.DataFrame:
    """run, variant, loops, seed, lr_scale, step, loop, value, threshold: the finite positive loop-end
    residual norms of every loop, and the run's explosion threshold."""
    frames = []
    for run in study.runs:
        sel = run.select(M.RESID_NORM_LOOP_END)
        sel = sel[sel.value > 0][["step", "loop", "value"]]
        frames.append(run.tag(sel.assign(threshold=run.explosion_threshold)))
    return concat(frames, ["step", "loop", "value", "threshold"])


def draw(df: pd.DataFrame):
    final = df[df.loop == df.loops]
    fig, _, cells = panels(final, "step", "‖h‖ at the final loop's end", sharex=True, sharey=True)
    for ax, cell in filled(cells):
        lines_by_run(ax, cell, "step", lw=1.3)
        for threshold in cell.threshold.dropna().unique():
            ax.axhline(threshold, color="0.35", ls="--", lw=0.9)
        log_y(ax)
    legend(fig, final, [(Line2D([], [], color="0.35", ls="--", lw=0.9), "explosion threshold")])
    return finish(fig, "Residual norm of the final loop")


register(Figure("residuals", (M.RESID_NORM_LOOP_END,), data, draw, empty="no resid_norm_loop_end recorded"))
