"""Figures, report and regenerate script on fake run and sweep folders (tests/fake_runs.py)."""
from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest

import processes
from fake_runs import EXPECTED_VERDICTS, make_run, make_sweep
from flt_diag.storage import metric_names as M
from flt_diag.results import figures as P
from flt_diag.results.figures import depth
from flt_diag.results.tables import OSC_COLUMNS
from flt_diag.results.report import write_report
from flt_diag.storage.folders import CELLS, StorageError, read_json, write_json

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHROMIUM = Path("/usr/bin/chromium")
# the figures of any run or sweep (map, breaking: map folders only; accuracy: runs of a synthetic task only)
RUN_FIGURES = [k for k in P.FIGURES if k not in ("map", "breaking", "accuracy")]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    return make_sweep(tmp_path_factory.mktemp("plots") / "sweep")


@pytest.fixture(scope="module")
def regenerated(sweep, tmp_path_factory) -> Path:
    """analysis/regenerate.py run once, in a subprocess, on the fake sweep."""
    out = tmp_path_factory.mktemp("regen")
    proc = subprocess.run([sys.executable, str(REPO / "analysis" / "regenerate.py"), str(sweep), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    image = mpimg.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 100, path


def assert_pdf(path: Path) -> None:
    data = path.read_bytes()
    assert data[:5] == b"%PDF-" and b"%%EOF" in data[-1024:], path


def stored(run_dir: Path, metric: str) -> pd.DataFrame:
    """Rows of one metric read straight from the run's Parquet parts (independently of flt_diag)."""
    df = pd.read_parquet(run_dir / "metrics")
    df = df[df.metric == metric].astype({"loop": "int64", "layer": "int64"})
    return df.sort_values(["step", "loop", "layer"]).reset_index(drop=True)


# --------------------------------------------------------------------------- writing figures

def test_regenerate_writes_every_figure_table_and_report(regenerated, sweep):
    for kind in RUN_FIGURES:
        assert_png(regenerated / f"{kind}.png")
        assert_pdf(regenerated / f"{kind}.pdf")
    table = pd.read_csv(regenerated / "table.csv")
    assert len(table) == len(EXPECTED_VERDICTS)
    assert (regenerated / "table.md").read_text().startswith("| Variant | Loops |")
    assert (regenerated / "report.html").exists()


def test_plot_all_on_a_single_run(tmp_path):
    run = make_run(tmp_path / "run", "flt", 3, eval_loops=True)
    written = P.plot("all", run)
    assert sorted(p.name for p in written) == sorted(f"{k}.{f}" for k in RUN_FIGURES for f in ("png", "pdf"))
    assert all(p.parent == run / "figures" for p in written) and not written.skipped
    for p in written:
        (assert_png if p.suffix == ".png" else assert_pdf)(p)


def test_in_progress_run_without_eval_loops(tmp_path):
    run = make_run(tmp_path / "run", "lt", 6, collapsed=True, finished=False)
    written = P.plot("all", run, out_dir=tmp_path / "out", formats=("png",))
    assert sorted(p.stem for p in written) == sorted(k for k in RUN_FIGURES if k != "loops")
    assert "eval_loops.csv" in written.skipped["loops"]
    with pytest.raises(StorageError, match="eval_loops"):
        P.plot("loops", run)
    assert P.figure_data("collapse", run).verdict.tolist() == ["running"]


def _run_without_metrics(d: Path) -> Path:
    write_json(d / "config.json", {"model": {"variant": "lt", "loops": 3}, "train": {"seed": 0, "lr_scale": 1.0}})
    return d


@pytest.mark.parametrize("make_bad, message", [
    (lambda d: d / "missing", "no such folder"),
    (lambda d: d, "neither a run folder"),
    (_run_without_metrics, "no metrics recorded yet"),
])
def test_bad_paths_raise_storage_error(tmp_path, make_bad, message):
    with pytest.raises(StorageError, match=message):
        P.plot("all", make_bad(tmp_path))
    with pytest.raises(ValueError, match="unknown figure"):
        P.figure_data("nope", tmp_path)


# --------------------------------------------------------------------------- figure data

def _files(folder: Path) -> dict:
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def test_figure_data_is_a_function_of_the_folders_files(sweep, tmp_path):
    """Every run figure of the sweep has rows; a copy of the folder elsewhere (other paths, other
    modification times) gives the same tables; and reading them writes nothing into the folder."""
    before = _files(sweep)
    copy = tmp_path / "elsewhere" / sweep.name
    shutil.copytree(sweep, copy, copy_function=shutil.copy)  # contents only: new mtimes
    for kind in RUN_FIGURES:
        here = P.figure_data(kind, sweep)
        assert len(here), kind
        pd.testing.assert_frame_equal(here, P.figure_data(kind, copy), obj=kind)
    assert _files(sweep) == before


def test_figure_data_matches_stored_rows(sweep):
    spec = read_json(sweep / "sweep.json")
    runs = [sweep / CELLS / n for n in spec["cell_names"] if (sweep / CELLS / n).exists()]
    resid, grads, loss = (P.figure_data(k, sweep) for k in ("residuals", "gradients", "loss"))
    heat = depth.data(P.study_of(sweep, ["depth"]), steps=[10, 10_000])
    for run in runs:
        got = resid[resid.run == run.name].sort_values(["step", "loop"]).reset_index(drop=True)
        want = stored(run, M.RESID_NORM_LOOP_END)
        np.testing.assert_array_equal(got[["step", "loop"]].to_numpy(), want[["step", "loop"]].to_numpy())
        np.testing.assert_allclose(got.value, want.value)

        g = grads[(grads.run == run.name) & (grads.metric == M.GRAD_NORM)]
        np.testing.assert_allclose(g.value, stored(run, M.GRAD_NORM).query("layer == -1").value)

        raw = stored(run, M.LOSS)  # the verdict's smoothing: a trailing mean over full windows only
        window = read_json(run / "config.json")["verdict"]["smooth_window"]
        values = raw.value.to_numpy()
        smooth = [values[i - window + 1:i + 1].mean() for i in range(window - 1, len(values))]
        got = loss[(loss.run == run.name) & (loss.metric == "loss_smoothed")]
        np.testing.assert_array_equal(got.step, raw.step[window - 1:])
        np.testing.assert_allclose(got.value, smooth)

        h = heat[heat.run == run.name]
        last = int(stored(run, M.RESID_NORM).step.max())
        assert sorted(h.step.unique()) == [10, last]
        r = stored(run, M.RESID_NORM)
        np.testing.assert_allclose(h.sort_values(["step", "loop", "layer"]).value,
                                   r[r.step.isin([10, last])].value)


def test_oscillation_indices_come_from_the_summary(sweep):
    grads = P.figure_data("gradients", sweep)
    run = sweep / CELLS / "lt_K06_seed0_lr1"
    summary = read_json(run / "summary.json")
    osc = grads[(grads.run == run.name) & grads.metric.str.startswith("osc_")]
    assert dict(zip(osc.metric, osc.value)) == pytest.approx({k: summary[k] for k in OSC_COLUMNS})
    running = grads[(grads.run == "fla_K03_seed0_lr1") & grads.metric.str.startswith("osc_")]
    assert len(running) == 4 and running.value.notna().all()


def test_collapse_grid_has_the_verdict_of_every_cell(sweep):
    grid = P.figure_data("collapse", sweep)
    assert {(r.variant, r.loops): r.verdict for r in grid.itertuples()} == EXPECTED_VERDICTS
    row = grid[(grid.variant == "lt") & (grid.loops == 6)].iloc[0]
    summary = read_json(sweep / CELLS / "lt_K06_seed0_lr1" / "summary.json")
    assert row.final_loss == pytest.approx(summary["final_loss"]) and row.residual_explosion


def test_collapse_grid_aggregates_seeds_and_lr_scales(tmp_path):
    sweep = make_sweep(tmp_path / "sweep", seeds=(0, 1), lr_scale=(1.0, 2.0))
    grid = P.figure_data("collapse", sweep)
    assert len(grid) == 2 * len(EXPECTED_VERDICTS)
    for r in grid.itertuples():
        assert r.verdict == EXPECTED_VERDICTS[(r.variant, r.loops)]
        assert (r.runs, r.finished, r.agree) == {"pending": (0, 0, 0), "running": (2, 0, 0)}.get(r.verdict, (2, 2, 2))
    assert P.FIGURES["collapse"].figure(P.study_of(sweep, ["collapse"])).axes[0].get_title() == "lr×1"


# --------------------------------------------------------------------------- report

def test_report_has_every_figure_and_the_table(regenerated):
    html = (regenerated / "report.html").read_text()
    images = re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == html.count("<img") == len(RUN_FIGURES)
    assert all(base64.b64decode(i)[:8] == PNG_MAGIC for i in images)
    for (variant, loops), verdict in EXPECTED_VERDICTS.items():
        assert re.search(rf"<tr><td[^>]*>{variant}</td><td[^>]*>{loops}</td><td[^>]*>{verdict}", html), (variant, loops)
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert "cell_names" in html and "Environment" in html


def test_write_report_default_location_on_a_run(tmp_path):
    run = make_run(tmp_path / "run", "lt", 3)  # no eval_loops.csv: five figures
    html = write_report(run).read_text()
    assert (run / "report.html").exists()
    assert html.count("data:image/png;base64,") == len(RUN_FIGURES) - 1 and "left out" in html


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium")
def test_report_renders_in_headless_chromium(regenerated, tmp_path):
    shot = tmp_path / "shot.png"
    processes.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--no-first-run",
                   f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,2000",
                   (regenerated / "report.html").as_uri()], capture_output=True, timeout=120)  # and its helpers
    assert shot.exists() and shot.stat().st_size > 20_000
    image = mpimg.imread(shot)
    assert image.shape[:2] == (2000, 1200)
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 100  # text, table and figures, not a blank page


def test_the_regenerate_script_never_imports_torch():
    """(Every module of flt_diag/analysis/ is checked in tests/test_layers.py; this is the script.)"""
    code = ("import runpy, sys; runpy.run_path('analysis/regenerate.py', run_name='imported'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
