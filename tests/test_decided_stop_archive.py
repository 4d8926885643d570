"""The stop once decided (flt_diag.training.decided_stop.DecidedStop), replayed on every archived run of both
stabiliser benchmarks (issue 64's test "the early stop never changes a probe's outcome", through the callback the
Trainer runs, not only the rule it asks): the rows it keeps decide at the step `decided_at` finds on all of a
run's records; where nothing is decided, nothing is; every archived stop is at that step. The stop of
2026-12-07 kept no `loops_run`, so at a sampled loop count it judged by verdict v3 and stopped a stable probe
(docs/plans/2026-12-05-stabiliser-benchmark-2.md, the 17:08 UTC line): these tests fail on that code."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flt_diag.judge.decided import decided_at
from flt_diag.judge.verdict import Recipe
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_config, load_metrics, load_summary
from flt_diag.training.decided_stop import DecidedStop

RUNS = Path(__file__).resolve().parents[1] / "docs" / "data" / "runs"
ROUND_TWO = RUNS / "stabiliser-bench-2"
SET_ASIDE = ROUND_TWO / "D-set-aside"
COLUMNS = ["step", "metric", "loop", "layer", "value"]
PRE_FIX = ("cfba02b", "a5f7189", "f6ffb41", "e7e37c0")  # the commits stage A, B and D ran before 8e9ceff's fix
SAMPLED = ("stars-source_", "huginn_", "parcae-source_")  # the variants that draw their loop count per step


class _Trainer:
    """What DecidedStop reads of a Trainer: its recipe, run folder, rank (no loop-dynamics probe: it stops at the
    decided step itself), and where it asks the run to stop."""

    def __init__(self, recipe):
        self.recipe, self.run_dir, self.is_main, self.world, self.probe, self.stopped = recipe, "run", True, 1, None, None

    def request_stop(self, text):
        self.stopped = text


FOLDERS = ["stabiliser-map", *(f"stabiliser-bench-2/{s}" for s in
                                ("A-strength-0.5", "A-strength-1", "A-strength-2", "A-strength-4", "B-1", "B-2",
                                 "C", "CPU-check", "D", "L2000"))]  # (L2000: none until its runs are archived)


def runs_in(folder: str) -> list[Path]:
    return sorted((RUNS / folder).rglob("*.parquet"))


def archived_runs() -> list[Path]:
    return [p for folder in FOLDERS for p in runs_in(folder)]


def _run(path: Path):
    recipe = Recipe.of(load_config(path).run_config())
    return recipe, load_metrics(path)[COLUMNS]


def criteria_of(path: Path) -> list[str]:
    """The criteria a run's stop judged (its config's stop_when_decided), else its map's (the nearest sweep.json
    above it that names them: round one's map, training and explosion), else `training`."""
    own = load_config(path).run_config().diagnostics.stop_when_decided
    if own:
        return list(own)
    for folder in path.parents:
        spec = folder / "sweep.json"
        if spec.is_file() and json.loads(spec.read_text()).get("criteria"):
            return list(json.loads(spec.read_text())["criteria"])
        if folder == RUNS:
            break
    return ["training"]


def _rows(df):
    return list(df.itertuples(index=False, name=None))


def test_the_replay_reads_every_archived_run_of_both_benchmarks():
    """Every archived folder of both rounds is replayed, none left out (D-set-aside: its own test below)."""
    listed = {p.name for p in ROUND_TWO.iterdir() if p.is_dir()}
    assert listed - {f.split("/")[-1] for f in FOLDERS} == {"D-set-aside"}
    assert len(runs_in("stabiliser-map")) == 312 and len(archived_runs()) >= 312 + 300


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_rows_the_stop_keeps_decide_where_all_of_a_runs_records_do(folder):
    """Every archived run, all its rows handed to the stop at once: its decision is decided_at's on the whole table
    (the rows it drops never matter), and every stop the archive records is at that step."""
    for path in runs_in(folder):
        recipe, df = _run(path)
        criteria = criteria_of(path)
        expected = decided_at(df, recipe, criteria)
        stop = DecidedStop(criteria)
        stop.on_rows(_Trainer(recipe), int(df.step.max()), _rows(df))
        assert (None if stop.decision is None else stop.decision.step) == \
            (None if expected is None else expected.step), path.name
        summary = load_summary(path)
        if summary.decided_at is not None:
            assert expected is not None and summary.decided_at == expected.step, path.name
        if decided_at(df, recipe, ["training"]) is not None:  # (independent of the stop: the verdict on all records)
            assert summary.verdict != "stable", path.name


def _sampled_count_stops() -> list[Path]:
    """The archived runs of round two that were stopped once decided and ran a loop count drawn per step."""
    out = []
    for path in (p for p in archived_runs() if ROUND_TWO in p.parents and p.name.startswith(SAMPLED)):
        if load_summary(path).decided_at is None:
            continue
        _, df = _run(path)
        if df[df.metric == M.LOOPS_RUN].value.nunique() > 1:
            out.append(path)
    return out


def test_every_stopped_run_at_a_sampled_loop_count_fed_step_by_step_stops_where_it_did():
    """The Trainer's path: rows step by step; the stop asks once decided, at the archived `decided_at`, and its
    rows then judge as all the records do."""
    paths = _sampled_count_stops()
    before_the_fix = [p for p in paths if str((load_config(p).env.get("code") or {}).get("commit"))[:7] in PRE_FIX]
    assert len(before_the_fix) == 12  # stars-source 7 in A, 2 in B-2, 1 in D; huginn 2 in D (the 17:08 line)
    for path in paths:
        recipe, df = _run(path)
        stop, trainer = DecidedStop(["training"]), _Trainer(recipe)
        archived = load_summary(path).decided_at
        early = df[df.step < archived - 20]  # (one call up to 20 steps before: a certainty once found stays found,
        stop.on_rows(trainer, int(early.step.max()), _rows(early))  # so undecided there is undecided before)
        assert stop.decision is None, path.name
        for step, rows in df[df.step >= archived - 20].groupby("step", sort=True):
            stop.on_rows(trainer, int(step), _rows(rows))
            if trainer.stopped:
                break
        assert stop.decision is not None and stop.decision.step == archived, path.name
        assert trainer.stopped is not None


def test_the_set_aside_probe_is_the_false_stop_the_fixed_rule_never_decides():
    """D's stars-source seed 1 at x 0.25, stopped by the old code at step 200: on its own records the fixed stop
    decides nothing (its verdict there is `stable`)."""
    paths = sorted(SET_ASIDE.rglob("*.parquet"))
    assert len(paths) == 1
    recipe, df = _run(paths[0])
    assert load_summary(paths[0]).decided_at == 200
    stop = DecidedStop(["training"])
    stop.on_rows(_Trainer(recipe), int(df.step.max()), _rows(df))
    assert stop.decision is None and decided_at(df, recipe, ["training"]) is None


@pytest.mark.parametrize("dropped", [M.LOSS, M.GRAD_NORM, M.LOOPS_RUN])
def test_a_stop_that_kept_too_little_would_be_caught(dropped, monkeypatch):
    """The first test's check can fail: a stop keeping one metric fewer (the loop count: the bug of 2026-12-07)
    decides elsewhere on some archived run."""
    import flt_diag.training.decided_stop as D
    monkeypatch.setattr(D, "KEPT", tuple(m for m in D.KEPT if m != dropped))
    for path in archived_runs()[::-1]:  # (round two first: its sampled loop counts)
        recipe, df = _run(path)
        stop = DecidedStop(["training"])
        stop.on_rows(_Trainer(recipe), int(df.step.max()), _rows(df))
        expected = decided_at(df, recipe, ["training"])
        if (None if stop.decision is None else stop.decision.step) != (None if expected is None else expected.step):
            return
    pytest.fail(f"no archived run decides otherwise without {dropped}")
