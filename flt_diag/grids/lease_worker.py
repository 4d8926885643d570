"""A lease worker: trains a map's probes (a sweep's cells) one at a time, claimed under a lease
(flt_diag.grids.leases), until every line is searched (every cell finished). Many of them (processes, machines, a
SLURM job array) share one map or sweep folder.

A sweep's cells are independent: a worker claims the first cell not finished, not marked failed and not held. A
line's bisection is sequential (its next probe depends on the last outcome), so a worker claims the *next
probe* of a line: it replays every line's search from the finished probes (`search_line` with a runner that
stops at the first probe it would run), and takes the first such probe whose lease is free or expired. Where
all are held it waits and looks again; where no line has a next probe, it ends. SIGTERM checkpoints the
running probe (resume.pt) and releases its lease, so whoever takes it next resumes it. docs/DESIGN.md section 5.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

from flt_diag.grids.leases import Held, LeaseTimes, claim, failed_reason, heartbeat, mark_failed, release
from flt_diag.grids.stability_map import MapSpec, search_line
from flt_diag.grids.progress import cell_status
from flt_diag.grids.sweep import BUSY_RESULT, SweepSpec, run_cell
from flt_diag.storage.folders import CELLS, load_summary
from flt_diag.training import preemption

POLL_S = 1.0  # how long a worker waits when every next probe is held by another
holding: list[Held] = []  # the lease this worker holds now (for submitit's checkpoint: release_held)


class _NextProbe(Exception):
    def __init__(self, cfg, cell):
        super().__init__(cell.name)
        self.cfg, self.cell = cfg, cell


def next_probes(spec: MapSpec, out: Path, probe_ends: bool = False, run_to_end: bool = False) -> Iterator:
    """Each line's next probe as (probe config, cell), replayed from the finished probes; a line whose next
    probe was marked failed has none (its search stops there, as at any failed probe)."""
    for line in spec.lines():
        def stop_at(cfg, cell, out_str):
            if failed_reason(out, cell.name) is not None:
                return "failed"
            raise _NextProbe(cfg, cell)
        try:
            search_line(spec, out, line, stop_at, report=lambda text: None, probe_ends=probe_ends,
                        run_to_end=run_to_end)
        except _NextProbe as nxt:
            yield nxt.cfg, nxt.cell


def next_cells(spec: SweepSpec, out: Path) -> list:
    """A sweep's cells still to train as (cell config, cell), in the grid's order: not finished, not marked failed
    (a cell that failed under the leases is not trained again by this submission, as a map's probe)."""
    return [(spec.cell_config(c), c) for c in spec.cells()
            if cell_status(out, c) != "done" and failed_reason(out, c.name) is None]


def _try_one(spec: MapSpec | SweepSpec, out: Path, runner: Callable, times: LeaseTimes, report, probe_ends: bool,
             run_to_end: bool) -> bool | None:
    """Claim and train one probe (cell): True where one was trained, False where every next probe is held, None
    where the map (sweep) has none left."""
    pending = next_cells(spec, out) if isinstance(spec, SweepSpec) else \
        list(next_probes(spec, out, probe_ends, run_to_end))
    if not pending:
        return None
    for cfg, cell in pending:
        held = claim(out, cell.name, times)
        if held is None:
            continue
        if load_summary(out / CELLS / cell.name) is not None:  # finished between the replay and the claim
            release(held, "finished")
            continue
        holding[:] = [held]
        try:
            with heartbeat(held, times.heartbeat_s):
                result = runner(cfg, cell, str(out))
        except preemption.Preempted as e:
            release(held, f"preempted: {e}")
            raise
        finally:
            holding.clear()
        if str(result).startswith(BUSY_RESULT):  # its run folder is locked by a live process: look elsewhere
            release(held, "busy")
            continue
        if load_summary(out / CELLS / cell.name) is None:  # it failed (error.txt): never trained again
            mark_failed(out, cell.name, str(result).splitlines()[0] if str(result) else "failed")
        release(held, "finished")
        report(f"{cell.name}: {result}" + (f" (retry {held.lease.retries})" if held.lease.retries else ""))
        return True
    return False


def work(spec: MapSpec | SweepSpec, out: Path, runner: Callable = run_cell, times: LeaseTimes = LeaseTimes(),
         report: Callable[[str], None] = print, probe_ends: bool = False, run_to_end: bool = False,
         poll_s: float = POLL_S) -> int:
    """Train claimed probes until no line has a next probe (a sweep: no cell is left); returns how many this worker
    trained. SIGTERM
    (installed here) ends it after a checkpoint of the running probe, by `preemption.Preempted`."""
    out, trained = Path(out), 0
    preemption.install()
    while not preemption.requested():
        done = _try_one(spec, out, runner, times, report, probe_ends, run_to_end)
        if done is None:
            return trained
        if done:
            trained += 1
        else:
            time.sleep(poll_s)
    raise preemption.Preempted("preempted between probes")


def release_held(reason: str) -> None:
    """Release the lease this worker holds (if any): it is about to exit without finishing its probe (submitit
    requeues it at its time limit), so that the probe is taken over at once, from its last resume.pt."""
    for held in list(holding):
        release(held, reason)
