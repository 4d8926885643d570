"""Files a user names for a command's output (`predict --csv`, `fit-predictor --out`, `report --out`, ...): a name
that would replace one of flt-diag's own data files is refused before any work, so a typo never costs a run's
config, a sweep's spec or an archive record. A command writing its own files into its own folders (a run's
summary.json, a sweep's summary.csv, the report's default report.html) does not come through here.
"""
from __future__ import annotations

import os
from pathlib import Path

from flt_diag.storage import archive
from flt_diag.storage.folders import (CHECKPOINT, CONFIG, ERROR, EVAL_LOOPS, LOCK, METRICS, PROGRESS, RESUME,
                                      SUMMARY, SWEEP_SPEC, SWEEP_SUMMARY)
from flt_diag.storage.schema import StorageError

MAP_TABLE = "map.csv"  # a map folder's table (flt_diag.judge.map_boundaries.MAP_CSV; storage imports no judge)
LEASES = "leases"  # a map's lease marks (flt_diag.grids.leases)
OWN_FILES = frozenset({CONFIG, SUMMARY, PROGRESS, CHECKPOINT, RESUME, EVAL_LOOPS, SWEEP_SPEC, SWEEP_SUMMARY,
                       Path(SWEEP_SUMMARY).stem + archive.SUFFIX, MAP_TABLE, ERROR, LOCK})


def _holds_data(folder: Path) -> bool:
    return (folder / CONFIG).is_file() or (folder / SWEEP_SPEC).is_file()


def data_file(path: Path) -> str | None:
    """What `path` is, where it is (or will be) flt-diag's own data: one of OWN_FILES in a run's, sweep's or map's
    folder (one holding config.json or sweep.json), written yet or not (a pending cell's summary.json is still its
    own); a metrics part or a lease mark; an archive record that exists; else None."""
    path = Path(path)
    if path.is_dir():
        return None
    folder = path.parent
    if path.name in OWN_FILES and _holds_data(folder):
        return f"the {path.name} of {folder}" + ("" if os.path.lexists(path) else " (not written yet)")
    if folder.name == METRICS and (folder.parent / CONFIG).is_file():
        return f"a metrics part of the run {folder.parent}"
    if folder.name == LEASES and (folder.parent / SWEEP_SPEC).is_file():
        return f"a lease mark of the map {folder.parent}"
    if os.path.lexists(path) and archive.is_record(path):
        return "an archive record"
    return None


def refuse_data_file(flag: str, path: Path | None) -> None:
    """One line (StorageError) where the output file `flag` names would replace flt-diag's own data."""
    what = None if path is None else data_file(path)
    if what:
        raise StorageError(f"{flag} {path}: that is {what}; writing there would replace it, so give another file")


def refuse_same_file(named: dict[str, Path | None]) -> None:
    """One line where two output options of one command name the same file (the second would replace the first)."""
    seen: dict[Path, str] = {}
    for flag, path in named.items():
        if path is None:
            continue
        key = Path(os.path.abspath(path))
        if key in seen:
            raise StorageError(f"{seen[key]} and {flag} name the same file {path}; give each its own")
        seen[key] = flag
