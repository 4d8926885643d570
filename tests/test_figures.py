"""The figure registry and what figures show (tests/fake_runs.py folders)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure
from matplotlib.table import Table

from fake_runs import UNIGRAM_ENTROPY, make_run, make_sweep
from flt_diag.results import figures
from flt_diag.storage import metric_names as M
from flt_diag.results.figures import FIGURES, Figure, plot, register, render, study_of, unregister
from flt_diag.results.figures.style import style
from flt_diag.judge.verdict import resummarize
from flt_diag.results.tables import SUMMARY_COLUMNS, collect
from flt_diag.storage.folders import CELLS, StorageError, read_json


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    return make_sweep(tmp_path_factory.mktemp("figures") / "sweep")


def test_summary_csv_holds_each_finished_runs_summary_json(sweep):
    """summary.csv has one row per finished run, and every figure it shares with that run's
    summary.json is the file's (read here with json, not flt_diag); depth is config.json's depth."""
    table = pd.read_csv(sweep / "summary.csv")
    finished = sorted(p.name for p in (sweep / CELLS).iterdir() if (p / "summary.json").exists())
    assert sorted(table.cell) == finished and set(SUMMARY_COLUMNS) <= set(table.columns)
    for row in table.to_dict("records"):
        run = sweep / CELLS / row["cell"]
        summary, config = (json.loads((run / name).read_text()) for name in ("summary.json", "config.json"))
        assert row["depth"] == config["model"]["depth"]
        shared = set(row) & set(summary)
        assert {"verdict", "variant", "loops", "seed", "lr_scale", "final_loss", "best_loss", "val_loss",
                "peak_resid_norm", "osc_cv", "steps_done"} <= shared
        for key in shared:
            want = summary[key]
            assert row[key] == (want if isinstance(want, str) else pytest.approx(want, rel=1e-12, nan_ok=True)), key


def test_a_fake_run_is_rejudged_against_its_corpus_entropy(tmp_path):
    """config.json's corpus holds the unigram entropy the verdict compares with, as a trained run's
    does, so re-judging a fake run from its folder uses it."""
    run = make_run(tmp_path / "run", "flt", 3)
    assert json.loads((run / "config.json").read_text())["corpus"]["unigram_entropy"] == UNIGRAM_ENTROPY
    assert resummarize(run).evidence.unigram_entropy == UNIGRAM_ENTROPY


def test_registry_in_display_order_with_help():
    assert list(FIGURES)[:7] == ["residuals", "depth", "gradients", "loss", "collapse", "loops", "map"]
    assert all(f.name == name and f.help and "\n" not in f.help for name, f in FIGURES.items())


def _runs_table(study) -> pd.DataFrame:
    return pd.DataFrame({"run": [r.name for r in study.runs], "final": [r.summary is not None for r in study.runs]})


def _draw_runs(df: pd.DataFrame) -> MplFigure:
    fig = MplFigure(figsize=(3, 2))
    fig.subplots().bar(range(len(df)), df.final.astype(int))
    return fig


def test_the_figure_table_the_command_line_reads_gives_every_registered_figure_its_help_and_place():
    """flt_diag.results.figure_names (read by `flt-diag plot` without matplotlib) is the one place a figure's
    help and order are written: the registry holds its figures in its order, each drawn by the module it
    names, with its help; a listed figure with a help of its own, or drawn elsewhere, is refused, and a
    figure it does not list needs a help."""
    from flt_diag.results.figure_names import FIGURE_NAMES
    assert list(FIGURES) == list(FIGURE_NAMES)
    for name, (module, help) in FIGURE_NAMES.items():
        assert (FIGURES[name].draw.__module__, FIGURES[name].help) == (f"flt_diag.results.figures.{module}", help)
    with pytest.raises(ValueError, match="figure_names lists it"):  # a listed name with a help of its own
        register(Figure("loss", (), FIGURES["loss"].data, FIGURES["loss"].draw, help="another help"))
    with pytest.raises(ValueError, match="figure_names lists it"):  # a listed name drawn by another module
        register(Figure("loss", (), _runs_table, _draw_runs))
    with pytest.raises(ValueError, match="needs a help"):
        register(Figure("unlisted", (), _runs_table, _draw_runs))
    assert FIGURES["loss"].help == FIGURE_NAMES["loss"][1] and "unlisted" not in FIGURES


@pytest.fixture
def throwaway():
    register(Figure("finished", (), _runs_table, _draw_runs, help="which runs finished", order=65))
    yield "finished"
    unregister("finished")


def test_a_registered_figure_is_plotted_by_name_and_by_all(throwaway, sweep, tmp_path):
    assert list(FIGURES).index("finished") == list(FIGURES).index("loops") + 1
    written = plot("finished", sweep, tmp_path / "one", ("png",))
    assert [p.name for p in written] == ["finished.png"] and written[0].stat().st_size > 1000
    every = plot("all", sweep, tmp_path / "all", ("png",))
    assert "finished.png" in {p.name for p in every}
    assert "map" not in {p.stem for p in every} and "map" not in every.skipped  # a sweep is not a map
    assert figures.figure_data("finished", sweep).final.sum() == 4


def test_unknown_and_empty_figures(tmp_path):
    run = make_run(tmp_path / "run", "lt", 3)  # no eval_loops.csv
    with pytest.raises(ValueError, match="unknown figure 'nope'"):
        plot("nope", run)
    with pytest.raises(StorageError, match="eval_loops"):
        plot("loops", run)
    with pytest.raises(StorageError, match="not a stability map"):
        plot("map", run)


def test_loss_figure_draws_the_verdicts_smoothing(sweep):
    """The plotted smoothed loss is the verdict's: a trailing mean over full windows of smooth_window
    steps (computed here with numpy), ending at the summary's final_loss, its minimum its best_loss,
    and the collapse cross sits at the evidence's climb_step."""
    loss = figures.figure_data("loss", sweep)
    for name in ("lt_K06_seed0_lr1", "flt_K03_seed0_lr1"):
        run = sweep / CELLS / name
        window = read_json(run / "config.json")["verdict"]["smooth_window"]
        raw = pd.read_parquet(run / "metrics")
        raw = raw[raw.metric == M.LOSS].sort_values("step")
        kernel = np.ones(window) / window
        want = np.convolve(raw.value.to_numpy(), kernel, mode="valid")
        got = loss[(loss.run == name) & (loss.metric == "loss_smoothed")]
        np.testing.assert_array_equal(got.step, raw.step.to_numpy()[window - 1:])
        np.testing.assert_allclose(got.value, want, rtol=1e-12)
        summary = read_json(run / "summary.json")
        assert got.value.iloc[-1] == pytest.approx(summary["final_loss"])
        assert got.value.min() == pytest.approx(summary["best_loss"])
    mark = loss[loss.metric == "collapsed"]
    summary = read_json(sweep / CELLS / "lt_K06_seed0_lr1" / "summary.json")
    assert mark.run.tolist() == ["lt_K06_seed0_lr1"] and mark.step.tolist() == [summary["evidence"]["climb_step"]]


def _boxes(fig: MplFigure):
    canvas = FigureCanvasAgg(fig)
    with style():  # as save() lays it out
        canvas.draw()
    renderer = canvas.get_renderer()
    tables = [a.get_window_extent(renderer) for ax in fig.axes for a in ax.get_children() if isinstance(a, Table)]
    legends = [lg.get_window_extent(renderer) for lg in fig.legends]
    axes = [ax.get_window_extent(renderer) for ax in fig.axes if ax.axison]
    return tables, legends, axes


def test_gradients_legend_covers_no_table_and_no_panel(sweep):
    fig = FIGURES["gradients"].figure(study_of(sweep, ["gradients"]))
    tables, legends, axes = _boxes(fig)
    assert len(tables) == 2 and len(legends) == 1  # one table per loops value, one legend per figure
    assert not any(legends[0].overlaps(box) for box in tables + axes)
    assert not any(a.overlaps(b) for i, a in enumerate(tables) for b in tables[i + 1:])


def test_every_figure_has_one_legend_outside_its_panels(sweep):
    drawn, skipped = render(collect(sweep))
    assert not skipped
    for name, fig in drawn.items():
        _, legends, axes = _boxes(fig)
        assert len(legends) == 1 and not any(ax.legend_ for ax in fig.axes), name
        assert not any(legends[0].overlaps(box) for box in axes), name


def test_loop_dynamics_contraction_panel_leaves_out_zeros_and_tells_its_three_records_apart(tmp_path):
    """A spectral radius of exactly 0 (FLT at initialisation) is left out of the log axis and counted, so the
    panel keeps the scale of the other values; the spectral radius is drawn as lines (one style per seed),
    the perturbation growth as crosses and the largest singular value dotted, so that no reader takes sigma_max
    (which exceeds 1 on loops that contract) for contraction."""
    from flt_diag.results.figures.dynamics import COLUMNS, draw_dynamics, dynamics_data
    df = dynamics_data(collect(make_sweep(tmp_path / "s", seeds=(0, 1)), None))
    df = df[df.loops == 3].copy()  # one row of panels
    zero = (df.metric == M.LOOP_SPECTRAL_RADIUS) & (df.step == 0)
    df.loc[zero, "value"] = 0.0
    df.loc[(df.metric == M.LOOP_PERTURBATION_GROWTH) & (df.step == 0), "value"] = 1e-30  # a round-off zero
    growth_zero = (df.metric == M.LOOP_PERTURBATION_GROWTH) & (df.step == 0) & (df.loop == df.loops)
    fig = draw_dynamics(df)
    col = [i for i, (metric, by, _) in enumerate(COLUMNS) if metric == M.LOOP_SPECTRAL_RADIUS and by == "step"][0]
    ax = fig.axes[col]
    positive = df[(df.metric == M.LOOP_SPECTRAL_RADIUS) & (df.value > 0)].value
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] > positive.min() / 10  # not squashed towards 0
    notes = [t.get_text() for t in ax.texts]
    assert notes == [f"{int((zero & (df.loop == df.loops)).sum() + growth_zero.sum())} value(s) <= 1e-06 not drawn"]
    crosses = [line for line in ax.lines if line.get_marker() == "x"]
    assert crosses and all(line.get_linestyle() == "None" for line in crosses)
    growth = df[(df.metric == M.LOOP_PERTURBATION_GROWTH) & (df.loop == df.loops) & (df.value > 1e-6)]
    assert sorted(v for line in crosses for v in line.get_ydata()) == sorted(growth.value)  # the crosses: growth
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    sigma = df[(df.metric == M.LOOP_GAIN) & (df.loop == df.loops)]
    assert sorted(v for line in dotted for v in line.get_ydata()) == sorted(sigma.value)  # dotted: sigma_max
    solid = {line.get_linestyle() for line in ax.lines if line.get_marker() != "x" and line.get_linestyle() != ":"}
    assert solid >= {"-", "--"}  # the spectral radius, seeds 0 and 1
    cosine_ax = fig.axes[[i for i, (m, by, _) in enumerate(COLUMNS) if m == M.TOKEN_COSINE and by == "step"][0]]
    assert cosine_ax.get_yscale() == "linear" and cosine_ax.get_ylim()[1] == pytest.approx(1.05)

def test_many_seeds_are_drawn_solid_and_never_dotted_like_sigma_max(tmp_path):
    """With more seeds than line styles a style would repeat (seed 0 and seed 3 alike) and one of them was
    dotted, like sigma_max: every seed's line is solid then, the legend says how many seeds there are (not a
    style per seed), and the only dotted lines of the contraction panel are sigma_max's."""
    from flt_diag.results.figures.dynamics import COLUMNS, draw_dynamics, dynamics_data
    seeds = (0, 1, 2, 3, 4)
    df = dynamics_data(collect(make_sweep(tmp_path / "s", seeds=seeds), None))
    df = df[df.loops == 3].copy()
    fig = draw_dynamics(df)
    col = [i for i, (metric, by, _) in enumerate(COLUMNS) if metric == M.LOOP_SPECTRAL_RADIUS and by == "step"][0]
    ax = fig.axes[col]
    radius = [line for line in ax.lines if line.get_marker() != "x" and line.get_linestyle() != ":"
              and line.get_color() != "0.3"]  # (the grey line at 1 left out)
    runs = df[df.metric == M.LOOP_SPECTRAL_RADIUS].run.nunique()
    assert len(radius) == runs == 3 * len(seeds) and {line.get_linestyle() for line in radius} == {"-"}
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    sigma = df[(df.metric == M.LOOP_GAIN) & (df.loop == df.loops)]
    assert sorted(v for line in dotted for v in line.get_ydata()) == sorted(sigma.value)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert f"{len(seeds)} seeds, one solid line each" in labels and not any(t.startswith("seed ") for t in labels)


def test_a_figure_left_out_of_a_watched_run_names_what_watch_takes_not_a_flag(tmp_path):
    """The hints of figures without data name CLI flags (--attention-stats, eval-loops) that a flt_diag.watch
    user cannot set: for runs of flt_diag.watch (config.json's `probe` entry) they say what applies there."""
    import json
    from flt_diag.results.figures import render
    cli_run, watched = make_run(tmp_path / "cli", "lt", 3), make_run(tmp_path / "mine", "lt", 3)
    cfg = json.loads((watched / "config.json").read_text())
    (watched / "config.json").write_text(json.dumps({**cfg, "probe": {"model": "Looped"}}))
    from flt_diag.results.figures import FIGURES
    cli_study, watched_study = collect(cli_run), collect(watched)
    skipped_cli, skipped_watched = render(cli_study, ["loops"])[1], render(watched_study, ["loops"])[1]
    assert "eval-loops` first" in skipped_cli["loops"] and "flt-diag's own models only" in skipped_watched["loops"]
    attention = FIGURES["attention"]
    assert "--attention-stats" in attention.why_empty(cli_study)
    assert "does not record attention" in attention.why_empty(watched_study)
    assert "--" not in attention.why_empty(watched_study)
