"""A campaign's code snapshot (`--snapshot`, docs/DESIGN.md §5, "Campaigns"): the `flt_diag/` package of one
commit, written out of the git repository that the running flt_diag lives in (`git archive`) into a folder of its
own, so that a campaign's processes import that code whatever the developer's checkout does meanwhile (edited,
committed, checked out at another commit). The folder holds MARKER: the commit, the repository it came from and
a digest of its files; `code_version()` of a process run from it names that commit, and "clean" only while the
files still have that digest. Torch-free.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from flt_diag.storage.errors import StorageError
from flt_diag.storage.safe_files import read_bounded

MARKER = ".flt-diag-snapshot.json"  # in the snapshot's root, beside flt_diag/
ENV = "FLT_DIAG_SNAPSHOT"  # the snapshot folder a campaign's processes must import flt_diag from
CODE_DIR = ".code"  # the default snapshot folder: <out>/.code/<commit, 12 hex digits>/
PACKAGE = "flt_diag"  # what a snapshot holds of the tree: the package that `import flt_diag` finds
MAX_ARCHIVE_BYTES = 256 << 20  # far above the package's size (about 1 MB): a bound, never reached
MAX_MARKER_BYTES = 1 << 16


def files_digest(root: Path) -> str:
    """SHA-256 over the snapshot's package files (path and bytes, in path order; caches left out): what tells an
    edited snapshot from the commit's tree."""
    h = hashlib.sha256()
    for p in sorted((Path(root) / PACKAGE).rglob("*")):
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            rel = p.relative_to(root).as_posix().encode()
            h.update(len(rel).to_bytes(4, "big") + rel)
            data = p.read_bytes()
            h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def is_commit(text) -> bool:
    return isinstance(text, str) and re.fullmatch(r"[0-9a-f]{40}", text) is not None


def read_marker(root: Path) -> dict | None:
    """The marker of a snapshot folder ({"commit", "source", "digest", "made"}), None where there is none or it
    is damaged (then the folder is no snapshot)."""
    try:
        marker = json.loads(read_bounded(Path(root) / MARKER, MAX_MARKER_BYTES, "snapshot marker"))
    except (OSError, ValueError):  # (StorageError is a ValueError)
        return None
    return marker if isinstance(marker, dict) and is_commit(marker.get("commit")) else None


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        raise StorageError(f"cannot run git to make the code snapshot: {e}") from None


def commit_version(repo: Path, commit: str) -> str | None:
    """flt-diag's version as the commit's own pyproject.toml states it (None where it does not say): what a snapshot
    of that commit is, whatever version the installed package's metadata names."""
    import tomllib
    done = _git(repo, "show", f"{commit}:pyproject.toml")
    try:
        ver = tomllib.loads(done.stdout.decode()).get("project", {}).get("version") if done.returncode == 0 else None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    return ver if isinstance(ver, str) and len(ver) <= 64 else None


def _archive(repo: Path, commit: str, where: Path) -> bytes:
    """`git archive` of the package at `commit` (a tar), or one line: the commit not in the repository, git failing."""
    if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise StorageError(f"commit {commit[:12]} is not in the repository at {repo}: cannot make or check the code "
                           f"snapshot {where} (fetch that commit there)")
    done = _git(repo, "archive", "--format=tar", commit, "--", PACKAGE)
    if done.returncode != 0 or len(done.stdout) > MAX_ARCHIVE_BYTES:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        raise StorageError(f"git archive of commit {commit[:12]} failed: {said[-1] if said else 'too large'}")
    return done.stdout


def tar_digest(data: bytes) -> str:
    """files_digest of the tree a `git archive` tar holds, computed from the tar itself (nothing extracted)."""
    h = hashlib.sha256()
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        members = sorted((m for m in t.getmembers() if m.isfile() and "__pycache__" not in m.name.split("/")
                          and not m.name.endswith(".pyc")), key=lambda m: Path(m.name).parts)
        for m in members:
            rel = Path(m.name).as_posix().encode()
            h.update(len(rel).to_bytes(4, "big") + rel)
            body = t.extractfile(m).read()  # type: ignore[union-attr]  # (a regular member has a body)
            h.update(len(body).to_bytes(8, "big") + body)
    return h.hexdigest()


def make_snapshot(repo: Path, commit: str, where: Path) -> Path:
    """Write `flt_diag/` of `commit` (of the git repository at `repo`) into folder `where`, with its MARKER, and
    return it; a folder already holding that commit's snapshot is kept as it is. The files are written into a
    temporary sibling first and renamed into place, so that a kill leaves no half snapshot; they are made
    read-only (a snapshot is not edited)."""
    where = Path(where)
    if not is_commit(commit):  # (never handed to git as an option)
        raise StorageError(f"{str(commit)[:60]!r} is not a commit (40 hex digits): no code snapshot is made of it")
    marker = read_marker(where)
    if marker is not None and marker["commit"] == commit:  # (its files checked against the commit's: a folder
        if files_digest(where) != tar_digest(_archive(repo, commit, where)):  # sent along is never run unchecked)
            raise StorageError(f"{where} holds files that are not commit {commit[:12]}'s (edited, or come with the "
                               "folder from elsewhere): not run; remove it, and it is made again from the commit")
        return where
    if where.exists() and (not where.is_dir() or any(where.iterdir())):
        raise StorageError(f"{where} exists and is not a snapshot of commit {commit[:12]}; give another folder")
    tar = _archive(repo, commit, where)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}.", suffix=".tmp", dir=where.parent))
    except OSError as e:
        raise StorageError(f"cannot write the code snapshot {where}: {e}") from None
    try:
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(tmp, filter="data")
        info = dict(commit=commit, source=str(repo), digest=files_digest(tmp), made=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    **({"version": v} if (v := commit_version(repo, commit)) else {}))
        (tmp / MARKER).write_text(json.dumps(info, indent=1))
        tmp.chmod(0o755)  # (mkdtemp's 0700: readable as any folder of the campaign's)
        for p in tmp.rglob("*"):
            if p.is_file():
                p.chmod(0o444)
        os.replace(tmp, where)  # (onto an empty folder, or none)
    except (OSError, tarfile.TarError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        won = read_marker(where)  # another task of the same job array made it first: that one is used
        if won is not None and won["commit"] == commit:
            return where
        raise StorageError(f"cannot write the code snapshot {where}: {e}") from None
    return where


def snapshot_code(root: Path) -> dict | None:
    """What `code_version()` says of a process whose flt_diag lies in snapshot `root`: its commit, clean while the
    files have the marker's digest (else the first 16 hex digits of theirs as `diff`), the folder, and flt-diag's
    version as the commit states it (where the marker records it: snapshots made since 2026-12-07); None where
    `root` is no snapshot."""
    marker = read_marker(root)
    if marker is None:
        return None
    digest = files_digest(root)
    clean = digest == marker.get("digest")
    ver = marker.get("version")
    return {"commit": marker["commit"], "clean": clean, **({} if clean else {"diff": digest[:16]}),
            "snapshot": str(root), **({"flt_diag": ver} if isinstance(ver, str) and ver else {})}


IMPORTED = Path(__file__).resolve().parents[1]  # the flt_diag package this process imported (this module's)


def imported_from(root: Path) -> bool:
    """Whether the flt_diag this process imported lies in folder `root`."""
    return IMPORTED.is_relative_to(Path(root).resolve())


def check_snapshot() -> None:
    """In a campaign's process (the command re-run in its snapshot, a pool worker, a lease or submitit task): where
    the campaign runs from a snapshot (ENV names it), refuse unless flt_diag was imported from there."""
    root = os.environ.get(ENV)
    if root and not imported_from(Path(root)):
        raise StorageError(f"this campaign runs from its code snapshot {root}, but flt_diag was imported from "
                           f"{IMPORTED}: put the snapshot first on PYTHONPATH")


def running_snapshot(out: Path) -> dict | None:
    """The snapshot this process runs from (ENV), as a campaign in folder `out` records it: {"path", "commit"}. The
    path is relative to `out` where the snapshot lies inside it, or in any `.code` folder (a chain of studies runs
    from the first study's `<first>/.code/<commit>`; a --snapshot-dir that ends in `.code/<x>` counts so too), so
    that the folders can move together, to another machine or checkout; any other snapshot folder is recorded
    absolute. None: no snapshot."""
    root = os.environ.get(ENV)
    marker = None if not root else read_marker(Path(root))
    if marker is None:
        return None
    path, base = Path(str(root)).resolve(), Path(out).resolve()
    if path.is_relative_to(base) or path.parent.name == CODE_DIR:
        return {"path": os.path.relpath(path, base), "commit": marker["commit"]}
    return {"path": str(path), "commit": marker["commit"]}


def recorded_folder(out: Path, recorded: dict) -> Path:
    """The folder of a campaign's recorded snapshot (a relative path lies in the campaign's folder `out`)."""
    path = Path(str(recorded.get("path")))
    return path if path.is_absolute() else Path(out) / path
