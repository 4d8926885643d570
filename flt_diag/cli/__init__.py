"""The `flt-diag` command line (the top layer): `commands` holds the commands, `options` turns the typed
config into their options, `console` prints."""
from flt_diag.cli.commands import main

__all__ = ["main"]
