"""The exit of every analysis/ script: its main's status, or one `error:` line and exit 2 for a missing or bad
folder (flt-diag's StorageError and BadFile are ValueErrors) or a file it cannot write, never a traceback."""
import sys


def run(main) -> None:
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a missing folder to write into, no permission, a full disk (as flt-diag's commands say it)
        print(f"error: {e.strerror or type(e).__name__}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        sys.exit(2)
