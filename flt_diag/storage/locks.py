"""The one writer of a run or sweep folder: folder_lock, an flock on <folder>/.lock (flt_diag.storage.folders
re-exports it). Torch-free."""
from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from pathlib import Path

from flt_diag.storage.errors import StorageError
from flt_diag.storage.links import make_folder, refuse_links, refuse_not_a_folder, refuse_symlink
from flt_diag.storage.safe_files import kind_of

BUSY = "is being written by another flt-diag process"  # folder_lock's refusal (a sweep tells it from a failure)
LOCK = ".lock"  # held (flock) by the one process writing a run or sweep folder; holds "pid host since" (holder_of)


def holder_text() -> str:
    """What a lock's holder writes into it: its pid, host and the second it took the lock (UTC)."""
    return f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"


def parse_holder(text: str) -> dict | None:
    """{"pid", "host", "since"} from a lock's text ("pid host since"; a lock of before holds the pid alone), or None
    where it is no holder's."""
    parts = text.split()
    if not parts or not parts[0].isdigit():
        return None
    return dict(pid=int(parts[0]), host=parts[1] if len(parts) > 1 else None, since=parts[2] if len(parts) > 2 else None)


def describe_holder(holder: dict | None) -> str:
    """"held by pid 12 on host h since 2026-12-05T09:00:00Z" (as much as the lock says), or ""."""
    if holder is None:
        return ""
    return (f"held by pid {holder['pid']}" + (f" on host {holder['host']}" if holder.get("host") else "")
            + (f" since {holder['since']}" if holder.get("since") else ""))


@contextlib.contextmanager
def folder_lock(folder: Path, kind: str = "run", root: Path | None = None):
    """Own a run or sweep folder while writing it (creating it): a second writer gets one StorageError line.
    An flock on <folder>/.lock, which the kernel drops when its process dies (kill -9 included). The lock file
    is opened without following links and removed on the way out, with the folder if this call created it
    and left it empty: a refused command leaves nothing behind. (No-op without fcntl.)"""
    folder = Path(folder)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    refuse_links(folder, root)
    refuse_not_a_folder(folder, f"a {kind} folder", "give a folder (it is made if missing)")  # never mkdir's "File exists"
    _refuse_odd_lock(folder / LOCK)  # a link, a folder or socket there: open() would say only "Is a directory" or ENXIO
    created = not folder.exists()
    try:
        make_folder(folder, root)
        # O_NONBLOCK: a FIFO planted as .lock must not block the open; it is refused below, and left alone
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        _refuse_odd_lock(folder / LOCK)  # planted between the check and the open (O_NOFOLLOW: ELOOP on a link)
        raise StorageError(f"cannot create {kind} folder {folder}: {e.strerror or e}") from None
    try:
        _refuse_odd_lock(folder / LOCK, os.fstat(fd).st_mode)
    except StorageError:
        os.close(fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # the holder before us may have removed the file we opened: then the lock is on a dead name
        if not _same_file(fd, folder / LOCK):
            raise BlockingIOError
    except OSError:
        holder = describe_holder(parse_holder(os.pread(fd, 512, 0).decode(errors="replace")))
        os.close(fd)
        raise StorageError(f"{folder} {BUSY}{f' ({holder})' if holder else ''}; wait for it to finish or stop "
                           "it") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_text().encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            if _same_file(fd, folder / LOCK):
                os.unlink(folder / LOCK)  # while still held: a waiting opener sees the name gone
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: a refused command leaves no folder either


def _refuse_odd_lock(lock: Path, mode: int | None = None) -> None:
    """A .lock (of `mode`, else lstat'ed; a missing one is fine) that is anything but a regular file is one line
    naming it and what it is (a link: never written through; a folder, a FIFO, a socket, a device), left alone."""
    if mode is None:
        try:
            mode = os.lstat(lock).st_mode
        except OSError:
            return
    if stat.S_ISLNK(mode):
        refuse_symlink(lock, "lock")
    if not stat.S_ISREG(mode):
        raise StorageError(f"{lock} is not a regular file ({kind_of(mode)}); flt-diag keeps its lock there: remove it")


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
