"""Leases on a map's probes: which worker trains which probe, on many machines sharing one map folder.

A probe's lease is a file `leases/<probe>.<generation>.json` in the map folder holding its holder (host, pid),
when it started, a heartbeat the holder refreshes from a thread while the probe trains, its retry count and
whether it was released. A lease is taken by creating the next generation's file with os.link (atomic, and
refused where it exists: of two racing workers exactly one gets it); the current lease is the highest
generation. A lease whose heartbeat is older than `timeout_s` is expired: the next claim takes the probe over
with retries + 1; past `max_retries` the probe is marked failed (`leases/<probe>.failed`, one line, and the run
folder's error.txt). A released lease (a probe finished, or a worker preempted by SIGTERM) is taken over at once
with the same retry count. docs/DESIGN.md section 5, "Many machines".
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveFloat

from flt_diag.storage.errors import StorageError
from flt_diag.storage.folders import CELLS, ERROR, atomic_write_text
from flt_diag.storage.safe_files import read_bounded

LEASES = "leases"
FAILED = ".failed"


class LeaseTimes(BaseModel):
    """How often a holder proves it is alive, after how long silence its probe is taken over, how often."""
    model_config = ConfigDict(frozen=True)
    heartbeat_s: PositiveFloat = 30.0
    timeout_s: PositiveFloat = 300.0
    max_retries: NonNegativeInt = 3


class Lease(BaseModel):
    """One lease file's content."""
    host: str
    pid: int
    start: float
    heartbeat: float
    retries: NonNegativeInt = 0
    released: bool = False
    reason: str = ""  # (why it was released: finished, preempted)
    timeout_s: float = 300.0  # (the holder's expiry, as `flt-diag status` reads it)


@dataclass
class Held:
    """A lease this process holds: its probe, generation and file."""
    folder: Path
    probe: str
    generation: int
    lease: Lease

    @property
    def path(self) -> Path:
        return lease_path(self.folder, self.probe, self.generation)


def lease_path(folder: Path, probe: str, generation: int) -> Path:
    return Path(folder) / LEASES / f"{probe}.{generation}.json"


def generations(folder: Path, probe: str) -> list[int]:
    """The generations of a probe's lease files, in order."""
    found = []
    for p in (Path(folder) / LEASES).glob(f"{probe}.*.json"):
        tail = p.name[len(probe) + 1:-len(".json")]
        if tail.isdigit():
            found.append(int(tail))
    return sorted(found)


def read_lease(path: Path) -> Lease | None:
    try:
        return Lease.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def current(folder: Path, probe: str) -> tuple[int, Lease] | None:
    """The probe's current lease (highest generation) and its generation, None where it never had one. An
    unreadable lease file reads as held since its modification time (it cannot be half-written: see _publish)."""
    gens = generations(folder, probe)
    if not gens:
        return None
    path = lease_path(folder, probe, gens[-1])
    lease = read_lease(path)
    if lease is None:
        mtime = path.stat().st_mtime if path.exists() else time.time()
        lease = Lease(host="?", pid=0, start=mtime, heartbeat=mtime)
    return gens[-1], lease


def expired(lease: Lease, times: LeaseTimes, now: float | None = None) -> bool:
    return not lease.released and (time.time() if now is None else now) - lease.heartbeat > times.timeout_s


def failed_reason(folder: Path, probe: str) -> str | None:
    """The one line a probe was marked failed with, None where it was not; a mark that is not a small regular file
    (a folder, a FIFO, a link, huge) still marks it failed, saying so (never a blocked read)."""
    mark = Path(folder) / LEASES / (probe + FAILED)
    if not (mark.exists() or mark.is_symlink()):
        return None
    try:
        text = read_bounded(mark, 4096, "a probe's failed mark").decode(errors="replace")
    except (OSError, StorageError):
        return "failed (its mark is not a readable file)"
    return " ".join(text.split())[:300] or "failed"


def _publish(path: Path, lease: Lease, exclusive: bool) -> bool:
    """Write a lease file whole: a temporary file, then os.link (exclusive: False where the file exists) or
    os.replace (a refresh of one's own lease)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(lease.model_dump_json())
    try:
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)


def mark_failed(folder: Path, probe: str, reason: str) -> None:
    """Mark the probe failed with a line (never claimed again); its run folder's error.txt says the same."""
    (Path(folder) / LEASES).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(folder) / LEASES / (probe + FAILED), reason + "\n")
    run_dir = Path(folder) / CELLS / probe
    if run_dir.is_dir() and not run_dir.is_symlink():
        with contextlib.suppress(OSError):
            atomic_write_text(run_dir / ERROR, reason + "\n")


def claim(folder: Path, probe: str, times: LeaseTimes) -> Held | None:
    """Take the probe's lease, or None: held by a live worker, lost a race, or failed (marked so here where
    an expired lease has no retry left)."""
    folder = Path(folder)
    if failed_reason(folder, probe) is not None:
        return None
    (folder / LEASES).mkdir(parents=True, exist_ok=True)
    now = time.time()
    cur = current(folder, probe)
    generation, retries = 0, 0
    if cur is not None:
        generation, old = cur[0] + 1, cur[1]
        if old.released:
            retries = old.retries
        elif expired(old, times, now):
            retries = old.retries + 1
            if retries > times.max_retries:
                mark_failed(folder, probe, f"lease expired {retries} times (last holder {old.host} pid {old.pid}, "
                                            f"silent for {now - old.heartbeat:.0f} s); max retries {times.max_retries}")
                return None
        else:
            return None
    lease = Lease(host=socket.gethostname(), pid=os.getpid(), start=now, heartbeat=now, retries=retries,
                  timeout_s=times.timeout_s)
    held = Held(folder, probe, generation, lease)
    return held if _publish(held.path, lease, exclusive=True) else None


def superseded(held: Held) -> bool:
    """Whether another worker took the probe over (a newer generation exists)."""
    return generations(held.folder, held.probe)[-1:] != [held.generation]


def refresh(held: Held) -> bool:
    """Refresh the heartbeat; False (and nothing written) where the lease was taken over."""
    if superseded(held):
        return False
    held.lease = held.lease.model_copy(update=dict(heartbeat=time.time()))
    return _publish(held.path, held.lease, exclusive=False)


def release(held: Held, reason: str) -> None:
    """Give the lease up (the probe finished, or this worker was preempted): the next claim takes it at once."""
    if not superseded(held):
        held.lease = held.lease.model_copy(update=dict(released=True, reason=reason, heartbeat=time.time()))
        _publish(held.path, held.lease, exclusive=False)


@contextlib.contextmanager
def heartbeat(held: Held, every_s: float):
    """Refresh the lease every `every_s` seconds from a thread while the body runs (the probe trains)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            if not refresh(held):
                return

    thread = threading.Thread(target=beat, name=f"lease {held.probe}", daemon=True)
    thread.start()
    try:
        yield held
    finally:
        stop.set()
        thread.join()


def lease_table(folder: Path, now: float | None = None) -> list[dict]:
    """Every probe's current lease, for `flt-diag status`: probe, holder, heartbeat age, retries, state
    (running, expired by the holder's own timeout, released, failed)."""
    now = time.time() if now is None else now
    probes = {p.name.rsplit(".", 2)[0] for p in (Path(folder) / LEASES).glob("*.json")}
    probes |= {p.name[:-len(FAILED)] for p in (Path(folder) / LEASES).glob("*" + FAILED)}
    rows = []
    for probe in sorted(probes):
        cur, reason = current(folder, probe), failed_reason(folder, probe)
        lease = cur[1] if cur else None
        state = ("failed" if reason else "released" if lease is not None and lease.released
                 else "expired" if lease is not None and expired(lease, LeaseTimes(timeout_s=lease.timeout_s), now)
                 else "running")
        rows.append(dict(probe=probe, state=state, holder=f"{lease.host} pid {lease.pid}" if lease else "",
                         heartbeat_age_s=None if lease is None else round(now - lease.heartbeat, 1),
                         retries=None if lease is None else lease.retries, reason=reason or ""))
    return rows


def lease_lines(folder: Path, now: float | None = None) -> list[str]:
    """`flt-diag status`'s lines for the probes whose lease is running or expired (released ones are done)."""
    return [(f"lease {r['probe']}: {r['state']}, {r['holder']}, heartbeat {r['heartbeat_age_s']:.0f} s ago, "
             f"retries {r['retries']}" if r["heartbeat_age_s"] is not None else
             f"lease {r['probe']}: {r['state']}, no readable lease file")
            if r["state"] != "failed" else f"lease {r['probe']}: failed: {r['reason']}"
            for r in lease_table(folder, now) if r["state"] != "released"]
