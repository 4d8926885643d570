"""The one error path of every analysis/ script: bad input is one `error:` line on stderr and exit 2, never a
traceback.

* `Parser`: argparse, but a bad argument is one `error: ...` line (argparse's own is a usage line and then
  the error), exit 2.
* `whole(lo, hi)`: an argparse type for counts and steps, a whole number in [lo, hi] (`--draws -1` and
  `--at -5` are refused by name, before anything is read).
* `guarded(main)`: `main(argv)` whose bad input becomes one line and 2: a missing or bad folder or file
  (flt-diag's StorageError and BadFile are ValueErrors; so are undecodable text and a CSV pandas cannot
  parse), a file it cannot read or write (OSError: missing, no permission, a full disk; as flt-diag's commands
  say it), a command that fails or hangs (subprocess), and a crafted table whose cells are of the wrong kind
  or missing (TypeError, LookupError), a value nested too deep (RecursionError). Other exceptions (a bug)
  keep their traceback. A library's warnings are held back while `main` runs: on bad input the one line is
  all that is printed; otherwise they are shown once `main` returns.
* `run(main)`: `sys.exit(guarded(main)())`, for `if __name__ == "__main__"`.
"""
from __future__ import annotations

import argparse
import functools
import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

BAD_INPUT = (ValueError, OSError, subprocess.SubprocessError, TypeError, LookupError, RecursionError)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, then each path argument of type `folder` or `source` checked (after every other
        refusal, so that an unknown option is named first; a path that is not one: a ValueError line)."""
        parsed = super().parse_args(args, namespace)
        for action in self._actions:
            given = getattr(parsed, action.dest, None)
            for path in (given if isinstance(given, list) else [given]) if hasattr(action.type, "check") else []:
                action.type.check(path)  # type: ignore[union-attr]  # (a ValueError: `guarded`'s one line, 2)
        return parsed


def whole(lo: int = 0, hi: int | None = None):
    """An argparse type: a whole number in [lo, hi] (hi None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"{n} is out of range: give {lo} or more"
                                             if hi is None else f"{n} is out of range: give {lo} to {hi}")
        return n
    parse.__name__ = "whole number"
    return parse


def _given(text: str, folder_only: bool):
    """`text` as a Path that exists as a folder (or, unless `folder_only`, a regular file: an archive record),
    else argparse's one line saying what the path is: missing, or a FIFO, a device, a socket."""
    from flt_diag.storage.safe_files import kind_of
    wanted = "a folder" if folder_only else "a folder or a file"
    try:
        mode = os.stat(text).st_mode  # (never blocks, even on a FIFO)
    except FileNotFoundError:
        raise ValueError(f"no such {'folder' if folder_only else 'file or folder'}: {text}") from None
    except OSError as e:
        raise ValueError(f"cannot read {text}: {e.strerror or e}") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) and not folder_only):
        raise ValueError(f"{text} is {kind_of(mode)}, not {wanted}")
    return Path(text)


def folder(text: str):
    """An argparse type: an existing folder (a FIFO, a file, a device or a missing path: one line saying which,
    by Parser.parse_args)."""
    return Path(text)


def source(text: str):
    """An argparse type: an existing folder or regular file (a run, a sweep, an archive or an archive record)."""
    return Path(text)


folder.__name__, source.__name__ = "folder", "folder or file"
folder.check = lambda path: _given(str(path), folder_only=True)  # type: ignore[attr-defined]
source.check = lambda path: _given(str(path), folder_only=False)  # type: ignore[attr-defined]


def message(e: BaseException) -> str:
    """One line for an error: an OSError as its reason and file; anything else its text, whitespace joined
    (a message quoting a command's stderr spans lines), cut at 400 characters; its type where it has no text,
    and a KeyError (whose text is only the key) as the key that is missing."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{f': {e.filename}' if e.filename else ''}"
    text = " ".join(str(e).split())
    if isinstance(e, KeyError):
        return f"no {text} in the input (a column, key or name it needs)"
    if isinstance(e, (TypeError, IndexError, RecursionError)):
        text = f"the input holds something of the wrong kind or shape ({type(e).__name__}: {text})"
    return (text or type(e).__name__)[:400]


def guarded(main):
    @functools.wraps(main)
    def checked(argv=None) -> int:
        with warnings.catch_warnings(record=True) as said:  # a library's warning about bad input: held back
            warnings.simplefilter("default")
            try:
                code = main(argv)
            except BAD_INPUT as e:  # its one line says what is wrong; the warnings that led there are not shown
                print(f"error: {message(e)}", file=sys.stderr)
                return 2
        for w in said if code == 0 else ():  # a run that succeeds shows them, as they came (one refused in its
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)  # own main said its one line)
        return code
    return checked


def plan_report(doc: str, report, root_help: str):
    """The main of a plan's analysis script: ROOT [--final] [--out FILE] -> report(root, final) as Markdown,
    printed or written to FILE; bad input one line (guarded)."""
    @guarded
    def main(argv=None) -> int:
        from pathlib import Path

        parser = Parser(description=doc.splitlines()[0])
        parser.add_argument("root", type=folder, help=root_help)
        parser.add_argument("--final", action="store_true", help="the plan's cut-off: read what is archived")
        parser.add_argument("--out", type=Path, help="write the Markdown here instead of printing it")
        args = parser.parse_args(argv)
        return emit(report(args.root, args.final), args.out)
    return main


def emit(text: str, out) -> int:
    """A report's Markdown written to `out` (atomically) or, without one, printed; 0 (the scripts' success)."""
    from flt_diag.storage.folders import atomic_write_text
    if out:
        atomic_write_text(out, text)
    else:
        print(text, end="")
    return 0


def run(main) -> None:
    sys.exit(guarded(main)())
