"""Run archives: a finished run kept as one compact Parquet file (a "record"), read by the same loaders as a
run folder (flt_diag.storage.folders dispatches on it). What a record holds and keeps: docs/DESIGN.md §9
("Run archives"); the thinning and its check: flt_diag.results.archiving; writing one: folders.write_record.
Its metadata is checked by the loaders of config.json and summary.json, its table like a metrics part; a
crafted, truncated or foreign Parquet file is one BadFile line. Torch-free.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Optional

import pandas as pd
from pydantic import Field

from flt_diag.storage import files
from flt_diag.storage.file_models import FileModel, RunConfigFile, Summary
from flt_diag.storage.safe_files import is_temporary
from flt_diag.storage.schema import MAX_FILE_BYTES, BadFile, StorageError, checked

SUFFIX = ".parquet"
META_KEY = b"flt_diag.archive"
FORMAT = 1
COLUMNS = list(files.METRICS_COLUMNS)
TYPES = {"step": "int64", "metric": "string", "loop": "int16", "layer": "int16", "value": "float64"}  # a metrics part's
MAX_RECORD_BYTES = MAX_FILE_BYTES  # a record is tens of kilobytes; a bigger file is not one of them
MAX_EVAL_LOOPS_BYTES = 16 << 20  # eval_loops.csv is a kilobyte (a line per loop count); kept whole up to this
LINKED = ("is a symbolic link; flt-diag does not read archive records through links (a folder from elsewhere may "
          "point anywhere): use the record's real path, or copy it there")


def is_record(path: Path) -> bool:
    """Whether `path` names an archive record: a regular file (not a link) ending in .parquet that is not a
    run folder's metrics part, nor a temporary file of a write (a hidden name: safe_files.is_temporary). Its
    content is checked when it is read."""
    path = Path(path)
    return (path.suffix == SUFFIX and not is_temporary(path) and not path.is_symlink() and path.is_file()
            and path.parent.name != "metrics")


def records_in(folder: Path) -> list[Path]:
    """The records directly in `folder`, by name."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if is_record(p))


def identity(config: FileModel | dict) -> str | None:
    """What a run is, whatever its folder or record is called: its config.json (as written) where that names the
    host and the second the run started (env.started, written since 2026-11); None for an older one, which names
    no single run."""
    doc = config.as_written() if isinstance(config, FileModel) else config
    env = doc.get("env") if isinstance(doc, dict) else None
    return json.dumps(doc, sort_keys=True, default=str) if isinstance(env, dict) and env.get("started") else None


def started(config: FileModel | dict) -> str:
    """The words naming a run by identity(): "the same config.json, started <second> on <host>"."""
    env = (config.as_written() if isinstance(config, FileModel) else config).get("env") or {}
    return f"the same config.json, started {env.get('started')} on {env.get('host', 'an unnamed host')}"


def _stored(path: Path) -> tuple[str | None, str | None]:
    """(source, identity) of a record, read from its metadata alone (no table; unchecked: a record that is not
    one is refused by its loaders, not here)."""
    try:
        doc = json.loads((_parquet_file(path).schema_arrow.metadata or {}).get(META_KEY) or b"null")
    except (BadFile, StorageError, ValueError, RecursionError):
        return None, None
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        return None, None
    source = doc.get("source") if isinstance(doc.get("source"), str) else None
    return source, identity(doc["config"])


def refuse_copies(records: list[Path]) -> None:
    """One run, one record: two records of a run (a record copied under another name, or one run archived twice
    through a link before 2026-12-05) are one line naming the one whose name contradicts its stored source, never
    a run counted twice."""
    seen: dict[str, tuple[Path, str | None]] = {}
    for record in records:
        source, key = _stored(record)
        if key is None:
            continue
        if key not in seen:
            seen[key] = (record, source)
            continue
        first, first_source = seen[key]
        copy, what = (first, first_source) if _misnamed(first, first_source) else (record, source)
        named = f" is named {copy.stem!r} but holds the archive of {what!r}," if _misnamed(copy, what) else ""
        raise StorageError(f"{copy}{named} the same run as {record if copy == first else first} "
                           f"({started(json.loads(key))}); a copy counts the run twice: remove one of them")


def _misnamed(record: Path, source: str | None) -> bool:
    return source is not None and source.rsplit("/", 1)[-1] != record.stem


def refuse_linked(folder: Path) -> None:
    """A link named like a record directly in `folder` (an archive from elsewhere) is one line, not a record
    skipped in silence (a cell left out of a summary, or another cell's rows under its name)."""
    folder = Path(folder)
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            if p.suffix == SUFFIX and not is_temporary(p) and p.is_symlink():
                raise StorageError(f"{p} {LINKED}")


def why_not(path: Path) -> str | None:
    """Why a path named like a record is not read as one (a link; a temporary file a killed write left), or None."""
    path = Path(path)
    if path.suffix != SUFFIX:
        return None
    if path.is_symlink():
        return f"{path} {LINKED}"
    if is_temporary(path) and path.is_file():
        return (f"{path} is a temporary file that a write killed before it finished left behind (a hidden name), "
                "not a record: remove it, or re-run the archive that left it")
    return None


def _parquet_file(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = Path(path)
    if path.is_symlink():
        raise StorageError(f"{path} {LINKED}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StorageError(f"missing {path}") from None
    if size > MAX_RECORD_BYTES:
        raise BadFile(f"{path}: {size:,} bytes; an archive record is far smaller")
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise BadFile(f"{path}: not a readable Parquet file ({' '.join(str(e).split())[:120] or type(e).__name__})") from None


class RecordMeta(FileModel):
    """A record's metadata (`source`: where it came from; `kept`: how it was thinned)."""

    format: int
    config: RunConfigFile
    summary: Optional[Summary]
    eval_loops: Optional[str] = Field(max_length=MAX_EVAL_LOOPS_BYTES)  # eval_loops.csv's text
    source: str
    kept: dict
    # {"run": the code that made the run, "archive": the code that archived it}: each its version, commit and clean
    # state (none before)
    code: Optional[dict[str, Optional[dict]]] = None


def read_meta(path: Path) -> RecordMeta:
    meta = (_parquet_file(path).schema_arrow.metadata or {}).get(META_KEY)
    if meta is None:
        raise BadFile(f"{path}: a Parquet file without flt-diag's archive metadata (not a run record)")
    try:
        doc = json.loads(meta)
    except (ValueError, RecursionError) as e:
        raise BadFile(f"{path}: unreadable archive metadata ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise BadFile(f"{path}: archive format {found!r}; this flt-diag reads format {FORMAT}")
    parts = {"config": RunConfigFile, "summary": Summary}  # (each checked as its loader checks it, named [config])
    doc |= {k: checked(f"{path} [{k}]", model, doc[k]) for k, model in parts.items() if doc.get(k) is not None}
    return checked(path, RecordMeta, doc)


def load_eval_loops(path: Path) -> pd.DataFrame | None:
    text = read_meta(path).eval_loops
    if text is None:
        return None
    try:
        table = pd.read_csv(io.StringIO(text))
    except ValueError as e:  # (pandas' errors name no file)
        raise BadFile(f"{path}: its eval_loops table cannot be read ({' '.join(str(e).split())[:120]})") from None
    return files.check_eval_loops(table, f"{path} (its eval_loops table)")


def row_count(path: Path) -> int:
    return _parquet_file(path).metadata.num_rows


def load_metrics(path: Path) -> pd.DataFrame:
    """The record's metrics table (COLUMNS, in TYPES), checked as a metrics part is."""
    import pyarrow as pa
    pf = _parquet_file(path)
    names = pf.schema_arrow.names
    if names != COLUMNS:
        raise BadFile(f"{path}: columns {names}; a run record has {COLUMNS}")
    try:
        table = pf.read()
    except (OSError, ValueError, pa.ArrowException) as e:
        raise BadFile(f"{path}: a damaged Parquet file ({' '.join(str(e).split())[:120] or type(e).__name__})") from None
    df = table.to_pandas()
    try:
        df = df.astype(TYPES)
    except (ValueError, TypeError, OverflowError) as e:
        raise BadFile(f"{path}: a column of the wrong type ({str(e)[:100]})") from None
    if len(df) and (df.step.min() < 0 or df.metric.isna().any()):
        raise BadFile(f"{path}: negative steps or missing metric names")
    return df


def record_frame(table: pd.DataFrame, path: Path) -> pd.DataFrame:
    """`table`'s COLUMNS in a record's types (TYPES, a metrics part's), or one StorageError line where a value
    would not come back as it is (a step past int64, a loop or layer past int16): a record stores what the
    run stored, or is not written."""
    df = table[COLUMNS].reset_index(drop=True)
    try:
        out = df.astype(TYPES)
    except (ValueError, TypeError, OverflowError) as e:
        raise StorageError(f"{path}: rows a record cannot hold ({' '.join(str(e).split())[:100]}); not archived") from None
    for column in ("step", "loop", "layer"):  # (outside the try: this line is not to be cut as an astype error's)
        if not (out[column].astype("int64").to_numpy() == df[column].to_numpy()).all():
            bad = df[column][out[column].astype("int64").to_numpy() != df[column].to_numpy()].iloc[0]
            raise StorageError(f"{path}: a {column} of {bad} does not fit a record's {TYPES[column]}; not archived")
    return out
