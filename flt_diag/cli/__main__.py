"""`python -m flt_diag.cli ...` is `flt-diag ...`."""
import sys

from flt_diag.cli.app import main

sys.exit(main())
