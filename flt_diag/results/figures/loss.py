"""Training loss as the verdict sees it (flt_diag.judge.verdict.smoothed, the run's smooth_window), one
panel per loops K (and lr scale), one line per variant; validation losses as dots; where the verdict
is collapsed a cross at the top of the smoothed loss's largest climb, where diverged a triangle at the
last finite loss."""
from __future__ import annotations

from typing import Any, cast

import pandas as pd
from matplotlib.lines import Line2D

from flt_diag.storage import metric_names as M
from flt_diag.storage.file_models import Summary
from flt_diag.results.tables import Run, Study, concat, smoothed_loss
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import auto_yscale, filled, finish, legend, lines_by_run, panels, variant_color

SMOOTHED = "loss_smoothed"
MARKS: dict[str, dict[str, Any]] = {"collapsed": dict(marker="X", ms=10), "diverged": dict(marker="v", ms=9)}


def _mark(run: Run, smooth: pd.Series) -> pd.DataFrame | None:
    """The collapse (or divergence) mark of a finished run: metric = its verdict, at the step the
    verdict's evidence names (climb_step; the last smoothed step otherwise)."""
    verdict = run.summary.verdict if run.summary is not None else None
    if verdict not in MARKS or smooth.empty:
        return None
    step = cast(Summary, run.summary).evidence.climb_step if verdict == "collapsed" else None  # (a verdict: a summary)
    step = step if step in smooth.index else smooth.index[-1]
    return pd.DataFrame({"metric": [verdict], "step": [int(step)],  # type: ignore[arg-type]  # (an index step)
                         "value": [float(smooth.loc[step])]})


def data(study: Study) -> pd.DataFrame:
    """run, ..., metric, step, value: the verdict's smoothed training loss (metric "loss_smoothed"),
    the validation loss ("val_loss"), and the collapse / divergence mark (metric "collapsed" or
    "diverged", one row) of runs with that verdict."""
    frames = []
    for run in study.runs:
        smooth = smoothed_loss(run)
        val = run.select(M.VAL_LOSS)
        frames.append(run.tag(pd.concat([
            pd.DataFrame({"metric": SMOOTHED, "step": smooth.index.to_numpy(), "value": smooth.to_numpy()}),
            pd.DataFrame({"metric": M.VAL_LOSS, "step": val.step.to_numpy(), "value": val.value.to_numpy()}),
            _mark(run, smooth),
        ], ignore_index=True)))
    return concat(frames, ["metric", "step", "value"])


def draw(df: pd.DataFrame):
    fig, axes, cells = panels(df, "step", "loss (nats/token)", sharey=True)
    for ax, cell in filled(cells):
        lines_by_run(ax, cell[cell.metric == SMOOTHED], "step", lw=1.4)
        for r in cell[cell.metric != SMOOTHED].itertuples():
            style_ = MARKS.get(r.metric, dict(marker="o", ms=4))
            ax.plot(r.step, r.value, ls="none", color=variant_color(r.variant), mec="black" if r.metric in MARKS
                    else "white", mew=0.8, zorder=4, **style_)
    auto_yscale(axes[0, 0], df.value)
    extra = [(Line2D([], [], ls="none", marker="o", color="0.4", ms=4), "validation")]
    extra += [(Line2D([], [], ls="none", color="0.4", mec="black", **MARKS[m]), m)
              for m in MARKS if (df.metric == m).any()]
    legend(fig, df, extra)
    return finish(fig, "Training loss (the verdict's smoothing)")


register(Figure("loss", (M.LOSS, M.VAL_LOSS), data, draw, empty="no loss recorded"))
