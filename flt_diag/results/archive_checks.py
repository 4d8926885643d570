"""What `flt-diag archive` refuses before it writes anything (docs/guide.md, "Run archives"), so that an archive
folder never mixes runs and no run folder takes records in:

* a `--to` that is a file, a FIFO or anything but a folder; a `--to` that is, or lies inside, a run folder (its
  `metrics/` too), a sweep or map folder, or an archived sweep or map (readers would take the records for that
  folder's, or the folder for an archive: `eval-loops` of a run would be refused as "a run archive");
* a run that has not finished, a source that is an archive already, a `--to` inside a source;
* two sources that would be archived under one name (two runs called R, a run and a sweep);
* a destination holding what another source archived: a record of another run of the same name, or an archived
  sweep whose sweep.json differs (a map named like a sweep), or records none of the source's cells wrote, unless
  `--replace` (then those records are removed first, and the destination holds this source alone).

A record is the source's own when its stored `source` names it (R, or S/cell) and its stored config is the
source's config.json (which holds the host and the second the run started, env.started): the same command run
again, or a sweep archived in slices as its cells finish, refreshes its own records. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flt_diag.storage import archive
from flt_diag.storage.campaign import without_campaign
from flt_diag.storage.folders import (CELLS, CONFIG, METRICS, SWEEP_SPEC, BadFile, StorageError, is_archive, is_run,
                                      is_sweep, load_config, load_spec, load_summary, not_a_folder, read_json, refuse_links,
                                      run_dirs)
from flt_diag.storage.safe_files import is_temporary

REPLACE = "give --replace to replace it, or archive into another --to"


@dataclass
class Plan:
    """One source and what archiving it writes: `runs` (run folder, record, the record's `source`), for a sweep
    or map its folder in the archive (`dest`) and spec, and `foreign`: records of other sources removed first."""
    source: Path
    runs: list[tuple[Path, Path, str]] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # unfinished cells
    dest: Path | None = None
    spec: dict | None = None
    foreign: list[Path] = field(default_factory=list)
    copies: list[tuple[Path, Path]] = field(default_factory=list)  # a folder's records (taken in from an archive
    #                                                                 it resumed from) -> the archive, as they are

    def targets(self) -> list[Path]:
        return [self.dest] if self.dest is not None else [record for _, record, _ in self.runs]


def check_destination(to: Path) -> None:
    """`to` is a folder (or missing: it is made) outside every run, sweep and map folder and archived sweep."""
    to = Path(to)
    if (it := not_a_folder(to)) is not None:  # (a link to a folder is the user's choice)
        raise StorageError(f"--to {to} is {it}; give a folder for the archive (it is made if missing)")
    here = to.resolve()
    for folder in (here, *here.parents):
        where = "is" if folder == here else "is inside"
        if (folder / SWEEP_SPEC).is_file():
            what = "a sweep or map folder" if (folder / CELLS).is_dir() else "an archived sweep or map"
        elif (folder / CONFIG).is_file() and (folder == here or (folder / METRICS).is_dir()):
            what = "a run folder"
        elif folder != here and (records := archive.records_in(folder)):
            raise StorageError(f"--to {to} is inside an archive of runs ({folder}, {len(records)} record(s)), whose "
                               "readers read the records at its top only: archive into that folder itself, or into "
                               "a folder outside it")
        else:
            continue
        raise StorageError(f"--to {to} {where} {what} ({folder}); readers would mix the records into it: archive "
                           "into a folder of its own")


def _foreign(record: Path, label: str, run_dir: Path | None) -> str | None:
    """Why `record` is not the archive of `run_dir` under `label` (None: it is; a re-run refreshes it)."""
    if record.is_symlink() or not record.is_file():
        raise StorageError(f"{record} is {'a symbolic link' if record.is_symlink() else 'not a file'} where the "
                           "archive writes a record; remove it, or archive into another --to")
    try:
        meta = archive.read_meta(record)
    except (BadFile, StorageError) as e:
        return f"not a record this flt-diag reads ({e})"
    if meta.source != label or run_dir is None or not (run_dir / CONFIG).is_file():
        return f"the archive of {meta.source!r}"
    if meta.config != load_config(run_dir):
        env = meta.config.env or {}
        when = f", started {env['started']}" if env.get("started") else ""
        return f"another run archived as {label!r}" + (f" (made on {env['host']}{when})" if env.get("host") else "")
    return None


def _plan_run(src: Path, to: Path, replace: bool) -> Plan:
    if load_summary(src) is None:
        raise StorageError(f"{src} has not finished (no summary.json): only finished runs are archived")
    record = to / (src.name + archive.SUFFIX)
    refuse_links(record, to)
    plan = Plan(src, runs=[(src, record, src.name)])
    if (record.exists() or record.is_symlink()) and (why := _foreign(record, src.name, src)):
        if not replace:
            raise StorageError(f"{record} holds {why}; {REPLACE}")
        plan.foreign.append(record)
    return plan


def _same_run(record: Path, other: Path) -> bool:
    """Whether two paths are records of one run (the same source and config): an archive's record and the copy a
    folder resumed from it holds. A damaged one is one line."""
    if not (archive.is_record(record) and archive.is_record(other)):
        return False
    a, b = archive.read_meta(record), archive.read_meta(other)
    return a.source == b.source and a.config == b.config


def _plan_sweep(src: Path, dirs: list[Path], to: Path, replace: bool) -> Plan:
    dest = to / src.name
    refuse_links(dest, to)
    load_spec(src)  # checked before it is copied
    plan = Plan(src, dest=dest, spec=read_json(src / SWEEP_SPEC))
    for d in dirs:
        if archive.is_record(d):  # already a record (the folder resumed from an archive): copied as it is, where
            if not _same_run(dest / d.name, d):  # the archive does not hold that run already
                plan.copies.append((d, dest / d.name))
            continue
        (plan.runs.append((d, dest / (d.name + archive.SUFFIX), f"{src.name}/{d.name}")) if load_summary(d) is not None
         else plan.skipped.append(d))
    if not dest.exists():
        return plan
    if not dest.is_dir():
        raise StorageError(f"{dest} is not a folder; the archive of {src} goes there: remove it, or archive into "
                           "another --to")
    others = [p for p in dest.iterdir() if not is_temporary(p) and p.name != SWEEP_SPEC and p.suffix != archive.SUFFIX]
    if others:
        raise StorageError(f"{dest} holds {others[0].name}, and an archived sweep holds sweep.json and records only: "
                           "archive into another --to")
    why = None
    if (dest / SWEEP_SPEC).exists():
        try:
            same = without_campaign(read_json(dest / SWEEP_SPEC)) == without_campaign(plan.spec or {})
            why = None if same else "another sweep or map (its sweep.json differs)"
        except (BadFile, StorageError) as e:
            why = f"a sweep.json this flt-diag does not read ({e})"
    elif any(p.suffix == archive.SUFFIX and not is_temporary(p) for p in dest.iterdir()):
        why = "archived runs, not an archived sweep (no sweep.json)"
    if why and not replace:
        raise StorageError(f"{dest} holds the archive of {why}; {REPLACE}")
    for record in sorted(p for p in dest.iterdir() if p.suffix == archive.SUFFIX and not is_temporary(p)):
        if _same_run(record, src / record.name):  # the folder holds this very run as a record taken from here
            continue
        cell = src / CELLS / record.stem
        if (problem := _foreign(record, f"{src.name}/{record.stem}", cell if is_run(cell) else None)) is not None:
            if not replace:
                raise StorageError(f"{record} holds {problem}; {REPLACE}")
            plan.foreign.append(record)
    return plan


def plan_sources(sources: list[Path], to: Path, replace: bool = False) -> list[Plan]:
    """What archiving `sources` into `to` writes, each source checked (see the module's docstring); writes
    nothing."""
    to = Path(to)
    plans: list = []
    seen: dict = {}
    for src in map(Path, sources):
        if is_archive(src):
            raise StorageError(f"{src} is already an archive; copy it, or archive the run folders it came from")
        dirs = run_dirs(src)  # a clear error for a path that is neither a run nor a sweep
        if to.resolve() == src.resolve() or src.resolve() in to.resolve().parents:
            raise StorageError(f"--to {to} is inside {src}; archive into a folder of its own")
        plan = _plan_sweep(src, dirs, to, replace) if is_sweep(src) else _plan_run(src, to, replace)
        for target in plan.targets():
            if target in seen:
                raise StorageError(f"{seen[target]} and {src} would both be archived as {target}; archive them "
                                   "into separate --to folders")
            seen[target] = src
        plans.append(plan)
    _refuse_twice(plans)
    _refuse_held(plans, to, replace)
    return plans


def _refuse_twice(plans: list[Plan]) -> None:
    """Each run archived once: two sources that are one folder (a link to it; a sweep and one of its cells) or
    copies of one run (archive.identity: the same config.json, its host and start second included) are one line,
    never two records that readers count as two runs."""
    seen: dict = {}
    for run_dir, _, _ in (run for plan in plans for run in plan.runs):
        cfg = load_config(run_dir)
        ident = archive.identity(cfg)
        keys: list[tuple[str, object]] = [("folder", run_dir.resolve())] + ([("run", ident)] if ident else [])
        for kind, key in keys:
            if (first := seen.setdefault((kind, key), run_dir)) != run_dir:
                how = f"one folder, {key}" if kind == "folder" else "copies of one run: " + archive.started(cfg)
                raise StorageError(f"{first} and {run_dir} are the same run ({how}); a run is archived once: give "
                                   "one of them")


def _refuse_held(plans: list[Plan], to: Path, replace: bool) -> None:
    """A run `to` holds already under another name (its record's stored config is the run's) is one line, or with
    `replace` that record is removed first: never a second record of one run."""
    held: dict[str | None, Path] = {}
    for record in archive.records_in(to):
        try:
            key = archive.identity(archive.read_meta(record).config)
        except (BadFile, StorageError):  # (not a record this flt-diag reads: _foreign says so where it matters)
            continue
        if key is not None:
            held[key] = record
    for plan in (p for p in plans if p.dest is None):
        for run_dir, record, _ in plan.runs:
            cfg = load_config(run_dir)
            other = held.get(archive.identity(cfg))
            if other is None or other == record or other in plan.foreign:
                continue
            if not replace:
                raise StorageError(f"{run_dir} is archived in {to} already, as {other.name} ({archive.started(cfg)}); "
                                   f"a second record would count it twice: {REPLACE}")
            plan.foreign.append(other)
