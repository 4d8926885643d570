"""The old path of flt_diag.integrations.lightning (docs/api.md), kept so that scripts importing it go on working."""
from flt_diag.integrations.lightning import FltDiagCallback

__all__ = ["FltDiagCallback"]
