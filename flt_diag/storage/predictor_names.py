"""The names an early-warning predictor file is made of (its features, targets, class weights) and
where the packaged one lives: what the predictor's loader (flt_diag.storage.files) checks against,
kept apart from the features' code so that the loader does not import it."""
from __future__ import annotations

from pathlib import Path

FEATURES = ["resid_level", "resid_growth", "loop_ratio", "grad_cv", "grad_dlog", "grad_cos", "act_grad_decay",
            "loss_slope", "loss_climb"]  # every feature `features` computes
PACKAGED = Path(__file__).parent.parent / "judge" / "early_warning.json"  # the packaged predictor (flt-diag fit-predictor)
COLLAPSE = ("stalled", "collapsed", "diverged")  # the run did not train: the paper's collapse is a high-loss plateau
FAILS = ("unstable", "stalled", "collapsed", "diverged")  # every verdict but stable (v3 added stalled)
# target -> (the final verdicts it counts; "collapse" counts stalled since 2026-12-01, whether a loss climb that recovered counts too)
TARGETS = {"fails": (FAILS, False),      # the run ends not stable (default)
           "collapse": (COLLAPSE, False),  # the run ends collapsed or diverged
           "climbs": (FAILS, True)}        # ... or its loss climbed and recovered (transient_rebound)
CLASS_WEIGHTS = ("balanced", "none")
