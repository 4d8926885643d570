"""Verdict v3's sensitivity table: on the stored runs of the given folders, each threshold multiplied by
0.5 and by 1.5 one at a time, and how many verdicts and flags change (numpy/pandas only; never torch).

The thresholds moved (THRESHOLDS), the baseline (each run's own config.json thresholds) and what is counted:
docs/DESIGN.md section 3, "Sensitivity". Nothing is written to the folders. Cells are the summary table's.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd

from flt_diag.judge.early_warning import finished_runs
from flt_diag.storage.cells import RunId
from flt_diag.judge.verdict import judged, residual_explosion, stored_config
from flt_diag.config.run_config import with_overrides
from flt_diag.results.tables import CELL, seed_table
from flt_diag.storage import metric_names as M
from flt_diag.storage.file_models import Summary
from flt_diag.storage.folders import load_config, load_metrics

THRESHOLDS = ("rebound_abs", "rebound_rel", "recovery_abs", "recovery_rel", "stall_margin", "osc_dlog_threshold",
              "explosion_ratio", "behind_margin")
VERDICT_FIELDS = ("rebound_abs", "rebound_rel", "recovery_abs", "recovery_rel", "osc_dlog_threshold",
                  "explosion_ratio")
FACTORS = (0.5, 1.5)
METRICS = [M.LOSS, M.GRAD_NORM, M.RESID_NORM, M.RESID_NORM_LOOP_END]
COLUMNS = ["threshold", "factor", "runs", "verdicts_changed", "changes", "explosions_changed", "cells",
           "behind_changed", "no_loop_gain_changed"]


class StoredRun:
    """A finished run's stored metrics and config, judged again under moved thresholds."""

    def __init__(self, run_dir: Path, summary: Summary, overrides: dict | None):
        stored = load_config(run_dir)
        self.summary = summary
        self.cfg = stored_config(stored, overrides)
        self.unigram_entropy = stored.unigram_entropy
        self.metrics = load_metrics(run_dir, METRICS)
        self.id = RunId.read(summary, stored.model)
        self.row = dict(self.id.row(), val_loss=summary.val_loss)  # (the last recorded, which no threshold moves)

    def judge(self, threshold: str | None = None, factor: float = 1.0) -> dict:
        """verdict and residual_explosion with `threshold` multiplied by `factor` (None: as configured)."""
        cfg = self.cfg
        if threshold in VERDICT_FIELDS:
            cfg = with_overrides(cfg, verdict={threshold: getattr(cfg.verdict, threshold) * factor})
        stall_scale = factor if threshold == "stall_margin" else 1.0
        prediction = self.summary.prediction and self.summary.prediction.as_written()
        name, _, _ = judged(self.metrics, cfg, self.unigram_entropy, prediction, stall_scale)
        resid = residual_explosion(self.metrics, self.id.loops, self.id.width, cfg.verdict.explosion_ratio)
        return dict(verdict=name, residual_explosion=resid["residual_explosion"],
                    peak_resid_norm=resid["peak_resid_norm"])


def stored_runs(paths, overrides: dict | None = None) -> list[StoredRun]:
    """Every finished run under the folders (a run and seed in two folders counts once, the first's)."""
    runs: dict = {}  # (by run id)
    for run in (StoredRun(d, s, overrides) for d, s in finished_runs(paths)):
        runs.setdefault(run.id, run)
    return list(runs.values())


def _cells(runs: list[StoredRun], judgements: list[dict], margin_scale: float) -> pd.DataFrame:
    """The runs' cells (seed_table) with their flags under these judgements (none without runs)."""
    if not runs:
        return pd.DataFrame(columns=["behind", "no_loop_gain"])
    rows = pd.DataFrame([{**r.row, **j} for r, j in zip(runs, judgements)])
    return seed_table(rows, margin_scale).set_index(CELL)


def _changed(base: pd.Series, moved: pd.Series) -> int:
    return int((base.astype(bool) != moved.astype(bool)).sum())


def sensitivity(paths, overrides: dict | None = None, factors=FACTORS) -> pd.DataFrame:
    """One row per (threshold, factor): how many of the stored runs' verdicts change (and from what to
    what), how many residual-explosion flags, and how many cells' behind and no_loop_gain flags."""
    runs = stored_runs(paths, overrides)
    base = [r.judge() for r in runs]
    base_cells = _cells(runs, base, 1.0)
    out = []
    for threshold in THRESHOLDS:
        for factor in factors:
            moved = base if threshold == "behind_margin" else [r.judge(threshold, factor) for r in runs]
            transitions = Counter(f"{b['verdict']}→{m['verdict']}" for b, m in zip(base, moved)
                                  if b["verdict"] != m["verdict"])
            cells = _cells(runs, moved, factor if threshold == "behind_margin" else 1.0)
            out.append(dict(threshold=threshold, factor=factor, runs=len(runs),
                            verdicts_changed=sum(transitions.values()),
                            changes="; ".join(f"{k} {n}" for k, n in sorted(transitions.items())),
                            explosions_changed=sum(b["residual_explosion"] != m["residual_explosion"]
                                                   for b, m in zip(base, moved)),
                            cells=len(base_cells), behind_changed=_changed(base_cells.behind, cells.behind),
                            no_loop_gain_changed=_changed(base_cells.no_loop_gain, cells.no_loop_gain)))
    return pd.DataFrame(out, columns=COLUMNS)
