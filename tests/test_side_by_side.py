"""Several run folders laid side by side (issue 42: a user's good and bad configuration compared): `summary`,
`plot` and `report` take run folders as they take sweeps, a row and a line each, labelled so that two runs are
never merged or drawn alike; a mix of run and sweep folders is one line."""
from __future__ import annotations

import json

import pytest

from fake_runs import make_run, make_sweep
from flt_diag.cli.app import main
from flt_diag.results.figures import figure_data, plot
from flt_diag.results.figures.style import variant_color
from flt_diag.results.tables import collect, folders_summary


def own(run_dir):
    """A run of a model of one's own, as flt_diag.watch writes it: variant null in config.json."""
    path = run_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["model"]["variant"] = None
    path.write_text(json.dumps(cfg))
    return run_dir


@pytest.fixture
def runs(tmp_path):
    """good and bad: two runs of one's own model (the same K, seed, lr scale); lt and flt: two of flt-diag's."""
    return [own(make_run(tmp_path / "good", "lt", 3)), own(make_run(tmp_path / "bad", "lt", 3, collapsed=True)),
            make_run(tmp_path / "lt", "lt", 6), make_run(tmp_path / "flt", "flt", 6)]


def verdict_on_disk(run_dir) -> str:
    return json.loads((run_dir / "summary.json").read_text())["verdict"]


def test_runs_side_by_side_are_a_row_each_labelled_by_folder_where_the_variant_says_nothing(runs):
    df = folders_summary(runs)
    assert sorted(df.cell) == ["bad", "flt", "good", "lt"]
    by_cell = df.set_index("cell")
    assert by_cell.variant.to_dict() == {"good": "good", "bad": "bad", "lt": "lt", "flt": "flt"}
    assert {c: by_cell.verdict[c] for c in by_cell.index} == {d.name: verdict_on_disk(d) for d in runs}
    assert by_cell.verdict["bad"] != by_cell.verdict["good"]  # (the fixture: one collapsed, one not)


def test_two_runs_of_one_variant_and_identity_are_told_apart_by_name_not_merged(tmp_path):
    a, b = make_run(tmp_path / "a" / "run", "flt", 3), make_run(tmp_path / "b" / "run", "flt", 3, collapsed=True)
    study = collect([a, b])
    assert [r.id.variant for r in study.runs] == sorted([str(a), str(b)])  # (same folder name: the paths)
    grid = figure_data("collapse", [a, b])
    assert len(grid) == 2 and set(grid.verdict) == {verdict_on_disk(a), verdict_on_disk(b)}


def test_labels_that_are_no_variant_get_colours_of_their_own(runs):
    colours = {r.id.variant: variant_color(r.id.variant) for r in collect(runs).runs}
    assert len(set(colours.values())) == 4 and colours["flt"] == "#000000"


def test_summary_plot_and_report_take_run_folders(runs, tmp_path, capsys):
    assert main(["summary", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    for name in ("good", "bad", "lt", "flt"):
        assert f"│ {name} " in out
    written = plot("all", runs, tmp_path / "figures", ("png",))
    assert (tmp_path / "figures" / "collapse.png") in written and (tmp_path / "figures" / "loss.png") in written
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert all(f">{name}</td>" in page for name in ("good", "bad"))


def test_run_and_sweep_folders_mixed_are_one_line(runs, tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    for command in ("summary", "report"):
        assert main([command, str(runs[0]), str(sweep)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a run folder and" in err[0] and "not both" in err[0]
    assert main(["summary", str(runs[0]), str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
