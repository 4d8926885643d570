"""`python -m flt_diag ...` is `flt-diag ...` (for environments where the console script is not on PATH)."""
import sys

from .cli import main

sys.exit(main())
