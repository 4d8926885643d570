"""`python -m flt_diag ...` is `flt-diag ...` (for environments where the console script is not on PATH)."""
import sys

try:  # Ctrl-C during the imports (torch takes seconds) is an interrupt too, not a traceback
    from flt_diag.cli import main  # (its net: a plugin that breaks the tables at import is one line)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
