"""Progress of a sweep: a bar of cells done (work weighted by loops x depth) with each running cell's step
and loss, a plain status line where the output is not a terminal, and one early estimate of the whole
sweep's time.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import cast

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from flt_diag.storage.cells import RunId
from flt_diag.storage.folders import CELLS, cell_path, load_progress, run_state


def cell_status(out: Path, cell: RunId) -> str:
    """"done", "partial" (started, not finished), "failed" (raised an error) or "pending": the cell's run_state
    (of its record, where the folder holds one taken in from its archive)."""
    return run_state(cell_path(Path(out), cell.name))


class SweepMonitor:
    """Progress bar: cells done, each running cell's step and loss, ETA (work weighted by loops).
    Where stdout is not a terminal (nohup, a batch job's log), where a bar cannot redraw, it prints a
    plain status line every `heartbeat` seconds instead. Once `estimate_after` seconds of training
    have been measured it prints, once, an estimate of the whole sweep's time (the rate of work since the
    first progress, weighted by loops x depth, extrapolated to all of it: a rough figure)."""

    heartbeat = 300.0
    estimate_after = 60.0

    def __init__(self, out: Path, cells: list[RunId], steps: int, enabled: bool):
        self.out, self.steps, self.enabled = out, steps, enabled
        self.weight = {c: c.loops * (c.depth or 1) * steps for c in cells}
        self.total = sum(self.weight.values())
        self.estimated = False
        self.first: tuple[float, float] | None = None  # first: (elapsed s, work) at the first progress reported
        done = [c for c in cells if cell_status(out, c) == "done"]
        self.done_work, self.n_done, self.n_cells = sum(self.weight[c] for c in done), len(done), len(cells)
        self.running: dict[RunId, int] = {}
        self.bar = None
        if enabled:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[cells]}"),
                                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False,
                                redirect_stdout=False, redirect_stderr=False)
            self.task = self.bar.add_task("sweep", total=self.total, completed=self.done_work,
                                          cells=self._cells_text())
            self.bar.start()
        self.t0 = self.last_beat = time.monotonic()
        self.work0 = self.done_work

    def _cells_text(self) -> str:
        return f"{self.n_done}/{self.n_cells} cells"

    def start(self, cell: RunId) -> None:
        self.running[cell] = 0
        self._refresh()

    def update(self, cell: RunId, info: dict) -> None:
        self.running[cell] = info.get("step", 0)
        self._refresh(info)

    def poll(self) -> None:
        for cell in self.running:
            info = load_progress(self.out / CELLS / cell.name)
            if info:
                self.running[cell] = info.get("step", 0)
        self._refresh()

    def finish(self, cell: RunId, result: str) -> None:
        self.running.pop(cell, None)
        self.done_work += self.weight[cell]
        self.n_done += 1
        if self.bar is not None:
            self.bar.console.print(f"  cell {cell.index} {cell.name}: {result}")
        self._refresh()

    def _refresh(self, info: dict | None = None) -> None:
        if self.bar is None:
            return
        work = self.done_work + sum(self.weight[cell] // self.steps * step for cell, step in self.running.items())
        parts = []
        for cell, step in self.running.items():
            p = load_progress(self.out / CELLS / cell.name) if info is None else info
            loss = f" loss {p['loss']:.3f}" if p and p.get("loss") is not None else ""
            parts.append(f"{cell.name} {step}/{self.steps}{loss}")
        self.bar.update(self.task, completed=work, cells=self._cells_text(),
                        description=("; ".join(parts) or "sweep")[:90])
        now = time.monotonic()
        self._estimate(work, now - self.t0)
        if not self.bar.console.is_terminal and now - self.last_beat >= self.heartbeat:
            self.last_beat = now
            elapsed = now - self.t0
            rate = (work - self.work0) / elapsed if elapsed > 0 else 0.0
            left = f", about {(self.total - work) / rate / 60:.0f} min left" if rate > 0 else ""
            self.bar.console.print(f"  [{elapsed / 60:.0f} min] {self._cells_text()}, {work / self.total:.0%} of the "
                                   f"work{left}; running: {'; '.join(parts) or '-'}", soft_wrap=True)

    def _estimate(self, work: float, elapsed: float) -> None:
        """Once: the rate is measured from the first progress a cell reports (start-up, data loading and
        compilation are behind it) over `estimate_after` seconds; the time before that is added as it was
        (a rate measured from the start overestimates the sweep: benchmarks/README.md)."""
        if self.estimated or work <= self.work0:
            return
        if self.first is None:
            self.first = (elapsed, work)
            return
        t1, w1 = self.first
        if elapsed - t1 < self.estimate_after or work <= w1:
            return
        self.estimated = True
        rate = (work - w1) / (elapsed - t1)
        cast(Progress, self.bar).console.print(
            f"  estimate from {elapsed - t1:.0f} s of training: the whole sweep takes about "
            f"{_minutes(t1 + (self.total - w1) / rate)}, {_minutes((self.total - work) / rate)} from now",
            soft_wrap=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
