"""When a run's outcome under a map criterion is certain (torch-free; pure functions of the records so far).

A criterion's outcome is *certain* at step s when no continuation of the run past s can change the class the
criterion reads (broken or not: flt_diag.judge.map_boundaries.CRITERIA). Only "broken" can ever be certain
before the last step (every rule that makes a run count as held reads its final loss), and only by these
rules of the verdict (v4; flt_diag.judge.verdict), each proved from the rule itself (docs/DESIGN.md §5):

* a non-finite loss (rule 1, `diverged`): the run is diverged whatever follows, broken under every criterion;
* `training`, the loss climb (rule 2/4a): the smoothed loss s is a trailing mean (its value at a step reads
  only the steps before it), so its rise above its running minimum at each step seen is fixed; the climb is the
  largest rise and can only grow, and the threshold max(rebound_abs, rebound_rel * min s) can only fall as
  min s falls (losses are >= 0 and rebound_rel >= 0). Once the largest rise so far exceeds the threshold at the
  running minimum so far, the full run's climb exceeds the full run's threshold: collapsed, stalled or
  unstable, never stable;
* `training`, the gradient oscillation (rule 4b): a window whose last difference is recorded holds every
  difference it will ever hold; once such a window's median |dlog g| exceeds the threshold, the run is
  unstable if its loss rules call it stable (and not stable otherwise);
* `explosion`: the peak residual norm over every recorded loop and layer can only grow: once one exceeds
  explosion_ratio * sqrt(d), residual_explosion_any holds.

No rule that predicts (a stall read off a plateau, the collapse predictor) is used here: a prediction can be
wrong, and a wrong one would move a map's boundary. `--stop-on-collapse` is such an option, never a default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from flt_diag.judge.verdict import Recipe, oscillation_index, quiet, smoothed
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import series

RESIDUAL_METRICS = (M.RESID_NORM, M.RESID_NORM_LOOP_END)  # what residual_explosion_any reads
DECIDABLE = ("training", "collapse", "explosion")  # the map's criteria (flt_diag.config.grid_options.Criterion)


@dataclass(frozen=True)
class Decision:
    """The first step at which every criterion asked about was certain, and per criterion the rule that made
    it certain with the step it did (`reasons`)."""

    step: int
    reasons: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        return f"decided at step {self.step}: " + "; ".join(f"{c} broken ({why})" for c, why in self.reasons.items())


def nonfinite_step(loss: pd.Series) -> int | None:
    """The first step with a non-finite loss (rule 1), or None."""
    bad = np.flatnonzero(~np.isfinite(loss.to_numpy(dtype=float)))
    return int(loss.index[bad[0]]) if len(bad) else None


@quiet
def climb_step(loss: pd.Series, recipe: Recipe) -> int | None:
    """The first step s at which the loss records up to s make the climb of rule 2 exceed its threshold whatever
    follows: the largest rise of the smoothed loss above its running minimum so far > max(rebound_abs,
    rebound_rel * running minimum). (Fewer than `smooth_window` losses are smoothed into one value: no rise.)"""
    v = recipe.verdict
    s = smoothed(loss, v.smooth_window).dropna()
    low = s.cummin()
    rise = (s - low).cummax()
    threshold = np.maximum(v.rebound_abs, v.rebound_rel * low.to_numpy())
    hit = np.flatnonzero(rise.to_numpy() > threshold)
    return int(s.index[hit[0]]) if len(hit) else None


def oscillation_step(grad_norm: pd.Series, recipe: Recipe, loops: pd.Series | None = None) -> int | None:
    """The first step at which a window of rule 4b that fires (median |dlog g| above the threshold, net of the
    loop count's change where `loops`, the run's loops_run series, varies: verdict v4) holds all its
    differences: min(start + osc_window, span_end - 1) over the firing windows of the records given, where
    that step is recorded (a window still open may yet fall below the threshold; a closed one's netting uses
    only its own differences, so it is final)."""
    v = recipe.verdict
    span_end = recipe.steps - round(recipe.warmdown_frac * recipe.steps)  # (as verdict.judged)
    index = oscillation_index(grad_norm, span_end, v.osc_window, v.osc_dlog_threshold, loops)
    last = int(grad_norm.index.max()) if len(grad_norm) else -1
    closed = [min(w["start"] + v.osc_window, span_end - 1) for w in index["osc_dlog_windows"]
              if w["median_abs_dlog"] > v.osc_dlog_threshold]
    closed = [s for s in closed if s <= last]
    return min(closed) if closed else None


def explosion_step(df: pd.DataFrame, recipe: Recipe) -> int | None:
    """The first step with a finite residual norm (any loop, any layer, any loop end) above explosion_ratio *
    sqrt(width) (residual_explosion_any), or None."""
    threshold = recipe.verdict.explosion_ratio * math.sqrt(recipe.width)
    rows = df[df.metric.isin(RESIDUAL_METRICS)]
    values = rows.value.to_numpy(dtype=float)
    over = rows[np.isfinite(values) & (values > threshold)]
    return int(over.step.min()) if len(over) else None


def certain_broken(df: pd.DataFrame, recipe: Recipe, criterion: str) -> tuple[int, str] | None:
    """(step, rule) at which the records `df` (a metrics table: step, metric, loop, layer, value) first make
    `criterion` certainly broken; None while its outcome is open."""
    if criterion not in DECIDABLE:
        raise ValueError(f"unknown criterion {criterion!r}; one of {', '.join(DECIDABLE)}")
    loss = series(df, M.LOSS)
    found: list[tuple[int, str]] = []
    if (s := nonfinite_step(loss)) is not None:
        found.append((s, "non-finite loss"))  # (a climb before it, computed on the same values, comes first)
    if criterion == "training":
        if (s := climb_step(loss, recipe)) is not None:
            found.append((s, "the smoothed loss climbed past the spike threshold"))
        if (s := oscillation_step(series(df, M.GRAD_NORM), recipe, series(df, M.LOOPS_RUN))) is not None:
            found.append((s, "a closed gradient-oscillation window fired"))
    elif criterion == "explosion" and (s := explosion_step(df, recipe)) is not None:
        found.append((s, "a residual norm exceeded the explosion threshold"))
    if not found:
        return None
    step, why = min(found)
    return step, f"{why} at step {step}"


def decided_at(df: pd.DataFrame, recipe: Recipe, criteria) -> Decision | None:
    """The step at which the records `df` first make every criterion of `criteria` certain (the latest of their
    steps), or None while one is open (and for no criteria: nothing to decide). A run that is stopped there
    has, under each criterion, the outcome it would have had had it run to its last step."""
    criteria = list(dict.fromkeys(criteria))
    if not criteria:
        return None
    found = {c: certain_broken(df, recipe, c) for c in criteria}
    if any(x is None for x in found.values()):
        return None
    return Decision(step=max(s for s, _ in found.values()), reasons={c: why for c, (_, why) in found.items()})  # type: ignore[misc]
