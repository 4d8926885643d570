"""The exit of every analysis/ script: its main's status, or one `error:` line and exit 2 for a missing or bad
folder (flt-diag's StorageError and BadFile are ValueErrors), never a traceback."""
import sys


def run(main) -> None:
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
