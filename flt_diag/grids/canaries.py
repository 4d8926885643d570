"""Canary probes of a baseline map (`flt-diag map --baseline`, docs/DESIGN.md §5 "Extending a benchmark"): before a
new variant's lines are pooled with an archived baseline, a few of the baseline's probes are re-run here, on this
code and machine, and compared with their archived records.

On the CPU kind that made them (env.cpu: the same model and SIMD flags) the first CANARY_STEPS steps of
SAME_KIND_PROBES archived probes must give the archived `loss` and `grad_norm` bit for bit (cost: 3 x 16 steps).
On another CPU kind the numbers drift from step 1 on, so the test is the outcome: for the first OTHER_KIND_LINES
lines whose `training` boundary was found, the probes at its last-stable and first-broken value are re-run in full
(cost: 4 probes, each stopped once decided, as the map's) and must end with the archived `training` outcome.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from flt_diag.config.run_config import RunConfig
from flt_diag.instruments.callbacks import Callback
from flt_diag.judge.map_boundaries import CRITERIA, boundaries, map_lines, probe_cell, spec_from_folder
from flt_diag.storage import archive
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics, load_summary
from flt_diag.storage.machine import cpu_info

CANARY_STEPS = 16
SAME_KIND_PROBES = 3
OTHER_KIND_LINES = 2
COMPARED = (M.LOSS, M.GRAD_NORM)


def cpu_kind(cpu: dict | None) -> tuple:
    """What makes two CPUs give the same numbers: the model and the SIMD flags."""
    cpu = cpu or {}
    return cpu.get("model"), tuple(sorted(cpu.get("simd") or ()))


def archived_cpu(record: Path) -> dict | None:
    return (archive.read_meta(record).config.as_written().get("env") or {}).get("cpu")


class StopAfter(Callback):
    """Ends a run after `steps` steps (a canary's first steps; the lr schedule is that of the whole run)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, trainer, step: int) -> None:
        if step + 1 >= self.steps:
            trainer.request_stop(f"canary: first {self.steps} steps")


def _rerun(record: Path, where: Path, steps: int | None = None):
    from flt_diag.training.trainer import Trainer
    cfg = RunConfig.from_dict(archive.read_meta(record).config.as_written())
    run = where / record.stem
    Trainer(cfg, run, callbacks=[StopAfter(steps)] if steps else None).fit()
    return run


def first_steps_differ(record: Path, where: Path, steps: int = CANARY_STEPS) -> str | None:
    """Re-run an archived probe's first `steps` steps; None where loss and gradient norm equal the record's bit for
    bit at every step, else where they first differ."""
    run = _rerun(record, where, steps)
    mine, theirs = (df[df.metric.isin(COMPARED) & (df.step < steps)][["step", "metric", "loop", "layer", "value"]]
                    for df in (load_metrics(run), archive.load_metrics(record)))
    last = int(mine.step.max()) if len(mine) else -1
    theirs = theirs[theirs.step <= last]
    both = theirs.merge(mine, on=["step", "metric", "loop", "layer"], how="outer", suffixes=("_archived", "_here"))
    bad = both[~(both.value_archived == both.value_here)].sort_values("step")
    if len(mine) == 0:
        return "it recorded nothing"
    if bad.empty:
        return None
    r = bad.iloc[0]
    return f"{r.metric} at step {int(r.step)}: archived {r.value_archived!r}, here {r.value_here!r}"


def outcome_differs(record: Path, where: Path, steps: int = 0) -> str | None:
    """Re-run an archived probe in full (`steps`: unused, a check's signature); None where its `training` outcome is
    the archived one."""
    summary, archived = load_summary(_rerun(record, where)), archive.read_meta(record).summary
    if summary is None or archived is None:
        return "the probe did not finish here" if summary is None else "the archived probe has no summary"
    then, now = CRITERIA["training"](archived), CRITERIA["training"](summary)
    return None if then == now else (f"training {'broke' if then else 'held'} in the archive, "
                                     f"{'broke' if now else 'held'} here (verdict {summary.verdict})")


def boundary_probes(baseline: Path, lines: int = OTHER_KIND_LINES) -> list[Path]:
    """The records at the last-stable and first-broken value of the first `lines` lines with a found boundary."""
    spec, table = spec_from_folder(baseline), boundaries(baseline)
    found = table[(table.criterion == "training") & (table.status == "found")].head(lines)
    by_line = {(r.variant, r.loops, r.seed): r for r in map_lines(spec)}
    out = []
    for row in found.itertuples():
        line = by_line[(row.variant, row.loops, row.seed)]
        out += [baseline / f"{probe_cell(spec, line, v).name}{archive.SUFFIX}" for v in (row.last_ok, row.first_broken)]
    return [p for p in out if p.is_file()]


def run_canaries(baseline: Path, report=print) -> list[dict]:
    """The canaries of an archived baseline map on this code and machine: one dict per probe (probe, mode,
    disagreement: None where it agrees)."""
    records = archive.records_in(baseline)
    same = [r for r in records if cpu_kind(archived_cpu(r)) == cpu_kind(cpu_info())]
    if same:
        mode, chosen, check = f"first {CANARY_STEPS} steps bit for bit", same[:SAME_KIND_PROBES], first_steps_differ
    else:
        mode, chosen, check = "training outcome (another CPU kind)", boundary_probes(baseline), outcome_differs
    results = []
    with tempfile.TemporaryDirectory(prefix="flt-diag-canary-") as tmp:
        for record in chosen:
            problem = check(record, Path(tmp))
            report(f"canary {record.stem}: {mode}: " + ("agrees" if problem is None else f"DIFFERS ({problem})"))
            results.append(dict(probe=record.stem, mode=mode, disagreement=problem))
    return results
