"""Ablation sweeps: every variant x loop count x seed x lr scale, one run folder per cell.

A sweep folder:
    sweep.json             the spec (base config + the grid) and the ordered cell names
    cells/<name>/          one run folder per cell (see flt_diag.storage.folders)
    summary.csv/.parquet   one row per finished cell (rewritten after every cell)

Re-running the same command skips finished cells (they have summary.json) and resumes or
restarts unfinished ones. Every file is written to a temporary name and renamed, so an
interrupted sweep never leaves a half-written file. A different spec on an existing folder is
refused. `--cell I` runs one cell, so a job array can spread a sweep over machines.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from pathlib import Path
from typing import cast

import pandas as pd
from pydantic import model_validator

from flt_diag.grids.campaign import CampaignOptions, archiving, prepare_spec_folder
from flt_diag.grids.progress import SweepMonitor, cell_status
from flt_diag.grids.worker_pool import auto_workers, run_parallel
from flt_diag.judge.summary_table import write_summary
from flt_diag.storage.cells import RunId
from flt_diag.storage.code_snapshot import check_snapshot
from flt_diag.storage.file_models import Summary
from flt_diag.storage.folders import (BUSY, CELLS, ERROR, StorageError, atomic_write_text, folder_lock, make_folder,
                                      refuse_links, refuse_not_a_folder)
from flt_diag.storage.schema import MAX_ITEMS
from flt_diag.training.settle import comparable
from flt_diag.config.run_config import RunConfig, with_overrides
from flt_diag.config.grid_options import SWEEP_GRID_FIELDS, SweepGrid


class SweepSpec(SweepGrid):
    """The grid of a sweep (its fields: flt_diag.config.grid_options.SweepGrid) and the config its cells share.

    `base` is the config of cell 0 (the first variant, loop count, seed and lr scale); every other
    cell differs from it only in those four fields. Construction validates every field (pydantic)
    and every cell."""

    def __init__(self, base: RunConfig, *grid, **named):
        super().__init__(base=base, **dict(zip(("variants", "loops", "seeds", "lr_scale"), grid)), **named)

    @model_validator(mode="after")
    def _every_cell(self):
        n = len(self.variants) * len(self.loops) * len(self.seeds) * len(self.lr_scale)
        if n > MAX_ITEMS:  # what the loader of sweep.json reads: a larger grid could never be resumed or read
            raise ValueError(f"the grid has {n:,} cells; a sweep holds at most {MAX_ITEMS:,} (split it into sweeps)")
        cells = self.cells()
        if twice := [name for name, n in Counter(c.name for c in cells).items() if n > 1]:
            raise ValueError(f"two cells of the grid would share the folder {twice[0]} (values that are equal as "
                             "numbers)")
        self.base = cell_config(self.base, cells[0])
        for cell in cells:  # validates every cell before anything runs
            self.cell_config(cell)
        return self

    def cells(self) -> list[RunId]:
        grid = [(lr, s, k, v) for lr in self.lr_scale for s in self.seeds for k in self.loops for v in self.variants]
        return [RunId(v, k, s, lr, index=i) for i, (lr, s, k, v) in enumerate(grid)]

    def cell_config(self, cell: RunId) -> RunConfig:
        return cell_config(self.base, cell)

    def to_dict(self) -> dict:
        return dict(variants=self.variants, loops=self.loops, seeds=self.seeds, lr_scale=self.lr_scale,
                    base=comparable(self.base.to_dict()), cell_names=[c.name for c in self.cells()])


def cell_config(base: RunConfig, cell: RunId, **train_overrides) -> RunConfig:
    """The base config with the cell's variant, loops, seed and lr scale (and any extra train fields)."""
    model = dict(variant=cell.variant, loops=cell.loops, **({} if cell.depth is None else {"depth": cell.depth}))
    return with_overrides(base, model=model, train=dict(seed=cell.seed, lr_scale=cell.lr_scale, **train_overrides))


def prepare_folder(spec: SweepSpec, out: Path, options: CampaignOptions = CampaignOptions()) -> None:
    """Create the sweep folder, or check that an existing one holds the same spec and code."""
    prepare_spec_folder(Path(out), spec.to_dict(), "sweep", SWEEP_GRID_FIELDS, spec.base.train.device, options)


BUSY_RESULT = "busy"  # run_cell's result for a cell another process is training (a second copy of a --cell task)


def run_cell(cfg: RunConfig, cell: RunId, out: str, threads: int | None = None,
             device: str | None = None, progress=None) -> str:
    """Train one cell, of config `cfg` (the cell's own: its spec's cell_config, validated when the spec was made),
    in this process; `threads` and `device` as the worker pool shares them out. Exceptions are written to the
    cell's error.txt."""
    import torch  # most of the CLI's start-up (benchmarks/README.md); the CLI imports this module for its options
    from flt_diag.training.trainer import train

    if threads or device:
        cfg = with_overrides(cfg, train={**({"threads": threads} if threads else {}),
                                         **({"device": device} if device else {})})
    run_dir = Path(out) / CELLS / cell.name
    try:
        check_snapshot()  # a campaign run from its code snapshot: this process must import flt_diag from there
        if threads:
            torch.set_num_threads(threads)
        summary = cast(Summary, train(cfg, run_dir, progress=progress, root=out))  # (one process: rank 0's summary;
        # refuses a link below `out`)
    except Exception as e:  # (a KeyboardInterrupt is not one: it stops the sweep)
        if isinstance(e, StorageError) and BUSY in str(e):  # another process (a second copy of this --cell task)
            return f"{BUSY_RESULT}: {e}"  # is training it: not a failure
        return _failed(run_dir, out, e)
    with contextlib.suppress(OSError, StorageError):  # an error.txt of an earlier failed attempt is stale now
        refuse_links(run_dir / ERROR, out)
        (run_dir / ERROR).unlink(missing_ok=True)
    return summary.verdict


def _failed(run_dir: Path, out, e: Exception) -> str:
    """Write the traceback into the cell's error.txt (never through a link below the sweep folder)."""
    try:
        make_folder(run_dir, out)
        refuse_links(run_dir / ERROR, out)
        atomic_write_text(run_dir / ERROR, traceback.format_exc())
    except (OSError, StorageError):  # a full disk, a linked cell: the cell is reported failed all the same
        pass
    return f"error: {type(e).__name__}: {e}"


def run_sweep(spec: SweepSpec, out: Path, workers: int = 1, only_cell: int | None = None,
              show_progress: bool = True, options: CampaignOptions = CampaignOptions()) -> pd.DataFrame:
    """Run the unfinished cells (all, or just `only_cell`) and write the summary table. The sweep
    folder is owned by this process meanwhile (a job array's `--cell` tasks share it: they only
    lock their own cell's run folder). `options`: the campaign's (resume under other code, archive as it goes)."""
    out = Path(out)
    refuse_not_a_folder(out, "a sweep folder", "use another --out")
    # (`out` is the user's own choice and may be a link; a link below it is refused)
    with (folder_lock(out, "sweep", root=out) if only_cell is None else contextlib.nullcontext()):
        prepare_folder(spec, out, options)
        cells = only(spec.cells(), only_cell)
        for cell in cells:  # a cell that is a link is refused before anything trains (one line)
            refuse_links(out / CELLS / cell.name, out)
        todo = [c for c in cells if cell_status(out, c) != "done"]
        device, runner = spec.base.train.device, archiving(run_cell, options)
        if workers <= 0:
            workers = auto_workers(device)
        monitor = SweepMonitor(out, cells, spec.base.train.steps, show_progress)
        try:
            if workers <= 1 or len(todo) <= 1:
                for cell in todo:
                    monitor.start(cell)
                    result = runner(spec.cell_config(cell), cell, str(out),
                                    progress=lambda info, c=cell: monitor.update(c, info))
                    monitor.finish(cell, result)
                    if only_cell is not None and result.startswith(BUSY_RESULT):
                        raise StorageError(f"cell {cell.index} ({cell.name}) is busy: "
                                           f"{result.removeprefix(BUSY_RESULT + ': ')}")
                    write_summary(out)
            else:
                run_parallel([(c, spec.cell_config(c)) for c in longest_first(todo)], device, out, workers, monitor,
                             runner, lambda: write_summary(out))
        finally:
            monitor.close()
        return write_summary(out)


def only(items: list, index: int | None, what: str = "") -> list:
    """All items, or just item `index` (`--cell I` of a job array); a bad index is one ValueError."""
    if index is None:
        return items
    if not 0 <= index < len(items):
        raise ValueError(f"--cell must be in 0..{len(items) - 1}{what}, got {index}")
    return [items[index]]


def longest_first(cells: list[RunId]) -> list[RunId]:
    """Cells in the order parallel workers should take them: the most block applications per step
    (loops x depth) first, so that no long cell starts last and runs alone (ties keep the grid's order)."""
    return sorted(cells, key=lambda c: -c.loops * (c.depth or 1))


