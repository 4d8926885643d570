"""The `flt-diag` command line (the top layer): `app` generates it with typer from the options that
`options` assigns to each command, `commands` holds the commands, `specs` builds grid specs and reads
study files, `console` and `output` print, `table` writes docs/cli.md."""
from flt_diag.cli.app import main

__all__ = ["main"]
