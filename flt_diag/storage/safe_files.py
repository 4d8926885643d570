"""Files of a folder from elsewhere, opened safely (docs/guide.md, "What a folder from elsewhere may contain"):
a FIFO, folder, device or socket where a file belongs is one line before anything would block on it. Every
reader of a file flt-diag reads goes through here. Torch-free."""
from __future__ import annotations

import errno
import fcntl
import functools
import os
import stat
from pathlib import Path

from flt_diag.storage.errors import BadFile, StorageError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words ("a folder", "a socket", ...), from its st_mode."""
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return "a file" if stat.S_ISREG(mode) else "a symbolic link"
    return next((text for test, text in _KINDS if test(mode)), "not a regular file")


def _refuse_mode(path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise BadFile(f"{path} is {kind_of(mode)}, not a file; flt-diag reads only regular files there")


def regular_file(path) -> Path:
    """`path`, once known to be a regular file (or a link to one); a missing file is StorageError, anything
    else one BadFile line. stat() never blocks, even on a FIFO."""
    try:
        _refuse_mode(path, os.stat(path).st_mode)
    except FileNotFoundError:
        raise StorageError(f"missing {path}") from None
    except OSError as e:
        raise StorageError(f"cannot read {path}: {e.strerror or e}") from None
    return Path(path)


def open_regular(path, text: bool = False):
    """`path` opened for reading (binary, or UTF-8 text), refused first unless it is a regular file. The
    descriptor is opened non-blocking (a FIFO swapped in after a check cannot block the open) and checked
    with fstat, so what is read is what was checked."""
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise StorageError(f"missing {path}") from None
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise BadFile(f"{path} is a folder, not a file") from None
        raise StorageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        _refuse_mode(path, os.fstat(fd).st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "r", encoding="utf-8") if text else os.fdopen(fd, "rb")


def new_file(path) -> Path:
    """A path a file is about to be written to: one that exists as something other than a file is refused
    (renaming over it would replace it; open() would block on a FIFO). A link is left to atomic_path."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return Path(path)
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e.strerror or e}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise StorageError(f"{path} is {kind_of(mode)}, not a file; give the name of a file to write")
    return Path(path)


def read_bounded(path, limit: int, what: str) -> bytes:
    """The bytes of a regular file (open_regular) of at most `limit` bytes: at most limit + 1 are ever read, so
    a file that is larger, or grows while read, is one BadFile line naming `what` it should be and the bound,
    never a read that fills the memory."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BadFile(f"{path}: over {limit:,} bytes, too large for {what}")
    return data


@functools.cache
def umask() -> int:
    """The process's umask, read once without changing it (Linux: /proc/self/status); elsewhere it is set
    and restored at once, before any worker thread writes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode an ordinary open() gives a new file: 0o666 less the umask."""
    return 0o666 & ~umask()


# --------------------------------------------------------------------------- temporary files of a write

TEMPORARY = ".tmp"  # a temporary file's name: "." + the file's name + "." + random letters + ".tmp"


def temporary_affixes(path) -> tuple[str, str]:
    """The prefix and suffix of the temporary names folders.atomic_path writes `path` through (mkstemp adds the
    random letters between them): hidden, and ending in neither .parquet nor .json nor any suffix a reader
    looks for, so that a file left by a kill -9 is never taken for data."""
    return f".{Path(path).name}.", TEMPORARY


def is_temporary(path) -> bool:
    """Whether `path` names no data: a hidden name (a leading "."), as every temporary file of a write has (the
    names before 2026-12-04 ended in the file's own suffix, .x.parquet.<random>.tmp.parquet: hidden as well).
    Every reader that lists a folder skips these."""
    return Path(path).name.startswith(".")


def stale_temporaries(path) -> list[Path]:
    """The temporary files a write of `path` left behind (killed before it renamed or removed them): regular
    files beside `path` named as atomic_path names them (before 2026-12-04 also with `path`'s suffix after
    .tmp). For a writer that holds the folder's lock to remove: no other write of `path` is in flight."""
    path = Path(path)
    prefix, suffix = temporary_affixes(path)
    try:
        found = [p for p in path.parent.iterdir() if p.name.startswith(prefix)
                 and p.name.endswith((suffix, suffix + path.suffix)) and not p.is_symlink() and p.is_file()]
    except OSError:
        return []
    return sorted(found)
