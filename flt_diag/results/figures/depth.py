"""Residual norm through depth (loop by loop, layer by layer) at the first, middle and last recorded
step: one row of panels per loops K (and lr scale), one column per chosen step, one line per variant.
(It replaces the earlier loop x layer heatmap.)"""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import ticker

from flt_diag.storage import metric_names as M
from flt_diag.results.tables import Study, concat, run_order
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import cell_rows, empty, finish, legend, lines_by_run, log_y, new_figure

STEP_NAMES = ["first", "middle", "last"]


def pick_steps(recorded: np.ndarray, steps=None) -> list[int]:
    """The recorded steps nearest to `steps` (default: first, middle, last), without repeats."""
    if steps is None:
        steps = [recorded[0], (recorded[0] + recorded[-1]) / 2, recorded[-1]]
    picked = [int(recorded[np.argmin(np.abs(recorded - s))]) for s in steps]
    return list(dict.fromkeys(picked))


def data(study: Study, steps=None) -> pd.DataFrame:
    """run, ..., panel, step, loop, layer, value: resid_norm at the chosen steps of each run (panel: the
    index of the chosen step)."""
    frames = []
    for run in study.runs:
        sel = run.select(M.RESID_NORM)
        sel = sel[sel.value > 0]
        if sel.empty:
            continue
        chosen = pick_steps(np.sort(sel.step.unique()), steps)
        part = sel[sel.step.isin(chosen)].copy()
        part.insert(0, "panel", part.step.map({s: i for i, s in enumerate(chosen)}))
        frames.append(run.tag(part[["panel", "step", "loop", "layer", "value"]]))
    df = concat(frames, ["panel", "step", "loop", "layer", "value"])
    return df.sort_values(["run", "panel", "loop", "layer"], key=run_order(study), kind="stable", ignore_index=True)


def _step_title(cell: pd.DataFrame, panel: int, npanel: int) -> str:
    steps = sorted(cell.step.unique())
    name = STEP_NAMES[panel] if npanel == 3 else f"chosen step {panel + 1}"
    return f"step {steps[0]}" if len(steps) == 1 else f"{name} step"


def draw(df: pd.DataFrame):
    npanel = int(df.panel.max()) + 1
    layers = df.groupby("run").layer.transform("max") + 1
    depth = df.assign(depth=df.loop - 1 + (df.layer + 1) / layers)  # the last layer of loop t sits at x = t
    rows = cell_rows(depth)
    fig, axes = new_figure(len(rows), npanel, panel=(3.6, 2.6), sharey=True)
    for i, (row, title) in enumerate(rows):
        for p in range(npanel):
            ax, cell = axes[i, p], row[row.panel == p]
            if cell.empty:
                empty(ax)
                continue
            ax.set_title(f"{title}, {_step_title(cell, p, npanel)}")
            lines_by_run(ax, cell, "depth", lw=1.3, marker="o", ms=2.5)
            log_y(ax)
            ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        axes[i, 0].set_ylabel("‖h‖ after each block")
    for ax in axes[-1]:
        ax.set_xlabel("loop (dots: layers)")
    legend(fig, df)
    return finish(fig, "Residual norm by loop index, at the first, middle and last step")


register(Figure("depth", (M.RESID_NORM,), data, draw, empty="no resid_norm recorded"))
