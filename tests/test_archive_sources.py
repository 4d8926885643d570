"""`flt-diag archive` never mixes sources (issue 54): another run or map of the same name, a --to inside a run,
sweep or archived sweep, a file or FIFO as --to, an empty path; a record stores what the run stored (a step of
2**53, a 3 MB eval_loops.csv) or refuses; a temporary file a kill -9 leaves is never read as a record, and the
re-run removes it; a linked record is one line; `plot all RECORD` asks for --out."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from fake_runs import make_run, make_sweep, config
from flt_diag.cli import main
from flt_diag.judge.verdict import resummarize
from flt_diag.storage import archive, metric_names as M
from flt_diag.storage.folders import CELLS, MetricsWriter, load_eval_loops, load_metrics, run_dirs

SUFFIX = ".parquet"


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def refused(args, capsys, *words):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (args, code, err)
    assert all(w in err for w in words), (words, err)
    return err


def tree(folder: Path) -> dict:
    """Every file below `folder` (hidden ones too) and its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def stored_config(record: Path) -> dict:
    return json.loads(pq.read_schema(record).metadata[archive.META_KEY])["config"]


# --------------------------------------------------------------------------- another source of the same name

def test_another_run_of_the_same_name_is_refused_unless_replace(tmp_path, capsys):
    first, second = make_run(tmp_path / "a" / "lt", "lt", 3), make_run(tmp_path / "b" / "lt", "lt", 3, seed=1)
    to = tmp_path / "arch"
    assert run_cli(["archive", first, "--to", to], capsys)[0] == 0
    assert stored_config(to / "lt.parquet")["train"]["seed"] == 0
    before = tree(to)
    refused(["archive", second, "--to", to], capsys, "lt.parquet", "another run", "--replace")
    assert tree(to) == before
    code, _, err = run_cli(["archive", first, "--to", to], capsys)  # the same run again: refreshed
    assert code == 0, err
    code, _, err = run_cli(["archive", second, "--to", to, "--replace"], capsys)
    assert code == 0, err
    assert stored_config(to / "lt.parquet")["train"]["seed"] == 1  # (read from the file, not through the loaders)
    refused(["archive", first, second, "--to", tmp_path / "both"], capsys, "both be archived")
    assert not (tmp_path / "both").exists()


def _map_named(folder: Path) -> Path:
    from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
    prepare_map_folder(MapSpec(config("lt", 3), ["lt", "flt"], [3], [0], "depth", [1, 2], ["training"]), folder)
    make_run(folder / CELLS / "lt_K03_seed0_lr1", "lt", 3, depth=1)  # a probe named like one of the sweep's cells
    make_run(folder / CELLS / "flt_K03_seed0_lr1_L2", "flt", 3, depth=2)
    return folder


def test_a_map_named_like_an_archived_sweep_is_refused_unless_replace(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "s" / "grid")
    to = tmp_path / "arch"
    assert run_cli(["archive", sweep, "--to", to], capsys)[0] == 0
    before = tree(to)
    mapped = _map_named(tmp_path / "m" / "grid")
    refused(["archive", mapped, "--to", to], capsys, str(to / "grid"), "sweep.json differs", "--replace")
    assert tree(to) == before
    code, _, err = run_cli(["archive", mapped, "--to", to, "--replace"], capsys)
    assert code == 0, err
    assert json.loads((to / "grid" / "sweep.json").read_text()) == json.loads((mapped / "sweep.json").read_text())
    assert sorted(p.name for p in (to / "grid").iterdir()) == ["flt_K03_seed0_lr1_L2.parquet", "lt_K03_seed0_lr1.parquet",
                                                              "sweep.json"]  # none of the sweep's records kept
    assert stored_config(to / "grid" / "lt_K03_seed0_lr1.parquet")["model"]["depth"] == 1


def test_a_sweep_archived_in_slices_refreshes_its_own_records(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "s" / "grid")
    to = tmp_path / "arch"
    assert run_cli(["archive", sweep, "--to", to], capsys)[0] == 0
    make_run(sweep / CELLS / "fla_K03_seed0_lr1", "fla", 3)  # the cell in progress has finished since
    code, out, err = run_cli(["archive", sweep, "--to", to], capsys)
    assert code == 0, err
    assert sorted(r.stem for r in run_dirs(to / "grid")) == sorted(
        ["lt_K03_seed0_lr1", "flt_K03_seed0_lr1", "lt_K06_seed0_lr1", "flt_K06_seed0_lr1", "fla_K03_seed0_lr1"])
    # the same sweep run again elsewhere (its cells made at another time): another source
    other = tmp_path / "s2" / "grid"
    shutil.copytree(sweep, other)
    for cell in (c for c in (other / CELLS).iterdir() if (c / "config.json").exists()):
        cfg = json.loads((cell / "config.json").read_text())
        (cell / "config.json").write_text(json.dumps({**cfg, "env": {**cfg["env"], "started": "2026-12-05T09:00:00"}}))
    refused(["archive", other, "--to", to], capsys, "another run archived as", "--replace")


# --------------------------------------------------------------------------- where --to may be

@pytest.mark.parametrize("where", ["run", "metrics", "sweep", "cells", "archived-sweep", "file", "fifo"])
def test_a_to_that_is_no_archive_folder_is_refused_and_nothing_is_made(tmp_path, capsys, where):
    run = make_run(tmp_path / "runs" / "lt", "lt", 3)
    other = make_run(tmp_path / "runs" / "other", "flt", 3)
    sweep = make_sweep(tmp_path / "sweep")
    assert run_cli(["archive", sweep, "--to", tmp_path / "arch"], capsys)[0] == 0
    to = {"run": other, "metrics": other / "metrics", "sweep": sweep / "new", "cells": sweep / CELLS / "x" / "y",
          "archived-sweep": tmp_path / "arch" / "sweep", "file": tmp_path / "f", "fifo": tmp_path / "p"}[where]
    if where == "file":
        to.write_text("notes")
    elif where == "fifo":
        os.mkfifo(to)
    before = tree(tmp_path) if where != "fifo" else None
    words = {"file": ["is a file"], "fifo": ["FIFO"], "run": ["is a run folder"], "metrics": ["inside a run folder"],
             "archived-sweep": ["an archived sweep"]}.get(where, ["inside a sweep or map folder"])
    refused(["archive", run, "--to", to], capsys, f"--to {to}", *words)
    if before is not None:
        assert tree(tmp_path) == before
    assert not (tmp_path / "sweep" / "new").exists() and not (sweep / CELLS / "x").exists()
    assert run_cli(["summary", other], capsys)[0] == 0  # still a run folder, not "a run archive"


def test_an_empty_path_is_refused(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "lt", "lt", 3)
    monkeypatch.chdir(tmp_path)
    refused(["archive", run, "--to", ""], capsys, "--to", "empty path")
    refused(["archive", "", "--to", "x"], capsys, "empty path")
    assert not (tmp_path / "lt.parquet").exists() and not (tmp_path / "x").exists()


def test_a_refused_archive_leaves_no_folder(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    refused(["archive", sweep / CELLS / "fla_K03_seed0_lr1", "--to", tmp_path / "new" / "deep"], capsys,
            "has not finished")
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- what a record stores

def test_steps_past_int32_come_back_as_stored(tmp_path, capsys):
    run = make_run(tmp_path / "lt", "lt", 3)
    writer = MetricsWriter(run)
    writer.extend([(10 ** 12, M.LOSS, -1, -1, 2.5), (2 ** 53, M.LOSS, -1, -1, 2.25)])
    writer.flush()
    resummarize(run)
    code, _, err = run_cli(["archive", run, "--to", tmp_path / "arch"], capsys)
    assert code == 0, err
    record = tmp_path / "arch" / "lt.parquet"
    steps = pq.read_table(record).column("step").to_pylist()  # the file itself, not the loader's cast
    assert {10 ** 12, 2 ** 53} <= set(steps)
    assert max(load_metrics(record).step) == 2 ** 53
    assert run_cli(["summary", tmp_path / "arch"], capsys)[0] == 0


def test_a_loop_past_int16_is_refused_not_wrapped(tmp_path, capsys):
    run = make_run(tmp_path / "lt", "lt", 3)
    part = next((run / "metrics").glob("part-*.parquet"))
    df = pd.read_parquet(part).astype({"loop": "int32"})
    df.loc[df.index[-1], "loop"] = 40_000  # a crafted part: its loop column int32
    df.to_parquet(part, index=False)
    refused(["archive", run, "--to", tmp_path / "arch"], capsys, "loop of 40000", "int16")
    assert not (tmp_path / "arch").exists()


def test_a_long_eval_loops_csv_is_kept_whole_and_a_huge_one_refused(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "lt", "lt", 3)
    lines = ["loops,trained_loops,val_loss,perplexity,data,batches"] + [
        f"{k},3,{2 + 1 / k:.6f},{7 + 1 / k:.6f},stdlib,2" for k in range(1, 200_001)]
    (run / "eval_loops.csv").write_text("\n".join(lines) + "\n")
    code, _, err = run_cli(["archive", run, "--to", tmp_path / "arch"], capsys)
    assert code == 0, err
    df = load_eval_loops(tmp_path / "arch" / "lt.parquet")
    assert len(df) == 200_000 and df.loops.iloc[-1] == 200_000 and df.val_loss.iloc[-1] == pytest.approx(2.000005)
    monkeypatch.setattr(archive, "MAX_EVAL_LOOPS_BYTES", 1 << 20)
    refused(["archive", run, "--to", tmp_path / "arch2"], capsys, "eval_loops.csv", "1,048,576")
    assert not (tmp_path / "arch2").exists()


@pytest.mark.parametrize("table, words", [
    ('loops,val_loss\n"3,2.0\n', "its eval_loops table cannot be read"),  # an unclosed quote: pandas' ParserError
    ("a,b\n1,2\n", "no loops and val_loss column"),  # none of the table's columns
    ("loops,trained_loops,val_loss,perplexity,data,batches\nthree,3,x,y,stdlib,2\n", "holds 'three', not a number"),
])
def test_a_records_crafted_eval_loops_table_is_one_line_where_it_is_read(tmp_path, capsys, table, words):
    """A record whose stored eval_loops table was edited: `plot loops` on its archive refuses it in one line,
    writes no figure, and leaves the record as it was."""
    run = make_run(tmp_path / "lt", "lt", 3)
    (run / "eval_loops.csv").write_text("loops,trained_loops,val_loss,perplexity,data,batches\n"
                                        "3,3,2.0,7.4,stdlib,2\n6,3,2.1,8.2,stdlib,2\n")
    assert run_cli(["archive", run, "--to", tmp_path / "arch"], capsys)[0] == 0
    record = tmp_path / "arch" / "lt.parquet"
    t = pq.read_table(record)
    meta = json.loads(t.schema.metadata[archive.META_KEY])
    meta["eval_loops"] = table
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, archive.META_KEY: json.dumps(meta).encode()}),
                   record)
    before = record.read_bytes()
    refused(["plot", "loops", tmp_path / "arch", "--out", tmp_path / "figs"], capsys, words)
    figs = tmp_path / "figs"
    assert record.read_bytes() == before and not (figs.exists() and any(figs.iterdir()))


# --------------------------------------------------------------------------- temporary files, links, plot

KILLED = """
import os, signal, sys
import pyarrow.parquet as pq
write = pq.write_table
def killed(table, where, **kw):
    write(table, where, **kw)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 between the write and the rename
pq.write_table = killed
from flt_diag.cli import main
main(["archive", sys.argv[1], "--to", sys.argv[2]])
"""


def test_a_kill_during_archive_leaves_no_record_and_the_rerun_cleans_up(tmp_path, capsys):
    first, second = make_run(tmp_path / "a", "lt", 3), make_run(tmp_path / "b", "flt", 3)
    to = tmp_path / "arch"
    assert run_cli(["archive", first, "--to", to], capsys)[0] == 0
    proc = subprocess.run([sys.executable, "-c", KILLED, str(second), str(to)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    left = [p.name for p in to.iterdir() if p.name not in ("a.parquet", ".lock")]  # (.lock: the next one takes it)
    assert len(left) == 1 and left[0].startswith(".b.parquet.") and not left[0].endswith((".parquet", ".json"))
    assert [r.name for r in run_dirs(to)] == ["a.parquet"]  # the temporary file is no record
    code, out, err = run_cli(["summary", to], capsys)
    assert code == 0 and err == "", err
    code, _, err = run_cli(["archive", second, "--to", to], capsys)  # the re-run completes and removes it
    assert code == 0, err
    assert sorted(p.name for p in to.iterdir()) == ["a.parquet", "b.parquet"]


def test_a_stale_temporary_file_of_the_old_name_is_skipped_by_every_reader(tmp_path, capsys):
    run = make_run(tmp_path / "lt", "lt", 3)
    to = tmp_path / "arch"
    assert run_cli(["archive", run, "--to", to], capsys)[0] == 0
    (to / ".lt.parquet.k3j9x_0a.tmp.parquet").write_bytes((to / "lt.parquet").read_bytes()[:500])  # as before 54
    assert [r.name for r in run_dirs(to)] == ["lt.parquet"]
    for args in (["summary", to], ["summary", "--recompute", to]):
        code, _, err = run_cli(args, capsys)
        assert code == 0, (args, err)
    assert run_cli(["archive", run, "--to", to], capsys)[0] == 0
    assert sorted(p.name for p in to.iterdir()) == ["lt.parquet"]  # the re-run removed its own stale file


def test_a_linked_record_is_one_line(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    to = tmp_path / "arch"
    assert run_cli(["archive", sweep, "--to", to], capsys)[0] == 0
    cell = to / "sweep" / "lt_K03_seed0_lr1.parquet"
    cell.unlink()
    cell.symlink_to(to / "sweep" / "lt_K06_seed0_lr1.parquet")  # another cell's rows under this name
    for args in (["summary", to / "sweep"], ["summary", cell], ["plot", "loss", to / "sweep", "--out", tmp_path / "f"]):
        refused(args, capsys, str(cell), "symbolic link")


def test_plot_of_a_record_without_out_says_to_give_out(tmp_path, capsys):
    run = make_run(tmp_path / "lt", "lt", 3)
    assert run_cli(["archive", run, "--to", tmp_path / "arch"], capsys)[0] == 0
    refused(["plot", "all", tmp_path / "arch" / "lt.parquet"], capsys, "give --out")
    code, _, err = run_cli(["plot", "loss", tmp_path / "arch" / "lt.parquet", "--out", tmp_path / "f",
                            "--format", "png", "pdf"], capsys)
    assert code == 0, err
    assert (tmp_path / "f" / "loss.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "f" / "loss.pdf").read_bytes()[:4] == b"%PDF"


def test_report_of_a_record_without_out_says_to_give_out(tmp_path, capsys):
    run = make_run(tmp_path / "lt", "lt", 3)
    assert run_cli(["archive", run, "--to", tmp_path / "arch"], capsys)[0] == 0
    refused(["report", tmp_path / "arch" / "lt.parquet"], capsys, "give --out")
    code, _, err = run_cli(["report", tmp_path / "arch" / "lt.parquet", "--out", tmp_path / "r.html"], capsys)
    assert code == 0, err
    assert (tmp_path / "r.html").read_text().lstrip().lower().startswith("<!doctype html")
