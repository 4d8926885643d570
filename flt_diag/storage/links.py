"""Links below the folder a command was given, refused before anything is written through them (docs/guide.md,
"What a folder from elsewhere may contain"); flt_diag.storage.folders re-exports these. Torch-free."""
from __future__ import annotations

from pathlib import Path

from flt_diag.storage.errors import StorageError


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
