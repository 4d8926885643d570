"""A lease worker as a child process, for tests/test_leases.py: `python lease_runs.py KIND OUT LOG PAUSE`.
KIND `probe`: the map of tests/test_campaigns.py's kill test with the fake probe of tests/campaign_runs.py (each
finished probe appended to LOG); KIND `train`: a one-probe map of real tiny training (each training start appended
to LOG with the step it starts from; PAUSE is STEPS:CHECKPOINT_EVERY). The lease times are short (heartbeat 0.2 s, expiry 3 s)."""
from __future__ import annotations

import sys
from pathlib import Path

import contextlib
from unittest import mock

import campaign_runs
from campaign_runs import Probe
from conftest import tiny_config
from flt_diag.grids.lease_worker import work
from flt_diag.grids.leases import LeaseTimes
from flt_diag.grids.stability_map import MapSpec
from flt_diag.grids.sweep import run_cell
from flt_diag.storage.folders import CELLS
from flt_diag.training import preemption

TIMES = LeaseTimes(heartbeat_s=0.2, timeout_s=3.0, max_retries=2)


def _no_lock(folder: Path, **named):
    folder.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext()


class Unlocked(Probe):
    """The fake probe without its run folder's lock, as two hosts see it where their flocks do not reach each
    other (a shared file system): only the leases keep two workers off one probe."""
    def __call__(self, cfg, cell, out, *rest, **named) -> str:
        with mock.patch.object(campaign_runs, "folder_lock", _no_lock):
            return super().__call__(cfg, cell, out)


def train_spec(steps: int = 400, checkpoint_every: int = 0) -> MapSpec:
    return MapSpec(tiny_config(steps=steps, checkpoint_every=checkpoint_every, width=16, heads=2),
                   ["lt"], [2], [0], "lr", [1.0], ["training"])


class Counted:
    """run_cell, each start logged with the step it resumes from (0: from scratch)."""
    def __init__(self, log: Path):
        self.log = log

    def __call__(self, cfg, cell, out) -> str:
        from flt_diag.training.checkpoint import load, resume_file
        path = resume_file(Path(out) / CELLS / cell.name)
        start = 0 if path is None else int(load(path)["step"])
        with open(self.log, "a") as f:
            f.write(f"{cell.name} {start}\n")
        return run_cell(cfg, cell, out, threads=1)


def main(kind: str, out: str, log: str, pause: str) -> int:
    from test_campaigns import kill_spec
    if kind == "probe":
        spec, runner = kill_spec(), Unlocked(Path(log), float(pause))
    else:
        steps, every = pause.split(":")
        spec, runner = train_spec(int(steps), int(every)), Counted(Path(log))
    try:
        work(spec, Path(out), runner=runner, times=TIMES, report=lambda s: None, poll_s=0.1)
    except preemption.Preempted:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
