"""The `flt-diag` command line (the top layer): `app` generates it with typer from the options that
`options` assigns to each command, `commands` holds the commands, `specs` builds grid specs and reads
study files, `console` and `output` print, `table` writes docs/cli.md."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The `flt-diag` command. Importing the command line reads every installed record and stabiliser: one of
    one's own that breaks flt-diag's tables there (an option named like flt-diag's own) is one line, exit 2, not a
    traceback before any command runs."""
    try:
        from flt_diag.cli.app import main as run
    except ValueError as e:
        print(f"error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    return run(argv)


__all__ = ["main"]
