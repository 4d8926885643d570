"""What a run of a sweep or map is doing now, read from its folder alone (`flt-diag status`, the map's busy-probe
line): finished, failed (with the last line of its error.txt), running (the step it reached of its steps, from its
progress.json; the holder of its lock: pid, host, since; and how long since the run last wrote anything), or open (not started, or stopped: a lock nobody holds). And the
code that made it (its config's env.code). Torch-free.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from flt_diag.storage.folders import (CONFIG, ERROR, LOCK, METRICS, PROGRESS, StorageError, load_config, load_progress,
                                      load_summary, metrics_missing)
from flt_diag.storage import archive
from flt_diag.storage.locks import describe_holder, parse_holder
from flt_diag.storage.safe_files import open_regular, read_bounded

STALE_S = 600.0  # a lock of another host whose run wrote nothing for this long is taken for a dead holder's
MAX_ERROR_TAIL = 64 << 10  # what is read of an error.txt: its end


@dataclass(frozen=True)
class Activity:
    state: str  # "finished", "failed", "running", "open" or "damaged" (a summary without a readable run beside it)
    holder: dict | None = None  # the lock's: pid, host, since (running, or a stale lock of an open run)
    seen_s: float | None = None  # seconds since the run last wrote a file (running or stopped)
    reason: str | None = None  # failed: the last line of its error.txt
    commit: str | None = None  # the code that made it: 12 hex digits, "+" where the tree had changes
    progress: tuple[int, int] | None = None  # running: (steps done, steps) as its progress.json last said
    wall_s: float | None = None  # finished: its summary's wall time (None: not timed)

    def detail(self) -> str:
        """The words after the state: the step a running run reached, whose lock and since when, why it failed."""
        if self.state in ("failed", "damaged"):
            return self.reason or ""
        if self.holder is None:
            return ""
        seen = f", last seen {self.seen_s:.0f} s ago" if self.seen_s is not None else ""
        reached = f"step {self.progress[0]} of {self.progress[1]}, " if self.progress is not None else ""
        return reached + describe_holder(self.holder) + seen + ("" if self.state == "running" else
                                                                 " (a stopped run's lock)")


def _holder_alive(lock: Path, holder: dict, seen_s: float | None) -> bool:
    """Whether the lock's holder still runs: on this host, whether its pid holds an flock on this very file
    (/proc/locks; elsewhere whether the pid lives); on another, whether the run wrote within STALE_S."""
    if holder.get("host") not in (None, socket.gethostname()):
        return seen_s is not None and seen_s < STALE_S
    try:
        st = os.stat(lock)
        with open("/proc/locks") as f:
            table = f.read(1 << 22)
    except OSError:
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return False
        except OSError:  # (another user's process: alive)
            return True
        return True
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():  # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF" ("1: -> FLOCK ..": a waiter)
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == device:
            return True
    return False


def _seen_s(run_dir: Path) -> float | None:
    times = []
    for p in (run_dir / LOCK, run_dir / PROGRESS, run_dir / METRICS, run_dir / CONFIG):
        try:
            times.append(os.stat(p).st_mtime)
        except OSError:
            pass
    return max(0.0, time.time() - max(times)) if times else None


def _reason(error: Path) -> str:
    try:
        with open_regular(error) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - MAX_ERROR_TAIL))
            lines = [line.strip() for line in f.read(MAX_ERROR_TAIL).decode(errors="replace").splitlines()]
    except (OSError, StorageError) as e:
        return f"{error}: {e}"
    return next((line for line in reversed(lines) if line), "an empty error.txt")[:200]


def progress_of(run: Path) -> tuple[int, int] | None:
    """(steps done, steps) from the run's progress.json; None where there is none or it is not two counts
    0 <= done <= steps (a half-written or crafted file says nothing)."""
    info = load_progress(run)
    done, steps = (info.get("step"), info.get("steps")) if isinstance(info, dict) else (None, None)
    if type(done) is not int or type(steps) is not int or not 0 <= done <= steps:
        return None
    return done, steps


def commit_of(run: Path) -> str | None:
    """The commit of the code that made the run (12 hex digits, "+" where it ran with uncommitted changes)."""
    try:
        code = (load_config(run).env or {}).get("code")
    except (OSError, StorageError):
        return None
    if not isinstance(code, dict) or not code.get("commit"):
        return None
    return str(code["commit"])[:12] + ("+" if code.get("clean") is False else "")


def damaged(run: Path) -> str | None:
    """Why a run folder whose summary.json reads is no finished run after all (its config.json unreadable, its
    metrics/ not a folder of parts), in one line; None where it is whole as far as this cheap look goes (a record's
    summary and config are one file, read already)."""
    if archive.is_record(run):
        return None
    try:
        load_config(run)
    except (OSError, StorageError) as e:
        return f"damaged: {' '.join(str(e).split())[:160]}"
    return None if (why := metrics_missing(run)) is None else f"damaged: {why}"


def activity(run: Path) -> Activity:
    """Where run folder (or record) `run` stands now."""
    run = Path(run)
    if run.suffix == archive.SUFFIX and os.path.lexists(run) and not archive.is_record(run):
        return Activity("damaged", reason=f"damaged: {archive.why_not(run) or 'named like a record, not a file'}")
    if run.is_symlink() or (run.exists() and not run.is_dir() and not archive.is_record(run)):
        return Activity("damaged", reason=f"damaged: {'a symbolic link' if run.is_symlink() else 'a file'} where a "
                                          "run's folder goes")
    summary = load_summary(run)
    if summary is not None:  # (a run folder with its summary.json, or an archive's record)
        if (why := damaged(run)) is not None:
            return Activity("damaged", reason=why)
        return Activity("finished", commit=commit_of(run), wall_s=summary.wall_time)
    commit = commit_of(run) if (run / CONFIG).exists() else None
    if (run / ERROR).exists():
        return Activity("failed", reason=_reason(run / ERROR), commit=commit)
    try:
        holder = parse_holder(read_bounded(run / LOCK, 512, "a lock").decode(errors="replace"))
    except (OSError, StorageError):
        holder = None
    seen = _seen_s(run) if run.exists() else None
    if holder is not None and _holder_alive(run / LOCK, holder, seen):
        return Activity("running", holder, seen, commit=commit, progress=progress_of(run))
    return Activity("open", holder, seen, commit=commit)
