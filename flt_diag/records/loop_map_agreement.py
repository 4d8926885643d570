"""The per-loop gradient agreement (of the loop dynamics, with the loop map every `dynamics_every` steps; DESIGN.md
§3, "Loop dynamics"): at the step's first micro-batch (its first `dynamics_batch` sequences), for each loop t and
block, the cosine between loop t's gradient of the block's weights and their total gradient (over all loops), by one
backward per loop that writes to no .grad. Moment loop_map (records/__init__.py, MOMENTS), on flt-diag's own model
only (K >= 2); the torch math: flt_diag.instruments.loop_dynamics, through the step's loop map `ctx.loop_map` (its
`agreement()`). Named after the loop map so that it is taken after it, as before it was a file."""
from __future__ import annotations

from flt_diag.records import Record, RecordContext, RecordOptions

LOOP_GRAD_COSINE = "loop_grad_cosine"


def compute(ctx: RecordContext) -> dict:
    """{loop_grad_cosine: {(loop t, block): cosine}} (none on a model flt-diag did not write, or with K = 1)."""
    cos = ctx.loop_map.agreement()  # (K, L)
    if cos is None:
        return {}
    return {LOOP_GRAD_COSINE: {(t + 1, layer + 1): value for t, row in enumerate(cos.unbind())
                               for layer, value in enumerate(row.unbind())}}


RECORD = Record(options=RecordOptions, switched_by="dynamics_every", moment="loop_map", schedule="every_n",
                context=True, compute=compute, metrics={
                    LOOP_GRAD_COSINE: "cos(loop t's gradient of block `layer`'s weights, their total gradient)"})
