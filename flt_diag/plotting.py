"""Figures of a run or a sweep, drawn from its folder alone (numpy/pandas/matplotlib; no torch).

Every figure is a pure function of stored data: `figure_data(kind, path)` is the exact table a
figure draws and `fig_<kind>(path)` draws that table and nothing else. Figures work on a sweep
still in progress: unfinished runs appear in the traces and as "running" in the collapse grid.

    residuals  residual norm at each loop's end against step, one panel per (variant, loops)
    heatmap    (loop x layer) residual norms at the first, middle and last recorded step
    gradients  global gradient norm, per-loop activation-gradient norm, consecutive cosine
    loss       smoothed training loss and validation loss, one panel per loops value
    collapse   variant x loops grid coloured by verdict, annotated with the final loss
    loops      validation loss against inference loops (from eval_loops.csv)

Each variant has one colour in every figure (VARIANT_COLORS), each verdict one colour.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import matplotlib

if "matplotlib.pyplot" not in sys.modules:  # headless by default; leave an interactive session alone
    matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.cm import ScalarMappable  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from . import metric_names as M  # noqa: E402
from .metrics import oscillation_indices  # noqa: E402
from .storage import (ERROR, METRICS, atomic_path, SWEEP_SPEC, StorageError, is_sweep, load_config, load_eval_loops,  # noqa: E402
                      load_metrics, load_summary, read_json, run_dirs, run_label, series)

log = logging.getLogger(__name__)

VARIANT_ORDER = ["lt", "lt-ii", "lt-ai", "fla", "flt"]
# Okabe-Ito (colour-blind safe), five clearly distinct hues; FLT, the method under study, in black.
from .variants import VARIANT_COLORS  # noqa: E402
OTHER_COLOR = "#7f7f7f"
VERDICT_ORDER = ["stable", "unstable", "collapsed", "diverged"]  # by severity (ties in a majority go to the worse)
VERDICT_COLORS = {"stable": "#a6d96a", "unstable": "#fee08b", "collapsed": "#fdae61", "diverged": "#d7191c",
                  "running": "#c6dbef", "failed": "#969696", "pending": "#f0f0f0"}
LOOP_CMAP = "viridis"  # sequential palette for loop indices
LINESTYLES = ["-", "--", ":", "-."]
RUN_COLUMNS = ["run", "variant", "loops", "seed", "lr_scale"]
OSC_LABELS = {"osc_cv": "cv", "osc_mean_abs_dlog": "|Δlog g|", "osc_sign_alternation": "alt",
              "osc_neg_cosine_share": "cos<0"}
DPI = 150


class NoData(StorageError):
    """The folder holds nothing this figure can draw (yet)."""


# --------------------------------------------------------------------------- loading

@dataclass(eq=False)
class Run:
    """One run folder: its labels, config, summary (None while running), metrics and eval_loops."""
    path: Path
    variant: str
    loops: int
    seed: int
    lr_scale: float
    config: dict
    summary: dict | None
    metrics: pd.DataFrame
    eval_loops: pd.DataFrame | None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def status(self) -> str:
        """The verdict once finished, else "failed" (the sweep left an error.txt) or "running"."""
        if self.summary:
            return self.summary["verdict"]
        return "failed" if (self.path / ERROR).exists() else "running"

    def sort_key(self) -> tuple:
        return self.lr_scale, self.seed, self.loops, variant_rank(self.variant), self.variant, self.name


@dataclass(eq=False)
class Study:
    """Every run of a sweep (or one run folder), sorted by lr scale, seed, loops and variant."""
    path: Path
    runs: list[Run]
    spec: dict | None = None  # sweep.json; None for a single run folder


def variant_rank(variant: str) -> int:
    return VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER)


def variant_color(variant: str) -> str:
    return VARIANT_COLORS.get(variant, OTHER_COLOR)


def _has_metrics(run_dir: Path) -> bool:
    return any((run_dir / METRICS).glob("part-*.parquet"))


def collect(path, metrics: list[str] | None = None) -> Study:
    """Load every run of a sweep, or a single run folder (`metrics` keeps only those names).

    Raises StorageError for a path that is neither, or one with no metrics recorded yet."""
    path = Path(path)
    dirs = run_dirs(path)
    if not dirs:
        raise StorageError(f"{path}: no run folders yet")
    if not any(_has_metrics(d) for d in dirs):
        raise StorageError(f"{path}: no metrics recorded yet")
    runs = []
    for d in dirs:
        label = run_label(d)
        runs.append(Run(d, label["variant"], int(label["loops"]), int(label["seed"]), float(label["lr_scale"]),
                        load_config(d), load_summary(d), load_metrics(d, metrics), load_eval_loops(d)))
    spec = read_json(path / SWEEP_SPEC) if is_sweep(path) else None
    return Study(path, sorted(runs, key=Run.sort_key), spec)


def _study(src, kind: str) -> Study:
    return src if isinstance(src, Study) else collect(src, NEEDS[kind])


def _tag(run: Run, df: pd.DataFrame) -> pd.DataFrame:
    """Prefix a per-run table with the run's identifying columns."""
    ids = dict(run=run.name, variant=run.variant, loops=run.loops, seed=run.seed, lr_scale=run.lr_scale)
    return df.reset_index(drop=True).assign(**ids)[RUN_COLUMNS + list(df.columns)]


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=RUN_COLUMNS + columns)
    return pd.concat(frames, ignore_index=True)[RUN_COLUMNS + columns]


def _select(run: Run, metric: str) -> pd.DataFrame:
    m = run.metrics
    sel = m[(m.metric == metric) & np.isfinite(m.value)]
    return sel.astype({"step": "int64", "loop": "int64", "layer": "int64", "value": "float64"})


# --------------------------------------------------------------------------- figure data

def residuals_data(src) -> pd.DataFrame:
    """run, variant, loops, seed, lr_scale, step, loop, value: finite positive loop-end residual norms."""
    study = _study(src, "residuals")
    frames = []
    for run in study.runs:
        sel = _select(run, M.RESID_NORM_LOOP_END)
        frames.append(_tag(run, sel[sel.value > 0][["step", "loop", "value"]]))
    return _concat(frames, ["step", "loop", "value"])


def _pick_steps(recorded: np.ndarray, steps) -> list[int]:
    """The recorded steps nearest to `steps` (default: first, middle, last), without repeats."""
    if steps is None:
        steps = [recorded[0], (recorded[0] + recorded[-1]) / 2, recorded[-1]]
    picked = [int(recorded[np.argmin(np.abs(recorded - s))]) for s in steps]
    return list(dict.fromkeys(picked))


def heatmap_data(src, steps=None) -> pd.DataFrame:
    """run, ..., panel, step, loop, layer, value: resid_norm at the chosen steps of each run."""
    study = _study(src, "heatmap")
    frames = []
    for run in study.runs:
        sel = _select(run, M.RESID_NORM)
        sel = sel[sel.value > 0]
        if sel.empty:
            continue
        chosen = _pick_steps(np.sort(sel.step.unique()), steps)
        part = sel[sel.step.isin(chosen)].copy()
        part.insert(0, "panel", part.step.map({s: i for i, s in enumerate(chosen)}))
        frames.append(_tag(run, part[["panel", "step", "loop", "layer", "value"]]))
    df = _concat(frames, ["panel", "step", "loop", "layer", "value"])
    return df.sort_values(["run", "panel", "loop", "layer"], key=_run_order(study, "run"), kind="stable",
                          ignore_index=True)


def _run_order(study: Study, column: str):
    order = {r.name: i for i, r in enumerate(study.runs)}
    return lambda s: s.map(order) if s.name == column else s


def _osc(run: Run) -> dict:
    """Oscillation indices from the summary, or computed like flt_diag.metrics.summarize while running."""
    if run.summary and all(k in run.summary for k in OSC_LABELS):
        return {k: run.summary[k] for k in OSC_LABELS}
    g, c = series(run.metrics, M.GRAD_NORM), series(run.metrics, M.GRAD_COSINE)
    dense = run.config.get("diagnostics", {}).get("dense_steps", math.inf)
    return {f"osc_{k}": v for k, v in oscillation_indices(g[g.index < dense], c[c.index < dense]).items()}


def gradients_data(src) -> pd.DataFrame:
    """run, ..., metric, step, loop, value: grad_norm and grad_cosine per step (loop -1); act_grad_norm
    averaged over layers per loop at the last step it was recorded; the four oscillation indices
    (metric osc_*, step and loop -1)."""
    study = _study(src, "gradients")
    frames = []
    for run in study.runs:
        parts = []
        for metric in (M.GRAD_NORM, M.GRAD_COSINE):
            sel = _select(run, metric)
            sel = sel[(sel.loop == M.NONE) & (sel.layer == M.NONE)]
            parts.append(sel[["metric", "step", "loop", "value"]])
        act = _select(run, M.ACT_GRAD_NORM)
        if len(act):
            last = act[act.step == act.step.max()]
            agg = last.groupby(["step", "loop"], as_index=False).value.mean()
            parts.append(agg.assign(metric=M.ACT_GRAD_NORM)[["metric", "step", "loop", "value"]])
        if any(len(p) for p in parts):
            osc = pd.DataFrame({"metric": list(OSC_LABELS), "step": M.NONE, "loop": M.NONE,
                                "value": [float(v) if v is not None else math.nan for v in _osc(run).values()]})
            parts.append(osc)
        frames.append(_tag(run, pd.concat(parts, ignore_index=True).astype({"metric": "object"})))
    return _concat(frames, ["metric", "step", "loop", "value"])


def _smooth_window(run: Run) -> int:
    return int(run.config.get("verdict", {}).get("smooth_window", 50))


def loss_data(src) -> pd.DataFrame:
    """run, ..., metric, step, value: training loss smoothed by a trailing mean over the verdict's
    smooth_window recorded steps (metric "loss_smoothed"), and validation loss ("val_loss")."""
    study = _study(src, "loss")
    frames = []
    for run in study.runs:
        loss = _select(run, M.LOSS)
        loss = loss[(loss.loop == M.NONE) & (loss.layer == M.NONE)]
        smooth = loss.value.rolling(_smooth_window(run), min_periods=1).mean()
        val = _select(run, M.VAL_LOSS)
        frames.append(_tag(run, pd.concat([
            pd.DataFrame({"metric": "loss_smoothed", "step": loss.step.to_numpy(), "value": smooth.to_numpy()}),
            pd.DataFrame({"metric": M.VAL_LOSS, "step": val.step.to_numpy(), "value": val.value.to_numpy()}),
        ], ignore_index=True)))
    return _concat(frames, ["metric", "step", "value"])


def _majority(verdicts: list[str]) -> tuple[str, int]:
    """The most common verdict (ties go to the more severe one) and how many runs have it."""
    counts = Counter(verdicts)
    best = max(counts, key=lambda v: (counts[v], VERDICT_ORDER.index(v) if v in VERDICT_ORDER else -1))
    return best, counts[best]


SUMMARY_NUMBERS = ["final_loss", "best_loss", "val_loss", "val_ppl", "peak_resid_norm", "osc_cv",
                   "osc_mean_abs_dlog", "osc_sign_alternation", "osc_neg_cosine_share", "loss_std", "grad_norm_std"]


def summary_table(src) -> pd.DataFrame:
    """One row per (lr_scale, variant, loops) cell of the grid: majority verdict over its finished seeds
    ("running" while none finished, "failed" when its runs only left an error.txt, "pending" with no
    run folder yet), `agree` seeds agreeing with it, `runs` and `finished` counts, any residual
    explosion, and the mean over finished seeds of each summary number."""
    study = _study(src, "collapse")
    cells: dict[tuple, list[Run]] = {key: [] for key in _grid(study)}
    for run in study.runs:
        cells.setdefault((run.lr_scale, run.variant, run.loops), []).append(run)
    rows = []
    for (lr, variant, loops), runs in cells.items():
        done = [r.summary for r in runs if r.summary]
        if done:
            verdict, agree = _majority([s["verdict"] for s in done])
        else:
            statuses = {r.status for r in runs}
            verdict, agree = ("running" if "running" in statuses else "failed" if runs else "pending"), 0
        numbers = {k: _mean([s.get(k) for s in done]) for k in SUMMARY_NUMBERS}
        rows.append(dict(lr_scale=lr, variant=variant, loops=loops, verdict=verdict, agree=agree, runs=len(runs),
                         finished=len(done), residual_explosion=any(bool(s.get("residual_explosion")) for s in done),
                         **numbers))
    df = pd.DataFrame(rows, columns=["lr_scale", "variant", "loops", "verdict", "agree", "runs", "finished",
                                     "residual_explosion", *SUMMARY_NUMBERS])
    order = df.assign(_r=df.variant.map(variant_rank)).sort_values(["lr_scale", "loops", "_r", "variant"])
    return df.loc[order.index].reset_index(drop=True)


def _mean(values) -> float:
    """Mean of the finite numbers among `values` (NaN when there are none)."""
    v = np.array([x for x in values if isinstance(x, (int, float))], dtype=float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else math.nan


def _grid(study: Study) -> list[tuple]:
    """Every (lr_scale, variant, loops) of the sweep's spec (empty for a single run folder)."""
    spec = study.spec or {}
    if not all(k in spec for k in ("variants", "loops", "lr_scales")):
        return []
    return [(float(lr), v, int(k)) for lr in spec["lr_scales"] for v in spec["variants"] for k in spec["loops"]]


def collapse_data(src) -> pd.DataFrame:
    """lr_scale, variant, loops, verdict, agree, runs, finished, residual_explosion, final_loss: the
    collapse grid's cells (see summary_table)."""
    return summary_table(src)[["lr_scale", "variant", "loops", "verdict", "agree", "runs", "finished",
                               "residual_explosion", "final_loss"]]


def loops_data(src) -> pd.DataFrame:
    """run, ..., inference_loops, trained_loops, val_loss, perplexity: each run's eval_loops.csv."""
    study = _study(src, "loops")
    frames = []
    for run in study.runs:
        ev = run.eval_loops
        if ev is None or ev.empty:
            continue
        ev = ev.rename(columns={"loops": "inference_loops"}).sort_values("inference_loops")
        frames.append(_tag(run, ev[["inference_loops", "trained_loops", "val_loss", "perplexity"]]))
    return _concat(frames, ["inference_loops", "trained_loops", "val_loss", "perplexity"])


# --------------------------------------------------------------------------- drawing helpers

@contextmanager
def style():
    """The look of every figure: seaborn paper context, white grid, readable at paper size."""
    with sns.axes_style("whitegrid"), sns.plotting_context("paper", font_scale=1.25), \
            matplotlib.rc_context({"legend.frameon": False, "axes.titleweight": "bold", "figure.dpi": 100}):
        yield


def _figure(nrows: int, ncols: int, panel=(3.6, 2.7), **kw) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(panel[0] * ncols + 0.6, panel[1] * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _varying(df: pd.DataFrame) -> list[str]:
    return [c for c in ("seed", "lr_scale") if c in df and df[c].nunique() > 1]


def _run_labels(df: pd.DataFrame, with_loops: bool = False) -> dict[str, str]:
    """A short label per run: variant (K loops) (seed, lr scale where those vary)."""
    vary = _varying(df)
    out = {}
    for row in df.drop_duplicates("run").itertuples():
        parts = [row.variant, f"K{row.loops}" if with_loops else "",
                 f"s{row.seed}" if "seed" in vary else "", f"lr×{row.lr_scale:g}" if "lr_scale" in vary else ""]
        out[row.run] = " ".join(p for p in parts if p)
    return out


def _linestyles(df: pd.DataFrame) -> dict[str, str]:
    """Line style per run, by its (seed, lr scale) combination (solid when there is one)."""
    combos = sorted({(r.seed, r.lr_scale) for r in df.drop_duplicates("run").itertuples()})
    index = {c: i for i, c in enumerate(combos)}
    return {r.run: LINESTYLES[index[(r.seed, r.lr_scale)] % len(LINESTYLES)]
            for r in df.drop_duplicates("run").itertuples()}


def _variants(df: pd.DataFrame) -> list[str]:
    return sorted(df.variant.unique(), key=lambda v: (variant_rank(v), v))


def _auto_yscale(ax, values) -> None:
    """Log scale when the values span more than a factor of 5."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v) and v.max() / v.min() > 5:
        _log_y(ax)


class _PlainLogFormatter(ticker.LogFormatter):
    """Log-axis tick labels as plain numbers (0.5, 20, 1e-05), labelling minor ticks on short ranges."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:.3g}"


def _log_y(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_PlainLogFormatter())
    ax.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))


def _empty(ax, text="no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax.set_axis_off()  # (not set_*ticks([]), which would clear the ticks of every shared axis)


def _finish(fig: Figure, title: str) -> Figure:
    fig.suptitle(title, fontweight="bold")
    return fig


def _need(df: pd.DataFrame, kind: str, hint: str) -> pd.DataFrame:
    if df.empty:
        raise NoData(f"{kind}: nothing to draw ({hint})")
    return df


# --------------------------------------------------------------------------- figures

def draw_residuals(df: pd.DataFrame) -> Figure:
    loops_values = sorted(df.loops.unique())
    variants = _variants(df)
    kmax = int(df.loop.max())
    norm = mcolors.Normalize(1, max(kmax, 2))
    cmap = matplotlib.colormaps[LOOP_CMAP]
    styles = _linestyles(df)
    with style():
        fig, axes = _figure(len(loops_values), len(variants), sharex=True, sharey=True)
        for i, k in enumerate(loops_values):
            for j, v in enumerate(variants):
                ax = axes[i, j]
                cell = df[(df.loops == k) & (df.variant == v)]
                ax.set_title(f"{v}, K={k}")
                if cell.empty:
                    _empty(ax)
                    continue
                for (run, loop), g in cell.groupby(["run", "loop"], sort=True):
                    ax.plot(g.step, g.value, color=cmap(norm(loop)), ls=styles[run], lw=1.2)
                _log_y(ax)
                if i == len(loops_values) - 1:
                    ax.set_xlabel("step")
                if j == 0:
                    ax.set_ylabel("‖h‖ at loop end")
        _finish(fig, "Residual norm at the end of each loop")
        sm = ScalarMappable(norm=norm, cmap=cmap)
        fig.colorbar(sm, ax=axes.ravel().tolist(), label="loop", shrink=0.8, pad=0.02)
    return fig


def fig_residuals(path) -> Figure:
    """Mean per-token residual norm at the end of each loop (resid_norm_loop_end) against step: one
    line per loop coloured by loop index (sequential palette), one panel per (variant, loops), shared
    log y scale; several seeds / lr scales of one cell differ by line style."""
    return draw_residuals(_need(residuals_data(path), "residuals", "no resid_norm_loop_end recorded"))


def draw_heatmap(df: pd.DataFrame) -> Figure:
    runs = list(dict.fromkeys(df.run))
    labels = _run_labels(df, with_loops=True)
    npanel = int(df.panel.max()) + 1
    norm = mcolors.LogNorm(df.value.min(), max(df.value.max(), df.value.min() * 1.001))
    with style():
        fig, axes = _figure(len(runs), npanel, panel=(2.8, 2.0))
        image = None
        for i, run in enumerate(runs):
            for p in range(npanel):
                ax = axes[i, p]
                cell = df[(df.run == run) & (df.panel == p)]
                if cell.empty:
                    ax.set_axis_off()
                    continue
                grid = cell.pivot_table(index="loop", columns="layer", values="value", aggfunc="last")
                image = ax.imshow(grid.to_numpy(), norm=norm, cmap="magma", aspect="auto", interpolation="nearest")
                ax.set_xticks(range(grid.shape[1]), grid.columns)
                ax.set_yticks(range(grid.shape[0]), grid.index)
                ax.grid(False)
                ax.set_title(f"step {int(cell.step.iloc[0])}")
                if p == 0:
                    ax.set_ylabel(f"{labels[run]}\nloop")
                if i == len(runs) - 1:
                    ax.set_xlabel("layer")
        _finish(fig, "Residual norm per (loop, layer)")
        fig.colorbar(image, ax=axes.ravel().tolist(), label="‖h‖", shrink=0.6, pad=0.02)
    return fig


def fig_residual_heatmap(path, steps=None) -> Figure:
    """Mean per-token residual norm after each block (resid_norm) as a (loop x layer) heatmap at chosen
    steps (default: first, middle and last recorded step; otherwise the nearest recorded ones),
    one row per run, one shared log colour scale."""
    return draw_heatmap(_need(heatmap_data(path, steps), "heatmap", "no resid_norm recorded"))


def _osc_table(ax, rows: pd.DataFrame, labels: dict[str, str]) -> None:
    """The oscillation indices of each run in `rows` as a small table, run names in variant colour."""
    osc = rows[rows.metric.isin(list(OSC_LABELS))]
    ax.set_axis_off()
    if osc.empty:
        return
    grid = osc.pivot_table(index="run", columns="metric", values="value", aggfunc="last", dropna=False)
    runs = list(dict.fromkeys(osc.run))
    cols = [k for k in OSC_LABELS if k in grid]
    text = [[f"{grid.loc[r, k]:.2f}" for k in cols] for r in runs]
    table = ax.table(cellText=text, rowLabels=[labels[r] for r in runs], colLabels=[OSC_LABELS[k] for k in cols],
                     loc="center", cellLoc="center", edges="horizontal")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    variant = dict(zip(osc.run, osc.variant))
    for i, r in enumerate(runs, start=1):
        table[i, -1].get_text().set_color(variant_color(variant[r]))
    ax.set_title("oscillation indices")


def draw_gradients(df: pd.DataFrame) -> Figure:
    loops_values = sorted(df.loops.unique())
    labels, styles = _run_labels(df), _linestyles(df)
    titles = {M.GRAD_NORM: "global grad norm", M.ACT_GRAD_NORM: "activation grad norm, last step",
              M.GRAD_COSINE: "cosine to previous gradient"}
    with style():
        fig, axes = _figure(len(loops_values), 4, panel=(3.6, 2.8), gridspec_kw={"width_ratios": [1, 1, 1, 0.9]})
        for i, k in enumerate(loops_values):
            rows = df[df.loops == k]
            for j, metric in enumerate(titles):
                ax = axes[i, j]
                ax.set_title(f"{titles[metric]}, K={k}")
                sel = rows[rows.metric == metric]
                if sel.empty:
                    _empty(ax)
                    continue
                for run, g in sel.groupby("run", sort=False):
                    x = g.loop if metric == M.ACT_GRAD_NORM else g.step
                    ax.plot(x, g.value, color=variant_color(g.variant.iloc[0]), ls=styles[run], lw=1.1,
                            label=labels[run], marker="o" if metric == M.ACT_GRAD_NORM else None, ms=4)
                if metric == M.GRAD_COSINE:
                    ax.axhline(0, color="0.4", lw=0.8)
                    ax.set_ylim(-1.05, 1.05)
                else:
                    _log_y(ax)
                if metric == M.ACT_GRAD_NORM:
                    ax.set_xlabel("loop")
                    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
                elif i == len(loops_values) - 1:
                    ax.set_xlabel("step")
            _osc_table(axes[i, 3], rows, labels)
            axes[i, 3].legend(*axes[i, 0].get_legend_handles_labels(), loc="lower center", fontsize="small",
                              ncols=2)
    return _finish(fig, "Gradients")


def fig_gradients(path) -> Figure:
    """Per run (colour = variant), one row per loops value: the global gradient norm against step (log);
    the activation-gradient norm averaged over layers, per loop, at the last recorded step; the cosine
    between consecutive gradients; and a table of the oscillation indices (cv, mean |Δlog g|, sign
    alternation, share of negative cosines; from summary.json, or computed like it while running)."""
    return draw_gradients(_need(gradients_data(path), "gradients", "no grad_norm recorded"))


def draw_loss(df: pd.DataFrame) -> Figure:
    loops_values = sorted(df.loops.unique())
    lrs = sorted(df.lr_scale.unique())
    labels, styles = _run_labels(df), _linestyles(df)
    with style():
        fig, axes = _figure(len(lrs), len(loops_values), sharey=True)
        for i, lr in enumerate(lrs):
            for j, k in enumerate(loops_values):
                ax = axes[i, j]
                ax.set_title(f"K={k}" + (f", lr×{lr:g}" if len(lrs) > 1 else ""))
                cell = df[(df.loops == k) & (df.lr_scale == lr)]
                for run, g in cell.groupby("run", sort=False):
                    color = variant_color(g.variant.iloc[0])
                    tr, val = g[g.metric == "loss_smoothed"], g[g.metric == M.VAL_LOSS]
                    ax.plot(tr.step, tr.value, color=color, ls=styles[run], lw=1.3, label=labels[run])
                    ax.plot(val.step, val.value, color=color, ls="none", marker="o", ms=4, mec="white", mew=0.6)
                if cell.empty:
                    _empty(ax)
                    continue
                ax.set_xlabel("step")
                ax.legend(fontsize="small")
            axes[i, 0].set_ylabel("loss (nats/token)")
        _auto_yscale(axes[0, 0], df.value)
    return _finish(fig, "Training loss (smoothed; dots: validation)")


def fig_loss(path) -> Figure:
    """Training loss smoothed by a trailing mean (the verdict's smooth_window), one line per run coloured
    by variant, one panel per loops value (and per lr scale where several); validation losses as dots."""
    return draw_loss(_need(loss_data(path), "loss", "no loss recorded"))


def _text_color(fill: str) -> str:
    r, g, b = mcolors.to_rgb(fill)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _cell_text(row) -> str:
    if row.verdict in ("running", "failed", "pending"):
        return row.verdict
    text = f"{row.final_loss:.2f}" + ("*" if row.residual_explosion else "")
    if row.runs > 1:
        text += f"\n{row.agree}/{row.finished}" + (f" (+{row.runs - row.finished})" if row.runs > row.finished else "")
    return text


def draw_collapse(df: pd.DataFrame) -> Figure:
    lrs = sorted(df.lr_scale.unique())
    variants, loops_values = _variants(df), sorted(df.loops.unique())
    with style():
        fig, axes = _figure(1, len(lrs), panel=(0.9 * len(loops_values) + 1.4, 0.6 * len(variants) + 1.2))
        for ax, lr in zip(axes[0], lrs):
            for row in df[df.lr_scale == lr].itertuples():
                x, y = loops_values.index(row.loops), variants.index(row.variant)
                fill = VERDICT_COLORS.get(row.verdict, OTHER_COLOR)
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=fill, edgecolor="white", lw=2))
                ax.text(x, y, _cell_text(row), ha="center", va="center", fontsize="small", color=_text_color(fill))
            ax.set_xlim(-0.5, len(loops_values) - 0.5)
            ax.set_ylim(len(variants) - 0.5, -0.5)
            ax.set_xticks(range(len(loops_values)), loops_values)
            ax.set_yticks(range(len(variants)), variants)
            ax.set_xlabel("loops K")
            ax.grid(False)
            ax.set_title(f"lr×{lr:g}" if len(lrs) > 1 else "")
        shown = [v for v in VERDICT_COLORS if v in set(df.verdict)]
        axes[0, -1].legend([Patch(color=VERDICT_COLORS[v]) for v in shown], shown, loc="upper left",
                           bbox_to_anchor=(1.02, 1), fontsize="small", handlelength=1.2)
        note = "numbers: final smoothed loss (mean over seeds)\n* residual explosion"
        if (df.runs > 1).any():
            note += "; n/m: seeds agreeing / finished (+running)"
        fig.supxlabel(note, fontsize="small", color="0.3")
    return _finish(fig, "Verdict by variant and loops")


def fig_collapse(path) -> Figure:
    """The variant x loops grid coloured by verdict (majority over finished seeds, "running" while
    none finished, "pending" before a cell starts), annotated with the mean final smoothed loss (and,
    with several seeds, how many agree); one grid per lr scale."""
    return draw_collapse(_need(collapse_data(path), "collapse", "no runs"))


def draw_loops(df: pd.DataFrame) -> Figure:
    trained = sorted(df.trained_loops.unique())
    labels, styles = _run_labels(df), _linestyles(df)
    with style():
        fig, axes = _figure(1, len(trained), sharey=True)
        for ax, k in zip(axes[0], trained):
            ax.axvline(k, color="0.3", ls="--", lw=1)
            for run, g in df[df.trained_loops == k].groupby("run", sort=False):
                color = variant_color(g.variant.iloc[0])
                ax.plot(g.inference_loops, g.val_loss, color=color, ls=styles[run], marker="o", ms=3.5,
                        label=labels[run])
                at = g[g.inference_loops == k]
                ax.plot(at.inference_loops, at.val_loss, ls="none", marker="*", ms=11, color=color, mec="black",
                        mew=0.5)
            ax.set_title(f"trained with K={k}")
            ax.set_xlabel("inference loops")
            ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
            ax.legend(fontsize="small")
        axes[0, 0].set_ylabel("validation loss")
        _auto_yscale(axes[0, 0], df.val_loss)
    return _finish(fig, "Test-time loops (dashed: trained loop count)")


def fig_loops(path) -> Figure:
    """Validation loss against the number of inference loops (eval_loops.csv), one line per run coloured
    by variant, one panel per trained loop count with a dashed vertical line (and a star) at it."""
    return draw_loops(_need(loops_data(path), "loops", "no eval_loops.csv; run `flt-diag eval-loops` first"))


def _map_path(src) -> Path:
    path = src.path if isinstance(src, Study) else Path(src)
    spec = read_json(path / SWEEP_SPEC) if is_sweep(path) else {}
    if spec.get("kind") != "map":
        raise NoData(f"{path} is not a stability map (made by `flt-diag map`)")
    return path


def map_data(src) -> pd.DataFrame:
    """Per (criterion, variant, loops): the boundary over seeds (flt_diag.figure_map)."""
    from .figure_map import map_data as data
    return data(_map_path(src))


def fig_map(src) -> Figure:
    """Phase diagram of a stability map: where each variant's training breaks (flt_diag.figure_map)."""
    from .figure_map import fig_map as draw
    return draw(_map_path(src))


# The figures of any run or sweep folder; a stability map (flt-diag map) adds MAP_FIGURES.
FIGURES = {"residuals": fig_residuals, "heatmap": fig_residual_heatmap, "gradients": fig_gradients,
           "loss": fig_loss, "collapse": fig_collapse, "loops": fig_loops}
MAP_FIGURES = {"map": fig_map}
ALL_FIGURES = {**FIGURES, **MAP_FIGURES}
DATA = {"residuals": residuals_data, "heatmap": heatmap_data, "gradients": gradients_data,
        "loss": loss_data, "collapse": collapse_data, "loops": loops_data, "map": map_data}
NEEDS = {"residuals": [M.RESID_NORM_LOOP_END], "heatmap": [M.RESID_NORM],
         "gradients": [M.GRAD_NORM, M.GRAD_COSINE, M.ACT_GRAD_NORM], "loss": [M.LOSS, M.VAL_LOSS],
         "collapse": [M.LOSS], "loops": [M.LOSS], "map": [M.LOSS]}


def _check_kind(kind: str) -> None:
    if kind not in ALL_FIGURES:
        raise ValueError(f"unknown figure {kind!r}; choose from {', '.join(ALL_FIGURES)}")


def figure_data(kind: str, path) -> pd.DataFrame:
    """The exact table figure `kind` draws (a pure function of the folder)."""
    _check_kind(kind)
    return DATA[kind](path)


class Written(list):
    """The files `plot` wrote; `skipped` maps each figure left out to the reason."""

    def __init__(self):
        super().__init__()
        self.skipped: dict[str, str] = {}


def render(study: Study, kinds=None) -> tuple[dict[str, Figure], dict[str, str]]:
    """Every figure of `kinds` (default all) that has data, and the reason for each one left out."""
    figures, skipped = {}, {}
    is_map = isinstance(study, Study) and bool(study.spec) and study.spec.get("kind") == "map"
    for kind in kinds or ({**FIGURES, **MAP_FIGURES} if is_map else FIGURES):
        try:
            figures[kind] = ALL_FIGURES[kind](study)
        except NoData as e:
            skipped[kind] = str(e)
            log.info("skipped %s", e)
    return figures, skipped


def save(fig: Figure, path: Path, dpi: int = DPI) -> Path:
    """Write a figure atomically (format from the suffix; PDFs without a creation date), inside
    `style()` so that tick labels are laid out as intended."""
    path = Path(path)
    meta = {"CreationDate": None} if path.suffix == ".pdf" else None
    with style(), atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", metadata=meta)
    return path


def plot(kind: str, path, out_dir=None, formats=("png", "pdf")) -> Written:
    """Write figure `kind` (or every figure with data for "all") as <out_dir>/<kind>.<format>.

    Default out_dir: <path>/figures. For "all", figures without data are skipped and listed in
    the result's `skipped`; a single kind without data raises StorageError."""
    kinds = None if kind == "all" else [kind]
    for k in kinds or []:
        _check_kind(k)
    study = Path(path) if kinds == ["map"] else collect(path)  # the map figure reads summaries only
    figures, skipped = render(study, kinds)
    if kind != "all" and skipped:
        raise StorageError(skipped[kind])
    out = Path(out_dir) if out_dir is not None else Path(path) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    written = Written()
    written.skipped.update(skipped)
    for k, fig in figures.items():
        written.extend(save(fig, out / f"{k}.{fmt}") for fmt in formats)
    return written
