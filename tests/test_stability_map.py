"""The boundary search of `flt-diag map`, on a synthetic cell runner ("breaks if x > threshold")."""
import math
from pathlib import Path

import pandas as pd
import pytest

from conftest import tiny_config
from flt_diag.judge.map_boundaries import AXES, CRITERIA, bracket, critical_values
from flt_diag.config.grid_options import MAP_AXES, MAP_CRITERIA, geometric_grid
from flt_diag.grids.stability_map import MapSpec, run_map, search
from flt_diag.storage.folders import CELLS, SUMMARY, write_json


def test_geometric_grid():
    g = geometric_grid(0.5, 16, 2)
    assert g == [0.5, 1, 2, 4, 8, 16]
    g = geometric_grid(1, 10, 1.5)
    assert g[0] == 1 and g[-1] == 10 and all(b / a <= 1.5 + 1e-3 for a, b in zip(g, g[1:]))
    assert geometric_grid(2, 12, 1.5, integer=True) == [2, 3, 4, 7, 10, 12]
    for bad in [(0, 1, 2), (2, 1, 2), (1, 2, 1), (1, float("inf"), 2), (1e-9, 1e9, 1.01)]:
        with pytest.raises(ValueError):
            geometric_grid(*bad)


def test_the_axes_and_criteria_the_options_offer_are_the_ones_the_map_implements():
    assert set(MAP_AXES) == set(AXES) and set(MAP_CRITERIA) == set(CRITERIA)


@pytest.mark.parametrize("threshold_index", [-1, 0, 3, 7, 15])
def test_bisection_finds_the_first_breaking_index_in_log_probes(threshold_index):
    n = 16
    calls = []

    def outcome(i):
        calls.append(i)
        return i > threshold_index  # breaks above the threshold

    r = search(n, outcome)
    assert (r["a"], r["b"]) == (threshold_index, threshold_index + 1)
    assert len(calls) == len(set(calls)) <= math.ceil(math.log2(n + 1))  # no probe twice, ~log2 probes


def test_probing_both_ends_finds_a_low_end_failure_that_bisection_misses():
    """The 12-loop LT on the depth axis: breaks at the lowest value, holds in the middle, breaks again
    higher up. Bisection starts in the middle and never looks below it; with probe_ends the line is
    reported as non-monotone."""
    n = 9
    breaks = lambda i: i == 0 or i >= 6  # noqa: E731
    plain, ends = [], []
    r = search(n, lambda i: plain.append(i) or breaks(i))
    assert 0 not in plain and r["monotone"] and (r["a"], r["b"]) == (5, 6)
    r = search(n, lambda i: ends.append(i) or breaks(i), probe_ends=True)
    assert ends[:2] == [0, n - 1] and len(ends) == len(set(ends))
    assert not r["monotone"]


@pytest.mark.parametrize("threshold_index", [-1, 0, 3, 7, 15])
def test_probing_both_ends_keeps_a_monotone_boundary_and_never_probes_twice(threshold_index):
    n, calls = 16, []
    r = search(n, lambda i: calls.append(i) or i > threshold_index, probe_ends=True)
    assert (r["a"], r["b"]) == (threshold_index, threshold_index + 1) and r["monotone"]
    assert len(calls) == len(set(calls)) <= math.ceil(math.log2(n + 1)) + 2
    known = {0: False, n - 1: True}  # ends already finished (a resumed map): not probed again
    calls.clear()
    search(n, lambda i: calls.append(i) or i > 7, known=known, probe_ends=True)
    assert 0 not in calls and n - 1 not in calls


def test_bracket_reports_non_monotone_outcomes():
    assert bracket({0: False, 3: True, 5: False}, 8) == (0, 3, False)
    assert bracket({}, 8) == (-1, 8, True)


class Synthetic:
    """A cell runner that writes a run folder's summary.json: collapsed if lr > threshold[variant];
    explosion if lr > 2 x threshold. Counts runs; can die after `die_after` runs (kill -9 stand-in)."""

    def __init__(self, thresholds, die_after=None):
        self.thresholds, self.die_after, self.runs = thresholds, die_after, []

    def __call__(self, base, cell, out):
        if self.die_after is not None and len(self.runs) >= self.die_after:
            raise KeyboardInterrupt
        self.runs.append(cell.name)
        d = Path(out) / CELLS / cell.name
        d.mkdir(parents=True)
        t = self.thresholds[cell.variant] * (1 + 0.1 * cell.seed)
        cfg = tiny_config(variant=cell.variant, loops=cell.loops, seed=cell.seed, lr_scale=cell.lr_scale, steps=10)
        write_json(d / "config.json", cfg.to_dict())
        from flt_diag.judge.verdict import summarize
        from flt_diag.storage.folders import MetricsWriter, load_metrics
        w = MetricsWriter(d)
        for step in range(10):
            w.add(step, "loss", -1, -1, 3.0 - 0.1 * step)
        w.flush()
        write_json(d / SUMMARY, summarize(load_metrics(d), cfg).as_written() | dict(
            verdict="collapsed" if cell.lr_scale > t else "stable", residual_explosion_any=cell.lr_scale > 2 * t))
        return "done"


def _spec(**kw):
    base = tiny_config(steps=10)
    args = dict(variants=["lt", "flt"], loops=[6, 12], seeds=[0, 1], axis="lr",
                grid=geometric_grid(0.25, 64, 1.41), criteria=["training", "explosion"])
    args.update(kw)
    return MapSpec(base, **args)


def test_map_finds_each_boundary_within_one_grid_ratio(tmp_path):
    spec, runner = _spec(), Synthetic({"lt": 1.3, "flt": 9.0})
    table = run_map(spec, tmp_path / "m", runner=runner, report=lambda s: None)
    assert len(runner.runs) == len(set(runner.runs))  # no cell run twice
    n_lines = 2 * 2 * 2
    assert len(runner.runs) <= n_lines * 2 * math.ceil(math.log2(len(spec.grid) + 1))
    for _, r in table.iterrows():
        t = {"lt": 1.3, "flt": 9.0}[r.variant] * (1 + 0.1 * r.seed) * (2 if r.criterion == "explosion" else 1)
        assert r.status == "found" and r.last_ok <= t < r.first_broken and r.first_broken / r.last_ok <= 1.42
        assert r.boundary / t < 1.42 and t / r.boundary < 1.42  # within one grid ratio
    crit = critical_values(tmp_path / "m")
    assert set(crit.variant) == {"lt", "flt"} and (crit.seeds == 2).all()
    assert (tmp_path / "m" / "map.csv").exists() and (tmp_path / "m" / "summary.csv").exists()


def test_map_resumes_after_a_kill_without_rerunning(tmp_path):
    spec = _spec()
    first = Synthetic({"lt": 1.3, "flt": 9.0}, die_after=5)
    with pytest.raises(KeyboardInterrupt):
        run_map(spec, tmp_path / "m", runner=first, report=lambda s: None)
    second = Synthetic({"lt": 1.3, "flt": 9.0})
    resumed = run_map(spec, tmp_path / "m", runner=second, report=lambda s: None)
    assert not set(first.runs) & set(second.runs)  # finished probes are read back, never re-run
    fresh = Synthetic({"lt": 1.3, "flt": 9.0})
    once = run_map(spec, tmp_path / "n", runner=fresh, report=lambda s: None)
    assert sorted(first.runs + second.runs) == sorted(fresh.runs)  # the same probes as an uninterrupted map
    assert resumed.equals(once)


def test_boundaries_beyond_the_grid(tmp_path):
    spec = _spec(variants=["lt", "flt"], loops=[6], seeds=[0], grid=[1, 2, 4, 8])
    table = run_map(spec, tmp_path / "m", runner=Synthetic({"lt": 0.5, "flt": 100}), report=lambda s: None)
    st = dict(zip(zip(table.variant, table.criterion), table.status))
    assert st[("lt", "training")] == "below grid" and st[("flt", "training")] == "above grid"
    text = dict(zip(critical_values(tmp_path / "m").query("criterion == 'training'").variant,
                    critical_values(tmp_path / "m").query("criterion == 'training'").text))
    assert text == {"lt": "< 1", "flt": "> 8"}


class LowEndBreaks(Synthetic):
    """Also collapsed at the grid's lowest lr scale: a boundary that is not monotone."""

    def __call__(self, base, cell, out):
        result = super().__call__(base, cell, out)
        if cell.lr_scale == 1:
            from flt_diag.storage.folders import read_json
            d = Path(out) / CELLS / cell.name
            write_json(d / SUMMARY, read_json(d / SUMMARY) | dict(verdict="collapsed"))
        return result


def test_map_with_probe_ends_reports_a_non_monotone_line_and_resumes_a_map_searched_without(tmp_path):
    spec = _spec(variants=["lt"], loops=[6], seeds=[0], grid=[1, 2, 4, 8, 16, 32, 64], criteria=["training"])
    table = run_map(spec, tmp_path / "m", runner=LowEndBreaks({"lt": 10}), report=lambda s: None)
    assert table.status.tolist() == ["found"]  # bisection: 8 held, 16 broke; 1 never probed
    runner = LowEndBreaks({"lt": 10})
    table = run_map(spec, tmp_path / "m", runner=runner, report=lambda s: None, probe_ends=True)
    assert sorted(runner.runs) == sorted(c.name for c in (spec.cell(spec.lines()[0], v) for v in (1, 64)))
    assert table.status.tolist() == ["non-monotone"]


class BreaksAt(Synthetic):
    """Also collapsed at the given lr scales: non-monotone lines."""

    def __init__(self, thresholds, extra):
        super().__init__(thresholds)
        self.extra = extra

    def __call__(self, base, cell, out):
        result = super().__call__(base, cell, out)
        if cell.lr_scale in self.extra.get(cell.variant, ()):
            from flt_diag.storage.folders import read_json
            d = Path(out) / CELLS / cell.name
            write_json(d / SUMMARY, read_json(d / SUMMARY) | dict(verdict="collapsed"))
        return result


def test_the_map_figure_draws_a_non_monotone_line_where_it_first_breaks(tmp_path):
    """LT breaks at 1 (the grid's lowest), holds at 2-8, breaks from 16: drawn below the grid. FLT holds at
    1, breaks at 2, holds at 4-8, breaks from 16: drawn in (1, 2]. Both wear the ring; FLA (monotone) not."""
    from flt_diag.results.figures.map import draw, map_data
    spec = _spec(variants=["lt", "fla", "flt"], loops=[6], seeds=[0], grid=[1, 2, 4, 8, 16], criteria=["training"])
    runner = BreaksAt({"lt": 10, "fla": 3, "flt": 10}, {"lt": (1,), "flt": (2,)})
    table = run_map(spec, tmp_path / "m", runner=runner, report=lambda s: None, probe_ends=True)
    for v in ("lt", "flt"):  # make sure every value of the two lines is known, as a finished map would have it
        for value in spec.grid:
            cell = spec.cell(next(line for line in spec.lines() if line.variant == v), value)
            if not (tmp_path / "m" / CELLS / cell.name / SUMMARY).exists():
                runner(spec.base.to_dict(), cell, str(tmp_path / "m"))
    from flt_diag.judge.map_boundaries import boundaries
    table = boundaries(tmp_path / "m").set_index("variant")
    assert table.status.to_dict() == {"lt": "non-monotone", "fla": "found", "flt": "non-monotone"}
    df = map_data(tmp_path / "m").set_index("variant")
    assert df.beyond["lt"] == "below" and df.value["lt"] == 1 and df.non_monotone["lt"]
    assert pd.isna(df.beyond["flt"]) and df.value["flt"] == pytest.approx(math.sqrt(1 * 2)) and df.non_monotone["flt"]
    assert (df.low["flt"], df.high["flt"]) == (1, 2)
    assert df.value["fla"] == pytest.approx(math.sqrt(2 * 4)) and not df.non_monotone["fla"]
    fig = draw(map_data(tmp_path / "m"))
    rings = [ln for ln in fig.axes[0].lines if ln.get_marker() == "o" and ln.get_markerfacecolor() == "none"]
    assert sorted(round(y, 6) for ln in rings for y in ln.get_ydata()) == sorted([1 / 1.25, round(math.sqrt(2), 6)])
    assert "non-monotone" in fig.legends[0].get_title().get_text()


def test_another_map_on_the_same_folder_is_refused(tmp_path):
    run_map(_spec(loops=[6], seeds=[0]), tmp_path / "m", runner=Synthetic({"lt": 1, "flt": 2}), report=lambda s: None)
    from flt_diag.storage.folders import StorageError
    with pytest.raises(StorageError, match="differs in"):
        run_map(_spec(loops=[12], seeds=[0]), tmp_path / "m", runner=Synthetic({"lt": 1, "flt": 2}), report=lambda s: None)


def test_map_figure_draws_from_the_folder(tmp_path):
    from flt_diag.results.figures.map import draw, map_data
    run_map(_spec(), tmp_path / "m", runner=Synthetic({"lt": 1.3, "flt": 9.0}), report=lambda s: None)
    df = map_data(tmp_path / "m")
    assert len(df) == 2 * 2 * 2  # criteria x variants x loops
    fig = draw(map_data(tmp_path / "m"))
    fig.savefig(tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 10_000


def test_depth_axis_probes_are_cells_with_their_depth(tmp_path):
    spec = _spec(axis="depth", grid=[1, 2, 3, 4], variants=["fla"], loops=[6], seeds=[0], criteria=["training"])
    cell = spec.cell(spec.lines()[0], 3)
    assert cell.depth == 3 and cell.name.endswith("_L3")
    from flt_diag.grids.sweep import cell_config
    assert cell_config(spec.base, cell).model.depth == 3


def test_report_and_regenerate_show_the_map(tmp_path):
    import sys
    from pathlib import Path as P
    sys.path.insert(0, str(P(__file__).resolve().parents[1] / "analysis"))
    from regenerate import regenerate
    run_map(_spec(), tmp_path / "m", runner=Synthetic({"lt": 1.3, "flt": 9.0}), report=lambda s: None)
    written = {p.name for p in regenerate(tmp_path / "m", tmp_path / "out", formats=("png",))}
    assert {"map.png", "map_table.md", "map_table.csv", "report.html"} <= written
    html = (tmp_path / "out" / "report.html").read_text()
    assert "Stability map: critical values" in html and 'id="map"' in html
    table = (tmp_path / "out" / "map_table.md").read_text()
    assert "training at K=6 (lr scale)" in table and "| lt |" in table


@pytest.mark.parametrize("bad", [dict(variants=["zz"]), dict(loops=[0]), dict(axis="width"), dict(grid=[2.0, 1.0]),
                                 dict(criteria=["nonsense"]), dict(seeds=[]), dict(grid=[1.0, 1.0])])
def test_a_bad_map_spec_is_refused_when_made(bad):
    args = dict(variants=["lt"], loops=[2], seeds=[0], axis="lr", grid=[0.5, 1.0], criteria=["training"]) | bad
    with pytest.raises(ValueError):
        MapSpec(tiny_config(), **args)


@pytest.mark.parametrize("verdict, training, collapse", [("stable", False, False), ("unstable", True, False),
                                                         ("stalled", True, True), ("collapsed", True, True),
                                                         ("diverged", True, True)])
def test_the_criteria_read_the_verdict_as_documented(verdict, training, collapse):
    """DESIGN.md §5: training = not stable; collapse = the run did not train (stalled counts: a high-loss plateau)."""
    from flt_diag.judge.map_boundaries import CRITERIA
    from flt_diag.storage.file_models import Summary
    s = Summary.model_construct(verdict=verdict)
    assert (CRITERIA["training"](s), CRITERIA["collapse"](s)) == (training, collapse)


# --------------------------------------------------------------------------- the informed start (issue 64)

@pytest.mark.parametrize("threshold_index", [-1, 0, 3, 7, 8])
@pytest.mark.parametrize("prior", [None, 0, 2, 4, 7, 8, 9])
def test_a_line_started_at_a_prior_boundary_finds_the_bisection_boundary(threshold_index, prior):
    """Grid of 9 (the benchmark's 1 ... 256): from any prior boundary (9: held everywhere), the bracket of a
    monotone line is the one plain bisection finds, no probe twice; a right prior costs two probes (one at an end)."""
    n, calls = 9, []
    r = search(n, lambda i: calls.append(i) or i > threshold_index, prior=prior)
    assert (r["a"], r["b"]) == (threshold_index, threshold_index + 1)
    assert len(calls) == len(set(calls))
    b = threshold_index + 1
    if prior == b:
        assert calls == [i for i in (b, b - 1) if 0 <= i < n]
    if prior is not None and 0 <= prior < n:
        assert calls[0] == prior


def test_the_prior_is_the_lower_median_of_closed_monotone_brackets():
    from flt_diag.judge.line_prior import closed_boundary, prior_index, start_probes
    assert closed_boundary({3: False, 4: True}, 9) == 4
    assert closed_boundary({8: False}, 9) == 9 and closed_boundary({0: True}, 9) == 0
    assert closed_boundary({2: False, 5: True}, 9) is None  # open
    assert closed_boundary({3: False, 4: True, 6: False}, 9) is None  # not monotone
    assert prior_index([]) is None and prior_index([4]) == 4
    assert prior_index([7, 4, 7, 4]) == 4 and prior_index([7, 4, 5]) == 5
    assert start_probes(4) == (4, 3) and start_probes(None) == ()


class Recorded(Synthetic):
    """Synthetic, and the base config each probe was given."""

    def __init__(self, thresholds):
        super().__init__(thresholds)
        self.bases = []

    def __call__(self, base, cell, out):
        self.bases.append(base)
        return super().__call__(base, cell, out)


def test_a_map_line_starts_where_its_variants_earlier_seed_broke(tmp_path):
    """Seeds 0 and 1 of one variant: seed 1's first probe is seed 0's first broken lr, then the one below it;
    the boundaries are those of a map of independent lines (bisection from the middle)."""
    grid = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
    spec = _spec(variants=["flt"], loops=[6], seeds=[0, 1], grid=grid, criteria=["training"])
    runner = Recorded({"flt": 9.0})  # breaks above 9.0 (seed 0) and 9.9 (seed 1): first broken 16 for both
    table = run_map(spec, tmp_path / "m", runner=runner, report=lambda s: None)
    seed1 = [r for r in runner.runs if "seed1" in r]
    assert seed1 == [spec.cell(spec.lines()[1], v).name for v in (16.0, 8.0)]
    assert table.first_broken.tolist() == [16.0, 16.0] and table.last_ok.tolist() == [8.0, 8.0]
    assert all(b.diagnostics.stop_when_decided == ["training"] for b in runner.bases)  # the map's criteria


def test_run_to_end_gives_the_probes_no_criteria_to_stop_on(tmp_path):
    spec = _spec(variants=["flt"], loops=[6], seeds=[0], criteria=["training", "explosion"])
    runner = Recorded({"flt": 9.0})
    run_map(spec, tmp_path / "m", runner=runner, report=lambda s: None, run_to_end=True)
    assert runner.bases and all(b.diagnostics.stop_when_decided is None for b in runner.bases)
    runner = Recorded({"flt": 9.0})
    run_map(spec, tmp_path / "n", runner=runner, report=lambda s: None)
    assert all(b.diagnostics.stop_when_decided == ["training", "explosion"] for b in runner.bases)
