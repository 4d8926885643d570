"""What a file may hold, declared as data: the entries of a schema and the one function that checks a
value against them (`check`). flt_diag.storage.files declares a schema per file kind and loads with it.

Entries:
    Scalar  one value, checked by an `Option` (flt_diag.vocab.config): its kind, whether None is a value,
            its choices and bounds. Fields of the typed config use the config's own Option, so a size
            read from a file obeys the same limits as the command line.
    Items   a list of entries (length bounds, distinct items, as many items as another list)
    Record  a table of named entries (required or not; other keys refused unless `other_keys`)
    Table   a table of free keys (e.g. one model per step) whose values share one entry
    Shape   a tensor of a given shape (anything with `.shape`: this module imports no torch)

`check(entry, value)` returns the value with integral floats of integer fields made ints, or raises
`Problem(where, text)`: `where` is the dotted path of the field ("model.loops", "models.100.coef[2]").
`fields(entry)` lists every entry with its path (what the generated tests mutate). Reading: `read_json`
(a missing, malformed, huge or deeply nested file is one line) and `checked(path, entry, obj)`: the
value, or one `BadFile` line "<file>: <field> <problem>". Torch-free, and no config at import.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from flt_diag.storage.errors import BadFile, StorageError  # noqa: F401  (re-exported: one error type)
from flt_diag.storage.safe_files import open_regular

if TYPE_CHECKING:
    from flt_diag.vocab.config import Option

MAX_ITEMS = 10_000  # entries of one list or table in any file flt-diag writes (a sweep's cells, a grid, ...)
MAX_FILE_BYTES = 64 << 20  # flt-diag's JSON and TOML files are kilobytes; a bigger one is not one of them
MAX_TEXT = 4096  # characters of one text value (a path, a name): more is not something flt-diag wrote


class Problem(Exception):
    """A value that does not fit its entry: `where` (a dotted path) and what is wrong (one line)."""

    def __init__(self, where: str, text: str):
        super().__init__(f"{where} {text}" if where else text)
        self.where, self.text = where, text


def value(kind: type, *, optional: bool = False, choices=None, low=None, high=None, above=None,
          below=None):
    """An Option (flt_diag.vocab.config) for a field that only exists in files (not a command-line option)."""
    from flt_diag.vocab.config import Option  # (when a schema is built: reading a folder imports no config)
    return Option("file", "", "", kind, optional, False, None, "", tuple(choices) if choices else None, low, high,
                  above, below)


@dataclass(frozen=True)
class Scalar:
    option: Option
    required: bool = True
    nan: bool = False  # NaN and infinities are values too (figures a run computed: a diverged run's loss)


@dataclass(frozen=True)
class Items:
    item: object
    required: bool = True
    min_items: int = 1
    max_items: int = MAX_ITEMS
    distinct: bool = False
    ascending: bool = False
    length_of: str | None = None  # a list at the top of the file this one must match in length ("features")


@dataclass(frozen=True)
class Record:
    entries: dict = field(default_factory=dict)
    required: bool = True
    other_keys: bool = False  # keys not declared are kept as they are (free-form metadata)
    nullable: bool = False


@dataclass(frozen=True)
class Table:
    key: Option  # what each key must be once read as its kind (keys of JSON tables are text)
    entry: object
    required: bool = True
    min_items: int = 1
    max_items: int = MAX_ITEMS


@dataclass(frozen=True)
class Shape:
    shape: tuple
    required: bool = True


def scalar_of(o, required: bool = True) -> Scalar | Items:
    """The entry of a typed-config Option (a list of distinct values for a list option)."""
    if o.many:
        return Items(Scalar(replace(o, many=False, optional=False)), required, distinct=True)
    return Scalar(o, required)


def _shown(x) -> str:
    text = repr(x) if not isinstance(x, (dict, list)) else type(x).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _check_scalar(entry: Scalar, x, where: str):
    if entry.nan and isinstance(x, float) and not math.isfinite(x):
        return x
    if isinstance(x, (dict, list, tuple)):
        raise Problem(where, f"must be a single value, got {'a list' if isinstance(x, (list, tuple)) else 'a table'}")
    if isinstance(x, str) and len(x) > MAX_TEXT:
        raise Problem(where, f"is {len(x):,} characters of text; at most {MAX_TEXT}")
    problem = replace(entry.option, flag="", many=False).check(x)
    if problem:
        raise Problem(where, problem.strip())
    return int(x) if entry.option.kind is int and isinstance(x, float) else x


def _check_items(entry: Items, x, where: str, root):
    if not isinstance(x, (list, tuple)):
        raise Problem(where, f"must be a list, got {_shown(x)}")
    if not entry.min_items <= len(x) <= entry.max_items:
        raise Problem(where, f"has {len(x):,} items; it needs {entry.min_items} to {entry.max_items:,}")
    if entry.length_of is not None:
        other = root.get(entry.length_of) if isinstance(root, dict) else None
        if isinstance(other, list) and len(other) != len(x):
            raise Problem(where, f"has {len(x)} items but {entry.length_of} has {len(other)}")
    out = [_check(entry.item, item, f"{where}[{i}]", root) for i, item in enumerate(x)]
    if entry.distinct and len(set(map(repr, out))) != len(out):
        raise Problem(where, f"has duplicates: {_shown(out)}")
    if entry.ascending and out != sorted(out):
        raise Problem(where, "must be ascending")
    return out


def _check_record(entry: Record, x, where: str, root):
    if x is None and entry.nullable:
        return None
    if not isinstance(x, dict):
        raise Problem(where, f"must be a table of named entries, got {_shown(x)}")
    unknown = [k for k in x if k not in entry.entries]
    if unknown and not entry.other_keys:
        raise Problem(_join(where, str(unknown[0])), "is not a field flt-diag writes here")
    out = dict(x)
    for name, sub in entry.entries.items():
        if name in x:
            out[name] = _check(sub, x[name], _join(where, name), root)
        elif sub.required:
            raise Problem(_join(where, name), "is missing")
    return out


def _check_table(entry: Table, x, where: str, root):
    if not isinstance(x, dict):
        raise Problem(where, f"must be a table, got {_shown(x)}")
    if not entry.min_items <= len(x) <= entry.max_items:
        raise Problem(where, f"has {len(x):,} entries; it needs {entry.min_items} to {entry.max_items:,}")
    out = {}
    for k, v in x.items():
        key = k
        if entry.key.kind is int:
            try:
                key = int(str(k))
            except ValueError:
                raise Problem(_join(where, str(k)), "is not a whole number") from None
        problem = replace(entry.key, flag="", many=False).check(key)
        if problem:
            raise Problem(_join(where, str(k)), problem.strip())
        out[k] = _check(entry.entry, v, _join(where, str(k)), root)
    return out


def _check_shape(entry: Shape, x, where: str):
    got = getattr(x, "shape", None)
    if got is None or not hasattr(x, "dtype"):
        raise Problem(where, f"must be a tensor, got {_shown(x)}")
    if tuple(got) != tuple(entry.shape):
        raise Problem(where, f"has shape {tuple(got)}; this run's is {tuple(entry.shape)}")
    return x


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _check(entry, x, where: str, root):
    if isinstance(entry, Scalar):
        return _check_scalar(entry, x, where)
    if isinstance(entry, Items):
        return _check_items(entry, x, where, root)
    if isinstance(entry, Record):
        return _check_record(entry, x, where, root)
    if isinstance(entry, Table):
        return _check_table(entry, x, where, root)
    return _check_shape(entry, x, where)


def check(entry, x, where: str = ""):
    """`x` checked against `entry` (see the module doc); raises Problem on the first misfit."""
    return _check(entry, x, where, x)


def fields(entry, where: tuple = ()) -> list[tuple[tuple, object]]:
    """Every entry below `entry` with its path: keys of records, 0 for a list's first item, None for
    a table's first key (a sample file decides which)."""
    out = []
    if isinstance(entry, Record):
        for name, sub in entry.entries.items():
            out += [((*where, name), sub), *fields(sub, (*where, name))]
    elif isinstance(entry, Items):
        out += [((*where, 0), entry.item), *fields(entry.item, (*where, 0))]
    elif isinstance(entry, Table):
        out += [((*where, None), entry.entry), *fields(entry.entry, (*where, None))]
    return out


# --------------------------------------------------------------------------- reading a file

def bad(path, problem: Problem | str) -> BadFile:
    return BadFile(f"{path}: {problem}")


def read_text(path: Path) -> str:
    path = Path(path)
    try:
        with open_regular(path, text=True) as f:  # a FIFO, a folder, a device: one line, never blocks
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise BadFile(f"{path}: {size:,} bytes; the files flt-diag writes there are far smaller")
            return f.read()
    except FileNotFoundError:
        raise StorageError(f"missing {path}") from None
    except IsADirectoryError:
        raise BadFile(f"{path} is a folder, not a file") from None
    except UnicodeDecodeError:
        raise BadFile(f"{path}: not text (UTF-8)") from None


def read_json(path: Path):
    """A JSON file's content; a missing, unreadable or malformed file is one line."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadFile(f"unreadable {path}: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of 5,000 digits, nesting 100,000 deep
        raise BadFile(f"unreadable {path}: {type(e).__name__}: {str(e)[:100]}") from None


def checked(path, entry, obj, where: str = ""):
    """`obj` (read from `path`) checked against `entry`; a misfit is one BadFile line."""
    try:
        return check(entry, obj, where)
    except Problem as p:
        raise bad(path, p) from None
