"""Links below the folder a command was given, refused before anything is written through them (docs/guide.md,
"What a folder from elsewhere may contain"); flt_diag.storage.folders re-exports these. Torch-free."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from flt_diag.storage.errors import StorageError
from flt_diag.storage.safe_files import kind_of


def refuse_symlink(path: Path, what: str = "write") -> None:
    """flt-diag never makes a symlink: writing through one would change a file elsewhere, so every write
    refuses it (one line)."""
    if Path(path).is_symlink():
        raise StorageError(f"{path} is a symbolic link; flt-diag does not {what} through links "
                           f"(a folder from elsewhere may point anywhere): remove the link or use the real path")


def refuse_links(path: str | Path, root: str | Path | None = None, what: str = "write") -> None:
    """No part of `path` below `root` (the folder a command was given; default: `path`'s own folder) is a
    symbolic link, each part lstat'ed in turn. `root` itself may be a link; `path` outside `root` is checked
    alone."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        parts, root = (path.name,), path.parent
    current = root
    for part in parts:
        current = current / part
        refuse_symlink(current, what)


def make_folder(folder: Path, root: Path | None = None) -> Path:
    """mkdir -p `folder`, refusing a link at any depth below `root` (before and after it is made)."""
    folder = Path(folder)
    refuse_links(folder, root)
    folder.mkdir(parents=True, exist_ok=True)
    refuse_links(folder, root)
    return folder


def not_a_folder(path: str | Path) -> str | None:
    """What `path` is, in words, where a folder is to be made or written into and it is something else: "a link
    to nothing (-> X)", "a link to X, a file", "a FIFO (named pipe)", "a device", "a file"; None where it is a
    folder, a link to one (a destination the user named may be a link), or missing. lstat and stat never block."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"not readable ({e.strerror or e})"
    if not stat.S_ISLNK(mode):
        return None if stat.S_ISDIR(mode) else kind_of(mode)
    target = os.readlink(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"a link to nothing (it points to {target}, which does not exist)"
    except OSError as e:
        return f"a link to {target}, which cannot be read ({e.strerror or e})"
    return None if stat.S_ISDIR(mode) else f"a link to {target}, {kind_of(mode)}"


def refuse_not_a_folder(path: str | Path, what: str, hint: str) -> None:
    """One line where `path`, about to hold `what` (a run folder, ...), is something else (not_a_folder): never
    "File exists" from mkdir, nor "not empty" for a FIFO or a device; `hint` says what to do."""
    if (it := not_a_folder(path)) is not None:
        raise StorageError(f"{path} is {it}, not {what}; {hint}")
