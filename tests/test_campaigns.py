"""Campaigns (docs/DESIGN.md §5, "Campaigns"): a sweep or map folder pinned to its code (a resume under other code
refused, unless allowed and then recorded), every run naming its CPU, runs archived as they finish and a campaign
resumed from its archive in a fresh folder, a campaign killed with kill -9 again and again losing no finished probe
and running none twice, and the map's lr axis reaching each probe's own config (`flt-diag status`:
tests/test_campaign_status.py)."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import processes
from campaign_runs import CODE, Probe, breaks
from conftest import tiny_config
from flt_diag.cli import main
from flt_diag.config.run_config import RunConfig
from flt_diag.grids.campaign import CampaignOptions
from flt_diag.grids.stability_map import MapSpec, run_map
from flt_diag.judge.map_boundaries import boundaries
from flt_diag.results.run_archiver import FolderArchive
from flt_diag.storage import campaign as C
from flt_diag.storage.folders import CELLS, LOCK, SUMMARY, StorageError, folder_lock, is_archive, write_json
from flt_diag.storage.machine import parse_cpuinfo

TESTS = Path(__file__).parent


def small_spec(seeds=(0, 1)) -> MapSpec:
    return MapSpec(tiny_config(steps=10), ["lt"], [6], list(seeds), "lr", [0.5, 1, 2, 4, 8], ["training"])


def kill_spec() -> MapSpec:
    return small_spec(seeds=(0, 1, 2))


def expected_bracket(seed: int, grid: list[float]) -> tuple[float, float]:
    """The line's (last_ok, first_broken), written out: the probe breaks above 1.3 x (1 + 0.1 seed)."""
    t = 1.3 * (1 + 0.1 * seed)
    return max(g for g in grid if g <= t), min(g for g in grid if g > t)


def _pin(monkeypatch, commit: str, clean: bool = True, diff: str | None = None) -> None:
    code = {"flt_diag": "0.1.0", "commit": commit, "clean": clean, **({"diff": diff} if diff else {})}
    monkeypatch.setattr(C, "code_version", lambda: code)


# ---------------------------------------------------------------- the machine a run names


def test_the_cpu_model_and_its_simd_flags_are_read_from_cpuinfo():
    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz\n"
            "flags\t\t: fpu vme sse sse2 ht ssse3 fma sse4_1 sse4_2 avx f16c smep avx2 avx512f avx512bw smap\n\n"
            "processor\t: 1\nmodel name\t: Another CPU\nflags\t\t: sse\n")
    assert parse_cpuinfo(text) == {"model": "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz",
                                   "simd": ["avx", "avx2", "avx512bw", "avx512f", "f16c", "fma", "sse", "sse2",
                                            "sse4_1", "sse4_2", "ssse3"]}
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes sve sve2 cpuid\nHardware\t: Graviton3\n"
    assert parse_cpuinfo(arm) == {"model": "Graviton3", "simd": ["asimd", "sve", "sve2"]}


# ---------------------------------------------------------------- code pinning


def test_a_resume_under_other_code_is_refused_unless_allowed_and_then_recorded(tmp_path, monkeypatch):
    out, spec = tmp_path / "m", small_spec()
    a, b = "a" * 40, "b" * 40
    _pin(monkeypatch, a)
    run_map(spec, out, runner=Probe(), report=lambda s: None, only_line=0)
    campaign = json.loads((out / "sweep.json").read_text())["campaign"]
    assert campaign["code"]["commit"] == a and campaign["code"]["clean"] is True and campaign["changes"] == []
    assert campaign["machine"]["model"] == parse_cpuinfo(Path("/proc/cpuinfo").read_text())["model"]
    written = (out / "sweep.json").read_bytes()
    for commit, clean, diff in ((b, True, None), (a, False, "1234abcd")):  # another commit; uncommitted changes
        _pin(monkeypatch, commit, clean, diff)
        with pytest.raises(StorageError) as e:
            run_map(spec, out, runner=Probe(), report=lambda s: None)
        assert "\n" not in str(e.value) and "--allow-code-change" in str(e.value) and f"commit {a[:12]} (clean)" in str(e.value)
        assert (out / "sweep.json").read_bytes() == written and not (out / CELLS / "lt_K06_seed1_lr2").exists()
    _pin(monkeypatch, a, False, "5678")  # the same commit with other changes: the same folder, once allowed
    run_map(spec, out, runner=Probe(), report=lambda s: None, options=CampaignOptions(allow_code_change=True))
    campaign = json.loads((out / "sweep.json").read_text())["campaign"]
    assert campaign["code"]["commit"] == a and [c["code"]["diff"] for c in campaign["changes"]] == ["5678"]
    assert campaign["changes"][0]["host"] == socket.gethostname()
    run_map(spec, out, runner=Probe(), report=lambda s: None)  # that code, once allowed, resumes it again
    _pin(monkeypatch, a)
    run_map(spec, out, runner=Probe(), report=lambda s: None)  # and so does the pinned code


def test_the_same_code_on_another_machine_kind_resumes_and_is_named_once(tmp_path, monkeypatch, capsys):
    """Resumed by the pinned code on a CPU of another kind: not refused; the new kind named once in `changes` (again
    on it, or back on the first: nothing added); a code change then names its machine; `status` says which is which."""
    import flt_diag.grids.campaign as G
    out, spec = tmp_path / "m", small_spec()
    a = "a" * 40
    first = {"arch": "x86_64", "model": "CPU One", "simd": ["avx2"]}
    second = {"arch": "x86_64", "model": "CPU Two", "simd": ["avx2", "avx512f"]}
    _pin(monkeypatch, a)
    monkeypatch.setattr(G, "machine_kind", lambda gpu=None: first)
    run_map(spec, out, runner=Probe(), report=lambda s: None, only_line=0)
    monkeypatch.setattr(G, "machine_kind", lambda gpu=None: second)
    for _ in range(2):
        run_map(spec, out, runner=Probe(), report=lambda s: None, only_line=1)
    monkeypatch.setattr(G, "machine_kind", lambda gpu=None: first)
    run_map(spec, out, runner=Probe(), report=lambda s: None)
    campaign = json.loads((out / "sweep.json").read_text())["campaign"]
    assert campaign["machine"] == first and [c["machine"] for c in campaign["changes"]] == [second]
    assert campaign["changes"][0]["code"]["commit"] == a and campaign["changes"][0]["host"] == socket.gethostname()
    _pin(monkeypatch, "b" * 40)
    run_map(spec, out, runner=Probe(), report=lambda s: None, options=CampaignOptions(allow_code_change=True))
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if " on " in x and ("machine" in x or "change" in x)]
    assert len(said) == 2 and said[0].startswith("machine added ") and said[0].endswith(": CPU Two (avx512f)")
    assert said[1].startswith("code change allowed ") and "commit bbbbbbbbbbbb" in said[1] \
        and said[1].endswith("machine CPU One (avx2)")


def test_the_command_refuses_other_code_in_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sw"
    args = ["run-ablation", "--loops", "2", "--variants", "lt", "--steps", "2", "--device", "cpu", "--depth", "1",
            "--quiet", "--out", str(out), "--list"]
    _pin(monkeypatch, "c" * 40)
    S = __import__("flt_diag.grids.sweep", fromlist=["prepare_folder"])
    from flt_diag.cli.specs import sweep_spec
    from flt_diag.cli.options import command_args
    S.prepare_folder(sweep_spec(command_args("run-ablation", dict(loops=[2], variants=["lt"], steps=2, device="cpu",
                                                                    depth=1)), settled=False), out)
    _pin(monkeypatch, "d" * 40)
    assert main(args[:-1]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allow-code-change" in err[0] and "commit cccccccccccc" in err[0]
    assert not (out / CELLS / "lt_K02_seed0_lr1").exists()


# ---------------------------------------------------------------- archive as it goes, resume from the archive


def test_runs_are_archived_as_they_finish_and_a_fresh_folder_resumes_from_the_archive(tmp_path, monkeypatch):
    spec, arch = small_spec(), tmp_path / "archive"
    options = CampaignOptions(archive=FolderArchive(arch))
    writes = []
    import flt_diag.results.run_archiver as R
    real = R.archive_run
    monkeypatch.setattr(R, "archive_run", lambda run, record, *a: writes.append(record.name) or real(run, record, *a))
    first = Probe()
    run_map(spec, tmp_path / "machine1" / "m", runner=first, report=lambda s: None, only_line=0, options=options)
    assert sorted(writes) == sorted(f"{n}.parquet" for n in first.runs)  # each record written once, as it finished
    assert sorted(p.name for p in (arch / "m").iterdir()) == sorted(writes + ["sweep.json"])
    fresh = Probe()  # another machine: a new folder of the same name, the archive (e.g. from git) beside it
    table = run_map(spec, tmp_path / "machine2" / "m", runner=fresh, report=lambda s: None, options=options)
    assert not set(fresh.runs) & set(first.runs)  # the archived probes count as finished: none run again
    assert all(n.startswith("lt_K06_seed1_") for n in fresh.runs)
    assert sorted(writes) == sorted(f"{n}.parquet" for n in first.runs + fresh.runs)  # no record written twice
    assert is_archive(arch / "m") and sorted(p.name for p in (arch / "m").iterdir()) == sorted(writes + ["sweep.json"])
    for folder in (tmp_path / "machine2" / "m", arch / "m"):  # the fresh folder and the archive: the whole map
        found = boundaries(folder) if folder != tmp_path / "machine2" / "m" else table
        assert {(r.seed, r.last_ok, r.first_broken) for r in found.itertuples()} == \
            {(s, *expected_bracket(s, spec.grid)) for s in (0, 1)}
    lost = arch / "m" / f"{fresh.runs[-1]}.parquet"  # a kill between a probe's summary and its record:
    lost.unlink()
    again = Probe()
    run_map(spec, tmp_path / "machine2" / "m", runner=again, report=lambda s: None, options=options)
    assert again.runs == [] and lost.is_file()  # the next start archives it, and runs nothing
    assert main(["archive", str(tmp_path / "machine1" / "m"), "--to", str(tmp_path / "again")]) == 0  # still archives
    # the fresh folder holds machine 1's runs as records taken from the archive: `archive` of it into that archive
    # (e.g. after eval-loops refreshed its own runs) writes only its own runs, never the taken records again
    records = {p.name: p.read_bytes() for p in (arch / "m").glob("*.parquet")}
    assert main(["archive", str(tmp_path / "machine2" / "m"), "--to", str(arch)]) == 0
    assert {p.name: p.read_bytes() for p in (arch / "m").glob("*.parquet") if f"{p.stem}" in first.runs} == \
        {n: b for n, b in records.items() if n[:-8] in first.runs}
    assert main(["archive", str(tmp_path / "machine2" / "m"), "--to", str(tmp_path / "other")]) == 0  # elsewhere:
    assert sorted(p.name for p in (tmp_path / "other" / "m").glob("*.parquet")) == sorted(records)  # all, copied
    assert all((tmp_path / "other" / "m" / f"{n}.parquet").read_bytes() == records[f"{n}.parquet"] for n in first.runs)
    # a damaged record (truncated) is never resumed over: one line, nothing changed; removed, it is archived anew
    damaged = arch / "m" / f"{fresh.runs[0]}.parquet"
    whole = damaged.read_bytes()
    damaged.write_bytes(whole[:500])
    with pytest.raises(StorageError, match="damaged record in the archive; its run is finished in") as e:
        run_map(spec, tmp_path / "machine2" / "m", runner=again, report=lambda s: None, options=options)
    assert len(str(e.value).splitlines()) == 1 and damaged.read_bytes() == whole[:500] and again.runs == []
    with pytest.raises(StorageError, match="only copy of that run"):  # a fresh folder lacks that run
        run_map(spec, tmp_path / "machine3" / "m", runner=again, report=lambda s: None, options=options)
    damaged.unlink()
    run_map(spec, tmp_path / "machine2" / "m", runner=again, report=lambda s: None, options=options)
    assert again.runs == [] and damaged.read_bytes() != whole[:500] and is_archive(arch / "m")


def test_a_map_pointed_at_its_archive_is_refused_and_the_archive_left_as_it_was(tmp_path, capsys):
    spec, arch = small_spec(), tmp_path / "archive"
    run_map(spec, tmp_path / "m", runner=Probe(), report=lambda s: None, only_line=0,
            options=CampaignOptions(archive=FolderArchive(arch)))
    before = sorted(p.name for p in (arch / "m").iterdir())
    with pytest.raises(StorageError, match="--archive-to") as e:
        run_map(spec, arch / "m", runner=Probe(), report=lambda s: None)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in (arch / "m").iterdir()) == before and is_archive(arch / "m")


# ---------------------------------------------------------------- the lr axis reaches the probe


def test_each_probe_gets_its_own_typed_config_with_the_axis_value(tmp_path):
    seen = []

    def runner(cfg, cell, out):
        seen.append((type(cfg), cfg.train.lr_scale, cfg.train.seed, cell.lr_scale))
        return Probe()(cfg, cell, out)
    spec = small_spec()
    run_map(spec, tmp_path / "m", runner=runner, report=lambda s: None)
    assert seen and all(t is RunConfig for t, *_ in seen)
    assert all(lr == cell_lr and lr in [0.5, 1, 2, 4, 8] for _, lr, _, cell_lr in seen)
    assert len({lr for _, lr, _, _ in seen}) > 1  # (not the base's first grid value every time)


# ---------------------------------------------------------------- kill -9


def _working(out: Path, log: Path, before: int, timeout: float = 60) -> None:
    """Wait until the child writes a probe file it had not (start-up behind it), so that the kill lands in the work."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sum(1 for _ in (out / CELLS).rglob("*")) if (out / CELLS).is_dir() else 0
        if files > before:
            return
        time.sleep(0.05)
    raise TimeoutError("the campaign wrote nothing")


def _inside_a_probe(out: Path, timeout: float = 60) -> None:
    """Wait until a probe is under way (a cell folder without its summary), so that one kill surely lands inside one
    whatever the machine's load (a random point alone may fall between two probes on a busy machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / CELLS).is_dir() and any(d.is_dir() and not (d / SUMMARY).exists() for d in (out / CELLS).iterdir()):
            return
        time.sleep(0.01)
    raise TimeoutError("no probe was seen under way")


@pytest.mark.parametrize("trials,pause", [(2, 0.1), pytest.param(6, 0.3, marks=pytest.mark.slow)])  # (~50 s)
def test_a_campaign_killed_at_random_points_loses_no_finished_probe_and_runs_none_twice(tmp_path, trials, pause):
    out, arch, log = tmp_path / "m", tmp_path / "archive", tmp_path / "finished.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    rng = random.Random(64)
    command = [sys.executable, str(TESTS / "campaign_runs.py"), str(out), str(arch), str(log), str(pause)]
    spec = kill_spec()
    mid_probe = 0
    for trial in range(trials):
        p = processes.start(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _working(out, log, sum(1 for _ in (out / CELLS).rglob("*")) if (out / CELLS).is_dir() else 0)
        if trial == 0:  # the first kill inside a probe, the others at random points
            _inside_a_probe(out)
        else:
            time.sleep(rng.uniform(0.0, 1.5))  # a probe takes 2 pauses plus its archiving
        processes.kill_group(p)  # SIGKILL, no clean-up
        finished = log.read_text().split() if log.exists() else []
        assert len(finished) == len(set(finished))  # no probe finished twice
        for name in finished:  # none lost: its summary (its record: the next start archives what a kill missed)
            assert (out / CELLS / name / SUMMARY).exists()
        mid_probe += any(not (d / SUMMARY).exists() for d in (out / CELLS).iterdir())
    before = finished
    done = processes.run(command, timeout=120, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    finished = log.read_text().split()
    assert len(finished) == len(set(finished)) and len(finished) > len(before) and mid_probe  # (the kills landed in
    # the campaign, inside probes)
    assert sorted(p.stem for p in (arch / "m").glob("*.parquet")) == sorted(finished)  # each archived, once resumed
    for folder in (out, arch / "m"):
        assert {(r.seed, r.last_ok, r.first_broken) for r in boundaries(folder).itertuples()} == \
            {(s, *expected_bracket(s, spec.grid)) for s in spec.seeds}
