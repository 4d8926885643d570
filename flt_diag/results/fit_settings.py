"""The settings of an early-warning predictor's fit, each with its default and help, once: `flt-diag
fit-predictor`'s options (flt_diag.cli.options) and flt_diag.results.predictor_fit's defaults. Torch-,
pandas- and matplotlib-free, so that the command line offers them without importing the fit."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from flt_diag.storage.predictor_names import CLASS_WEIGHTS, FEATURES, TARGETS
from flt_diag.config.option_fields import Items, Options, opt


class FitSettings(Options):
    at: Items[Annotated[int, Field(ge=1)]] = opt([100, 200, 300, 500], "Steps to fit a model at.")
    l2: float = opt(1.0, "L2 penalty of the logistic regression.", gt=0)
    target: Literal[tuple(TARGETS)] = opt(  # type: ignore[valid-type]  # (a Literal of the names, built at import)
        "fails", "fails (final verdict unstable, stalled, collapsed or diverged), "
        "collapse (stalled, collapsed or diverged) or climbs (fails, or the loss "
        "climbed and recovered: the verdict's transient_rebound).")
    features: Items[Literal[tuple(FEATURES)]] = opt(  # type: ignore[valid-type]  # (as above)
        ["resid_level", "resid_growth", "loop_ratio", "grad_cv", "grad_dlog",
         "act_grad_decay", "loss_slope", "loss_climb"],
        "Features the model uses.")
    class_weight: Literal[CLASS_WEIGHTS] = opt(  # type: ignore[valid-type]  # (as above)
        "balanced", "balanced (each class weighs half of the fit, whatever "
        "share of the runs fails) or none (each run weighs 1).")


DEFAULTS = FitSettings()
