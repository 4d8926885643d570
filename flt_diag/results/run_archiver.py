"""Archiving as a grid runs (`--archive-to DIR` of run-ablation, map and study; docs/guide.md "Campaigns"): a
sweep or map folder S is archived into DIR/S/, as `flt-diag archive S --to DIR` would archive it, but each run's
record is written once, when the run finishes (flt_diag.results.archiving.archive_run), and never again. The
archive stays an archive (sweep.json and records only) and is the campaign's resume point: a fresh folder named
S started with the same --archive-to takes its records in as finished runs (copies, beside cells/), so that every
reader of S sees them, and archives its new runs back.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from flt_diag.results.archive_checks import check_destination
from flt_diag.results.archiving import archive_run
from flt_diag.storage import archive
from flt_diag.storage.campaign import without_campaign
from flt_diag.storage.folders import (CELLS, SWEEP_SPEC, StorageError, atomic_path, load_config, load_spec,
                                      load_summary, make_folder, read_json, refuse_links, write_json)
from flt_diag.storage.safe_files import is_temporary


@dataclass(frozen=True)
class FolderArchive:
    """The archive DIR of --archive-to (flt_diag.grids.campaign.Archiver)."""

    to: Path

    def dest(self, out: Path) -> Path:
        return Path(self.to) / Path(out).resolve().name

    def spec(self, out: Path) -> dict | None:
        """The archived folder's sweep.json (checked), or None where the archive holds no such folder yet."""
        dest = self._checked_dest(out)
        if not (dest / SWEEP_SPEC).exists():
            return None
        load_spec(dest)  # (a damaged one: one line)
        return read_json(dest / SWEEP_SPEC)

    def _checked_dest(self, out: Path) -> Path:
        to, dest = Path(self.to), self.dest(out)
        check_destination(to)  # a folder outside every run, sweep and map folder and archived sweep
        if Path(out).resolve() in (to.resolve(), *to.resolve().parents):
            raise StorageError(f"--archive-to {to} is inside {out}; archive into a folder of its own")
        refuse_links(dest, to)
        if dest.exists() and not dest.is_dir():
            raise StorageError(f"{dest} is not a folder; the archive of {out} goes there: remove it, or give "
                               "another --archive-to")
        if dest.is_dir():
            archive.refuse_linked(dest)
            others = [p for p in dest.iterdir()
                      if not is_temporary(p) and p.name != SWEEP_SPEC and not archive.is_record(p)]
            if others:
                raise StorageError(f"{dest} holds {others[0].name}, and an archived sweep holds sweep.json and records "
                                   "only: give another --archive-to")
            if not (dest / SWEEP_SPEC).exists() and archive.records_in(dest):
                raise StorageError(f"{dest} holds archived runs, not an archived sweep (no sweep.json): give another "
                                   "--archive-to")
        return dest

    def start(self, out: Path) -> None:
        """The folder's sweep.json into the archive (its campaign as the folder holds it now), the archive's records
        the folder lacks into it, then its finished runs not archived yet into the archive."""
        out, dest = Path(out), self._checked_dest(out)
        make_folder(dest, Path(self.to))
        spec = read_json(out / SWEEP_SPEC)
        if (dest / SWEEP_SPEC).exists() and without_campaign(read_json(dest / SWEEP_SPEC)) != without_campaign(spec):
            raise StorageError(f"{dest} holds the archive of another sweep or map (its sweep.json differs); give "
                               "another --archive-to")
        for record in archive.records_in(dest):  # (each read once here: a damaged one is never resumed over)
            try:
                archive.read_meta(record)
            except StorageError as e:
                try:
                    finished = archive.is_record(out / record.name) or load_summary(out / CELLS / record.stem) is not None
                except StorageError:
                    finished = False
                raise StorageError(f"{' '.join(str(e).split())[:200]}: a damaged record in the archive; "
                                   + (f"its run is finished in {out}: remove the record and start again (it is "
                                      "archived anew)" if finished else "it is the archive's only copy of that run: "
                                      "restore it (e.g. git checkout), or remove it to run it again")) from None
        write_json(dest / SWEEP_SPEC, spec, root=self.to)
        for record in archive.records_in(dest):
            mine = out / record.name
            if load_summary(out / CELLS / record.stem) is None and not mine.exists():
                with atomic_path(mine, out) as tmp:
                    shutil.copyfile(record, tmp)
        folder = out / CELLS
        for run in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []:
            if load_summary(run) is not None and not (dest / f"{run.name}{archive.SUFFIX}").exists():
                self.finished(out, run.name)

    def finished(self, out: Path, name: str) -> None:
        """Archive run `name` of the folder (finished): written once; a record of another run there is one line."""
        out, dest = Path(out), self.dest(out)
        run, record = out / CELLS / name, dest / f"{name}{archive.SUFFIX}"
        if archive.is_record(record):
            if archive.read_meta(record).config != load_config(run):
                raise StorageError(f"{record} holds another run of {name} than {run}; it is left as it is")
            return
        archive_run(run, record, f"{dest.name}/{name}", Path(self.to))
