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

        parser = Parser(description=doc.splitlines()[0])
        parser.add_argument("root", type=Path, help=root_help)
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
