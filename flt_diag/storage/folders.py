"""Run and sweep folders (what each holds: docs/guide.md "What a run folder holds"): the only thing plots,
reports and analysis scripts read. Each metrics part is written to a temporary name and renamed, so a crash
or kill -9 leaves only complete parts. Imports no torch: analysis scripts use it without the training code.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path

import pandas as pd

from flt_diag.storage.code_snapshot import CODE_DIR
from flt_diag.storage import archive, files
from flt_diag.storage.links import (make_folder, not_a_folder, refuse_links, refuse_not_a_folder,  # noqa: F401
                                    refuse_symlink)  # (re-exported)
from flt_diag.storage.locks import BUSY, LOCK, folder_lock  # noqa: F401  (re-exported)
from flt_diag.storage.safe_files import file_mode, is_temporary, kind_of, open_regular
from flt_diag.storage.safe_files import temporary_affixes  # (the names atomic_path writes through)
from flt_diag.storage.schema import BadFile, StorageError, read_json  # noqa: F401  (re-exported: one error type)

CONFIG, SUMMARY, PROGRESS, METRICS = "config.json", "summary.json", "progress.json", "metrics"
CHECKPOINT, RESUME, EVAL_LOOPS = "checkpoint.pt", "resume.pt", "eval_loops.csv"
SWEEP_SPEC, SWEEP_SUMMARY, CELLS = "sweep.json", "summary.csv", "cells"
ERROR = "error.txt"  # written into a sweep cell whose run raised
COLUMNS = archive.COLUMNS


@contextlib.contextmanager
def atomic_path(path: Path, root: Path | None = None):
    """The one way flt-diag writes a file: yields a temporary name beside `path` (created exclusively),
    renamed over `path` on success and removed on any failure (an exception, a full disk, Ctrl-C). Links
    below `root` are refused (refuse_links). The file gets open()'s mode (0o666 less the umask), not 0600.
    The name (.<name>.<random>.tmp, safe_files.temporary_affixes) has no suffix: write it with the format
    given, not guessed from the name (matplotlib's savefig(format=...))."""
    path = Path(path)
    refuse_links(path, root)
    if path.is_dir():
        raise StorageError(f"{path} is a folder; give a file name")
    prefix, suffix = temporary_affixes(path)  # hidden, no .parquet/.json: a file left by kill -9 is no data
    try:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
    except OSError as e:  # (it names its temporary file: the user named `path`)
        raise OSError(e.errno, e.strerror or os.strerror(e.errno or 0), str(path)) from None
    try:
        os.fchmod(fd, file_mode())
    finally:
        os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        refuse_links(path, root)  # made while we wrote?
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno and (not e.filename or str(e.filename) == str(tmp)):
            # (pyarrow's errors name no file; a write's or a rename's name the temporary file: say `path`)
            raise OSError(e.errno, os.strerror(e.errno), str(path)) from None
        raise


def atomic_write_text(path: Path, text: str, root: Path | None = None) -> None:
    with atomic_path(path, root) as tmp:
        tmp.write_text(text)


def has_content(folder: Path) -> bool:
    """Whether a folder holds anything besides its lock file and a campaign's code snapshots (.code/: made by
    `--snapshot` before the folder is)."""
    return Path(folder).is_dir() and any(p.name not in (LOCK, CODE_DIR) for p in Path(folder).iterdir())


def write_json(path: Path, obj, root: Path | None = None) -> None:
    """`obj` as JSON (a file model, such as a Summary, as it is written: `as_written()`)."""
    atomic_write_text(path, json.dumps(obj, indent=1, default=_json_default, allow_nan=True), root)


def _json_default(o):
    if hasattr(o, "as_written"):
        return o.as_written()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# --------------------------------------------------------------------------- writing archive records

def write_record(path: Path, table: pd.DataFrame, meta: dict, root: Path | None = None) -> None:
    """Write one archive record (flt_diag.storage.archive) atomically. `meta` holds config, summary,
    eval_loops, source and kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    df = archive.record_frame(table, Path(path))  # every value as the run stored it (a step of 2**53 too), or refused
    arrow = pa.Table.from_pandas(df, preserve_index=False)
    arrow = arrow.replace_schema_metadata({archive.META_KEY: json.dumps({"format": archive.FORMAT, **meta},
                                                                         allow_nan=True, default=_json_default)})
    with atomic_path(Path(path), root) as tmp:
        pq.write_table(arrow, tmp, compression="zstd", compression_level=19, use_dictionary=["metric"])


def rewrite_record_summary(path: Path, summary: dict, root: Path | None = None) -> None:
    """Replace an archive record's summary (summary --recompute on an archive), its table and the rest unchanged."""
    meta = archive.read_meta(path)
    write_record(path, load_metrics(path), {**meta.as_written(), "summary": summary}, root)


# --------------------------------------------------------------------------- writing metrics

class MetricsWriter:
    """Buffers rows and writes them as numbered Parquet parts (each part complete or absent)."""

    def __init__(self, run_dir: Path, root: Path | None = None):
        self.dir = Path(run_dir) / METRICS
        self.root = Path(root) if root is not None else Path(run_dir)
        make_folder(self.dir, self.root)
        self.rows: list[tuple] = []

    def add(self, step: int, metric: str, loop: int, layer: int, value: float) -> None:
        self.rows.append((step, metric, loop, layer, value))

    def extend(self, rows) -> None:
        self.rows.extend(rows)

    def flush(self) -> None:
        if not self.rows:
            return
        df = _frame(self.rows)
        first, last = int(df.step.min()), int(df.step.max())
        name = f"part-{first:09d}-{last:09d}-{len(list(self.dir.glob('part-*.parquet'))):05d}.parquet"
        with atomic_path(self.dir / name, self.root) as tmp:
            df.to_parquet(tmp, index=False)
        self.rows = []

    def truncate_after(self, step: int) -> None:
        """Drop stored rows with step > `step` (used when resuming from a mid-run checkpoint)."""
        self.rows = [r for r in self.rows if r[0] <= step]
        for part in sorted(self.dir.glob("part-*.parquet")):
            first, last = files.part_steps(part)
            if first > step:
                part.unlink()
            elif last > step:
                df = read_part(part)
                with atomic_path(part, self.root) as tmp:
                    df[df.step <= step].to_parquet(tmp, index=False)


def _frame(rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=COLUMNS).astype(archive.TYPES)


# --------------------------------------------------------------------------- reading

def is_run(path: Path) -> bool:
    """A run folder (config.json), or an archive record (flt_diag.storage.archive)."""
    return (Path(path) / CONFIG).exists() or archive.is_record(path)


def is_sweep(path: Path) -> bool:
    return (Path(path) / SWEEP_SPEC).exists()


def run_name(run_dir: Path) -> str:
    """A run's name in tables: its folder's name, or an archive record's without ".parquet" (the cell it came from)."""
    return Path(run_dir).stem if archive.is_record(run_dir) else Path(run_dir).name


def run_state(run_dir: Path) -> str:
    """Where a run stands, the one definition the progress bar, the tables and the map's brackets read: "done" (its
    summary is written; an archive record that holds one), "failed" (the sweep or map that ran it left an error.txt:
    the run raised), "partial" (started, not finished) or "pending" (nothing there yet)."""
    d = Path(run_dir)
    if archive.is_record(d):
        return "done" if archive.read_meta(d).summary is not None else "partial"
    if (d / SUMMARY).exists():
        return "done"
    if (d / ERROR).exists():
        return "failed"
    return "partial" if d.exists() else "pending"


def load_config(run_dir: Path) -> files.F.RunConfigFile:
    if archive.is_record(run_dir):
        return archive.read_meta(run_dir).config
    return files.load_run_config(Path(run_dir) / CONFIG)


def load_summary(run_dir: Path) -> files.F.Summary | None:
    """The run's summary (checked), or None while it has not finished."""
    if archive.is_record(run_dir):
        return archive.read_meta(run_dir).summary
    p = Path(run_dir) / SUMMARY
    return files.load_summary(p) if p.exists() else None


def load_spec(folder: Path) -> files.F.SweepSpecFile | files.F.MapSpecFile:
    """The spec (sweep.json, checked) of a sweep or map folder."""
    return files.load_spec(Path(folder) / SWEEP_SPEC)


def load_progress(run_dir: Path) -> dict | None:
    p = Path(run_dir) / PROGRESS
    try:
        with open_regular(p, text=True) as f:
            return json.loads(f.read(1 << 20))
    except (StorageError, OSError, ValueError):  # missing, a FIFO, not JSON: no progress to show
        return None


def metrics_missing(run_dir: Path) -> str | None:
    """Why a finished run folder holds no stored metrics (its metrics/ missing, a link, a file, or without parts),
    in one line; None where it holds parts (or is a record, whose table is in the file)."""
    if archive.is_record(run_dir):
        return None
    parts = Path(run_dir) / METRICS
    if parts.is_symlink() or not parts.is_dir() or not any(parts.glob("part-*.parquet")):
        return f"{parts} is not a folder of metrics parts (missing, a link, a file or emptied)"
    return None


def load_metrics(run_dir: Path, metrics: list[str] | None = None) -> pd.DataFrame:
    """The long metrics table of a run (COLUMNS), of a run in progress the parts written so far; `metrics`
    keeps only those metric names. Parts are read in step order (the numbers in their names); one whose steps
    reach back below an earlier part's last step (a copied or stale part: a run writes each step once, in order,
    and a resume truncates the parts past its checkpoint) is one BadFile line. A copy of a part that starts at the
    step the previous one ended (the final evaluation's part) is not told from a legitimate one by this check."""
    filters = [("metric", "in", list(metrics))] if metrics else None
    if archive.is_record(run_dir):
        frames = [archive.load_metrics(run_dir)]
    else:
        frames, reached = [], None
        for p in sorted((Path(run_dir) / METRICS).glob("part-*.parquet"), key=files.part_order):
            frames.append(read_part(p, filters))
            if len(frames[-1]):  # a run writes its steps once, in order: a part reaching back is a copy or stale
                if reached is not None and int(frames[-1].step.min()) < reached:
                    raise BadFile(f"{p}: its steps from {int(frames[-1].step.min())} were written by an earlier part "
                                  f"already (up to step {reached}): a copied or stale metrics part, not read")
                reached = max(reached or 0, int(frames[-1].step.max()))
    frames = [f for f in frames if len(f)]
    if not frames:
        return _frame([])
    df = pd.concat(frames, ignore_index=True)
    df = df[df.metric.isin(list(metrics))] if metrics else df  # (a record's table is read whole)
    return df.sort_values(["step", "metric", "loop", "layer"], kind="stable").reset_index(drop=True)


def read_part(path: Path, filters=None) -> pd.DataFrame:
    """One metrics part, its name and columns checked first; a damaged one is one BadFile line."""
    import pyarrow as pa
    files.check_metrics_part(path)
    try:
        return pd.read_parquet(path, filters=filters)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise BadFile(f"{path}: a damaged Parquet file ({' '.join(str(e).split())[:120] or type(e).__name__})") from None


def series(df: pd.DataFrame, metric: str, loop: int = -1, layer: int = -1) -> pd.Series:
    """One metric as a step-indexed series."""
    sel = df[(df.metric == metric) & (df.loop == loop) & (df.layer == layer)]
    return pd.Series(sel.value.to_numpy(), index=sel.step.to_numpy(), name=metric)


def wide(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One metric as a table: rows = step, columns = (loop, layer)."""
    sel = df[df.metric == metric]
    return sel.pivot_table(index="step", columns=["loop", "layer"], values="value", aggfunc="last")


def load_eval_loops(run_dir: Path) -> pd.DataFrame | None:
    if archive.is_record(run_dir):
        return archive.load_eval_loops(run_dir)
    p = Path(run_dir) / EVAL_LOOPS
    if not p.exists():
        return None
    with open_regular(p) as f:
        try:
            table = pd.read_csv(f)
        except (ValueError, UnicodeDecodeError) as e:  # (pandas' errors name no file)
            raise BadFile(f"{p}: not a table flt-diag reads ({' '.join(str(e).split())[:120] or type(e).__name__})") from None
    return files.check_eval_loops(table, p)


def cell_names(sweep: Path) -> list[str]:
    """The cells of a sweep folder in order: the grid's, listed in sweep.json; for a stability map
    (whose probes are chosen as it runs) the cell folders present, by name."""
    spec = load_spec(sweep)
    check_cells(sweep)
    if isinstance(spec, files.F.MapSpecFile):  # its probes' folders, and its records (an archived map's; those a map
        folder = Path(sweep) / CELLS  # resumed from its archive took in: flt_diag.results.run_archiver)
        probes = {p.name for p in folder.iterdir() if p.is_dir()} if folder.is_dir() else set()
        return sorted(probes | {p.stem for p in archive.records_in(sweep) if p.stem != Path(SWEEP_SUMMARY).stem})
    return list(spec.cell_names)


def cell_path(sweep: Path, name: str) -> Path:
    """Where a sweep's or map's cell `name` is: its record in the folder (an archived sweep or map, or one taken in
    from the archive a folder resumed from), else its run folder in cells/."""
    record = Path(sweep) / f"{name}{archive.SUFFIX}"
    return record if archive.is_record(record) else Path(sweep) / CELLS / name


def check_cells(sweep: Path) -> None:
    """A sweep's `cells` is a folder or absent (an archived sweep, one not started): a file, FIFO, socket or device
    there is one line, never an empty sweep ("no finished runs yet")."""
    cells = Path(sweep) / CELLS
    try:
        mode = os.stat(cells).st_mode
    except FileNotFoundError:
        if cells.is_symlink():
            raise StorageError(f"{cells} is a link to nothing; a sweep keeps its run folders there") from None
        return
    except OSError as e:
        raise StorageError(f"cannot read {cells}: {e.strerror or e}") from None
    if not stat.S_ISDIR(mode):
        raise StorageError(f"{cells} is {kind_of(mode)}, not a folder; a sweep keeps its run folders there")


def is_archive(path: Path) -> bool:
    """An archive record, or a folder of records (an archived sweep or map, or a set of archived runs)."""
    return archive.is_record(path) or (Path(path).is_dir() and not (Path(path) / CELLS).is_dir()
                                       and bool(archive.records_in(path)))


def _not_a_record(p: Path) -> str:
    """Why a path named like an archive record is not read as one, in one line."""
    return archive.why_not(p) or f"{p} is named like a run record but is not a file (a folder?): move it away"


def run_dirs(path: Path) -> list[Path]:
    """The run folders of a sweep (in cell order), or [path] for a single run folder. A cell that is a link or a
    file, one with a summary.json but no config.json, and a path named like a record that is none are one line
    each, never a run left out in silence."""
    path = Path(path)
    if not path.exists():
        raise StorageError(f"no such folder: {path}")
    if path.is_dir() and not is_run(path) and not (path / CELLS).is_dir():
        archive.refuse_linked(path)  # an archive's linked record: one line, never a cell skipped in silence
    if is_sweep(path):
        out = []
        for name in cell_names(path):
            cell = path / CELLS / name
            if cell.is_symlink() or (cell.exists() and not cell.is_dir()):
                what = "a symbolic link" if cell.is_symlink() else "a file"
                raise StorageError(f"{cell} is {what} where a cell's folder goes: nothing is read or written through "
                                   "it (a sweep's cells are its own folders)")
            if is_run(cell):
                out.append(cell)
            elif (cell / SUMMARY).exists():
                raise StorageError(f"{cell} has a {SUMMARY} but no {CONFIG}: a damaged run, not read (and not left "
                                   "out in silence)")
            elif archive.is_record(path / (name + archive.SUFFIX)):
                out.append(path / (name + archive.SUFFIX))
            elif os.path.lexists(path / (name + archive.SUFFIX)):
                raise StorageError(_not_a_record(path / (name + archive.SUFFIX)))
        archive.refuse_copies([d for d in out if archive.is_record(d)])  # (a copy under a cell's name)
        return out
    if is_run(path):
        return [path]
    if odd := [p for p in sorted(path.glob("*" + archive.SUFFIX)) if not archive.is_record(p) and not
               is_temporary(p)] if path.is_dir() else []:  # (a killed write's temporary file: skipped, as always)
        raise StorageError(_not_a_record(odd[0]))  # (never a run left out of the folder's runs in silence)
    if records := archive.records_in(path):  # a folder of archived runs
        archive.refuse_copies(records)  # one run, one record: a copy under another name is one line, never counted twice
        return records
    if why := archive.why_not(path):  # a linked record, a temporary file a killed write left
        raise StorageError(why)
    raise StorageError(f"{path} is neither a run folder (no {CONFIG}), a sweep folder (no {SWEEP_SPEC}) nor an "
                       "archive (no run records)")

