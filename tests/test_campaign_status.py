"""`flt-diag status` (docs/DESIGN.md §5, "Campaigns"), read against map, sweep and campaign folders built by hand: each
line or cell finished, failed (why), running (pid, host, the step it reached) or open, the code it is pinned to, a
folder of campaigns counted each and all, the time left of a running sweep or map, and a busy probe said to be busy
by whom, not failed. Split from tests/test_campaigns.py by concern."""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from campaign_runs import CODE, breaks
from conftest import tiny_config
from flt_diag.cli import main
from flt_diag.grids.stability_map import MapSpec
from flt_diag.storage.folders import CELLS, LOCK, SUMMARY, folder_lock, write_json

# ---------------------------------------------------------------- status


def _probe(out: Path, name: str, seed: int, lr: float, verdict: str | None, commit: str,
           wall: float | None = None) -> Path:
    """A probe's run folder by hand: config.json naming its code, one metrics part, summary.json where finished."""
    from flt_diag.judge.verdict import summarize
    from flt_diag.storage.folders import MetricsWriter, load_metrics
    d = out / CELLS / name
    d.mkdir(parents=True)
    cfg = tiny_config(variant="lt", loops=6, seed=seed, lr_scale=lr, steps=10)
    write_json(d / "config.json", cfg.to_dict() | {"env": {"code": {"flt_diag": "0.1.0", "commit": commit,
                                                                     "clean": True}}})
    w = MetricsWriter(d)
    w.add(0, "loss", -1, -1, 3.0)
    w.flush()
    if verdict:
        write_json(d / SUMMARY, summarize(load_metrics(d), cfg).as_written() | dict(verdict=verdict, wall_time=wall))
    return d


def test_status_of_a_map_folder_built_by_hand(tmp_path, capsys):
    """Four lines, by hand: seed 0 finished (holds at 1, breaks at 2), seed 1 failed (error.txt), seed 2 running
    (this process holds its probe's lock), seed 3 open (a stopped run's lock, of a pid that is no more)."""
    out = tmp_path / "m"
    spec = MapSpec(tiny_config(steps=10), ["lt"], [6], [0, 1, 2, 3], "lr", [1, 2], ["training"])
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps(spec.to_dict() | {"campaign": {"code": CODE, "machine": {
        "model": "Hand-made CPU", "simd": ["avx2"]}, "changes": []}}))
    one, two = "1" * 40, "2" * 40
    _probe(out, "lt_K06_seed0_lr1", 0, 1, "stable", one, wall=30.0)
    _probe(out, "lt_K06_seed0_lr2", 0, 2, "collapsed", two, wall=50.0)
    (_probe(out, "lt_K06_seed1_lr1", 1, 1, None, one) / "error.txt").write_text(
        "Traceback (most recent call last):\n  File x\nRuntimeError: out of memory\n\n")
    running = _probe(out, "lt_K06_seed2_lr1", 2, 1, None, one)
    (running / "progress.json").write_text(json.dumps(dict(step=3, steps=10, loss=5.0, elapsed=1.0, final=False)))
    stopped = _probe(out, "lt_K06_seed3_lr1", 3, 1, None, one)
    (stopped / LOCK).write_text(f"{2 ** 22 + 7} {socket.gethostname()} 2026-12-01T00:00:00Z")
    old = time.time() - 3600
    for p in (stopped / LOCK, stopped / "config.json", stopped / "metrics"):
        os.utime(p, (old, old))
    with folder_lock(running):
        assert main(["status", str(out)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert main(["map", "--variants", "lt", "--loops", "6", "--seeds", "0", "1", "2", "3", "--lo", "1",
                     "--hi", "2", "--ratio", "2", "--criteria", "training", "--steps", "10", "--list",
                     "--out", str(out)]) == 0
        listed = capsys.readouterr().out.splitlines()
    assert lines[0] == "code: flt-diag 0.1.0, commit abcdef012345 (clean)"
    assert lines[1] == "machine: Hand-made CPU (avx2)"
    rows = {line.split()[1]: line for line in lines[2:6]}
    assert rows["lt_K06_seed0"].split()[2:] == ["finished", "2", "probes", "code", f"{one[:12]},", two[:12]]
    assert rows["lt_K06_seed1"].split()[2:] == ["failed", "lr", "1:", "RuntimeError:", "out", "of", "memory", "code",
                                                one[:12]]
    assert rows["lt_K06_seed2"].split()[2] == "running"
    assert f"lr 1: step 3 of 10, held by pid {os.getpid()} on host {socket.gethostname()} since " in rows["lt_K06_seed2"]
    assert ", last seen 0 s ago" in rows["lt_K06_seed2"] or ", last seen 1 s ago" in rows["lt_K06_seed2"]
    assert rows["lt_K06_seed3"].split()[2:5] == ["open", "0", "probes"]
    assert lines[6] == "1 finished, 1 running, 1 open, 1 failed"
    # the finished line's 2 probes (30 and 50 s: median 40 s); to go: the running line 2 - 0.3 (step 3 of 10), the
    # open one 2, the failed one none: 3.7 probes x 40 s = 148 s on one lane
    assert lines[7] == ("roughly 2 min left: about 4 probes to go (a finished line took a median of 2 probes, a probe "
                        "a median of 40 s), on the 1 lane running now")
    assert [line.split()[1:] for line in listed] == [["lt_K06_seed0", "finished"], ["lt_K06_seed1", "failed"],
                                                     ["lt_K06_seed2", "running"], ["lt_K06_seed3", "open"]]


def _hand_map(out: Path, finished: int, failed: int) -> None:
    """A map folder by hand (lt, K 6, `finished + failed` seeds, lr 1 and 2): seeds 0.. finished (holds at 1, breaks
    at 2), the next `failed` failed at lr 1 (error.txt)."""
    spec = MapSpec(tiny_config(steps=10), ["lt"], [6], list(range(finished + failed)), "lr", [1, 2], ["training"])
    out.mkdir(parents=True)
    (out / "sweep.json").write_text(json.dumps(spec.to_dict()))
    for s in range(finished):
        _probe(out, f"lt_K06_seed{s}_lr1", s, 1, "stable", "1" * 40)
        _probe(out, f"lt_K06_seed{s}_lr2", s, 2, "collapsed", "1" * 40)
    for s in range(finished, finished + failed):
        (_probe(out, f"lt_K06_seed{s}_lr1", s, 1, None, "1" * 40) / "error.txt").write_text("RuntimeError: x\n")


def test_status_of_a_folder_of_campaigns_counts_each_and_all(tmp_path, capsys):
    """A campaign's folder holding maps at several depths (a stage's strength, slice, study): a line of counts per
    map folder found (up to three levels down, not into a link), then the total; a crafted one is its own line,
    the others still counted, exit 1."""
    root = tmp_path / "bench"
    _hand_map(root / "A" / "x1" / "study", 2, 0)
    _hand_map(root / "B" / "slice", 1, 1)
    _hand_map(tmp_path / "elsewhere", 3, 0)
    (root / "B" / "linked").symlink_to(tmp_path / "elsewhere")  # (a link: not followed)
    _hand_map(root / "C" / "a" / "b" / "too-deep", 1, 0)  # (four levels down: not looked for)
    assert main(["status", str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "A/x1/study: 2 finished", "B/slice: 1 finished, 1 failed", "all: 3 finished, 1 failed"]
    (root / "D").mkdir()
    (root / "D" / "sweep.json").write_text("{not json")
    assert main(["status", str(root)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["A/x1/study: 2 finished", "B/slice: 1 finished, 1 failed"]
    assert out[2].startswith("D: cannot be read (") and out[3] == "all: 3 finished, 1 failed" and len(out) == 4
    assert main(["status", str(root / "A")]) == 0 and capsys.readouterr().out.splitlines()[-1] == "all: 2 finished"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["status", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a sweep or map folder" in err[0] and "holds none" in err[0]


@pytest.mark.parametrize("progress, said", [
    (dict(step=250, steps=600), "step 250 of 600, "), (dict(step=600, steps=600), "step 600 of 600, "),
    (dict(step=601, steps=600), ""), (dict(step=-1, steps=600), ""), (dict(step="250", steps=600), ""),
    (dict(step=2.5, steps=600), ""), (dict(step=True, steps=600), ""), ([250, 600], ""), (None, "")])
def test_a_running_run_says_the_step_it_reached_and_a_crafted_progress_file_says_nothing(tmp_path, progress, said):
    """The step of a running run is its progress.json's, two counts 0 <= done <= steps; anything else (a bool, a
    float, a string, a list, more done than steps, no file) leaves the step out and the rest of the line as it was."""
    from flt_diag.storage.run_activity import activity
    run = tmp_path / "r"
    run.mkdir()
    if progress is not None:
        (run / "progress.json").write_text(json.dumps(progress))
    with folder_lock(run):
        a = activity(run)
    assert a.state == "running"
    assert a.detail().startswith(f"{said}held by pid {os.getpid()} on host {socket.gethostname()} since ")


def test_time_left_is_the_open_and_unfinished_runs_at_the_median_over_the_lanes_running():
    from flt_diag.results.campaign_status import time_left
    # median of 100, 300, 200 = 200 s; 4 open (800 lane-s) + one 25 % done (150) + one of unknown progress (200)
    # = 1150 lane-s over 2 lanes = 575 s = 9.6 min
    assert time_left([100.0, 300.0, 200.0], 4, [0.25, None]) == (
        "about 10 min left: 4 open and 2 running at the finished runs' median of 200 s a run, on the 2 lanes running now")
    assert time_left([60.0, 120.0], 0, [0.5]) == (  # 90 s x 0.5 on one lane; under two minutes in seconds
        "about 45 s left: 0 open and 1 running at the finished runs' median of 90 s a run, on the 1 lane running now")
    assert time_left([], 4, [0.5]) is None and time_left([100.0], 4, []) is None  # nothing timed; no lane to count


def test_a_maps_time_left_is_the_lines_to_go_at_the_finished_lines_median_probes():
    """Written out: finished lines of 3 and 5 probes (median 4); a running line with 1 probe done and its second a
    quarter through needs 4 - 1 - 0.25 = 2.75 more, an open line without probes 4, an open line of 6 probes (past
    the median) 1, a failed line none: 7.75 probes. The map's 15 timed probes (100 x 3, 50 x 5, 200, 40, 60, 30, 70,
    45, 55) have a median of 50 s: 387.5 s on one lane, about 6 min."""
    from flt_diag.results.campaign_status import Row, map_time_left

    def row(state, walls, progress=None):
        return Row(0, "x", state, "", (), progress, probe_walls=tuple(walls))
    rows = [row("finished", [100.0] * 3), row("finished", [50.0] * 5), row("running", [200.0], (150, 600)),
            row("open", []), row("open", [40.0, 60.0, 30.0, 70.0, 45.0, 55.0]), row("failed", [])]
    assert map_time_left(rows) == ("roughly 6 min left: about 8 probes to go (a finished line took a median of 4 "
                                   "probes, a probe a median of 50 s), on the 1 lane running now")
    assert map_time_left([r for r in rows if r.state != "running"]) is None  # no lane runs now
    assert map_time_left([r for r in rows if r.state != "finished"]) is None  # no finished line to count probes


def test_status_of_a_running_sweep_ends_with_its_time_left(tmp_path, capsys):
    """fake_runs' sweep: four cells finished (wall time 1 s each), fla K 3 half written, fla K 6 not started. With
    fla K 3's lock held it runs: 1 open + 1 running of unknown progress at 1 s a run on 1 lane = 2 s; without, no
    lane runs and no time is guessed."""
    from fake_runs import make_sweep
    out = make_sweep(tmp_path / "sw")
    assert main(["status", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 finished, 2 open"
    with folder_lock(out / CELLS / "fla_K03_seed0_lr1"):
        assert main(["status", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["4 finished, 1 running, 1 open", (
        "about 2 s left: 1 open and 1 running at the finished runs' median of 1 s a run, on the 1 lane running now")]


def test_status_pads_names_to_the_longest_so_the_columns_line_up():
    """A sweep whose cell names are longer than the default column (32): every state starts in one column."""
    from flt_diag.results.campaign_status import Row, row_lines
    rows = [Row(0, "a" * 40, "running", "x", ()), Row(1, "b", "open", "", ("c" * 12,))]
    assert row_lines(rows) == [f"   0  {'a' * 40} running   x  code -", f"   1  b{' ' * 40}open      code {'c' * 12}"]
    assert row_lines(rows[1:]) == [f"   1  b{' ' * 32}open      code {'c' * 12}"]  # (short names: the 32 of before)


def test_a_busy_probe_is_said_to_be_busy_by_whom_not_failed(tmp_path, capsys):
    """A racing duplicate of a `--cell` task: the probe's lock is held (here by this process), the task's real
    probe is refused by it, and the map says busy, whose, since when; nothing is written into the probe."""
    args = ["map", "--variants", "lt", "--loops", "2", "--lo", "1", "--hi", "2", "--ratio", "2",
            "--criteria", "training", "--steps", "2", "--depth", "1", "--device", "cpu", "--quiet",
            "--out", str(tmp_path / "m"), "--cell", "0"]
    from flt_diag.cli.app import parse
    from flt_diag.cli.options import command_args
    from flt_diag.cli.specs import map_spec
    from flt_diag.grids.stability_map import prepare_map_folder
    _, values, _ = parse(args)
    prepare_map_folder(map_spec(command_args("map", values)), tmp_path / "m")  # the folder the first copy made
    probe = tmp_path / "m" / CELLS / "lt_K02_seed0_lr1"  # (bisection of [1, 2] probes index 0 first)
    with folder_lock(probe):
        assert main(args) == 1
        out, err = capsys.readouterr()
        assert [p.name for p in probe.iterdir()] == [LOCK] and not (probe / "error.txt").exists()
    assert f"busy, held by pid {os.getpid()} on host {socket.gethostname()} since " in err
    assert "error.txt" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("change, said", [
    ({"code": {"commit": "b" * 40, "clean": [1]}, "machine": {"model": "X", "simd": 5}},
     "commit bbbbbbbbbbbb (state unknown), machine X"),  # (before: TypeError, unhashable list; int not iterable)
    ({"at": "t", "host": "h", "machine": {"model": "Y", "simd": ["avx2"]}},
     "code change allowed t on h: not recorded, machine Y (avx2)"),  # (before: "flt-diag unknown, not from git")
])
def test_a_crafted_campaign_change_is_described_never_a_traceback(tmp_path, change, said):
    from flt_diag.results.campaign_status import campaign_lines
    code = {"flt_diag": "0.1.0", "commit": "a" * 40, "clean": True}
    write_json(tmp_path / "sweep.json", {"kind": "map", "campaign": {
        "code": code, "machine": {"model": "Z", "simd": {"a": 1}}, "changes": [change]}})
    lines = campaign_lines(tmp_path)
    assert lines[1] == "machine: Z" and said in lines[-1]
