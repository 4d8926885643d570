"""Pooling sweeps: several sweep folders of one setting read as one experiment (more seeds of some cells,
run later into folders of their own). `summary`, `plot` and `report` pool the folders they are given
(flt_diag.results.tables.pooled_summary and collect) after `check_poolable` (torch-free)."""
from __future__ import annotations

from pathlib import Path

from flt_diag.storage.file_models import MapSpecFile
from flt_diag.storage.folders import StorageError, is_sweep, load_spec
from flt_diag.config.grid_options import SWEEP_GRID_FIELDS


def without_grid_fields(base, grid_fields: dict):
    """A spec's base config without the fields its grid sets per cell (`grid_fields`: section -> names)."""
    if not isinstance(base, dict):
        return base
    return {k: ({f: x for f, x in v.items() if f not in grid_fields.get(k, ())} if isinstance(v, dict) else v)
            for k, v in base.items()}


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k} ({x!r} vs {y!r})")
    return out


def check_poolable(paths) -> None:
    """Every folder is a sweep (not a map) whose shared config equals the first's, grid fields aside; else
    StorageError naming what differs."""
    first = None
    for path in map(Path, paths):
        if not path.exists():
            raise StorageError(f"no such folder: {path}")
        if not is_sweep(path):
            raise StorageError(f"{path}: not a sweep folder (pooling takes sweep folders only)")
        spec = load_spec(path)
        if isinstance(spec, MapSpecFile):  # a map's probes are a search, not a grid's cells: nothing to add seeds to
            raise StorageError(f"{path} is a map folder; pooling takes sweep folders only (give a map on its own)")
        setting = without_grid_fields(spec.base.as_written(), SWEEP_GRID_FIELDS)  # what two sweeps must share
        if first is None:
            first = (path, setting)
        elif setting != first[1]:
            diff = _differences(first[1], setting)
            raise StorageError(f"{path} and {first[0]} ran different settings, so their runs cannot be pooled: "
                               + ", ".join(diff[:5]) + (f" and {len(diff) - 5} more" if len(diff) > 5 else ""))
