"""Test-time loops: validation loss against the number of inference loops (eval_loops.csv), one
panel per trained loop count (and per data, where runs were evaluated on several: `eval-loops --data`) with a
dashed line (and a star) at it, one line per variant; on a synthetic task, a second row of panels shows the
held-out accuracy the same way."""
from __future__ import annotations

import pandas as pd
from matplotlib import ticker
from matplotlib.lines import Line2D

from flt_diag.results.tables import Study, concat
from flt_diag.results.figures import Figure, register
from flt_diag.results.figures.style import auto_yscale, finish, legend, lines_by_run, new_figure, variant_color

COLUMNS = ["inference_loops", "trained_loops", "val_loss", "perplexity", "accuracy", "data"]
UNNAMED = "data not recorded"  # the rows of a file written before eval_loops.csv had a data column


def data(study: Study) -> pd.DataFrame:
    """run, ..., inference_loops, trained_loops, val_loss, perplexity, accuracy, data: each run's eval_loops.csv
    (accuracy NaN for text, and in files written before it was recorded; data UNNAMED where not recorded). Of
    rows measured twice (the same data and loop count at other --batches) the last written is drawn."""
    frames = []
    for run in study.runs:
        ev = run.eval_loops
        if ev is not None and not ev.empty:
            ev = ev.rename(columns={"loops": "inference_loops"}).reindex(columns=COLUMNS)
            ev["data"] = ev["data"].astype(object).where(ev["data"].notna(), UNNAMED).astype(str)
            ev = ev.drop_duplicates(["data", "inference_loops"], keep="last")
            frames.append(run.tag(ev.sort_values(["data", "inference_loops"], kind="stable")))
    return concat(frames, COLUMNS)


def _panel(ax, cell: pd.DataFrame, k: int, y: str) -> None:
    ax.axvline(k, color="0.3", ls="--", lw=1)
    lines_by_run(ax, cell, "inference_loops", y, marker="o", ms=3.5)
    for r in cell[cell.inference_loops == k].itertuples():
        ax.plot(r.inference_loops, getattr(r, y), ls="none", marker="*", ms=11, color=variant_color(r.variant),
                mec="black", mew=0.5)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))


def draw(df: pd.DataFrame):
    columns = sorted(set(zip(df.trained_loops, df.data)), key=lambda c: (c[0], c[1]))  # (K, data) panels
    several = df.data.nunique() > 1
    rows = ["val_loss"] + (["accuracy"] if df.accuracy.notna().any() else [])
    fig, axes = new_figure(len(rows), len(columns), sharey="row" if not several else False, sharex="col")
    for j, (k, on) in enumerate(columns):
        cell = df[(df.trained_loops == k) & (df.data == on)]
        for i, y in enumerate(rows):
            _panel(axes[i, j], cell, k, y)
        axes[0, j].set_title(f"trained with K={k}" + (f", on {on}" if several else ""))
        if several:  # (losses on other data are on other scales: each panel its own)
            auto_yscale(axes[0, j], cell.val_loss)
        axes[-1, j].set_xlabel("inference loops")
    axes[0, 0].set_ylabel("validation loss")
    if not several:
        auto_yscale(axes[0, 0], df.val_loss)
    if len(rows) > 1:
        axes[1, 0].set_ylabel("held-out accuracy")
        for ax in axes[1] if several else axes[1, :1]:
            ax.set_ylim(-0.03, 1.03)
    legend(fig, df, [(Line2D([], [], color="0.3", ls="--", marker="*", mfc="0.6", mec="black", ms=9),
                      "trained loop count")])
    return finish(fig, "Test-time loops")


register(Figure("loops", (), data, draw, empty="no eval_loops.csv; run `flt-diag eval-loops` first",
                empty_watched="no eval_loops.csv: `flt-diag eval-loops` evaluates flt-diag's own models only"))
