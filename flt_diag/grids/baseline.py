"""A new variant benchmarked against an archived baseline map (`flt-diag map --baseline ARCHIVE --variants NEW`,
docs/DESIGN.md §5 "Extending a benchmark"). The baseline's spec (grid, axis, criteria, loops, seeds, base recipe)
is read from its archive and reused exactly; its probes are re-run as canaries (flt_diag.grids.canaries) before any
new line; the new map folder then holds the pooled map: its spec names the baseline's variants and the new ones,
the baseline's records are copied beside cells/ (finished probes, as a resume from an archive copies them), and only
the new variants' lines are searched, so `summary`, `plot breaking`, map.csv and the analysis read old and new lines
together. sweep.json's `baseline` names the archive; its `canaries` list each check (and a drift accepted).
"""
from __future__ import annotations

import shutil
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import pandas as pd

from flt_diag.config.run_config import RunConfig
from flt_diag.grids.campaign import Archiver, CampaignOptions
from flt_diag.storage.campaign import CANARIES
from flt_diag.grids.canaries import run_canaries
from flt_diag.grids.stability_map import MapSpec, run_map
from flt_diag.grids.sweep import cell_config
from flt_diag.judge.map_boundaries import spec_from_folder
from flt_diag.storage import archive
from flt_diag.training.settle import settle
from flt_diag.storage.errors import BadFile
from flt_diag.storage.folders import (CELLS, SWEEP_SPEC, StorageError, atomic_path, is_archive, load_summary,
                                      read_json, refuse_not_a_folder, write_json)

BASELINE = "baseline"  # its key in sweep.json (the canaries': flt_diag.storage.campaign.CANARIES)
ACCEPT = "--accept-baseline-drift"


class PooledMapSpec(MapSpec):
    """A map pooled with an archived baseline: the baseline's variants and the new ones; only lines of the new
    ones are searched (`searched_lines`)."""

    baseline: dict

    def searched_lines(self):
        return [line for line in self.lines() if line.variant not in self.baseline["variants"]]

    def to_dict(self) -> dict:
        return {**super().to_dict(), BASELINE: self.baseline}


def read_baseline(path: Path) -> tuple[dict, list[Path]]:
    """An archived map's sweep.json (checked) and its records (each one's metadata read: a half-written record is
    one line); anything else is one line."""
    path = Path(path)
    if not path.is_dir():
        raise StorageError(f"--baseline {path}: no such folder (give an archived map: `flt-diag archive` of a map, or "
                           "the --archive-to folder of one)")
    if not is_archive(path):
        raise StorageError(f"--baseline {path} is not an archived map (an archive holds sweep.json and run records, "
                           "no cells/)")
    if not (path / SWEEP_SPEC).is_file():
        raise StorageError(f"--baseline {path} holds records but no sweep.json: not the archive of a map")
    spec_from_folder(path)  # (kind map, every field checked: one line)
    records = archive.records_in(path)
    for record in records:
        meta = archive.read_meta(record)
        if meta.summary is None:
            raise BadFile(f"{record}: a record without a summary (an unfinished probe): not a baseline's probe")
    return read_json(path / SWEEP_SPEC), records


def pooled_spec(path: Path, spec: dict, new: list[str]) -> PooledMapSpec:
    """The baseline's spec with the `new` variants added after its own; every new probe's config checked."""
    taken = [v for v in new if v in spec["variants"]]
    if taken:
        raise StorageError(f"--variants {' '.join(taken)}: already in the baseline {path}; give new variants only")
    base = settle(RunConfig.from_dict(spec["base"]))  # (as the baseline map settled it: device, vocabulary)
    pooled = PooledMapSpec(base=base, variants=[*spec["variants"], *new], loops=spec["loops"], seeds=spec["seeds"],
                           axis=spec["axis"], grid=spec["grid"], criteria=spec["criteria"],
                           baseline=dict(archive=str(Path(path).resolve()), variants=list(spec["variants"])))
    for line in pooled.searched_lines():
        for value in pooled.grid:
            cell_config(base, pooled.cell(line, value))
    return pooled


def copy_baseline(records: list[Path], out: Path) -> None:
    """The baseline's records into the map folder as finished probes (beside cells/), where not there yet."""
    for record in records:
        mine = Path(out) / record.name
        if load_summary(Path(out) / CELLS / record.stem) is None and not mine.exists():
            with atomic_path(mine, Path(out)) as tmp:
                shutil.copyfile(record, tmp)


def record_canaries(out: Path, results: list[dict], accepted: bool) -> None:
    """Append this start's canaries (and whether a drift was accepted) to the folder's sweep.json."""
    spec = read_json(Path(out) / SWEEP_SPEC)
    entry = dict(at=time.strftime("%Y-%m-%dT%H:%M:%S"), host=socket.gethostname(), probes=results,
                 agree=all(r["disagreement"] is None for r in results), drift_accepted=accepted)
    write_json(Path(out) / SWEEP_SPEC, {**spec, CANARIES: [*spec.get(CANARIES, []), entry]})


def drift_line(path: Path, results: list[dict]) -> str | None:
    """One line where a canary disagrees (None: all agree)."""
    bad = [r for r in results if r["disagreement"] is not None]
    if not bad:
        return None
    return (f"the baseline {path} does not reproduce on this code and machine: {len(bad)} of {len(results)} canaries "
            f"differ ({bad[0]['probe']}: {bad[0]['disagreement']}); pooling would compare unlike runs: run it where "
            f"it was made, or give {ACCEPT} (recorded in sweep.json)")


@dataclass(frozen=True)
class WithBaseline:
    """The map folder's archiver (flt_diag.grids.campaign.Archiver) when it pools a baseline: at each start, once
    the folder holds its sweep.json, the baseline's records are copied in and this start's canaries recorded; then
    the --archive-to archive, if any, does its own."""

    records: tuple[Path, ...]
    canaries: tuple[dict, ...]
    accepted: bool
    inner: Optional[Archiver] = None

    def spec(self, out: Path) -> dict | None:
        return None if self.inner is None else self.inner.spec(out)

    def start(self, out: Path) -> None:
        copy_baseline(list(self.records), out)
        record_canaries(out, list(self.canaries), self.accepted)
        if self.inner is not None:
            self.inner.start(out)

    def finished(self, out: Path, name: str) -> None:
        if self.inner is not None:
            self.inner.finished(out, name)


def run_baseline_map(path: Path, new: list[str], out: Path, accept_drift: bool = False, report=print,
                     options: CampaignOptions = CampaignOptions(), submit: tuple | None = None,
                     **how) -> pd.DataFrame:
    """Check the baseline archive at `path`, run its canaries (a disagreement: one line, unless `accept_drift`),
    then run the pooled map in `out` (`how`: run_map's workers, only_line, probe_ends, run_to_end), here or, with
    `submit` = (how, cluster options, tasks), by lease workers under a scheduler (flt_diag.grids.slurm.submit_map;
    the canaries still run here, first)."""
    spec, records = read_baseline(path)
    pooled = pooled_spec(path, spec, new)
    refuse_not_a_folder(Path(out), "a map folder", "use another --out")
    if submit is not None:  # (submitit there, heartbeat below the lease timeout: checked before any canary trains)
        from flt_diag.grids.slurm import submittable
        submittable(submit[1])
    results = run_canaries(Path(path), report)
    problem = drift_line(Path(path), results)
    if problem and not accept_drift:
        raise StorageError(problem)
    if problem:
        report(f"warning: {problem.split('; pooling')[0]}; pooled anyway ({ACCEPT}, recorded in sweep.json)")
    hook = WithBaseline(tuple(records), tuple(results), bool(problem), options.archive)
    if submit is not None:
        from flt_diag.grids.slurm import submit_map
        scheduler, cluster, tasks = submit
        return submit_map(pooled, Path(out), scheduler, cluster, tasks, how.get("probe_ends", False),
                          how.get("run_to_end", False), replace(options, archive=hook), report)
    return run_map(pooled, Path(out), report=report, options=replace(options, archive=hook), **how)
