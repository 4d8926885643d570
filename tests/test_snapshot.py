"""A campaign run from a snapshot of its pinned code (`--snapshot`, docs/DESIGN.md §5, "Campaigns"): the snapshot
holds the commit's files, its code version is that commit (not clean once edited), a process that imported flt_diag
elsewhere refuses to train, and, on a clone of this repository standing in for the developer's checkout, a map
started with --snapshot keeps training the pinned code after the checkout moves to a commit that breaks training,
makes its snapshot again once deleted, and a dirty or non-git checkout is refused with one line."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from flt_diag.grids.sweep import run_cell
from flt_diag.storage.cells import RunId
from flt_diag.storage.code_snapshot import ENV, MARKER, check_snapshot, make_snapshot, snapshot_code
from flt_diag.storage.errors import StorageError

REPO = Path(__file__).resolve().parents[1]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_snapshot_holds_the_commits_files_and_names_that_commit_until_edited(tmp_path):
    head = git(REPO, "rev-parse", "HEAD")
    where = make_snapshot(REPO, head, tmp_path / "snap")
    for name in ("flt_diag/__init__.py", "flt_diag/storage/code_snapshot.py"):  # the commit's bytes, by git itself
        committed = subprocess.run(["git", "-C", str(REPO), "show", f"{head}:{name}"], check=True,
                                   capture_output=True).stdout
        assert (where / name).read_bytes() == committed
    assert sorted(p.name for p in where.iterdir()) == sorted([MARKER, "flt_diag"])  # the package only
    code = snapshot_code(where)
    pyproject = subprocess.run(["git", "-C", str(REPO), "show", f"{head}:pyproject.toml"], check=True,
                               capture_output=True, text=True).stdout
    stated = next(line.split('"')[1] for line in pyproject.splitlines() if line.startswith("version = "))
    # the version the commit states, not the installed package's metadata (a checkout re-installed at another
    # version would otherwise make a resumed snapshot campaign look like other code)
    assert code == {"commit": head, "clean": True, "snapshot": str(where), "flt_diag": stated}
    assert json.loads((where / MARKER).read_text())["version"] == stated
    assert make_snapshot(REPO, head, where) == where  # kept as it is
    init = where / "flt_diag" / "__init__.py"
    init.chmod(0o644)
    init.write_text(init.read_text() + "\n# edited\n")
    edited = snapshot_code(where)
    assert edited["commit"] == head and edited["clean"] is False and len(edited["diff"]) == 16
    with pytest.raises(StorageError, match="not in the repository"):
        make_snapshot(REPO, "0" * 40, tmp_path / "other")


def test_tasks_racing_to_make_one_snapshot_all_get_it(tmp_path):
    """The tasks of a job array started with --snapshot make the same snapshot at once: one wins the rename, the
    others find it made; no temporary folder is left."""
    head, where = git(REPO, "rev-parse", "HEAD"), tmp_path / ".code" / "snap"
    code = ("import sys; from pathlib import Path; from flt_diag.storage.code_snapshot import make_snapshot; "
            "make_snapshot(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))")
    tasks = [subprocess.Popen([sys.executable, "-c", code, str(REPO), head, str(where)], stderr=subprocess.PIPE)
             for _ in range(4)]
    assert [t.wait(timeout=120) for t in tasks] == [0] * 4, [t.stderr.read() for t in tasks if t.stderr]
    assert json.loads((where / MARKER).read_text())["commit"] == head
    assert [p.name for p in where.parent.iterdir()] == ["snap"]


def test_a_crafted_snapshot_entry_is_one_line_and_no_commit_reaches_git_as_an_option(tmp_path):
    from flt_diag.cli.snapshot_exec import recorded_snapshot
    head = git(REPO, "rev-parse", "HEAD")
    for entry in ({"path": ".code/x", "commit": "--output=/tmp/owned"}, {"path": 3, "commit": head}, {"commit": head}):
        out = tmp_path / "m"
        out.mkdir(exist_ok=True)
        (out / "sweep.json").write_text(json.dumps({"campaign": {"code": {}, "snapshot": entry}}))
        with pytest.raises(StorageError, match=r"\[campaign\] snapshot is not"):
            recorded_snapshot(out, None)
    (out / "sweep.json").write_text(json.dumps({"campaign": {"code": {}, "snapshot": {"path": "s", "commit": head}}}))
    assert recorded_snapshot(out, None) == {"path": "s", "commit": head}
    with pytest.raises(StorageError, match="is not a commit"):
        make_snapshot(REPO, "--output=/tmp/owned", tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_a_process_that_imported_flt_diag_elsewhere_refuses_to_train(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))  # this process imported flt_diag from the worktree, not from tmp_path
    with pytest.raises(StorageError, match="imported from"):
        check_snapshot()
    cell = RunId("lt", 2, 0, 1.0)
    result = run_cell(tiny_config(loops=2, steps=2), cell, str(tmp_path / "m"))
    assert result.startswith("error: StorageError") and "code snapshot" in result
    run = tmp_path / "m" / "cells" / cell.name
    assert (run / "error.txt").is_file() and not (run / "config.json").exists()  # refused before training
    monkeypatch.setenv(ENV, str(REPO))  # where it was imported from: accepted
    check_snapshot()


def _flt_diag(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m flt_diag ARGS` as the developer runs it: from the checkout, with it on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(checkout)
    return subprocess.run([sys.executable, "-m", "flt_diag", *args], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=300)


MAP = ["map", "--variants", "lt", "--loops", "2", "--seeds", "0", "1", "2", "--lo", "1", "--hi", "2", "--ratio", "2",
       "--criteria", "training", "--steps", "2", "--depth", "1", "--device", "cpu", "--quiet", "--workers", "1"]


def _probe_code(out: Path, seed: int) -> dict:
    return json.loads((out / "cells" / f"lt_K02_seed{seed}_lr1" / "config.json").read_text())["env"]["code"]


def test_a_snapshot_campaign_runs_its_pinned_code_while_the_checkout_moves(tmp_path):
    checkout, out = tmp_path / "checkout", tmp_path / "m"
    git(tmp_path, "clone", "-q", str(REPO), str(checkout))
    pinned = git(checkout, "rev-parse", "HEAD")
    started = _flt_diag(checkout, *MAP, "--out", str(out), "--snapshot", "--cell", "0")
    assert started.returncode == 0, started.stderr
    snap = out / ".code" / pinned[:12]
    assert json.loads((snap / MARKER).read_text())["commit"] == pinned
    campaign = json.loads((out / "sweep.json").read_text())["campaign"]
    assert campaign["snapshot"] == {"path": f".code/{pinned[:12]}", "commit": pinned}
    assert campaign["code"]["commit"] == pinned and campaign["code"]["clean"] is True
    assert Path(_probe_code(out, 0)["snapshot"]).resolve() == snap.resolve()  # the probe's flt_diag lay there
    # the checkout moves on: a commit whose trainer cannot even be imported
    trainer = checkout / "flt_diag" / "training" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\nraise RuntimeError('the moved checkout')\n")
    git(checkout, "commit", "-qam", "a change that breaks training")
    moved = git(checkout, "rev-parse", "HEAD")
    resumed = _flt_diag(checkout, *MAP, "--out", str(out), "--cell", "1")  # (no --snapshot: the folder records it)
    assert resumed.returncode == 0, resumed.stderr
    assert _probe_code(out, 1)["commit"] == pinned != moved
    assert Path(_probe_code(out, 1)["snapshot"]).resolve() == snap.resolve()
    shutil.rmtree(snap)  # deleted: made again from its commit; the last line by a submitit task where there is submitit
    submit = ["--submit", "local"] if importlib.util.find_spec("submitit") else []
    rest = _flt_diag(checkout, *MAP, "--out", str(out), *submit)
    assert rest.returncode == 0, rest.stderr
    assert f"code snapshot {snap} is missing: made again from commit {pinned[:12]}" in rest.stdout
    assert json.loads((snap / MARKER).read_text())["commit"] == pinned
    assert _probe_code(out, 2)["commit"] == pinned and not list(out.glob("cells/*/error.txt"))
    assert Path(_probe_code(out, 2)["snapshot"]).resolve() == snap.resolve()
    assert (out / "jobs").is_dir() == bool(submit)  # (submitit's folder: its task trained the probe)
    status = _flt_diag(checkout, "status", str(out))
    assert f"snapshot: {snap} (commit {pinned[:12]}, present)" in status.stdout.splitlines()


def test_a_dirty_or_non_git_checkout_is_refused_with_one_line(tmp_path):
    checkout = tmp_path / "checkout"
    git(tmp_path, "clone", "-q", str(REPO), str(checkout))
    readme = checkout / "flt_diag" / "__init__.py"
    readme.write_text(readme.read_text() + "\n# not committed\n")
    dirty = _flt_diag(checkout, *MAP, "--out", str(tmp_path / "m"), "--snapshot")
    assert dirty.returncode == 2 and len(dirty.stderr.strip().splitlines()) == 1
    assert "uncommitted changes" in dirty.stderr and not (tmp_path / "m").exists()
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "flt_diag", copy / "flt_diag", ignore=shutil.ignore_patterns("__pycache__"))
    bare = _flt_diag(copy, *MAP, "--out", str(tmp_path / "m"), "--snapshot")
    assert bare.returncode == 2 and len(bare.stderr.strip().splitlines()) == 1
    assert "not run from a git checkout" in bare.stderr and not (tmp_path / "m").exists()


def test_a_checkout_changed_outside_its_code_snapshots_and_pins_clean(tmp_path):
    """A tracked docs page changed (as a campaign archiving into docs/data/ changes its checkout, 2026-12-07): no
    other code, so --snapshot goes on and the pin says clean; a change under flt_diag/ is refused (the test above)."""
    checkout = tmp_path / "checkout"
    git(tmp_path, "clone", "-q", str(REPO), str(checkout))
    page = checkout / "README.md"
    page.write_text(page.read_text() + "\nnot committed\n")
    started = _flt_diag(checkout, *MAP, "--out", str(tmp_path / "m"), "--snapshot", "--cell", "0")
    assert started.returncode == 0, started.stderr
    code = json.loads((tmp_path / "m" / "sweep.json").read_text())["campaign"]["code"]
    assert code["commit"] == git(checkout, "rev-parse", "HEAD") and code["clean"] is True and "diff" not in code


def test_a_fresh_folder_resumed_from_its_archive_runs_the_archived_campaigns_snapshot(tmp_path):
    """On a fresh machine (a fresh folder of the same name, the same --archive-to) the campaign's snapshot is read
    from the archive's sweep.json and made there from its commit, though the checkout has moved on."""
    checkout, archive = tmp_path / "checkout", tmp_path / "archive"
    git(tmp_path, "clone", "-q", str(REPO), str(checkout))
    pinned = git(checkout, "rev-parse", "HEAD")
    first = _flt_diag(checkout, *MAP, "--out", str(tmp_path / "a" / "m"), "--archive-to", str(archive), "--snapshot",
                      "--cell", "0")
    assert first.returncode == 0, first.stderr
    trainer = checkout / "flt_diag" / "training" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\nraise RuntimeError('the moved checkout')\n")
    git(checkout, "commit", "-qam", "a change that breaks training")
    fresh = tmp_path / "b" / "m"
    resumed = _flt_diag(checkout, *MAP, "--out", str(fresh), "--archive-to", str(archive), "--cell", "1")
    assert resumed.returncode == 0, resumed.stderr
    snap = fresh / ".code" / pinned[:12]
    assert f"code snapshot {snap} is missing: made again from commit {pinned[:12]}" in resumed.stdout
    assert _probe_code(fresh, 1)["commit"] == pinned
    assert Path(_probe_code(fresh, 1)["snapshot"]).resolve() == snap.resolve()
    assert json.loads((archive / "m" / "sweep.json").read_text())["campaign"]["snapshot"]["commit"] == pinned
    # moved on to a new snapshot only with --snapshot and --allow-code-change (the change recorded)
    git(checkout, "revert", "--no-edit", "HEAD")
    fixed = git(checkout, "rev-parse", "HEAD")
    moved = _flt_diag(checkout, *MAP, "--out", str(fresh), "--archive-to", str(archive), "--cell", "2",
                      "--snapshot", "--allow-code-change")
    assert moved.returncode == 0, moved.stderr
    campaign = json.loads((fresh / "sweep.json").read_text())["campaign"]
    assert campaign["snapshot"] == {"path": f".code/{fixed[:12]}", "commit": fixed}
    assert campaign["changes"][-1]["code"]["commit"] == fixed and campaign["code"]["commit"] == pinned
    assert _probe_code(fresh, 2)["commit"] == fixed


def test_a_slurm_jobs_script_sets_the_snapshot_for_its_tasks(tmp_path, monkeypatch):
    """`--submit slurm` from a snapshot: the sbatch script submitit writes exports the snapshot's variables before
    the task starts (a fake `srun` on PATH stands in for a cluster; the script is submitit's own text)."""
    from types import SimpleNamespace

    from flt_diag.grids.slurm import executor
    submitit_slurm = pytest.importorskip("submitit.slurm.slurm")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    snap = tmp_path / "a snapshot"
    monkeypatch.setenv(ENV, str(snap))
    monkeypatch.setenv("PYTHONPATH", f"{snap}{os.pathsep}/elsewhere")
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    ex = executor("slurm", tmp_path / "jobs", SimpleNamespace(time=10, partition=None, array_parallelism=None))
    script = submitit_slurm._make_sbatch_string(command="python -m submitit.core._submit", folder=tmp_path / "jobs",
                                                **ex._executor.parameters)
    lines = script.splitlines()
    assert f"export {ENV}='{snap}'" in lines and f"export PYTHONPATH='{snap}{os.pathsep}/elsewhere'" in lines
    assert "export PYTHONSAFEPATH=1" in lines
    assert lines.index("export PYTHONSAFEPATH=1") < next(i for i, x in enumerate(lines) if "submitit.core._submit" in x)


def test_several_study_files_run_from_one_snapshot_the_first_study_makes(tmp_path):
    """`flt-diag study A B --snapshot`: one snapshot of the pinned commit, in the first study's folder; the second
    study runs from it too (its probes' code names it) and records it, so either resumes from it alone."""
    checkout = tmp_path / "checkout"
    git(tmp_path, "clone", "-q", str(REPO), str(checkout))
    pinned = git(checkout, "rev-parse", "HEAD")
    files = []
    for name in ("a", "b"):
        files.append(tmp_path / f"{name}.toml")
        files[-1].write_text(f'[ablation]\npreset = "tiny"\nvariants = ["lt"]\nloops = [2]\nsteps = 2\ndepth = 1\n'
                             f'seq_len = 16\nbatch_size = 2\neval_batches = 1\ndevice = "cpu"\n'
                             f'out = "{tmp_path / name}"\n')
    done = _flt_diag(checkout, "study", *map(str, files), "--snapshot", "--quiet", "--workers", "1")
    assert done.returncode == 0, done.stderr
    snap = tmp_path / "a" / ".code" / pinned[:12]
    assert json.loads((snap / MARKER).read_text())["commit"] == pinned and not (tmp_path / "b" / ".code").exists()
    for name in ("a", "b"):
        code = json.loads((tmp_path / name / "cells" / "lt_K02_seed0_lr1" / "config.json").read_text())["env"]["code"]
        assert code["commit"] == pinned and Path(code["snapshot"]).resolve() == snap.resolve()
        campaign = json.loads((tmp_path / name / "sweep.json").read_text())["campaign"]
        assert campaign["snapshot"]["commit"] == pinned
    # recorded relative to each study's folder, so that the chain's folders (or their archive) can move together
    assert json.loads((tmp_path / "b" / "sweep.json").read_text())["campaign"]["snapshot"]["path"] == \
        os.path.join("..", "a", ".code", pinned[:12])


def test_a_snapshot_is_recorded_relative_where_it_moves_with_the_campaigns_folders(tmp_path, monkeypatch):
    """In the campaign's folder: relative to it; in another campaign's `.code` folder (a chain's first study): relative
    too, through `..`; elsewhere (--snapshot-dir): absolute. Each path, read back against its folder, is the
    snapshot; after the folders move together the relative ones still are."""
    from flt_diag.storage.code_snapshot import recorded_folder, running_snapshot
    commit = "ab" * 20
    snaps = [tmp_path / "runs" / "a" / ".code" / "abababababab", tmp_path / "elsewhere" / "snap"]
    for snap in snaps:
        snap.mkdir(parents=True)
        (snap / MARKER).write_text(json.dumps({"commit": commit}))
    expected = {("a", 0): os.path.join(".code", "abababababab"),
                ("b", 0): os.path.join("..", "a", ".code", "abababababab"), ("b", 1): str(snaps[1].resolve())}
    for (name, i), path in expected.items():
        out = tmp_path / "runs" / name
        out.mkdir(exist_ok=True)
        monkeypatch.setenv(ENV, str(snaps[i]))
        got = running_snapshot(out)
        assert got == {"path": path, "commit": commit}
        assert recorded_folder(out, got).resolve() == snaps[i].resolve()
    shutil.move(tmp_path / "runs", tmp_path / "moved")
    moved = recorded_folder(tmp_path / "moved" / "b", {"path": expected[("b", 0)], "commit": commit})
    assert json.loads((moved / MARKER).read_text())["commit"] == commit


def test_a_snapshot_folder_that_is_not_its_commits_files_is_never_run(tmp_path):
    """A snapshot folder whose marker names the commit but whose files differ (edited, or sent along with a
    crafted run folder) is refused in one line by make_snapshot, which every start of a campaign goes through."""
    head = git(REPO, "rev-parse", "HEAD")
    where = make_snapshot(REPO, head, tmp_path / "snap")
    init = where / "flt_diag" / "__init__.py"
    init.chmod(0o644)
    init.write_text(init.read_text() + "\nprint('code that came with the folder')\n")
    with pytest.raises(StorageError, match="not commit .*'s .*not run"):
        make_snapshot(REPO, head, where)


def test_a_missing_snapshot_is_made_again_only_in_a_campaigns_code_folder(tmp_path):
    """remakeable, written out: the campaign's own .code/<commit12> and a sibling study's are; a path a crafted
    sweep.json names elsewhere, a folder not named after the commit, or one two levels up are not."""
    from flt_diag.cli.snapshot_exec import remakeable
    commit = "ab" * 20
    out = tmp_path / "runs" / "study-b"
    cases = {out / ".code" / commit[:12]: True, tmp_path / "runs" / "study-a" / ".code" / commit[:12]: True,
             out / ".code" / "something": False, tmp_path / "elsewhere" / ".code" / commit[:12]: False,
             out / "sub" / commit[:12]: False, out / ".." / ".." / ".." / "x" / ".code" / commit[:12]: False}
    assert {where: remakeable(out, where, commit) for where in cases} == cases
