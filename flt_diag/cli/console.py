"""What the command line prints: the progress bar, a run's verdict line, a sweep's table."""
from __future__ import annotations

import math
from pathlib import Path


class _ConsoleProgress:
    def __init__(self):
        self.bar = None

    def __call__(self, info: dict) -> None:
        if self.bar is None:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
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


def print_run_summary(out: Path, s: dict) -> None:
    ev = s.get("evidence", {})
    verdict = s["verdict"] + (f" (predicted at step {s['prediction']['step']})" if s.get("prediction") else "")
    print(f"{out}: {verdict} ({ev.get('reason', '')}); final loss {s['final_loss']:.3f}, best "
          f"{s['best_loss']:.3f}, val {s['val_loss']:.3f}; peak final-loop residual norm {s['peak_resid_norm']:.1f}"
          f"{' (EXPLODED)' if s['residual_explosion'] else ''}; grad-norm CV {s['osc_cv']:.2f}"
          + (f"; val accuracy {s['val_accuracy']:.3f}" if _finite(s.get("val_accuracy")) else ""))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def print_eval_loops(run: Path, df) -> None:
    """One line per run of `flt-diag eval-loops`: the best loss, and the loss (and a task's accuracy) at every count."""
    finite = df[df.val_loss.apply(lambda x: x == x and abs(x) != float("inf"))]
    best = finite.loc[finite.val_loss.idxmin()] if len(finite) else None
    line = (f"{run}: trained at K={int(df.trained_loops[0])}; "
            + (f"best val loss {best.val_loss:.3f} at {int(best.loops)} loops; " if best is not None else
               "no finite val loss; ")
            + " ".join(f"{int(k)}:{x:.2f}" for k, x in zip(df.loops, df.val_loss)))
    if df.accuracy.notna().any():
        top = df.loc[df.accuracy.idxmax()]
        line += (f"; best accuracy {top.accuracy:.3f} at {int(top.loops)} loops; "
                 + " ".join(f"{int(k)}:{a:.2f}" for k, a in zip(df.loops, df.accuracy)))
    print(line)


def print_sweep_table(df) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ["variant", "loops", "seed", "lr_scale", "verdict", "residual_explosion", "final_loss", "best_loss",
            "val_loss", "peak_resid_norm", "osc_cv", "osc_sign_alternation", "loss_std", "grad_norm_std", "wall_time"]
    if "val_accuracy" in df and df.val_accuracy.notna().any():  # runs of a synthetic task
        cols.insert(cols.index("val_loss") + 1, "val_accuracy")
    table = Table(title="sweep summary")
    for c in cols:
        table.add_column(c.replace("_", " "))
    for _, row in df.iterrows():
        table.add_row(*[f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols])
    Console(width=200).print(table)
