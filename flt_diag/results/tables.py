"""The study layer: run and sweep folders read back as tables (numpy/pandas only; never torch).

`collect(path)` reads a sweep (or one run folder) into a `Study` of `Run`s; the summary tables below
(SUMMARY_COLUMNS, sweep_summary, pooled_summary, folders_summary, summary_table, seed_table, results_table) are
what the sweep's summary.csv, the CLI, the report, the figures and analysis/ all show. Per-run and per-cell
tables compare the variants (flt_diag.judge.peers: val_gap, resid_vs_flt). Derived series come from
flt_diag.judge.verdict. Works on a sweep still in progress: unfinished runs have `summary` None.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.storage import archive, metric_names as M
from flt_diag.storage.cells import IDENTITY, RunId
from flt_diag.storage.file_models import MapSpecFile, RunConfigFile, Summary, SweepSpecFile
from flt_diag.judge.peers import compare_cells, compare_runs, failed_text, flags_text, gap_text, ratio_text
from flt_diag.judge.verdict import OSC_INDICES, dense_oscillation, smoothed
from flt_diag.storage.folders import (COLUMNS, METRICS, StorageError, is_run, is_sweep, load_config,
                                     load_eval_loops, load_metrics, load_spec, load_summary, run_dirs, run_name,
                                     run_state,
                                     series)
from flt_diag.storage.pooling import check_poolable
from flt_diag.judge.summary_table import SUMMARY_COLUMNS, summary_frame, summary_row, sweep_summary
from flt_diag.config.variants import VARIANTS

VARIANT_ORDER = list(VARIANTS)
VERDICT_ORDER = ["stable", "unstable", "stalled", "collapsed", "diverged"]  # by severity (ties in a majority go to the worse)
RUN_COLUMNS = ["run", *IDENTITY[:4]]  # a per-run table's first columns: the run and its variant, loops, seed, lr scale
CELL = ["lr_scale", "variant", "loops", "depth", "width"]  # a cell of a grid: a run's identity without its seed
NO_METRICS = pd.DataFrame(columns=COLUMNS).astype({"step": "int64", "loop": "int16", "layer": "int16", "value": "float64"})

SUMMARY_NUMBERS = SUMMARY_COLUMNS[SUMMARY_COLUMNS.index("final_loss"):SUMMARY_COLUMNS.index("steps_done")]
OSC_COLUMNS = [f"osc_{k}" for k in OSC_INDICES]  # v2's indices over the dense steps (the gradients figure)
GRID_COLUMNS = [*CELL, "verdict", "agree", "runs", "finished", "failed", "residual_explosion", "val_sd", "val_n"]

# the report's table: display name -> (summary_table column, format)
TABLE_COLUMNS = {
    "Final loss": ("final_loss", "{:.3f}"),
    "Val loss": ("val_loss", "{:.3f}"),
    "Val ppl": ("val_ppl", "{:.2f}"),
    "Peak ‖h‖ (last loop)": ("peak_resid_norm", "{:.1f}"),
    "Osc |Δlog g|": ("osc_mean_abs_dlog", "{:.3f}"),
    "Loss std": ("loss_std", "{:.3f}"),
    "Grad-norm std": ("grad_norm_std", "{:.3f}"),
}


# --------------------------------------------------------------------------- runs and studies

@dataclass(eq=False)
class Run:
    """One run folder: its identity (read from its config; the variant of a model of one's own labelled "own"),
    config, summary (None while running), metrics and eval_loops."""
    path: Path
    id: RunId
    config: RunConfigFile
    summary: Summary | None
    metrics: pd.DataFrame
    eval_loops: pd.DataFrame | None

    @property
    def name(self) -> str:
        return run_name(self.path)

    @property
    def status(self) -> str:
        """The verdict once finished, else "failed" (the sweep left an error.txt) or "running"."""
        if self.summary is not None:
            return self.summary.verdict
        return "failed" if run_state(self.path) == "failed" else "running"

    def sort_key(self) -> tuple:
        i = self.id
        return i.lr_scale, i.seed, i.loops, variant_rank(i.variant), i.variant, self.name

    @property
    def smooth_window(self) -> int:
        return self.config.run_config().verdict.smooth_window

    @property
    def explosion_threshold(self) -> float:
        """The verdict's residual-explosion threshold: explosion_ratio * sqrt(d)."""
        return self.config.run_config().verdict.explosion_ratio * math.sqrt(self.config.model.width)

    def select(self, metric: str) -> pd.DataFrame:
        """The finite rows of one metric (step, metric, loop, layer, value)."""
        m = self.metrics
        sel = m[(m.metric == metric) & np.isfinite(m.value)]
        return sel.astype({"step": "int64", "loop": "int64", "layer": "int64", "value": "float64"})

    def tag(self, df: pd.DataFrame) -> pd.DataFrame:
        """Prefix a per-run table with the run's identifying columns (RUN_COLUMNS)."""
        return df.reset_index(drop=True).assign(run=self.name, **self.id.row())[RUN_COLUMNS + list(df.columns)]


@dataclass(eq=False)
class Study:
    """Every run of a sweep (or one run folder), sorted by lr scale, seed, loops and variant."""
    path: Path
    runs: list[Run]
    spec: SweepSpecFile | MapSpecFile | None = None  # sweep.json; None for a single run folder

    @property
    def kind(self) -> str:
        """"map" for a stability map (flt-diag map), "sweep", or "run"."""
        return "run" if self.spec is None else "map" if isinstance(self.spec, MapSpecFile) else "sweep"


def variant_rank(variant: str | None) -> int:
    return VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER)


def _has_metrics(run_dir: Path) -> bool:
    if archive.is_record(run_dir):
        return archive.row_count(run_dir) > 0
    return any((run_dir / METRICS).glob("part-*.parquet"))


def collect(path, metrics: list[str] | None = None) -> Study:
    """Load every run of a sweep, or a single run folder. `metrics` keeps only those names (None: all;
    an empty list reads no metrics at all, for tables of summaries). A list of several sweep folders of
    one setting is pooled (`check_poolable`): a cell and seed run in two of them counts once, the first
    folder's; the study's path and spec are the first folder's.

    Several run folders (or run records), e.g. flt_diag.watch runs of two configurations, are laid side by
    side instead (`side_by_side`): every run its own cell, labelled as `_labelled` says.

    Raises StorageError for a path that is neither, or one with no metrics recorded yet."""
    if isinstance(path, (list, tuple)):
        if side_by_side(path):
            return _side_by_side_study(path, metrics)
        if len(path) > 1:
            return _pooled_study([Path(p) for p in path], metrics)
        path = path[0]
    path = Path(path)
    dirs = run_dirs(path)
    if not dirs:
        raise StorageError(f"{path}: no run folders yet")
    if not any(_has_metrics(d) for d in dirs):
        raise StorageError(f"{path}: no metrics recorded yet")
    runs = []
    for d in dirs:
        cfg = load_config(d)
        run_id = RunId.read(cfg.model, cfg.train)
        table = load_metrics(d, metrics) if metrics is None or metrics else NO_METRICS.copy()
        runs.append(Run(d, dataclasses.replace(run_id, variant=run_id.variant or "own"), cfg, load_summary(d), table,
                        load_eval_loops(d)))
    spec = load_spec(path) if is_sweep(path) else None
    return Study(path, sorted(runs, key=Run.sort_key), spec)


def _pooled_study(paths: list[Path], metrics) -> Study:
    check_poolable(paths)
    runs: dict[RunId, Run] = {}  # (the first folder's run of an identity)
    for run in (run for path in paths for run in collect(path, metrics).runs):
        runs.setdefault(run.id, run)
    return Study(paths[0], sorted(runs.values(), key=Run.sort_key), load_spec(paths[0]))


def side_by_side(paths) -> bool:
    """Whether several paths are run folders (or run records) to lay side by side, rather than sweeps to pool;
    a mix of the two is refused (StorageError, one line)."""
    paths = [Path(p) for p in paths]
    if missing := next((p for p in paths if not p.exists()), None):
        raise StorageError(f"no such folder: {missing}")
    runs = [not is_sweep(p) and (is_run(p) or archive.is_record(p)) for p in paths]
    if len(paths) > 1 and any(runs) and not all(runs):
        raise StorageError(f"{paths[runs.index(True)]} is a run folder and {paths[runs.index(False)]} is not: give run "
                           "folders (laid side by side) or sweep folders of one setting (pooled), not both")
    return len(paths) > 1 and all(runs)


def _labelled(runs: list[Run]) -> list[Run]:
    """Runs given side by side, each labelled (its `variant`, the colour and row it gets) by its variant, or by
    its folder's name where the variant says nothing (a model of one's own: "own") or would not tell it from
    another run given (the same identity); by its path where names repeat."""
    same, names = Counter(r.id for r in runs), Counter(r.name for r in runs)
    return [r if r.id.variant != "own" and same[r.id] == 1 else dataclasses.replace(
        r, id=dataclasses.replace(r.id, variant=r.name if names[r.name] == 1 else str(r.path))) for r in runs]


def _side_by_side_study(paths, metrics) -> Study:
    runs = [run for p in paths for run in collect(p, metrics).runs]
    return Study(Path(paths[0]), sorted(_labelled(runs), key=Run.sort_key))


def folders_summary(paths) -> pd.DataFrame:
    """sweep_summary's rows of several folders, checked once (`side_by_side`): sweeps of one setting pooled
    (`pooled_summary`), or run folders laid side by side: one row per finished run, labelled as in `collect`,
    compared with the others as a sweep's runs are."""
    if not side_by_side(paths):
        return pooled_summary(paths)
    return summary_frame([summary_row(r.name, r.summary, r.config.model, variant=r.id.variant)
                          for r in _side_by_side_study(paths, []).runs if r.summary is not None])


def concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """Per-run tables (from Run.tag) as one, with RUN_COLUMNS + columns even when there are none."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=RUN_COLUMNS + columns)
    return pd.concat(frames, ignore_index=True)[RUN_COLUMNS + columns]


def run_order(study: Study, column: str = "run"):
    """A sort key (for DataFrame.sort_values) that orders `column` like the study's runs."""
    order = {r.name: i for i, r in enumerate(study.runs)}
    return lambda s: s.map(order) if s.name == column else s


# --------------------------------------------------------------------------- derived series

def smoothed_loss(run: Run) -> pd.Series:
    """The verdict's smoothed training loss (flt_diag.judge.verdict.smoothed over the finite losses; steps
    before the first full window have none), step-indexed."""
    loss = series(run.metrics, M.LOSS)
    return smoothed(loss[np.isfinite(loss.to_numpy())], run.smooth_window).dropna()


def oscillation(run: Run) -> dict:
    """The run's oscillation indices (osc_*): from summary.json, or computed like it while running."""
    stored = run.summary.model_dump() if run.summary is not None else {}
    if all(stored.get(k) is not None for k in OSC_COLUMNS):  # (a summary of v1 has no osc_mean_abs_dlog etc.)
        return {k: stored[k] for k in OSC_COLUMNS}
    dense = run.config.diagnostics.dense_steps
    osc = dense_oscillation(series(run.metrics, M.GRAD_NORM), series(run.metrics, M.GRAD_COSINE), dense)
    return {f"osc_{k}": v for k, v in osc.items()}


# --------------------------------------------------------------------------- summary tables

def pooled_summary(paths: list[Path]) -> pd.DataFrame:
    """sweep_summary of several sweeps of one setting as one table: e.g. more seeds of some cells, run
    later into folders of their own (`check_poolable`). A cell and seed finished in two folders counts
    once (the first folder's). Rows are compared again over the pooled runs, so a run's peers are the
    variants that any of the folders ran at its K, depth, seed and lr scale."""
    check_poolable(paths)
    frames = [sweep_summary(Path(path)) for path in paths]
    df = pd.concat([f for f in frames if len(f)] or frames[:1], ignore_index=True)
    df = df.drop_duplicates(subset=list(IDENTITY), keep="first").reset_index(drop=True)
    return compare_runs(df)


def _majority(verdicts: list[str]) -> tuple[str, int]:
    """The most common verdict (ties go to the more severe one) and how many runs have it."""
    counts = Counter(verdicts)
    best = max(counts, key=lambda v: (counts[v], VERDICT_ORDER.index(v) if v in VERDICT_ORDER else -1))
    return best, counts[best]


def _mean(values) -> float:
    """Mean of the finite numbers among `values` (NaN when there are none)."""
    v = np.array([x for x in values if isinstance(x, (int, float, np.number))], dtype=float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else math.nan


def _grid(study: Study) -> list[tuple]:
    """Every (lr_scale, variant, loops, depth, width) of the sweep's spec, depth and width its base config's
    (empty for a single run folder)."""
    spec = study.spec
    if not isinstance(spec, SweepSpecFile):
        return []
    base = RunId.read(spec.base.model, spec.base.train)
    return [(float(lr), v, int(k), base.depth, base.width) for lr in spec.lr_scale for v in spec.variants
            for k in spec.loops]


def _is_true(value) -> bool:
    """A stored flag: True only for a true value (None and a CSV's NaN are not)."""
    return value is not None and value == value and bool(value)


def _aggregate(done: list[dict]) -> dict:
    """What a cell's finished runs (summaries, or sweep_summary rows) say together: the majority verdict
    and how many agree with it, how many finished and how many of those failed (verdict not `stable`),
    any residual explosion, and the mean of each summary number (SUMMARY_NUMBERS)."""
    verdicts = [s["verdict"] for s in done]
    verdict, agree = _majority(verdicts)
    val = np.array([_mean([s.get("val_loss")]) for s in done], dtype=float)
    val = val[np.isfinite(val)]
    return dict(verdict=verdict, agree=agree, finished=len(done), failed=sum(v != "stable" for v in verdicts),
                residual_explosion=any(_is_true(s.get("residual_explosion")) for s in done),
                val_sd=float(val.std(ddof=1)) if len(val) > 1 else math.nan, val_n=len(val),
                **{k: _mean([s.get(k) for s in done]) for k in SUMMARY_NUMBERS})


def _not_done(runs: list[Run]) -> dict:
    """A cell none of whose runs finished: "running", "failed" (only an error.txt) or "pending" (no run)."""
    statuses = {r.status for r in runs}
    verdict = "running" if "running" in statuses else "failed" if runs else "pending"
    return dict(verdict=verdict, agree=0, finished=0, failed=0, residual_explosion=False, val_sd=math.nan, val_n=0,
                **{k: math.nan for k in SUMMARY_NUMBERS})


def _cells(rows: list[dict], margin_scale: float = 1.0) -> pd.DataFrame:
    """Cell rows as a table in display order (lr scale, depth, loops, variant), variants compared (the flags'
    margins times `margin_scale`)."""
    df = pd.DataFrame(rows, columns=GRID_COLUMNS + SUMMARY_NUMBERS)
    df["depth"], df["width"] = df.depth.astype("Int64"), df.width.astype("Int64")
    order = df.assign(_r=df.variant.map(variant_rank)).sort_values(["lr_scale", "depth", "loops", "_r", "variant"])
    return compare_cells(df.loc[order.index].reset_index(drop=True), margin_scale)


def summary_table(src) -> pd.DataFrame:
    """One row per (lr_scale, variant, loops, depth) cell of the grid: majority verdict over its finished
    seeds ("running" while none finished, "failed" when its runs only left an error.txt, "pending" with
    no run folder yet), `agree` seeds agreeing with it, `runs`, `finished` and `failed` (finished with a
    verdict other than stable) counts, any residual explosion, the mean over finished seeds of each
    summary number (SUMMARY_NUMBERS), and the comparison between variants (compare_cells)."""
    study = src if isinstance(src, Study) else collect(src, [])
    cells: dict[tuple, list[Run]] = {}
    for run in study.runs:
        cells.setdefault(tuple(getattr(run.id, k) for k in CELL), []).append(run)
    started = {key[:3] for key in cells}
    cells.update({key: [] for key in _grid(study) if key[:3] not in started})
    rows = []
    for key, runs in cells.items():
        done = [r.summary.model_dump() for r in runs if r.summary is not None]  # (as rows of a summary table)
        rows.append(dict(zip(CELL, key), runs=len(runs), **(_aggregate(done) if done else _not_done(runs))))
    return _cells(rows)


def seed_table(runs: pd.DataFrame, margin_scale: float = 1.0) -> pd.DataFrame:
    """summary_table's cells from sweep_summary's rows (finished runs only, so `runs` = `finished`); the
    flags' margins times `margin_scale` (the sensitivity table moves them)."""
    rows = [dict(zip(CELL, key), runs=len(g), **_aggregate(g.to_dict("records")))
            for key, g in runs.groupby(CELL, dropna=False)]
    return _cells(rows, margin_scale)


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return spec.format(value)


# the report table's comparison columns: each follows the TABLE_COLUMNS entry it compares
COMPARED_AFTER: dict[str, tuple[str, str, Callable[[Any], str]]] = {"Val loss": ("Gap to best", "val_gap", gap_text),
                  "Peak ‖h‖ (last loop)": ("Peak ÷ FLT", "resid_vs_flt", ratio_text)}


def results_table(src) -> pd.DataFrame:
    """The report's table as text: one row per (lr scale, depth, variant, loops) cell, numbers formatted,
    each compared number followed by its comparison (COMPARED_AFTER).

    Numbers are means over a cell's finished seeds; the verdict is their majority; "Failed" (with
    several seeds) is k/n: k of the n finished seeds ended with a verdict other than stable."""
    df = summary_table(src)
    multi_lr, multi_depth = df.lr_scale.nunique() > 1, df.depth.nunique() > 1
    multi_seed = (df.runs > 1).any()
    rows = []
    for r in df.itertuples():
        row = {"Variant": r.variant, "Loops": str(r.loops)}
        if multi_depth:
            row["Depth"] = "–" if pd.isna(r.depth) else str(r.depth)
        if multi_lr:
            row["LR scale"] = f"{r.lr_scale:g}"
        row["Verdict"] = r.verdict + (" (residual explosion)" if r.residual_explosion else "")
        if multi_seed:
            row["Failed"] = failed_text(r)
        for name, (col, spec) in TABLE_COLUMNS.items():
            row[name] = _fmt(getattr(r, col), spec)
            if name in COMPARED_AFTER:
                label, compared, text = COMPARED_AFTER[name]
                row[label] = text(getattr(r, compared))
        row["Flags"] = flags_text(r)
        rows.append(row)
    return pd.DataFrame(rows)
