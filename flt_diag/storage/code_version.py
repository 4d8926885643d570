"""Which code made a record: flt-diag's version, and where it runs from a git checkout, the commit and whether
the tracked files differed from it (`clean`). Stored in every run's config.json (`env.code`) and in every
archive record's metadata (`code`: the code that made the run and the code that archived it), so a result can
be traced to the commit of its plan from the records alone (docs/DESIGN.md §9). Torch-free.
"""
from __future__ import annotations

import functools
import hashlib
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from flt_diag.storage.code_snapshot import snapshot_code

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding flt_diag/ (a checkout, or site-packages)
# What a run imports or installs from a checkout: its changes make the code another code. A change elsewhere (docs,
# tests, analysis scripts, a study file, an archive written into docs/data/ as a campaign goes) does not.
CODE_PATHS = ("flt_diag", "pyproject.toml")


def _git(*args: str, text: bool = True) -> str | bytes | None:
    try:
        done = subprocess.run(["git", "-C", str(PACKAGE_ROOT), *args], capture_output=True, text=text, timeout=10,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    return done.stdout if done.returncode == 0 else None


def _text(*args: str) -> str | None:
    out = _git(*args)
    return out if isinstance(out, str) else None


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """{"flt_diag": version, "commit": 40 hex digits or None, "clean": True / False / None}, and where the tree is
    not clean "diff": the first 16 hex digits of the SHA-256 of `git diff HEAD` (the uncommitted changes, told
    apart: a campaign resumed under other changes is refused, docs/DESIGN.md §5). None: not run from a git
    checkout of flt-diag (an installed wheel), or git is missing. `clean` looks at the tracked files of CODE_PATHS
    only (an untracked file, or a changed docs page, is not code the run imported)."""
    try:
        ver = version("flt-diag")
    except PackageNotFoundError:
        ver = "unknown"
    snapshot = snapshot_code(PACKAGE_ROOT)  # a campaign's code snapshot (no git checkout): its marker's commit
    if snapshot is not None:
        return {"flt_diag": ver, **snapshot}
    commit, clean, diff = None, None, None
    top = _text("rev-parse", "--show-toplevel")
    if top is not None and Path(top.strip()).resolve() == PACKAGE_ROOT and (PACKAGE_ROOT / "flt_diag").is_dir():
        head = (_text("rev-parse", "HEAD") or "").strip()
        if len(head) == 40:
            commit = head
            status = _text("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
            clean = None if status is None else status.strip() == ""
            if clean is False and isinstance(changes := _git("diff", "HEAD", "--binary", "--", *CODE_PATHS,
                                                             text=False), bytes):
                diff = hashlib.sha256(changes).hexdigest()[:16]
    return {"flt_diag": ver, "commit": commit, "clean": clean, **({"diff": diff} if diff else {})}


def _flag(value):
    """A recorded `clean` as True / False, anything else (a crafted list or table) as None: never unhashable."""
    return value if isinstance(value, bool) else None


def describe(code: dict | None) -> str:
    """One line: "flt-diag 0.1.0, commit 1a2b3c4d5e6f (clean)"; "not recorded" for a record made before."""
    if not isinstance(code, dict):
        return "not recorded"
    commit = code.get("commit")
    where = "not from a git checkout" if not commit else \
        f"commit {str(commit)[:12]} ({ {True: 'clean', False: 'with uncommitted changes'}.get(_flag(code.get('clean')), 'state unknown')}{' ' + str(code['diff'])[:8] if code.get('diff') else ''})"  # type: ignore[arg-type]  # noqa: E501 (no flag: unknown)
    return f"flt-diag {code.get('flt_diag', 'unknown')}, {where}"
