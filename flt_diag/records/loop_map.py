"""The loop map's records (of the loop dynamics, every `dynamics_every` steps; DESIGN.md §3, "Loop dynamics"): at
the step's first micro-batch (its first `dynamics_batch` sequences), for each loop t = 2..K, the Jacobian of the loop
map h(t-1) -> h(t) at the forward's own h(t-1): its largest singular value (power iteration), its spectral radius and
that Ritz pair's residual (Arnoldi), its mean gain over random directions, and the growth of a perturbation carried
from h(1). Moment loop_map (records/__init__.py, MOMENTS): taken every N steps whether the step is recorded or not, on
flt-diag's own model; on a model flt-diag did not write, on the recorded steps with loop_dynamics on, from the
loop-end streams and the user's loop_step= (one that fails there is said once and the loop map records no more). The
torch math: flt_diag.instruments.loop_dynamics, through the step's loop map `ctx.loop_map` (its `stats()`)."""
from __future__ import annotations

from flt_diag.records import Record, RecordContext, RecordOptions

LOOP_GAIN = "loop_gain"
LOOP_SPECTRAL_RADIUS = "loop_spectral_radius"
LOOP_SPECTRAL_RESIDUAL = "loop_spectral_residual"
LOOP_MEAN_GAIN = "loop_mean_gain"
LOOP_PERTURBATION_GROWTH = "loop_perturbation_growth"


def compute(ctx: RecordContext) -> dict:
    """{metric: {loop t: value}}, t = 2..K, of the step's loop map (none where it has no loop map: K = 1, or a
    watched model without loop_step= or with fewer than two loop ends)."""
    stats = ctx.loop_map.stats()
    if stats is None:
        return {}
    return {metric: dict(zip(range(2, len(values) + 2), values.unbind())) for metric, values in stats.items()}


RECORD = Record(options=RecordOptions, switched_by="dynamics_every", moment="loop_map", schedule="every_n",
                context=True, compute=compute, metrics={
                    LOOP_GAIN: "largest singular value of the Jacobian of h(t-1) -> h(t), loop t >= 2 (every N steps)",
                    LOOP_SPECTRAL_RADIUS: "spectral radius of the same Jacobian (Arnoldi; earlier runs: 8 power steps)",
                    LOOP_SPECTRAL_RESIDUAL: "||J y - lambda y|| / |lambda| of that Ritz pair: < 0.01 = converged",
                    LOOP_MEAN_GAIN: "mean of ||J v|| over random unit directions v at h(t-1) (the rms singular value)",
                    LOOP_PERTURBATION_GROWTH: "||d(t)|| / ||d(t-1)|| of a perturbation carried from h(1)"})
