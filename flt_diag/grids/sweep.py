"""Ablation sweeps: every variant x loop count x seed x lr scale, one run folder per cell.

A sweep folder:
    sweep.json             the spec (base config + the grid) and the ordered cell names
    cells/<name>/          one run folder per cell (see flt_diag.analysis.storage)
    summary.csv/.parquet   one row per finished cell (rewritten after every cell)

Re-running the same command skips finished cells (they have summary.json) and resumes or
restarts unfinished ones. Every file is written to a temporary name and renamed, so an
interrupted sweep never leaves a half-written file. A different spec on an existing folder is
refused. `--cell I` runs one cell, so a job array can spread a sweep over machines.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import ctypes
import os
import signal
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from flt_diag.analysis.cells import Cell
from flt_diag.analysis.pooling import without_grid_fields
from flt_diag.config import RunConfig, check, validate, with_overrides
from flt_diag.grid_config import SWEEP_GRID_FIELDS, SweepGrid
from flt_diag.analysis.results import SUMMARY_COLUMNS, sweep_summary  # noqa: F401  (the one summary table; re-exported)
from flt_diag.analysis.storage import (CELLS, ERROR, SWEEP_SPEC, SWEEP_SUMMARY, StorageError, atomic_path, atomic_write_text, folder_lock,
                      has_content, load_progress, load_spec as load_folder_spec, refuse_symlink, write_json)
from flt_diag.settle import comparable



@dataclass
class SweepSpec(SweepGrid):
    """The grid of a sweep (its fields: flt_diag.grid_config.SweepGrid) and the config its cells share.

    `base` is the config of cell 0 (the first variant, loop count, seed and lr scale); every other
    cell differs from it only in those four fields. Construction validates every cell."""

    def __post_init__(self):
        check(self)  # every option field against its bounds and choices (flt_diag.config)
        self.variants, self.loops = list(self.variants), list(self.loops)
        self.seeds, self.lr_scales = list(self.seeds), list(self.lr_scales)
        cells = self.cells()
        self.base = cell_config(self.base, cells[0])
        for cell in cells:  # validates every cell before anything runs
            self.cell_config(cell)

    def cells(self) -> list[Cell]:
        grid = [(lr, s, k, v) for lr in self.lr_scales for s in self.seeds for k in self.loops for v in self.variants]
        return [Cell(i, v, k, s, lr) for i, (lr, s, k, v) in enumerate(grid)]

    def cell_config(self, cell: Cell) -> RunConfig:
        return cell_config(self.base, cell)

    def to_dict(self) -> dict:
        return dict(variants=self.variants, loops=self.loops, seeds=self.seeds, lr_scales=self.lr_scales,
                    base=comparable(self.base.to_dict()), cell_names=[c.name for c in self.cells()])




def cell_config(base: RunConfig, cell: Cell, **train_overrides) -> RunConfig:
    """The base config with the cell's variant, loops, seed and lr scale (and any extra train fields)."""
    model = dict(variant=cell.variant, loops=cell.loops, **({} if cell.depth is None else {"n_layer": cell.depth}))
    cfg = with_overrides(base, model=model,
                         train=dict(seed=cell.seed, lr_scale=cell.lr_scale, **train_overrides))
    validate(cfg)
    return cfg


def prepare_folder(spec: SweepSpec, out: Path) -> None:
    """Create the sweep folder, or check that an existing one holds the same spec."""
    prepare_spec_folder(Path(out), spec.to_dict(), "sweep", SWEEP_GRID_FIELDS)


def prepare_spec_folder(out: Path, new: dict, what: str, grid_fields: dict) -> None:
    """Create a sweep or map folder holding spec `new` (sweep.json), or check that an existing one
    holds the same spec (`what` names it in the messages; the bases are compared without the
    `grid_fields` that every cell sets)."""
    if (out / SWEEP_SPEC).exists():
        old = load_folder_spec(out)  # checked: a damaged spec is one line, never compared field by field

        def same(k):
            return without_grid_fields(old.get(k), grid_fields) == without_grid_fields(new[k], grid_fields) if k == "base" \
                else old.get(k) == new[k]
        if not all(same(k) for k in new):
            keys = [k for k in new if not same(k)]
            raise StorageError(f"{out} holds a {'map' if old.get('kind') == 'map' else 'sweep'} with a different "
                               f"spec (differs in: {', '.join(keys)}); use another --out, or the original options")
        return
    if has_content(out):
        raise StorageError(f"{out} exists, is not empty and is not a {what} folder; use another --out")
    refuse_symlink(out / CELLS)
    try:
        (out / CELLS).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create {what} folder {out}: {e.strerror}") from None
    if not os.access(out, os.W_OK):
        raise StorageError(f"cannot write to {out}")
    write_json(out / SWEEP_SPEC, new)


def cell_status(out: Path, cell: Cell) -> str:
    """"done", "partial" (started, not finished), "failed" (raised an error) or "pending"."""
    d = Path(out) / CELLS / cell.name
    if (d / "summary.json").exists():
        return "done"
    if (d / ERROR).exists():
        return "failed"
    return "partial" if d.exists() else "pending"


def run_cell(base: dict, cell: Cell, out: str, threads: int | None = None,
             device: str | None = None, progress=None) -> str:
    """Train one cell (in this process). Exceptions are written to the cell's error.txt."""
    import torch  # torch: 2.2 s of the CLI's 3 s start-up (-X importtime); the CLI imports this module for its options
    from flt_diag.training.trainer import train

    cfg = cell_config(RunConfig.from_dict(base), cell, **({"threads": threads} if threads else {}),
                      **({"device": device} if device else {}))
    run_dir = Path(out) / CELLS / cell.name
    if not run_dir.is_symlink():  # a linked cell is refused by train(); nothing is removed through it
        (run_dir / ERROR).unlink(missing_ok=True)
    try:
        if threads:
            torch.set_num_threads(threads)
        summary = train(cfg, run_dir, progress=progress)
        return summary.get("verdict", "?")
    except KeyboardInterrupt:
        raise
    except Exception as e:
        try:
            refuse_symlink(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / ERROR, traceback.format_exc())
        except (OSError, StorageError):  # a full disk, a linked cell: the cell is reported failed all the same
            pass
        return f"error: {type(e).__name__}: {e}"


def die_with_parent(parent_pid: int) -> None:
    """In a worker process: be killed when the parent dies (even by kill -9), so that no orphan
    keeps training a cell that a re-run of the sweep will train again (Linux; elsewhere a no-op).
    A parent that died before this ran is noticed by its pid, and the worker leaves at once."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except OSError:  # pragma: no cover - no glibc
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker_init(gpu_queue, parent_pid):
    die_with_parent(parent_pid)
    if gpu_queue is not None:
        os.environ["FLT_DIAG_DEVICE"] = f"cuda:{gpu_queue.get()}"


def _run_cell_in_worker(base, cell, out, threads):
    return run_cell(base, cell, out, threads, os.environ.get("FLT_DIAG_DEVICE"))


def run_sweep(spec: SweepSpec, out: Path, workers: int = 1, only_cell: int | None = None,
              show_progress: bool = True) -> pd.DataFrame:
    """Run the unfinished cells (all, or just `only_cell`) and write the summary table. The sweep
    folder is owned by this process meanwhile (a job array's `--cell` tasks share it: they only
    lock their own cell's run folder)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StorageError(f"{out} exists and is a file, not a sweep folder; use another --out")
    with (folder_lock(out, "sweep") if only_cell is None else contextlib.nullcontext()):
        return _run_sweep(spec, out, workers, only_cell, show_progress)


def only(items: list, index: int | None, what: str = "") -> list:
    """All items, or just item `index` (`--cell I` of a job array); a bad index is one ValueError."""
    if index is None:
        return items
    if not 0 <= index < len(items):
        raise ValueError(f"--cell must be in 0..{len(items) - 1}{what}, got {index}")
    return [items[index]]


def _run_sweep(spec, out, workers, only_cell, show_progress) -> pd.DataFrame:
    prepare_folder(spec, out)
    cells = only(spec.cells(), only_cell)
    todo = [c for c in cells if cell_status(out, c) != "done"]
    base = spec.base.to_dict()
    if workers <= 0:
        workers = auto_workers(base["train"]["device"])
    monitor = SweepMonitor(out, cells, spec.base.train.steps, show_progress)
    try:
        if workers <= 1 or len(todo) <= 1:
            for cell in todo:
                monitor.start(cell)
                result = run_cell(base, cell, str(out), progress=lambda info, c=cell: monitor.update(c, info))
                monitor.finish(cell, result)
                write_summary(out)
        else:
            _run_parallel(base, longest_first(todo), out, workers, monitor)
    finally:
        monitor.close()
    return write_summary(out)


def longest_first(cells: list[Cell]) -> list[Cell]:
    """Cells in the order parallel workers should take them: the most block applications per step
    (loops x depth) first, so that no long cell starts last and runs alone (ties keep the grid's order)."""
    return sorted(cells, key=lambda c: -c.loops * (c.depth or 1))


def auto_workers(device: str) -> int:
    """One worker per GPU (CUDA) or per CPU core (each worker then runs one thread)."""
    import torch  # (as in run_cell)
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def _run_parallel(base, todo, out, workers, monitor):
    import torch  # (as in run_cell)
    n_gpu = torch.cuda.device_count() if base["train"]["device"] in ("auto", "cuda") else 0
    ctx = mp.get_context("spawn")
    gpu_queue = None
    if n_gpu:
        workers = min(workers, n_gpu)
        gpu_queue = ctx.Queue()
        for i in range(workers):
            gpu_queue.put(i)
        threads = None
    else:
        threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(gpu_queue, os.getpid())) as pool:
        pending = {}
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < workers:
                cell = queue.pop(0)
                pending[pool.submit(_run_cell_in_worker, base, cell, str(out), threads)] = cell
                monitor.start(cell)
            done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in done:
                cell = pending.pop(fut)
                try:
                    result = fut.result()
                except Exception as e:  # a worker process died
                    result = f"error: {type(e).__name__}: {e}"
                monitor.finish(cell, result)
                write_summary(out)
            monitor.poll()


class SweepMonitor:
    """Progress bar: cells done, each running cell's step and loss, ETA (work weighted by loops).
    Where stdout is not a terminal (nohup, a batch job's log), where a bar cannot redraw, it prints a
    plain status line every `heartbeat` seconds instead. Once `estimate_after` seconds of training
    have been measured it prints, once, an estimate of the whole sweep's time (the rate of work since the
    first progress, weighted by loops x depth, extrapolated to all of it: a rough figure)."""

    heartbeat = 300.0
    estimate_after = 60.0

    def __init__(self, out: Path, cells: list[Cell], steps: int, enabled: bool):
        self.out, self.steps, self.enabled = out, steps, enabled
        self.weight = {c: c.loops * (c.depth or 1) * steps for c in cells}
        self.estimated, self.first = False, None  # first: (elapsed s, work) at the first progress reported
        self.done_work = sum(self.weight[c] for c in cells if cell_status(out, c) == "done")
        self.running: dict[Cell, int] = {}
        self.results: dict[Cell, str] = {}
        self.n_done = len(cells) - sum(cell_status(out, c) != "done" for c in cells)
        self.n_cells = len(cells)
        self.bar = None
        if enabled:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[cells]}"),
                                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False,
                                redirect_stdout=False, redirect_stderr=False)
            self.task = self.bar.add_task("sweep", total=sum(self.weight.values()), completed=self.done_work,
                                          cells=self._cells_text())
            self.bar.start()
        self.t0 = self.last_beat = time.monotonic()
        self.work0 = self.done_work

    def _cells_text(self) -> str:
        return f"{self.n_done}/{self.n_cells} cells"

    def start(self, cell: Cell) -> None:
        self.running[cell] = 0
        self._refresh()

    def update(self, cell: Cell, info: dict) -> None:
        self.running[cell] = info.get("step", 0)
        self._refresh(info)

    def poll(self) -> None:
        for cell in self.running:
            info = load_progress(self.out / CELLS / cell.name)
            if info:
                self.running[cell] = info.get("step", 0)
        self._refresh()

    def finish(self, cell: Cell, result: str) -> None:
        self.running.pop(cell, None)
        self.results[cell] = result
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
            total, elapsed = sum(self.weight.values()), now - self.t0
            rate = (work - self.work0) / elapsed if elapsed > 0 else 0.0
            left = f", about {(total - work) / rate / 60:.0f} min left" if rate > 0 else ""
            self.bar.console.print(f"  [{elapsed / 60:.0f} min] {self._cells_text()}, {work / total:.0%} of the work"
                                   f"{left}; running: {'; '.join(parts) or '-'}", soft_wrap=True)

    def _estimate(self, work: float, elapsed: float) -> None:
        """Once: the rate is measured from the first progress a cell reports (start-up, data loading and
        compilation are behind it) over `estimate_after` seconds; the time before that is added as it was.
        (Measured from the start instead, the default sweep's estimate said 78 min for a 49-min sweep.)"""
        if self.estimated or work <= self.work0:
            return
        if self.first is None:
            self.first = (elapsed, work)
            return
        t1, w1 = self.first
        if elapsed - t1 < self.estimate_after or work <= w1:
            return
        self.estimated = True
        total = sum(self.weight.values())
        rate = (work - w1) / (elapsed - t1)
        self.bar.console.print(f"  estimate from {elapsed - t1:.0f} s of training: the whole sweep takes about "
                               f"{_minutes(t1 + (total - w1) / rate)}, {_minutes((total - work) / rate)} from now",
                               soft_wrap=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def write_summary(out: Path) -> pd.DataFrame:
    df = sweep_summary(out)
    with atomic_path(out / SWEEP_SUMMARY) as tmp:
        df.to_csv(tmp, index=False)
    with atomic_path(out / "summary.parquet") as tmp:
        df.to_parquet(tmp, index=False)
    return df


def load_spec(out: Path) -> dict:
    return load_folder_spec(out)
