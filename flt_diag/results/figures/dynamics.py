"""Loop dynamics (DESIGN.md §3, Loop dynamics). exit-loss: the loss of the head applied at every loop's
exit, against the loop, at a few recorded steps (fainter = earlier), a panel per loops K, a line per run.
loop-dynamics: per loops K, against step (final loop) and by loop (last recorded step): the fixed-point
residual ||h(t) - h(t-1)|| / ||h(t-1)||; whether the loop contracts: the spectral radius of the Jacobian of
h(t-1) -> h(t) (lines; Arnoldi, or the 8-step power estimate of runs recorded before it), the growth of a
perturbation carried through the loops (crosses) and, faint and dotted, the largest singular value (the
worst one-loop stretch, which exceeds 1 on loops that contract), 1 marked; and the mean cosine between
positions' streams (the degenerate fixed point: 1 = every position holds the same vector). Values <= 0
and gains <= GAIN_FLOOR cannot sit on the log axis: they are left out and the panel says how many."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.lines import Line2D

from flt_diag.storage import metric_names as M
from flt_diag.results.tables import Study, concat
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import (auto_yscale, cell_rows, empty, filled, finish, legend, lines_by_run, log_y,
                                            panels, row_grid, variant_color)

SNAPSHOTS = 4  # recorded steps drawn in exit-loss: the first, the last and evenly between
# A loop-map gain or spectral radius at or below this is a zero up to round-off (e.g. 1e-30 for FLT at step 0,
# where the blocks' output projections start at zero): left out of the log axis, counted in the panel.
GAIN_FLOOR = 1e-6


def exit_data(study: Study) -> pd.DataFrame:
    """run, ..., step, loop, value: exit_loss of every loop at up to SNAPSHOTS recorded steps per run
    (evenly spaced by position among its recorded steps), with `snapshot` 0 (first) .. 1 (last)."""
    frames = []
    for run in study.runs:
        sel = run.select(M.EXIT_LOSS)[["step", "loop", "value"]]
        steps = np.sort(sel.step.unique())
        if len(steps):
            pick = steps[np.unique(np.linspace(0, len(steps) - 1, min(SNAPSHOTS, len(steps))).round().astype(int))]
            rank = {s: (i / (len(pick) - 1) if len(pick) > 1 else 1.0) for i, s in enumerate(pick)}
            sel = sel[sel.step.isin(pick)].assign(snapshot=lambda d: d.step.map(rank))
            frames.append(run.tag(sel.sort_values(["step", "loop"])))
    return concat(frames, ["step", "loop", "value", "snapshot"])


def draw_exit(df: pd.DataFrame):
    fig, axes, cells = panels(df, "loop t (head applied to h(t))", "exit loss (nats)", sharey=True)
    for ax, cell in filled(cells):
        for (run, step), g in cell.groupby(["run", "step"], sort=False):
            ax.plot(g.loop, g.value, color=variant_color(g.variant.iloc[0]), marker="o", ms=2.5,
                    alpha=0.25 + 0.75 * g.snapshot.iloc[0], lw=1.2)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    auto_yscale(axes[0, 0], df.value)
    steps = sorted(df.step.unique())
    legend(fig, df, [(Line2D([], [], color="0.3", alpha=0.3), f"early step (from {steps[0]})"),
                     (Line2D([], [], color="0.3"), f"last recorded step (to {steps[-1]})")])
    return finish(fig, "Exit loss by loop")


def dynamics_data(study: Study) -> pd.DataFrame:
    """run, ..., metric, step, loop, value: the rows of DRAWN."""
    frames = [run.tag(pd.concat([run.select(m) for m in DRAWN])[["metric", "step", "loop", "value"]])
              for run in study.runs]
    return concat(frames, ["metric", "step", "loop", "value"])


DRAWN = (M.FIXED_POINT_RESIDUAL, M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS, M.LOOP_PERTURBATION_GROWTH, M.TOKEN_COSINE)
COLUMNS = [(M.FIXED_POINT_RESIDUAL, "step", "fixed-point residual, final loop"),
           (M.FIXED_POINT_RESIDUAL, "loop", "fixed-point residual by loop, last step"),
           (M.LOOP_SPECTRAL_RADIUS, "step", "contraction, final loop"),
           (M.LOOP_SPECTRAL_RADIUS, "loop", "contraction by loop, last step"),
           (M.TOKEN_COSINE, "step", "token cosine, final loop"),
           (M.TOKEN_COSINE, "loop", "token cosine by loop, last step")]


def _series(sel: pd.DataFrame, by: str) -> pd.DataFrame:
    """The final loop's rows against step, or the last recorded step's rows against loop, per run."""
    if by == "step":
        return sel[sel.loop == sel.loops]
    last = sel.groupby("run").step.transform("max")
    return sel[sel.step == last]


def _panel(ax, row: pd.DataFrame, metric: str, by: str) -> None:
    """One panel: `metric` of a row's runs against `by` (the contraction panel with the perturbation growth and
    the largest singular value); values at or below the floor are left out of the log axis and counted (a
    cosine: linear axis, no floor)."""
    cosine, contraction = metric == M.TOKEN_COSINE, metric == M.LOOP_SPECTRAL_RADIUS
    parts = {m: _series(row[row.metric == m], by)
             for m in (metric, *((M.LOOP_PERTURBATION_GROWTH, M.LOOP_GAIN) if contraction else ()))}
    floor = -np.inf if cosine else GAIN_FLOOR if contraction else 0.0
    dropped = 0 if cosine else int(sum((~(p.value > floor)).sum() for p in parts.values()))  # (NaN counted too)
    parts = {m: p[p.value > floor] for m, p in parts.items()}
    below = f"<= {floor:g}" if floor else "<= 0"
    if all(p.empty for p in parts.values()):
        empty(ax, f"no value above {below[3:]} ({dropped})" if dropped else "no data")
        return
    lines_by_run(ax, parts[metric], by, lw=1.2, marker="o" if by == "loop" else None, ms=3)
    if contraction:
        lines_by_run(ax, parts[M.LOOP_PERTURBATION_GROWTH], by, ls="none", marker="x", ms=3.5, mew=0.9)
        lines_by_run(ax, parts[M.LOOP_GAIN], by, ls=":", lw=0.9, alpha=0.45)
        ax.axhline(1, color="0.3", lw=0.8)
    if cosine:
        ax.set_ylim(min(-0.05, parts[metric].value.min() - 0.05), 1.05)
    else:
        log_y(ax)
    if dropped:
        ax.text(0.98, 0.02, f"{dropped} value(s) {below} not drawn", transform=ax.transAxes, ha="right",
                va="bottom", fontsize="x-small", color="0.4")
    if by == "loop":
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))


def draw_dynamics(df: pd.DataFrame):
    rows = cell_rows(df)
    fig, axes = row_grid(rows, [heading for *_, heading in COLUMNS], [by for _, by, _ in COLUMNS], (3.4, 2.6))
    for i, (row, _) in enumerate(rows):
        for j, (metric, by, _) in enumerate(COLUMNS):
            _panel(axes[i, j], row, metric, by)
    legend(fig, df, [(Line2D([], [], color="0.3", lw=1.2), "contraction: spectral radius (Arnoldi)"),
                     (Line2D([], [], color="0.3", ls="none", marker="x", ms=4), "perturbation growth per loop"),
                     (Line2D([], [], color="0.3", ls=":", alpha=0.6), "largest singular value (not contraction)")])
    return finish(fig, "Loop dynamics: fixed-point residual, contraction and the degenerate fixed point")


register(Figure("exit-loss", (M.EXIT_LOSS,), exit_data, draw_exit, empty="no exit_loss recorded (--loop-dynamics)",
                empty_watched="no exit_loss recorded: flt_diag.watch records it with head= and targets (docs/api.md, "
                "Loop dynamics on your own model)"))
register(Figure("loop-dynamics", DRAWN, dynamics_data, draw_dynamics,
                empty="no fixed_point_residual or loop_gain recorded (--loop-dynamics, --dynamics-every)",
                empty_watched="no fixed_point_residual or loop_gain recorded: flt_diag.watch records them from the loop "
                "ends, the gain with loop_step= (docs/api.md, Loop dynamics on your own model)"))
