"""The sharpness (every `sharpness_every` steps, off by default; DESIGN.md §3, "Loop dynamics"): the top eigenvalue
of the Hessian of the training loss at the step's first micro-batch (its first `dynamics_batch` sequences) w.r.t. the
trained parameters, by `dynamics_iters` power iterations of Hessian-vector products (double backward) from a
direction drawn by the step's generator (after the loop map's draws, where both are taken). Moment loop_map
(records/__init__.py, MOMENTS), on flt-diag's own model only; the torch math: flt_diag.instruments.sharpness,
through the step's loop map `ctx.loop_map` (its `sharpness()`)."""
from __future__ import annotations

from flt_diag.records import Record, RecordContext, RecordOptions

SHARPNESS = "sharpness"


def compute(ctx: RecordContext) -> dict:
    """{sharpness: the top Hessian eigenvalue} (none on a model flt-diag did not write)."""
    value = ctx.loop_map.sharpness()
    return {} if value is None else {SHARPNESS: value}


RECORD = Record(options=RecordOptions, switched_by="sharpness_every", moment="loop_map", schedule="every_n",
                context=True, compute=compute, metrics={
                    SHARPNESS: "top Hessian eigenvalue of the training loss w.r.t. the trained parameters (every N "
                               "steps)"})
