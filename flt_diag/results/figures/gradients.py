"""Gradient oscillation: per loops K (and lr scale), the global gradient norm against step, the cosine
between consecutive gradients, the activation-gradient norm per loop at the last recorded step, and
a table of the run's oscillation indices (the summary's; computed like it while running)."""
from __future__ import annotations

import math

import pandas as pd
from matplotlib import ticker

from flt_diag.storage import metric_names as M
from flt_diag.results.tables import OSC_COLUMNS, Study, concat, oscillation
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import (cell_rows, empty, finish, legend, lines_by_run, log_y, row_grid,
                                            variant_color)

OSC_LABELS = {"osc_cv": "cv", "osc_mean_abs_dlog": "|Δlog g|", "osc_sign_alternation": "alt",
              "osc_neg_cosine_share": "cos<0"}
TITLES = {M.GRAD_NORM: "global gradient norm", M.GRAD_COSINE: "cosine to the previous gradient",
          M.ACT_GRAD_NORM: "activation grad norm at the last step"}


def data(study: Study) -> pd.DataFrame:
    """run, ..., metric, step, loop, value: grad_norm and grad_cosine per step (loop -1); act_grad_norm
    averaged over layers per loop at the last step it was recorded; the four oscillation indices
    (metric osc_*, step and loop -1)."""
    frames = []
    for run in study.runs:
        parts = []
        for metric in (M.GRAD_NORM, M.GRAD_COSINE):
            sel = run.select(metric)
            parts.append(sel[(sel.loop == M.NONE) & (sel.layer == M.NONE)][["metric", "step", "loop", "value"]])
        act = run.select(M.ACT_GRAD_NORM)
        if len(act):
            last = act[act.step == act.step.max()]
            agg = last.groupby(["step", "loop"], as_index=False).value.mean()
            parts.append(agg.assign(metric=M.ACT_GRAD_NORM)[["metric", "step", "loop", "value"]])
        if any(len(p) for p in parts):
            osc = oscillation(run)
            parts.append(pd.DataFrame({"metric": OSC_COLUMNS, "step": M.NONE, "loop": M.NONE,
                                       "value": [math.nan if osc[k] is None else float(osc[k]) for k in OSC_COLUMNS]}))
        frames.append(run.tag(pd.concat(parts, ignore_index=True).astype({"metric": "object"})))
    return concat(frames, ["metric", "step", "loop", "value"])


def osc_table(ax, rows: pd.DataFrame):
    """The oscillation indices of each run in `rows` as a table filling `ax`, run names in variant colour."""
    ax.set_axis_off()
    osc = rows[rows.metric.isin(OSC_COLUMNS)]
    if osc.empty:
        return None
    grid = osc.pivot_table(index="run", columns="metric", values="value", aggfunc="last", dropna=False)
    runs = list(dict.fromkeys(osc.run))
    ids = osc.drop_duplicates("run").set_index("run")
    several_seeds = ids.seed.nunique() > 1
    labels = [ids.variant[r] + (f" s{ids.seed[r]}" if several_seeds else "") for r in runs]
    text = [[f"{grid.loc[r, k]:.2f}" for k in OSC_COLUMNS] for r in runs]
    table = ax.table(cellText=text, rowLabels=labels, colLabels=[OSC_LABELS[k] for k in OSC_COLUMNS],
                     bbox=[0.25, 0.0, 0.75, 1.0], cellLoc="center", edges="horizontal")
    table.auto_set_font_size(False)
    table.set_fontsize(8.5)
    for i, r in enumerate(runs, start=1):
        table[i, -1].get_text().set_color(variant_color(ids.variant[r]))
        table[i, -1].get_text().set_fontweight("bold")
    return table


def draw(df: pd.DataFrame):
    rows = cell_rows(df)
    fig, axes = row_grid(rows, [*TITLES.values(), "oscillation indices"], ("step", "step", "loop"), (3.4, 2.6),
                         gridspec_kw={"width_ratios": [1.2, 1.2, 1, 1.1]})
    for i, (row, _) in enumerate(rows):  # rows: one per loops K (and lr scale)
        for j, metric in enumerate(TITLES):
            ax, sel = axes[i, j], row[row.metric == metric]
            if sel.empty:
                empty(ax)
                continue
            by_loop = metric == M.ACT_GRAD_NORM
            lines_by_run(ax, sel, "loop" if by_loop else "step", lw=1.3 if by_loop else 0.8,
                         marker="o" if by_loop else None, ms=3.5, alpha=1 if by_loop else 0.85)
            if metric == M.GRAD_COSINE:
                ax.axhline(0, color="0.3", lw=0.8)
                ax.set_ylim(-1.05, 1.05)
            else:
                log_y(ax)
            if by_loop:
                ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        osc_table(axes[i, 3], row)
    legend(fig, df)
    return finish(fig, "Gradients and their oscillation")


register(Figure("gradients", (M.GRAD_NORM, M.GRAD_COSINE, M.ACT_GRAD_NORM), data, draw,
                empty="no grad_norm recorded"))
