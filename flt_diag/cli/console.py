"""What the command line prints: the progress bar, a run's verdict line, a sweep's tables."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

from pandas import isna
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from flt_diag.judge import peers as comparison
from flt_diag.results.tables import seed_table
from flt_diag.storage.file_models import Summary


class _ConsoleProgress:
    total: int  # (set by console_progress before a run)
    label: str

    def __init__(self):
        self.bar = None

    def __call__(self, info: dict) -> None:
        if self.bar is None:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), redirect_stdout=False, redirect_stderr=False)
            self.task = self.bar.add_task(self.label, total=self.total, loss="-")
            self.bar.start()
        self.bar.update(self.task, completed=info["step"], loss=f"{info['loss']:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


progress_bar = _ConsoleProgress()


def console_progress(total: int, label: str) -> _ConsoleProgress:
    progress_bar.total, progress_bar.label = total, label
    return progress_bar


def print_run_summary(out: Path, s: Summary) -> None:
    verdict = s.verdict + (f" (predicted at step {s.prediction.step})" if s.prediction else "")
    verdict += f" (v3: {s.verdict_v3})" if s.verdict_v3 not in (None, s.verdict) else ""  # (v4 netted the loop count)
    print(f"{out}: {verdict} ({s.evidence.reason or ''}); final loss {s.final_loss:.3f}, best "
          f"{s.best_loss:.3f}, val {s.val_loss:.3f}; peak final-loop residual norm {s.peak_resid_norm:.1f}"
          f"{' (EXPLODED)' if s.residual_explosion else ''}; median |dlog g| {_number(s.osc_dlog_median, '{:.3f}')}"
          + (f"; val accuracy {s.val_accuracy:.3f}" if s.val_accuracy is not None and math.isfinite(s.val_accuracy)
             else ""))


def _number(value, spec: str) -> str:
    return "–" if value is None or isna(value) or value in (math.inf, -math.inf) else spec.format(value)


def _peak(row) -> str:
    """The peak residual norm, * when it exploded."""
    value = row.get("peak_resid_norm")
    text = _number(value, "{:.1f}" if value is not None and abs(value) < 100 else "{:.0f}")
    return text + ("*" if row.get("residual_explosion") in (True, 1) else "")


# (header, column, text of a row): the columns of `summary`'s tables in order; a column the table lacks
# (val_accuracy on older folders) is left out, and an identity column with one value moves to the title
IDENTITY = [("variant", "variant", lambda r: str(r["variant"])), ("K", "loops", lambda r: str(r["loops"])),
            ("L", "depth", lambda r: _number(r["depth"], "{:.0f}")), ("d", "width", lambda r: _number(r["width"], "{:.0f}")),
            ("seed", "seed", lambda r: str(r["seed"])),
            ("lr×", "lr_scale", lambda r: f"{r['lr_scale']:g}"), ("verdict", "verdict", lambda r: str(r["verdict"]))]
COMPARED = [("val loss", "val_loss", lambda r: _number(r["val_loss"], "{:.3f}")),
            ("gap to best", "val_gap", lambda r: comparison.gap_text(r["val_gap"])),
            ("val acc", "val_accuracy", lambda r: _number(r["val_accuracy"], "{:.3f}")),
            ("peak ‖h‖", "peak_resid_norm", _peak),
            ("÷ FLT", "resid_vs_flt", lambda r: comparison.ratio_text(r["resid_vs_flt"])),
            ("flags", "behind", lambda r: comparison.flags_text(r))]
DETAILS = [("final loss", "final_loss", lambda r: _number(r["final_loss"], "{:.3f}")),
           ("best loss", "best_loss", lambda r: _number(r["best_loss"], "{:.3f}")),
           ("|Δlog g|", "osc_dlog_median", lambda r: _number(r["osc_dlog_median"], "{:.3f}")),
           ("grad CV", "osc_cv", lambda r: _number(r["osc_cv"], "{:.2f}")),
           ("loss std", "loss_std", lambda r: _number(r["loss_std"], "{:.3f}")),
           ("grad std", "grad_norm_std", lambda r: _number(r["grad_norm_std"], "{:.3f}")),
           ("time", "wall_time", lambda r: _number(r["wall_time"], "{:.0f}s"))]
FAILED = [("failed", "failed", lambda r: comparison.failed_text(SimpleNamespace(**r)))]
COMPARISON_NOTE = ("gap to best: val loss minus the lowest among the variants at the same K{peers} (nats); "
                   "÷ FLT: peak final-loop residual norm ‖h‖ over FLT's there (– without FLT); "
                   "* residual explosion; flags: behind (the gap exceeds the peers' seed noise, margin in brackets), "
                   "no loop gain (not better than K = 1 by that margin); |Δlog g|: the verdict's oscillation index")
SEEDS_NOTE = ("failed k/n: k of the cell's n finished seeds ended with a verdict other than stable (running or "
              "crashed seeds are not in n); numbers are means over the finished seeds")
CONSTANT_TITLE = {"seed": "seed {}", "lr_scale": "lr×{:g}", "depth": "L={}", "width": "d={}"}


def _constant_columns(df) -> dict[str, object]:
    """The identity columns (seed, lr scale, depth) with a single value in the table."""
    return {c: df[c].iloc[0] for c in CONSTANT_TITLE if c in df and df[c].nunique(dropna=False) == 1}


def _print_table(df, columns: list[tuple], title: str, caption: str) -> None:
    constant = _constant_columns(df)
    shown = [c for c in columns if c[1] in df and c[1] not in constant
             and not (c[1] == "val_accuracy" and df[c[1]].isna().all())]  # accuracy: task runs only
    fixed = ", ".join(CONSTANT_TITLE[c].format(v) for c, v in constant.items())
    table = Table(title=title + (f" ({fixed})" if fixed else ""), caption=caption, caption_justify="left")
    for header, column, _ in shown:
        table.add_column(header, justify="left" if column in ("variant", "verdict", "behind") else "right")
    for row in df.to_dict("records"):
        table.add_row(*[text(row) for _, _, text in shown])
    Console(width=200).print(table)


def print_sweep_table(df) -> None:
    """`summary` of a sweep: one row per finished run and, where the sweep has several seeds, one per
    cell (seeds averaged), each compared with the other variants at the same K."""
    if df.empty:
        print("no finished runs yet")
        return
    _print_table(df, IDENTITY + COMPARED + DETAILS, "sweep summary: one row per finished run",
                 COMPARISON_NOTE.format(peers=", seed, lr scale, depth and width"))
    if df.seed.nunique() > 1:
        cells = seed_table(df)
        _print_table(cells, [c for c in IDENTITY if c[1] != "seed"] + FAILED + COMPARED + DETAILS[:4],
                     "per cell: majority verdict over seeds, seeds failed, means over finished seeds",
                     COMPARISON_NOTE.format(peers=", lr scale, depth and width") + "\n" + SEEDS_NOTE)


SENSITIVITY_NOTE = ("each threshold multiplied by the factor alone, every stored run judged again from its metrics: "
                    "verdicts changed (from→to), residual-explosion flags changed, and of the cells, behind and "
                    "no_loop_gain flags changed; stall_margin = tol(H1), behind_margin = the peer flags' margin")


def print_sensitivity(df) -> None:
    """`summary --sensitivity`: one row per (threshold, factor)."""
    table = Table(title=f"verdict sensitivity ({int(df.runs.iloc[0])} runs, {int(df.cells.iloc[0])} cells)",
                  caption=SENSITIVITY_NOTE, caption_justify="left")
    headers = ["threshold", "×", "verdicts changed", "changes", "explosions", "behind", "no loop gain"]
    for h in headers:
        table.add_column(h, justify="left" if h in ("threshold", "changes") else "right")
    for r in df.itertuples():
        table.add_row(r.threshold, f"{r.factor:g}", str(r.verdicts_changed), r.changes or "–",
                      str(r.explosions_changed), str(r.behind_changed), str(r.no_loop_gain_changed))
    Console(width=200).print(table)
