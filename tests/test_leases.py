"""Many workers on one map folder (docs/DESIGN.md §5, "Many machines"): probes claimed under leases, so that two
workers and a racing duplicate train no probe twice and lose none, a worker killed with kill -9 has its probe
taken over (retry count + 1) and resumed from its resume.pt, and SIGTERM leaves a checkpoint and a released lease."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import processes
from flt_diag.grids import leases as L
from flt_diag.grids.lease_worker import work
from flt_diag.grids.stability_map import prepare_map_folder
from flt_diag.judge.map_boundaries import boundaries
from flt_diag.storage.folders import CELLS, RESUME, SUMMARY
from flt_diag.training.checkpoint import load
from conftest import within
from lease_runs import TIMES, Counted, train_spec
from test_campaigns import expected_bracket, kill_spec

TESTS = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}


def _worker(kind: str, out: Path, log: Path, pause) -> subprocess.Popen:
    return processes.start([sys.executable, str(TESTS / "lease_runs.py"), kind, str(out), str(log), str(pause)],
                           env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for(predicate, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_a_claim_is_exclusive_and_an_expired_lease_is_taken_over_then_failed(tmp_path):
    times = L.LeaseTimes(heartbeat_s=1, timeout_s=10, max_retries=1)
    first = L.claim(tmp_path, "p", times)
    assert first is not None and first.lease.retries == 0
    assert L.claim(tmp_path, "p", times) is None  # held: a second claim waits
    assert L.current(tmp_path, "p")[1].pid == os.getpid()
    stale = first.lease.model_copy(update=dict(heartbeat=time.time() - 11))  # silent for 11 s > 10 s
    first.path.write_text(stale.model_dump_json())
    second = L.claim(tmp_path, "p", times)
    assert second is not None and second.generation == 1 and second.lease.retries == 1
    assert not L.refresh(first)  # the old holder learns it was taken over
    L.release(second, "preempted")
    third = L.claim(tmp_path, "p", times)  # a released lease: taken at once, the retry count kept
    assert third is not None and third.lease.retries == 1
    third.path.write_text(third.lease.model_copy(update=dict(heartbeat=time.time() - 11)).model_dump_json())
    assert L.claim(tmp_path, "p", times) is None  # a second expiry exceeds max_retries = 1: failed
    assert "max retries 1" in L.failed_reason(tmp_path, "p")
    assert [r["state"] for r in L.lease_table(tmp_path)] == ["failed"]


def test_two_workers_and_a_racing_duplicate_train_no_probe_twice_and_lose_none(tmp_path):
    out, log, spec = tmp_path / "m", tmp_path / "finished.log", kill_spec()
    prepare_map_folder(spec, out)
    workers = [_worker("probe", out, log, 0.1) for _ in range(3)]  # (the third: a duplicate of the second)
    for p in workers:
        try:
            assert p.wait(timeout=120) == 0, p.stderr.read().decode()[-2000:]
        finally:
            processes.kill_group(p)
    finished = log.read_text().split()
    assert len(finished) == len(set(finished))  # no probe trained twice
    assert {(r.seed, r.last_ok, r.first_broken) for r in boundaries(out).itertuples()} == \
        {(s, *expected_bracket(s, spec.grid)) for s in spec.seeds}  # none lost: every line found its boundary
    assert all((out / CELLS / name / SUMMARY).exists() for name in finished)


def test_a_worker_killed_mid_probe_has_its_probe_taken_over_and_resumed(tmp_path):
    out, log = tmp_path / "m", tmp_path / "starts.log"
    spec = train_spec(steps=100, checkpoint_every=2)
    prepare_map_folder(spec, out)
    cell = spec.cell(spec.lines()[0], 1.0)
    resume = out / CELLS / cell.name / RESUME
    p = _worker("train", out, log, "100:2")
    try:
        _wait_for(resume.exists, what="no resume.pt")
    finally:
        processes.kill_group(p)  # kill -9: no clean-up, its lease left behind
    saved = int(load(resume)["step"])
    assert L.claim(out, cell.name, TIMES) is None  # the dead holder's lease is not yet expired
    time.sleep(TIMES.timeout_s + 0.5)
    with within(90):  # (a lease that never expired would keep this worker waiting)
        assert work(spec, out, runner=Counted(log), times=TIMES, report=lambda s: None) == 1
    starts = [line.split() for line in log.read_text().splitlines()]
    assert starts[0] == [cell.name, "0"] and len(starts) == 2 and int(starts[1][1]) >= saved > 0  # resumed
    assert (out / CELLS / cell.name / SUMMARY).exists()
    assert L.current(out, cell.name)[1].retries == 1


def test_sigterm_leaves_a_checkpoint_and_a_released_lease(tmp_path):
    out, log = tmp_path / "m", tmp_path / "starts.log"
    spec = train_spec(checkpoint_every=0)  # no periodic checkpoint: only the preemption writes one
    prepare_map_folder(spec, out)
    cell = spec.cell(spec.lines()[0], 1.0)
    p = _worker("train", out, log, "400:0")
    try:
        _wait_for(lambda: (out / CELLS / cell.name / "config.json").exists(), what="no training started")
        time.sleep(0.5)
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=60) == 3, p.stderr.read().decode()[-2000:]
    finally:
        processes.kill_group(p)
    state = load(out / CELLS / cell.name / RESUME)
    assert 0 < int(state["step"]) < 400
    generation, lease = L.current(out, cell.name)
    assert lease.released and lease.reason.startswith("preempted") and lease.retries == 0
    assert not (out / CELLS / cell.name / SUMMARY).exists()


def test_of_two_claims_that_read_the_same_state_exactly_one_gets_the_lease(tmp_path, monkeypatch):
    times = L.LeaseTimes()
    read_before = L.current(tmp_path, "p")  # (nothing yet)
    assert L.claim(tmp_path, "p", times) is not None
    monkeypatch.setattr(L, "current", lambda folder, probe: read_before)  # the racer read before the first wrote
    assert L.claim(tmp_path, "p", times) is None  # the same generation's file exists: refused, not overwritten
    assert L.current.__module__ and [p.name for p in (tmp_path / L.LEASES).iterdir()] == ["p.0.json"]


def test_submitit_local_workers_make_the_map_the_in_process_search_makes(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    from campaign_runs import Probe
    from flt_diag.cli.cluster_options import ClusterOptions
    from flt_diag.grids.slurm import JOBS, submit_map
    from flt_diag.grids.stability_map import run_map
    from flt_diag.judge.map_boundaries import MAP_CSV
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])  # (submitit's local workers import the tests' runner)
    spec, log = kill_spec(), tmp_path / "finished.log"
    run_map(spec, tmp_path / "here", runner=Probe(), report=lambda s: None)
    cluster = ClusterOptions(time=5, heartbeat=0.2, lease_timeout=5)
    submit_map(spec, tmp_path / "there", "local", cluster, 2, runner=Probe(log), report=lambda s: None)
    # the brackets and boundaries alike; not `probes`, the number a line ran, which its informed start (an earlier
    # seed's bracket, issue 64 part 4) makes depend on which line a worker finished first
    here, there = (pd.read_csv(tmp_path / d / MAP_CSV).drop(columns="probes") for d in ("here", "there"))
    pd.testing.assert_frame_equal(there, here)
    assert len(here) and not here.isna().any().any()
    finished = log.read_text().split()  # trained by the two workers, none twice
    assert len(finished) == len(set(finished)) > 0
    assert len(list((tmp_path / "there" / JOBS).glob("*_result.pkl"))) == 2  # two submitit tasks ran


def test_status_shows_the_running_and_the_expired_leases(tmp_path, capsys):
    from flt_diag.cli import main
    out, spec = tmp_path / "m", kill_spec()
    prepare_map_folder(spec, out)
    times = L.LeaseTimes(timeout_s=60)
    running, stale = (L.claim(out, name, times) for name in ("lt_K06_seed0_lr2", "lt_K06_seed1_lr2"))
    stale.path.write_text(stale.lease.model_copy(update=dict(heartbeat=time.time() - 100)).model_dump_json())
    done = L.claim(out, "lt_K06_seed2_lr2", times)
    L.release(done, "finished")
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    host = running.lease.host
    assert f"lease lt_K06_seed0_lr2: running, {host} pid {os.getpid()}, heartbeat 0 s ago, retries 0" in text
    assert f"lease lt_K06_seed1_lr2: expired, {host} pid {os.getpid()}, heartbeat 100 s ago, retries 0" in text
    assert "seed2_lr2: " not in text.split("lease", 1)[1]  # a released lease is not listed


def test_submit_refuses_a_cell_and_a_heartbeat_not_shorter_than_the_timeout(tmp_path, capsys):
    from flt_diag.cli import main
    for command in ("run-ablation", "map"):
        assert main([command, "--submit", "local", "--cell", "0", "--out", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--cell" in err[0] and "leases" in err[0] and not (tmp_path / "s").exists()
    pytest.importorskip("submitit")
    for command, out in (("map", tmp_path / "m"), ("run-ablation", tmp_path / "a")):
        code = main([command, "--submit", "local", "--heartbeat", "10", "--lease-timeout", "5", "--preset", "tiny",
                     "--device", "cpu", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code != 0 and len(err) == 1 and "must be shorter than --lease-timeout" in err[0]
        assert not out.exists()  # refused before anything was written


def _sweep_spec():
    from conftest import tiny_config
    from flt_diag.grids.sweep import SweepSpec
    return SweepSpec(tiny_config(steps=10), ["lt"], [6], [0, 1, 2, 3], [1.0, 2.0])


def _expected_verdicts(spec) -> dict[str, str]:
    """The fake probe's verdict of each cell, written out: it breaks above lr 1.3 x (1 + 0.1 seed)."""
    return {c.name: "collapsed" if c.lr_scale > 1.3 * (1 + 0.1 * c.seed) else "stable" for c in spec.cells()}


def test_a_lease_worker_on_a_sweep_trains_every_cell_once_in_grid_order_but_one_marked_failed(tmp_path):
    from campaign_runs import Probe
    from flt_diag.grids.sweep import prepare_folder
    from flt_diag.storage.folders import load_summary
    spec, out, log = _sweep_spec(), tmp_path / "s", tmp_path / "finished.log"
    prepare_folder(spec, out)
    names = [c.name for c in spec.cells()]
    L.mark_failed(out, names[3], "RuntimeError: by hand")
    assert work(spec, out, Probe(log), TIMES, report=lambda s: None) == 7
    assert log.read_text().split() == names[:3] + names[4:]  # each once, in the grid's order; the failed one never
    assert load_summary(out / CELLS / names[3]) is None
    assert {n: load_summary(out / CELLS / n).verdict for n in names if n != names[3]} == \
        {n: v for n, v in _expected_verdicts(spec).items() if n != names[3]}
    assert work(spec, out, Probe(log), TIMES, report=lambda s: None) == 0  # nothing left: a second worker ends


def test_submitit_local_workers_train_a_sweep_each_cell_once(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    from campaign_runs import Probe
    from flt_diag.cli.cluster_options import ClusterOptions
    from flt_diag.grids.slurm import JOBS, submit_sweep
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])  # (submitit's local workers import the tests' runner)
    spec, log = _sweep_spec(), tmp_path / "finished.log"
    cluster = ClusterOptions(time=5, heartbeat=0.2, lease_timeout=5)
    table = submit_sweep(spec, tmp_path / "s", "local", cluster, 2, runner=Probe(log), report=lambda s: None)
    finished = log.read_text().split()
    assert sorted(finished) == sorted(c.name for c in spec.cells())  # every cell, none twice
    assert dict(zip(table.cell, table.verdict)) == _expected_verdicts(spec)
    assert len(list((tmp_path / "s" / JOBS).glob("*_result.pkl"))) == 2  # two submitit tasks ran
