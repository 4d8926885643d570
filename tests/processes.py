"""The tests' child processes, each in a process group of its own and killed with its whole group
(SIGKILL) when the test ends, passed, failed or interrupted: no test leaves a process behind, not
even a sweep's worker whose parent was killed. `start` is for the `spawn` fixture (tests/conftest.py),
which kills what it started at teardown; `run` is subprocess.run with the same guarantee."""
from __future__ import annotations

import os
import signal
import subprocess


def start(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(args, start_new_session=True, **kwargs)


def kill_group(p: subprocess.Popen) -> None:
    """Kill every process left in `p`'s group (its own pid is the group id), reap `p`, close its pipes."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone: every member has exited
        pass
    try:
        p.wait(timeout=30)
    finally:
        for pipe in (p.stdin, p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()


def run(args, timeout: float, check: bool = False, capture_output: bool = False, **kwargs):
    """subprocess.run(args, timeout=...), the child's group killed at the end (on a timeout too)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p = start(args, **kwargs)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        kill_group(p)
    done = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check:
        done.check_returncode()
    return done
