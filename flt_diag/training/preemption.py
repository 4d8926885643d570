"""Preemption: a scheduler's SIGTERM asks the running probe to stop at the end of its step with a resume.pt, so
that a requeued job resumes it instead of starting from step 0. Only a lease worker (flt_diag.grids.lease_worker)
installs the handler; the `Checkpoints` callback then writes resume.pt and raises `Preempted`."""
from __future__ import annotations

import signal
import threading

_requested = threading.Event()


class Preempted(BaseException):
    """Raised after the preempted step's resume.pt is written (a BaseException: not a failure of the run, so
    no error.txt is written for it)."""


def request(signum=None, frame=None) -> None:
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def install() -> None:
    """SIGTERM now requests a stop at the end of the step (main thread only)."""
    _requested.clear()
    signal.signal(signal.SIGTERM, request)
