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
  keep their traceback.
* `run(main)`: `sys.exit(guarded(main)())`, for `if __name__ == "__main__"`.
"""
from __future__ import annotations

import argparse
import functools
import subprocess
import sys

BAD_INPUT = (ValueError, OSError, subprocess.SubprocessError, TypeError, LookupError, RecursionError)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


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
    import os
    import stat
    from pathlib import Path

    from flt_diag.storage.safe_files import kind_of
    wanted = "a folder" if folder_only else "a folder or a file"
    try:
        mode = os.stat(text).st_mode  # (never blocks, even on a FIFO)
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"no such {'folder' if folder_only else 'file or folder'}: {text}") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror or e}") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) and not folder_only):
        raise argparse.ArgumentTypeError(f"{text} is {kind_of(mode)}, not {wanted}")
    return Path(text)


def folder(text: str):
    """An argparse type: an existing folder (a FIFO, a file, a device or a missing path: one line saying which)."""
    return _given(text, folder_only=True)


def source(text: str):
    """An argparse type: an existing folder or regular file (a run, a sweep, an archive or an archive record)."""
    return _given(text, folder_only=False)


folder.__name__, source.__name__ = "folder", "folder or file"


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
        try:
            return main(argv)
        except BAD_INPUT as e:
            print(f"error: {message(e)}", file=sys.stderr)
            return 2
    return checked


def plan_report(doc: str, report, root_help: str):
    """The main of a plan's analysis script: ROOT [--final] [--out FILE] -> report(root, final) as Markdown,
    printed or written to FILE; bad input one line (guarded)."""
    @guarded
    def main(argv=None) -> int:
        from pathlib import Path

        from flt_diag.storage.folders import atomic_write_text
        parser = Parser(description=doc.splitlines()[0])
        parser.add_argument("root", type=folder, help=root_help)
        parser.add_argument("--final", action="store_true", help="the plan's cut-off: read what is archived")
        parser.add_argument("--out", type=Path, help="write the Markdown here instead of printing it")
        args = parser.parse_args(argv)
        text = report(args.root, args.final)
        if args.out:
            atomic_write_text(args.out, text)
        else:
            print(text, end="")
        return 0
    return main


def run(main) -> None:
    sys.exit(guarded(main)())
