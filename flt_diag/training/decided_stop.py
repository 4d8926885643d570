"""Stop a run once its criteria are decided (`--stop-when-decided`; a map's probes: the map's criteria).

`DecidedStop` keeps the records the certainty rules read (loss, gradient norm, the loop count a step ran where it
varies, and the residual norms above the explosion threshold), asks flt_diag.judge.decided.decided_at after every step whether every criterion's outcome is
certain, and if so says so (one line, "decided at step s: ...") and ends the run: at once where the step was a
loop-dynamics snapshot (or the run takes none), else after one more step whose snapshot it asks for, so that the
run's last snapshot (what an analysis reads at a probe's end) is of the model at the stop. The summary names the
step (`decided_at`) and the stop (`stop_reason`). docs/DESIGN.md §5.
"""
from __future__ import annotations

import math

import pandas as pd

from flt_diag.instruments.callbacks import Callback
from flt_diag.judge.decided import RESIDUAL_METRICS, Decision, decided_at
from flt_diag.storage import metric_names as M
from flt_diag.storage.file_models import Summary

KEPT = (M.LOSS, M.GRAD_NORM, M.LOOPS_RUN)  # every row of these (the loop count too: rule 4b nets it out, verdict
# v4); of the residual norms only those above the threshold


class DecidedStop(Callback):
    """Ends the run once every criterion of `criteria` is certainly broken (none: never)."""

    def __init__(self, criteria) -> None:
        self.criteria = list(criteria or [])
        self.rows: list[tuple] = []
        self.decision: Decision | None = None
        self.stop_after: int | None = None  # the step after which the run ends (a snapshot step)

    def on_rows(self, trainer, step: int, rows) -> None:
        if not self.criteria or (getattr(trainer, "world", 1) > 1 and "explosion" in self.criteria):
            return  # (under DDP each rank records its own residual norms: no rank could stop alone)
        if self.decision is None:
            self._keep(trainer, rows)
            self.decision = decided_at(self.frame(), trainer.recipe, self.criteria)
            if self.decision is not None:
                self.stop_after = self._snapshot_step(trainer, step)
                if trainer.is_main:
                    print(f"{trainer.run_dir}: {self.decision.text()}", flush=True)
        if self.decision is not None and self.stop_after is not None and step >= self.stop_after:
            trainer.request_stop(self.decision.text())

    def _keep(self, trainer, rows) -> None:
        threshold = trainer.recipe.verdict.explosion_ratio * math.sqrt(trainer.recipe.width)
        self.rows += [tuple(r) for r in rows if r[1] in KEPT or (r[1] in RESIDUAL_METRICS and r[4] > threshold)]

    def frame(self) -> pd.DataFrame:
        """The records kept, as a metrics table."""
        return pd.DataFrame(self.rows, columns=["step", "metric", "loop", "layer", "value"])

    @staticmethod
    def _snapshot_step(trainer, step: int) -> int:
        """The step after which the run ends: this one if it took a loop-dynamics snapshot (or the run takes
        none, or it is the last), else the next, whose snapshot the loop dynamics are asked to take."""
        dynamics = getattr(getattr(trainer, "probe", None), "dynamics", None)
        if dynamics is None or step + 1 >= trainer.cfg.train.steps or not dynamics.takes_snapshots() \
                or dynamics.snapshot_due(step):
            return step
        dynamics.snapshot_at(step + 1)
        return step + 1

    def state_dict(self) -> dict:
        return {"rows": list(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        self.rows = [tuple(r) for r in state["rows"]]


def with_decision(summary: Summary, callbacks) -> Summary:
    """The summary with `decided_at` where a DecidedStop of the run decided it; unchanged otherwise."""
    for cb in callbacks:
        if isinstance(cb, DecidedStop) and cb.decision is not None:
            return Summary.model_validate({**summary.as_written(), "decided_at": cb.decision.step})
    return summary
