"""`python -m flt_diag.cli ...` is `flt-diag ...`."""
import sys

from flt_diag.cli.commands import main

sys.exit(main())
