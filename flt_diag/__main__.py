"""`python -m flt_diag ...` is `flt-diag ...` (for environments where the console script is not on PATH)."""
import sys

from flt_diag.cli.app import main

sys.exit(main())
