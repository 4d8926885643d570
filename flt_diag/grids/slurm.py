"""`--submit slurm|local`: a map's (a sweep's) lease workers (flt_diag.grids.lease_worker) handed to SLURM through
submitit (a job array; requeued on preemption and on its time limit), or to submitit's LocalExecutor (local
processes: how the tests run it). No scheduler of our own: the folder's leases are the only coordination. docs/DESIGN.md
section 5, "Many machines". submitit is the optional extra `cluster` (pip install 'flt-diag[cluster]').
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Callable

import pandas as pd

from flt_diag.grids.campaign import CampaignOptions, archiving
from flt_diag.grids.lease_worker import next_cells, release_held, work
from flt_diag.grids.leases import LeaseTimes
from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
from flt_diag.grids.sweep import SweepSpec, prepare_folder, run_cell, write_summary
from flt_diag.judge.map_boundaries import MAP_CSV, boundaries
from flt_diag.storage.code_snapshot import ENV, IMPORTED, imported_from
from flt_diag.storage.errors import StorageError
from flt_diag.storage.folders import atomic_path, refuse_not_a_folder
from flt_diag.training import preemption

JOBS = "jobs"  # submitit's folder (pickled tasks, logs) inside the map folder


def _checkpointable():
    try:
        import submitit
    except ImportError:
        raise StorageError("--submit needs submitit: pip install 'flt-diag[cluster]'") from None
    return submitit


class MapWorker:
    """One array task: a lease worker on the map (sweep) folder (picklable). submitit calls `checkpoint` on its time
    limit or a preemption signal and requeues the same task; SIGTERM (installed by `work`) first checkpoints the
    running probe and releases its lease, and the requeued task (or any other worker) resumes it."""

    def __init__(self, spec: MapSpec | SweepSpec, out: Path, runner: Callable, times: LeaseTimes, probe_ends: bool,
                 run_to_end: bool):
        self.spec, self.out, self.runner, self.times = spec, Path(out), runner, times
        self.probe_ends, self.run_to_end = probe_ends, run_to_end
        self.snapshot = os.environ.get(ENV)  # the campaign's code snapshot, where it runs from one

    def __call__(self, task: int) -> int:
        if self.snapshot and not imported_from(Path(self.snapshot)):  # (a task that imported other code: refused)
            raise StorageError(f"task {task} imported flt_diag from {IMPORTED}, not from "
                               f"the campaign's code snapshot {self.snapshot}")
        try:
            return work(self.spec, self.out, self.runner, self.times, lambda text: print(text, flush=True),
                        self.probe_ends, self.run_to_end)
        except preemption.Preempted as e:
            print(f"task {task}: {e}", flush=True)
            return -1

    def checkpoint(self, task: int):
        """At the time limit: release the running probe's lease (resumed from its last resume.pt) and requeue."""
        submitit = _checkpointable()
        release_held("requeued at the time limit")
        return submitit.helpers.DelayedSubmission(self, task)


def executor(how: str, folder: Path, cluster, name: str = "flt-diag-map"):
    """submitit's executor: `local` or `slurm`, with the job's time, partition and array parallelism."""
    submitit = _checkpointable()
    ex = submitit.AutoExecutor(folder=str(folder), cluster="local" if how == "local" else "slurm")
    params: dict = dict(timeout_min=cluster.time, name=name)
    if how == "slurm":
        params.update(slurm_partition=cluster.partition, slurm_additional_parameters={"requeue": True},
                      **({"slurm_array_parallelism": cluster.array_parallelism} if cluster.array_parallelism else {}))
        params = {k: v for k, v in params.items() if v is not None}
        if os.environ.get(ENV):  # (a campaign run from its code snapshot: the tasks import it too)
            params["slurm_setup"] = [f"export {name}={shlex.quote(os.environ[name])}"
                                     for name in (ENV, "PYTHONPATH", "PYTHONSAFEPATH") if name in os.environ]
    ex.update_parameters(**params)
    return ex


def submit_map(spec: MapSpec, out: Path, how: str, cluster, tasks: int, probe_ends: bool = False,
               run_to_end: bool = False, options: CampaignOptions = CampaignOptions(),
               report: Callable[[str], None] = print, runner: Callable = run_cell) -> pd.DataFrame:
    """Prepare the map folder (its code pin, its archive), run `tasks` lease workers as a job array (0: one per
    line), each training probes with `runner` (run_cell), wait for them, then write map.csv and the sweep summary as `run_map` does."""
    out = Path(out)
    refuse_not_a_folder(out, "a map folder", "use another --out")
    submittable(cluster)
    prepare_map_folder(spec, out, options)
    _run_workers(MapWorker(spec, out, archiving(runner, options), _times(cluster), probe_ends, run_to_end),
                 executor(how, out / JOBS, cluster), tasks or len(spec.lines()), how, out, report)
    write_summary(out)
    table = boundaries(out)
    with atomic_path(out / MAP_CSV) as tmp:
        table.to_csv(tmp, index=False)
    return table


def submit_sweep(spec: SweepSpec, out: Path, how: str, cluster, tasks: int,
                 options: CampaignOptions = CampaignOptions(), report: Callable[[str], None] = print,
                 runner: Callable = run_cell) -> pd.DataFrame:
    """A sweep's cells to `tasks` lease workers (0: one per cell still to train), each claiming cells under a lease
    and training them with `runner` (run_cell); the folder prepared as `run_sweep` does (its code pin, its archive),
    the summary written once they end."""
    out = Path(out)
    refuse_not_a_folder(out, "a sweep folder", "use another --out")
    submittable(cluster)
    prepare_folder(spec, out, options)
    n = tasks or max(1, len(next_cells(spec, out)))
    _run_workers(MapWorker(spec, out, archiving(runner, options), _times(cluster), False, False),
                 executor(how, out / JOBS, cluster, "flt-diag-sweep"), n, how, out, report)
    return write_summary(out)


def submittable(cluster) -> None:
    """submitit there and the lease times coherent: one line each, before anything is written."""
    _checkpointable()
    if cluster.heartbeat >= cluster.lease_timeout:
        raise StorageError(f"--heartbeat ({cluster.heartbeat:g} s) must be shorter than --lease-timeout "
                           f"({cluster.lease_timeout:g} s), or every lease expires while its holder is alive")


def _times(cluster) -> LeaseTimes:
    return LeaseTimes(heartbeat_s=cluster.heartbeat, timeout_s=cluster.lease_timeout, max_retries=cluster.max_retries)


def _run_workers(worker: MapWorker, ex, n: int, how: str, out: Path, report: Callable[[str], None]) -> None:
    """Submit `n` copies of the worker as a job array and wait for them (a task that died: said, its probes left to
    the leases)."""
    jobs = ex.map_array(worker, list(range(n)))
    report(f"submitted {n} {how} workers: job {jobs[0].job_id.split('_')[0]} (logs: {out / JOBS})")
    for job in jobs:
        try:
            job.result()
        except Exception as e:  # (a task that died: its probes are left to the leases; the map says unfinished)
            report(f"task {job.job_id} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}")
