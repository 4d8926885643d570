"""Run archives (issue 41): records written by `flt-diag archive` read as the run folders they came from
(tables, recompute, plots, report, predict), the thinning checked against the full rows by independent
pandas computations, and every crafted or truncated record one error line."""
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fake_runs import make_run, make_sweep
from flt_diag.cli import main
from flt_diag.results import archiving
from flt_diag.results.tables import summary_table
from flt_diag.storage import archive, metric_names as M
from flt_diag.judge.verdict import resummarize
from flt_diag.storage.folders import MetricsWriter, load_config, load_metrics, load_summary, run_dirs


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


@pytest.fixture
def archived(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    code, out, err = run_cli(["archive", sweep, "--to", tmp_path / "arch"], capsys)
    assert code == 0, err
    return sweep, tmp_path / "arch" / "sweep"


def test_an_archived_sweep_reads_as_the_sweep(archived):
    sweep, arch = archived
    finished = [d for d in run_dirs(sweep) if load_summary(d) is not None]
    records = run_dirs(arch)
    assert [r.stem for r in records] == [d.name for d in finished]  # the unfinished cell is not archived
    for d, r in zip(finished, records):
        assert load_config(r) == load_config(d) and load_summary(r) == load_summary(d)
        pd.testing.assert_frame_equal(load_metrics(r), load_metrics(d), check_dtype=False)  # 80 steps: kept whole
    cols = ["variant", "loops", "verdict", "final_loss", "val_loss", "behind"]
    a = summary_table(sweep)
    a = a[a.verdict.isin(["stable", "collapsed"])].reset_index(drop=True)[cols]
    b = summary_table(arch)
    assert sorted(b.verdict[~b.verdict.isin(["stable", "collapsed"])]) == ["pending", "pending"]  # not archived
    b = b[b.verdict.isin(["stable", "collapsed"])].reset_index(drop=True)[cols]
    pd.testing.assert_frame_equal(b, a, check_dtype=False)


def test_thinning_keeps_every_verdict_series_and_every_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(archiving, "EVERY", 7)
    monkeypatch.setattr(archiving, "SPARSE", 10)
    run = make_run(tmp_path / "lt", "lt", 6, collapsed=True)
    df = load_metrics(run)  # a residual spike mid-run, at a step the thinning grid skips (43 = 6 * 7 + 1)
    df.loc[(df.metric == M.RESID_NORM) & (df.loop == 2) & (df.layer == 1) & (df.step == 43), "value"] = 1e4
    for part in (run / "metrics").iterdir():
        part.unlink()
    writer = MetricsWriter(run)
    writer.extend(df.itertuples(index=False, name=None))
    writer.flush()
    resummarize(run)
    assert load_summary(run).residual_explosion_any
    done = archiving.archive_sources([run], tmp_path / "arch", report=lambda _: None)
    record = done[0].record
    full, kept = load_metrics(run), load_metrics(record)
    assert not done[0].whole and len(kept) < 0.4 * len(full)
    for metric in (M.LOSS, M.GRAD_NORM, M.VAL_LOSS):  # the verdict's series: every row
        pd.testing.assert_frame_equal(kept[kept.metric == metric].reset_index(drop=True),
                                      full[full.metric == metric].reset_index(drop=True), check_dtype=False)
    key = ["metric", "loop", "layer"]
    peaks = full.groupby(key).value.max()
    assert (kept.groupby(key).value.max() == peaks).all()  # every series' peak, exactly
    merged = kept.merge(full, on=["step"] + key, suffixes=("_k", "_f"))
    assert len(merged) == len(kept) and (merged.value_k == merged.value_f).all()  # rows are copies
    thinned = kept[kept.metric == M.RESID_NORM]
    assert set(thinned.step) - {0, 79} - set(full[full.metric == M.RESID_NORM].groupby(key).value.idxmax().map(
        full.step)) <= set(range(0, 80, 7))
    # the check: the summary recomputed from the record is the run's
    code = main(["summary", "--recompute", str(tmp_path / "arch")])
    assert code == 0
    again = load_summary(record)
    old = load_summary(run)
    assert again.verdict == old.verdict == "collapsed"
    for k in ("final_loss", "best_loss", "peak_resid_norm", "residual_explosion", "residual_explosion_any",
              "osc_dlog_median"):
        assert getattr(again, k) == getattr(old, k), k


def test_a_thinning_that_would_change_the_summary_keeps_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(archiving, "EVERY", 7)
    monkeypatch.setattr(archiving, "SPARSE", 10)
    monkeypatch.setattr(archiving, "FULL", ())  # the loss thinned too: the verdict's smoothing changes
    run = make_run(tmp_path / "lt", "lt", 6, collapsed=True)
    done = archiving.archive_sources([run], tmp_path / "arch", report=lambda _: None)
    assert done[0].whole and len(load_metrics(done[0].record)) == len(load_metrics(run))
    assert archive.read_meta(done[0].record).kept["thinned"] is False


def test_recompute_rejudges_an_archive_in_place(archived, capsys):
    _, arch = archived
    record = arch / "lt_K06_seed0_lr1.parquet"
    before = load_metrics(record)
    assert load_summary(record).verdict == "collapsed"
    code, out, err = run_cli(["summary", "--recompute", "--rebound-abs", "50", "--rebound-rel", "50", arch], capsys)
    assert code == 0, err
    assert load_summary(record).verdict != "collapsed"  # no climb is large enough any more
    pd.testing.assert_frame_equal(load_metrics(record), before)
    assert not (arch / "summary.csv").exists()  # an archive holds records and sweep.json only


def test_plot_report_and_predict_read_an_archive(archived, tmp_path, capsys):
    _, arch = archived
    code, out, err = run_cli(["plot", "all", arch, "--out", tmp_path / "figs", "--format", "png"], capsys)
    assert code == 0, err
    assert any(p.suffix == ".png" for p in (tmp_path / "figs").iterdir())
    code, out, err = run_cli(["report", arch, "--out", tmp_path / "r.html"], capsys)
    assert code == 0, err and (tmp_path / "r.html").stat().st_size > 1000
    code, out, err = run_cli(["predict", arch, "--online"], capsys)
    assert code == 0, err
    assert "lt_K06" in out or "lt" in out
    sweep, _ = archived
    finished = sorted(d.name for d in run_dirs(sweep) if load_summary(d) is not None)
    code, out, err = run_cli(["predict", arch, "--online", "--csv", tmp_path / "p.csv"], capsys)  # (--online: the
    assert code == 0, err  # fake runs' 80 steps are too few for --at; its rows are named by the same run_row)
    assert sorted(pd.read_csv(tmp_path / "p.csv").cell) == finished  # as in the sweep, not "<cell>.parquet"


def test_eval_loops_on_an_archive_says_why_not(archived, capsys):
    code, out, err = run_cli(["eval-loops", archived[1]], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "keeps no checkpoints" in err


def _craft(path, table=None, meta=None):
    t = table if table is not None else pa.table({"step": [0], "metric": ["loss"], "loop": pa.array([-1], pa.int16()),
                                                  "layer": pa.array([-1], pa.int16()), "value": [1.0]})
    if meta is not None:
        t = t.replace_schema_metadata({archive.META_KEY: meta})
    pq.write_table(t, path)


@pytest.mark.parametrize("kind,message", [
    ("noise", "not a readable Parquet file"),
    ("no-meta", "without flt-diag's archive metadata"),
    ("bad-json", "unreadable archive metadata"),
    ("format", "archive format 7"),
    ("bad-config", "[config]"),
    ("columns", "columns"),
    ("truncated", "not a readable Parquet file"),
])
def test_a_crafted_or_truncated_record_is_one_error_line(archived, tmp_path, capsys, kind, message):
    _, arch = archived
    good = arch / "flt_K03_seed0_lr1.parquet"
    meta = archive.read_meta(good).as_written()
    bad = tmp_path / "bad" / "x.parquet"
    bad.parent.mkdir()
    if kind == "noise":
        bad.write_bytes(np.random.default_rng(0).bytes(2000))
    elif kind == "no-meta":
        _craft(bad)
    elif kind == "bad-json":
        _craft(bad, meta=b"{nope")
    elif kind == "format":
        _craft(bad, meta=json.dumps({**meta, "format": 7}).encode())
    elif kind == "bad-config":
        cfg = {**meta["config"], "model": {**meta["config"]["model"], "loops": -4}}
        _craft(bad, meta=json.dumps({**meta, "config": cfg}).encode())
    elif kind == "columns":
        _craft(bad, table=pa.table({"a": [1]}), meta=json.dumps(meta).encode())
    else:
        data = good.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    commands = [["summary", "--recompute", bad.parent], ["plot", "all", bad.parent, "--out", tmp_path / "f"]]
    if kind != "columns":  # (a summary reads the record's metadata only, as it reads summary.json only)
        commands.append(["summary", bad.parent])
    for args in commands:
        code, out, err = run_cli(args, capsys)
        assert code != 0 and len(err.splitlines()) == 1 and message in err and "Traceback" not in err, (args, err)


def test_archive_refuses_what_it_cannot_archive(archived, tmp_path, capsys):
    sweep, arch = archived
    code, _, err = run_cli(["archive", arch, "--to", tmp_path / "again"], capsys)
    assert code == 2 and "already an archive" in err
    code, _, err = run_cli(["archive", sweep / "cells" / "fla_K03_seed0_lr1", "--to", tmp_path / "x"], capsys)
    assert code == 2 and "has not finished" in err
    code, _, err = run_cli(["archive", sweep, "--to", sweep / "inside"], capsys)
    assert code == 2 and "inside" in err


def test_the_analysis_scripts_read_an_archive_as_the_sweep(archived):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
    import failure_rates
    from flt_diag.results.tables import pooled_summary
    sweep, arch = archived
    a = failure_rates.failure_rates(pooled_summary([sweep]))
    b = failure_rates.failure_rates(pooled_summary([arch]))
    pd.testing.assert_frame_equal(a, b)
    assert set(a.failed) == {"0/1", "1/1"}


def test_run_state_of_folders_made_by_hand_and_of_records(archived, tmp_path):
    """One definition of where a run stands (storage.folders.run_state), read by the progress bar, the tables and
    the map's brackets: each state made here by hand, as the Trainer and the sweep leave it."""
    from flt_diag.storage.folders import run_state
    base = tmp_path / "states"
    (base / "done").mkdir(parents=True)
    (base / "done" / "summary.json").write_text("{}")  # (its content is not read: written last, it marks the end)
    (base / "failed").mkdir()
    (base / "failed" / "error.txt").write_text("Traceback ...")
    (base / "partial").mkdir()
    (base / "partial" / "config.json").write_text("{}")
    assert [run_state(base / n) for n in ("done", "failed", "partial", "pending")] == \
        ["done", "failed", "partial", "pending"]
    _, arch = archived
    assert {run_state(r) for r in run_dirs(arch)} == {"done"}  # a record holds a finished run
