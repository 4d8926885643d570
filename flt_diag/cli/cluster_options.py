"""The options that hand a map's (a sweep's) workers to a cluster (`--submit`, docs/DESIGN.md §5, "Many machines"): where
the workers run, the SLURM job's partition and time, how many of its array tasks run at once, and the leases
the workers hold their probes under (flt_diag.grids.leases)."""
from __future__ import annotations

from typing import Literal, Optional

from flt_diag.config.option_fields import Options, opt


class ClusterOptions(Options):
    submit: Optional[Literal["local", "slurm"]] = opt(
        None, "Hand the workers to a scheduler through submitit: `slurm` (a job array of --workers tasks, 0 = one "
        "per map line or per sweep cell still to train; each task claims probes or cells under a lease; requeued on "
        "preemption) or `local` (the same workers as local processes).")
    partition: Optional[str] = opt(None, "SLURM partition of the job array (--submit slurm).")
    time: int = opt(240, "Minutes each array task may run (--submit); a requeued task goes on where it stopped.",
                    ge=1)
    array_parallelism: int = opt(0, "Array tasks running at once (--submit slurm); 0 = all.", ge=0)
    lease_timeout: float = opt(300.0, "Seconds without a heartbeat after which a probe's lease is expired and "
                               "another worker takes the probe over (--submit).", gt=0)
    heartbeat: float = opt(30.0, "Seconds between a lease holder's heartbeats (--submit).", gt=0)
    max_retries: int = opt(3, "Takeovers of an expired lease before the probe is marked failed (--submit).", ge=0)
