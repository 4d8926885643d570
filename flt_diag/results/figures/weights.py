"""weights: per loops K, the parameter norm (top row) and the update ratio ||ΔW|| / ||W|| of the optimizer
step (bottom row) against step, for the embedding, the head, and the blocks' attention and MLP (the
blocks' groups pooled: the norm of all their weights, the mean ratio), a line per run.
attention: the mean attention entropy (nats) at every (loop, layer), at each run's last recorded step,
a heat map per run (recorded with --attention-stats; flt_diag.watch does not record them)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from flt_diag.records import attention
from flt_diag.storage import metric_names as M
from flt_diag.results.tables import Study, concat
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import cell_rows, empty, finish, legend, lines_by_run, log_y, new_figure, row_grid

KINDS = ("embedding", "head", "attn", "mlp")
QUANTITIES = ((M.PARAM_NORM, "parameter norm"), (M.UPDATE_RATIO, "update ratio"))
# how a kind's groups are pooled per step: the norm of all their weights, the mean of their update ratios
POOLED = {M.PARAM_NORM: lambda v: float(np.sqrt((v ** 2).sum())), M.UPDATE_RATIO: "mean"}


def weights_data(study: Study) -> pd.DataFrame:
    """run, ..., metric, kind, step, value: param_norm (root of the sum of squares over a kind's groups)
    and update_ratio (mean over them) per step, kind embedding, head, attn or mlp."""
    frames = []
    for run in study.runs:
        parts = []
        for metric, _ in QUANTITIES:
            for kind in KINDS:
                sel = run.select(f"{metric}/{kind}")
                if sel.empty:
                    continue
                agg = sel.groupby("step").value.agg(POOLED[metric])
                parts.append(agg.reset_index().assign(metric=metric, kind=kind))
        if parts:
            frames.append(run.tag(pd.concat(parts, ignore_index=True)[["metric", "kind", "step", "value"]]))
    return concat(frames, ["metric", "kind", "step", "value"])


def draw_weights(df: pd.DataFrame):
    rows = [(cell[cell.metric == metric], f"{title}\n{label}")
            for cell, title in cell_rows(df) for metric, label in QUANTITIES]
    headings = [kind if kind in ("embedding", "head") else f"blocks' {kind}" for kind in KINDS]
    fig, axes = row_grid(rows, headings, ["step"] * len(KINDS), (3.2, 2.4), sharex=True)
    for i, (cell, _) in enumerate(rows):
        for j, kind in enumerate(KINDS):
            ax, sel = axes[i, j], cell[cell.kind == kind]
            if sel.empty or not (sel.value > 0).any():
                empty(ax)
                continue
            lines_by_run(ax, sel[sel.value > 0], "step", lw=1.1)
            log_y(ax)
    legend(fig, df)
    return finish(fig, "Parameter norms and update ratios")


def attention_data(study: Study) -> pd.DataFrame:
    """run, ..., step, loop, layer, value: attn_entropy at each run's last recorded step."""
    frames = []
    for run in study.runs:
        sel = run.select(attention.ENTROPY)
        if len(sel):
            frames.append(run.tag(sel[sel.step == sel.step.max()][["step", "loop", "layer", "value"]]))
    return concat(frames, ["step", "loop", "layer", "value"])


def draw_attention(df: pd.DataFrame):
    runs = list(dict.fromkeys(df.run))
    cols = min(len(runs), 5)
    nrows = -(-len(runs) // cols)
    vmin, vmax = float(df.value.min()), float(df.value.max())
    fig, axes = new_figure(nrows, cols, panel=(2.8, 2.6))
    image = None
    for ax, run in zip(axes.flat, runs):
        g = df[df.run == run]
        grid = g.pivot_table(index="layer", columns="loop", values="value")
        image = ax.imshow(grid.values, aspect="auto", origin="lower", cmap="viridis", vmin=vmin, vmax=vmax,
                          extent=(grid.columns.min() - 0.5, grid.columns.max() + 0.5,
                                  grid.index.min() - 0.5, grid.index.max() + 0.5))
        ax.set_title(f"{g.variant.iloc[0]} K={g.loops.iloc[0]} s{g.seed.iloc[0]} (step {g.step.iloc[0]})",
                     fontsize="small")
        ax.set_xticks(list(grid.columns))
        ax.set_yticks(list(grid.index))
        ax.set_xlabel("loop")
        ax.set_ylabel("layer")
        ax.grid(False)
    for ax in list(axes.flat)[len(runs):]:
        ax.set_axis_off()
    fig.colorbar(image, ax=axes, label="attention entropy (nats)", shrink=0.8)  # type: ignore[arg-type]  # (a run)
    legend(fig, df)
    return finish(fig, "Attention entropy by loop and layer")


register(Figure("weights", tuple(f"{m}/{k}" for m, _ in QUANTITIES for k in KINDS), weights_data, draw_weights,
                empty="no param_norm or update_ratio recorded"))
register(Figure("attention", (attention.ENTROPY,), attention_data, draw_attention,
                empty="no attn_entropy recorded (train with --attention-stats)",
                empty_watched="no attn_entropy recorded: flt_diag.watch does not record attention statistics"))
