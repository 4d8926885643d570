"""The sweep's summary table: one row per finished run, read from the run folders and compared with its
peers (flt_diag.judge.peers). It is what summary.csv holds, written by the grids after every cell and read
by the results layer (flt_diag.results.tables), the CLI and analysis/. Torch-free.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from flt_diag.judge.peers import compare_runs
from flt_diag.storage.cells import RunId
from flt_diag.storage.file_models import Summary
from flt_diag.storage.folders import SWEEP_SUMMARY, atomic_path, load_config, load_summary, run_dirs, run_name

# summary.json keys shown per run (verdict_v3: v3's verdict beside v4's); SUMMARY_NUMBERS (final_loss .. grad_norm_std)
# are averaged per grid cell
SUMMARY_COLUMNS = ["cell", "variant", "loops", "seed", "lr_scale", "verdict", "verdict_v3", "residual_explosion",
                   "final_loss", "best_loss", "val_loss", "val_ppl", "val_accuracy", "peak_resid_norm", "osc_cv",
                   "osc_mean_abs_dlog", "osc_sign_alternation", "osc_neg_cosine_share", "osc_dlog_median",
                   "osc_alternation", "osc_dlog_median_v3", "loss_std", "grad_norm_std", "steps_done", "wall_time",
                   "verdict_version"]


def summary_row(cell: str, summary: Summary, model, **labels) -> dict:
    """One run's row of a summary table: its summary's fields, its cell (folder) name, and its identity, depth and
    width too (`model`: its config's model section); `labels` replace fields."""
    return {**summary.model_dump(), "cell": cell, **RunId.read(summary, model).row(), **labels}


def summary_frame(rows: list[dict]) -> pd.DataFrame:
    """`summary_row`s as a summary table (SUMMARY_COLUMNS, `depth` and `width` after loops, a summary's field
    that an older one lacks None), compared with their peers (the columns val_gap, resid_vs_flt and the flags
    behind / no_loop_gain with their margins, per run)."""
    return compare_runs(pd.DataFrame(rows, columns=SUMMARY_COLUMNS + ["depth", "width"]))


def sweep_summary(out: Path) -> pd.DataFrame:
    """One row per finished cell (`summary_frame`), read from the run folders (a pure function of the folder)."""
    return summary_frame([summary_row(run_name(d), s, load_config(d).model)
                          for d in run_dirs(Path(out)) if (s := load_summary(d)) is not None])


def write_summary(out: Path) -> pd.DataFrame:
    df = sweep_summary(out)
    for name, write in ((SWEEP_SUMMARY, df.to_csv), ("summary.parquet", df.to_parquet)):
        with atomic_path(out / name) as tmp:
            write(tmp, index=False)
    return df
