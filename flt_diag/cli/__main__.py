"""`python -m flt_diag.cli ...` is `flt-diag ...`."""
import sys

try:  # Ctrl-C during the imports (torch takes seconds) is an interrupt too, not a traceback
    from flt_diag.cli.app import main
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
