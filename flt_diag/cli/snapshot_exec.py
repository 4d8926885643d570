"""`--snapshot`: a grid command (run-ablation, map, study) re-run from its campaign's code snapshot (docs/DESIGN.md
§5, "Campaigns"; the snapshot itself: flt_diag.storage.code_snapshot). At a campaign's first start the clean
checkout's commit is written out (`<out>/.code/<commit>/`, or --snapshot-dir); on every start, the command replaces
itself (exec) by the same command line run by the same Python with the snapshot first on PYTHONPATH, so that this
process, its pool workers and its submitit tasks all import the snapshot's flt_diag, whatever the checkout holds
by then. A folder that records a snapshot is always run from it (made again from its commit where deleted).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from flt_diag.cli.options import UserError
from flt_diag.storage.campaign import read_campaign
from flt_diag.storage.code_snapshot import (CODE_DIR, ENV, check_snapshot, is_commit, make_snapshot,
                                            read_marker, recorded_folder)
from flt_diag.storage.errors import StorageError
from flt_diag.storage.code_version import PACKAGE_ROOT, code_version
from flt_diag.storage.folders import SWEEP_SPEC, read_json

command_line: list[str] = []  # this process's arguments (set by flt_diag.cli.app.run): what the exec repeats


def recorded_snapshot(out: Path, archive_to: Path | None) -> dict | None:
    """The snapshot ({"path", "commit"}) the campaign of folder `out` (or, for a fresh folder, of its archive)
    records; None where none is recorded, or the spec cannot be read (the command then says why itself); a
    damaged entry is one line."""
    for spec in (Path(out) / SWEEP_SPEC, *([Path(archive_to) / Path(out).name / SWEEP_SPEC] if archive_to else [])):
        if spec.is_file():
            try:
                data = read_json(spec)
            except OSError:
                return None  # (unreadable: the command says why itself)
            if not isinstance(data, dict):
                return None  # (not a sweep.json: the command says so itself)
            campaign = read_campaign(data, spec)
            snapshot = None if campaign is None else campaign.snapshot
            if snapshot is not None and not (is_commit(snapshot.get("commit")) and isinstance(snapshot.get("path"), str)
                                             and snapshot["path"] and "\x00" not in snapshot["path"]):
                raise StorageError(f"{spec}: [campaign] snapshot is not {{\"path\": a folder, \"commit\": 40 hex "
                                   "digits}")
            return snapshot
    return None


def remakeable(out: Path, where: Path, commit: str) -> bool:
    """Whether a missing recorded snapshot may be made again where recorded without being asked: only at a
    `.code/<commit, 12 digits>` folder of this campaign's folder or of a sibling's (a chain's first study), never at
    a path a crafted sweep.json names elsewhere."""
    where, home = Path(where).resolve(), Path(out).resolve().parent
    return where.name == commit[:12] and where.parent.name == CODE_DIR and where.is_relative_to(home)


def _new_snapshot(out: Path, snapshot_dir: Path | None) -> tuple[str, Path]:
    """(commit, folder) of a campaign's first snapshot: the checkout's HEAD, which must be clean."""
    code = code_version()
    if not code.get("commit") or code.get("snapshot"):
        raise UserError(f"--snapshot: flt_diag at {PACKAGE_ROOT} is not run from a git checkout; a snapshot is made "
                        "from the commit of one")
    if code.get("clean") is not True:
        raise UserError(f"--snapshot: the checkout {PACKAGE_ROOT} has uncommitted changes; commit them first (a "
                        "snapshot of uncommitted code cannot be pinned)")
    commit = str(code["commit"])
    return commit, Path(snapshot_dir) if snapshot_dir else Path(out) / CODE_DIR / commit[:12]


def run_from_snapshot(out: Path, snapshot: bool, snapshot_dir: Path | None, archive_to: Path | None,
                      allow_change: bool = False) -> None:
    """Return where this command runs here (no snapshot asked or recorded), or already in its snapshot (checked:
    flt_diag imported from there, else one line); otherwise make the snapshot where missing and exec the command
    in it (never returns). --snapshot with --allow-code-change moves a campaign to a new snapshot of the checkout
    (the change then recorded as any allowed change)."""
    if os.environ.get(ENV):
        check_snapshot()
        return
    asked = snapshot or snapshot_dir is not None
    recorded = recorded_snapshot(out, archive_to)
    if recorded is None and not asked:
        return
    if recorded is not None and asked and allow_change:
        recorded = None  # (a new snapshot of the checkout's HEAD, recorded in place of the old)
    if sys.version_info < (3, 11):
        raise UserError("--snapshot needs Python 3.11 or later (PYTHONSAFEPATH keeps the working folder's flt_diag "
                        "from shadowing the snapshot's)")
    if recorded is not None:
        commit, where = str(recorded["commit"]), recorded_folder(out, recorded)
        if snapshot_dir and Path(snapshot_dir).resolve() != where.resolve():
            raise UserError(f"{out} runs from its code snapshot {where}; --snapshot-dir cannot move it")
        if read_marker(where) is None:
            if not remakeable(out, where, commit) and snapshot_dir is None:
                raise UserError(f"{out} runs from its code snapshot {where}, which is missing and lies outside the "
                                f"campaign's own .code folders: give --snapshot-dir {where} to make it again there")
            print(f"code snapshot {where} is missing: made again from commit {commit[:12]}", flush=True)
    else:
        commit, where = _new_snapshot(out, snapshot_dir)
    where = make_snapshot(PACKAGE_ROOT, commit, where).resolve()
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, ENV: str(where), "PYTHONPATH": os.pathsep.join([str(where), *([path] if path else [])]),
           "PYTHONSAFEPATH": "1"}  # (-m would put the working folder, maybe a checkout, first on sys.path)
    print(f"running from code snapshot {where} (commit {commit[:12]})", flush=True)
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "flt_diag", *command_line], env)
