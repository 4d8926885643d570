"""Reading a file (a missing, malformed, huge or deeply nested one is one line), and checking what it holds
against its pydantic model (flt_diag.storage.file_models). Torch-free, and no config at import.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from flt_diag.config.option_fields import MAX_ITEMS, dotted, one_line  # noqa: F401 (re-exported)
from flt_diag.storage.errors import BadFile, StorageError  # noqa: F401  (re-exported: one error type)
from flt_diag.storage.safe_files import read_bounded

MAX_FILE_BYTES = 64 << 20  # flt-diag's JSON and TOML files are kilobytes; a bigger one is not one of them


# --------------------------------------------------------------------------- reading a file

def bad(path, problem: str) -> BadFile:
    return BadFile(f"{path}: {problem}")


def read_text(path: Path, limit: int = MAX_FILE_BYTES, what: str = "one of flt-diag's files") -> str:
    """A regular file's UTF-8 text, at most `limit` bytes read (safe_files.read_bounded: a FIFO, a folder, a
    device, a huge or growing file: one line, never blocks, never fills the memory)."""
    data = read_bounded(path, limit, what)
    try:
        return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()  # as open(): universal newlines
    except UnicodeDecodeError:
        raise BadFile(f"{path}: not text (UTF-8)") from None


def read_json(path: Path):
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadFile(f"unreadable {path}: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of 5,000 digits, nesting 100,000 deep
        raise BadFile(f"unreadable {path}: {type(e).__name__}: {str(e)[:100]}") from None


def checked(path, model, obj, context: dict | None = None):
    """`obj` (read from `path`) validated by `model` (a pydantic model or any type; `context` for its
    validators); a misfit is one BadFile line "<file>: <field> <problem>", the field dotted ("models.100.coef[2]")."""
    try:
        return TypeAdapter(model).validate_python(obj, context=context)  # (a model: its own validator)
    except ValidationError as e:
        cls = model if isinstance(model, type) else None
        raise bad(path, one_line(e, dotted, cls)) from None
