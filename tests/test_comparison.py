"""A sweep that compares variants: val_gap, resid_vs_flt and seeds failed (k/n) in the tables, the
collapse grid, `summary` and the report, checked against numbers computed here from the stored rows."""
from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.patches import Rectangle

from fake_runs import config, make_run
from flt_diag.results import figures as P
from flt_diag.storage import metric_names as M
from flt_diag.results.report import write_report
from flt_diag.results.tables import pooled_summary, results_table, summary_table, sweep_summary
from flt_diag.storage.folders import CELLS, StorageError, read_json, write_json
from flt_diag.cli import main
from flt_diag.grids.sweep import SweepSpec, write_summary

SEEDS = (0, 1, 2)
# (variant, loops, seed) -> make_run options. K=3: all stable, FLT best except at seed 1 (FLA);
# K=6: LT collapses in seeds 0 and 1, FLA in seed 1 and has not finished seed 2, FLT is stable.
PLAN = {}
for _seed in SEEDS:
    PLAN[("lt", 3, _seed)] = dict(val_shift=0.30, resid_scale=3.0)
    PLAN[("fla", 3, _seed)] = dict(val_shift=-0.05 if _seed == 1 else 0.10, resid_scale=2.0)
    PLAN[("flt", 3, _seed)] = dict(val_shift=0.0)
    PLAN[("lt", 6, _seed)] = dict(collapsed=True) if _seed < 2 else dict(val_shift=0.40, resid_scale=3.0)
    PLAN[("fla", 6, _seed)] = [dict(val_shift=0.0, resid_scale=2.0), dict(collapsed=True), dict(finished=False)][_seed]
    PLAN[("flt", 6, _seed)] = dict(val_shift=0.20)
FAILED = {("lt", 3): (0, 3), ("fla", 3): (0, 3), ("flt", 3): (0, 3),  # (seeds not stable, seeds finished)
          ("lt", 6): (2, 3), ("fla", 6): (1, 2), ("flt", 6): (0, 3)}


def write_sweep(out: Path, variants=("lt", "fla", "flt"), loops=(3, 6), seeds=SEEDS) -> Path:
    spec = SweepSpec(config("flt", 3), list(variants), list(loops), list(seeds), [1.0])
    (out / CELLS).mkdir(parents=True)
    write_json(out / "sweep.json", spec.to_dict())
    for cell in spec.cells():
        plan = PLAN[(cell.variant, cell.loops, cell.seed)]
        make_run(out / CELLS / cell.name, cell.variant, cell.loops, cell.seed, **plan)
    write_summary(out)
    return out


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    return write_sweep(tmp_path_factory.mktemp("comparison") / "sweep")


def stored_runs(sweep: Path) -> pd.DataFrame:
    """Per finished run, read straight from its Parquet parts: the last val loss and the peak loop-end
    residual norm of its final loop (exploded: above explosion_ratio·√d), with its variant, loops, seed
    and verdict."""
    rows = []
    for (variant, loops, seed), plan in PLAN.items():
        run = sweep / CELLS / f"{variant}_K{loops:02d}_seed{seed}_lr1"
        if plan.get("finished") is False:
            continue
        df = pd.read_parquet(run / "metrics")
        val = df[df.metric == M.VAL_LOSS].sort_values("step").value.iloc[-1]
        peak = df[(df.metric == M.RESID_NORM_LOOP_END) & (df.loop == loops)].value.max()
        cfg = read_json(run / "config.json")
        threshold = cfg["verdict"]["explosion_ratio"] * math.sqrt(cfg["model"]["width"])
        rows.append(dict(variant=variant, loops=loops, seed=seed, val=val, peak=peak, exploded=peak > threshold,
                         verdict=read_json(run / "summary.json")["verdict"]))
    return pd.DataFrame(rows)


def hand_gaps(rows: list[dict], peers) -> dict:
    """{key: (val gap, residual ratio to FLT)}, by plain loops over the rows sharing `peers`."""
    out = {}
    for r in rows:
        same = [q for q in rows if all(q[p] == r[p] for p in peers)]
        flt = [q["peak"] for q in same if q["variant"] == "flt"]
        out[tuple(r[p] for p in ("variant", *peers))] = (r["val"] - min(q["val"] for q in same),
                                                         r["peak"] / flt[0] if flt else math.nan)
    return out


def hand_cells(sweep: Path) -> dict:
    """Per (variant, loops) cell: the comparison of the means over its finished seeds."""
    runs = stored_runs(sweep)
    means = runs.groupby(["variant", "loops"]).agg(val=("val", "mean"), peak=("peak", "mean")).reset_index()
    return hand_gaps(means.to_dict("records"), ("loops",))


def test_the_fixture_has_the_planned_verdicts(sweep):
    runs = stored_runs(sweep)
    for r in runs.itertuples():
        assert (r.verdict != "stable") == bool(PLAN[(r.variant, r.loops, r.seed)].get("collapsed")), r


def test_each_run_is_compared_with_the_other_variants_of_its_seed_and_loops(sweep):
    expected = hand_gaps(stored_runs(sweep).to_dict("records"), ("loops", "seed"))
    for df in (sweep_summary(sweep), pd.read_csv(sweep / "summary.csv")):
        assert len(df) == len(expected)
        for r in df.itertuples():
            gap, ratio = expected[(r.variant, r.loops, r.seed)]
            assert r.val_gap == pytest.approx(gap, abs=1e-12) and r.resid_vs_flt == pytest.approx(ratio, rel=1e-12)
        best = df[df.val_gap == 0]
        assert sorted(zip(best.loops, best.seed, best.variant)) == [
            (3, 0, "flt"), (3, 1, "fla"), (3, 2, "flt"), (6, 0, "fla"), (6, 1, "flt"), (6, 2, "flt")]
        columns = list(df.columns)
        assert columns.index("val_gap") == columns.index("val_loss") + 1
        assert columns.index("resid_vs_flt") == columns.index("peak_resid_norm") + 1
        assert columns.index("depth") == columns.index("loops") + 1


def test_cells_compare_their_seed_means_and_count_failed_seeds(sweep):
    expected = hand_cells(sweep)
    table = summary_table(sweep)
    assert len(table) == len(FAILED)
    for r in table.itertuples():
        gap, ratio = expected[(r.variant, r.loops)]
        assert r.val_gap == pytest.approx(gap, abs=1e-12) and r.resid_vs_flt == pytest.approx(ratio, rel=1e-12)
        assert (r.failed, r.finished, r.runs) == (*FAILED[(r.variant, r.loops)], 3)
    assert table[table.val_gap == 0][["variant", "loops"]].values.tolist() == [["flt", 3], ["flt", 6]]


def test_collapse_grid_shows_the_gap_the_best_and_seeds_failed(sweep):
    expected = hand_cells(sweep)
    runs = stored_runs(sweep)
    mean_val = runs.groupby(["variant", "loops"]).val.mean()
    exploded = runs.groupby(["variant", "loops"]).exploded.any()
    assert exploded.sum() == 2  # the collapsed runs' residuals (LT and FLA at K=6)
    fig = P.FIGURES["collapse"].figure(P.study_of(sweep, ["collapse"]))
    ax = fig.axes[0]
    texts = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts}
    names, ks = ["lt", "fla", "flt"], [3, 6]
    for (variant, loops), (failed, finished) in FAILED.items():
        gap = expected[(variant, loops)][0]
        head = "best" if gap == 0 else f"+{gap:.2f}"
        star = "*" if exploded[(variant, loops)] else ""
        more = " (+1)" if (variant, loops) == ("fla", 6) else ""
        want = f"{head}{star}\n{mean_val[(variant, loops)]:.2f}\n{failed}/{finished} failed{more}"
        assert texts[(ks.index(loops), names.index(variant))] == want
    outlined = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert sorted((round(p.get_x() + 0.45), round(p.get_y() + 0.45)) for p in outlined) == [(0, 2), (1, 2)]
    assert "k/n failed" in fig.legends[0].get_title().get_text()


def test_report_shows_gap_ratio_and_failed_seeds(sweep, tmp_path):
    html = write_report(sweep, tmp_path / "report.html").read_text()
    expected = hand_cells(sweep)
    for (variant, loops), (failed, finished) in FAILED.items():
        gap, ratio = expected[(variant, loops)]
        row = re.search(rf"<tr><td[^>]*>{variant}</td><td[^>]*>{loops}</td>(.*?)</tr>", html).group(1)
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert cells[1].startswith(f"{failed}/{finished}")
        assert ("best" if gap == 0 else f"+{gap:.3f}") in cells and f"{ratio:.2f}" in cells
    assert "Gap to best" in html and "Peak ÷ FLT" in html and "n finished" in html


def test_summary_prints_runs_and_cells_with_seeds_failed(sweep, capsys):
    assert main(["summary", str(sweep)]) == 0
    out = capsys.readouterr().out
    per_run, per_cell = out.split("per cell: majority verdict")
    expected = hand_cells(sweep)
    lt6 = next(line for line in per_cell.splitlines() if re.match(r"\W*lt\W+6\W", line))
    assert re.search(r"collapsed\s*│\s*2/3\s*│", lt6) and f"+{expected[('lt', 6)][0]:.3f}" in lt6
    assert f"{expected[('lt', 6)][1]:.2f}" in lt6
    fla6 = next(line for line in per_cell.splitlines() if re.match(r"\W*fla\W+6\W", line))
    assert "1/2" in fla6
    assert per_run.count(" best │") == 6 and "gap to best" in per_run and "÷ FLT" in per_run


def test_summary_recompute_adds_the_comparison_to_an_old_folder(sweep, tmp_path, capsys):
    old = shutil.copytree(sweep, tmp_path / "old")
    csv = pd.read_csv(old / "summary.csv").drop(columns=["val_gap", "resid_vs_flt", "depth"])
    csv.to_csv(old / "summary.csv", index=False)  # as written before these columns existed
    assert main(["summary", str(old), "--recompute"]) == 0
    expected = hand_gaps(stored_runs(old).to_dict("records"), ("loops", "seed"))
    new = pd.read_csv(old / "summary.csv")
    for r in new.itertuples():
        assert r.val_gap == pytest.approx(expected[(r.variant, r.loops, r.seed)][0], abs=1e-12)
    assert "2/3" in capsys.readouterr().out


def test_a_sweep_without_flt_has_nan_ratios_not_an_error(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "noflt", variants=("lt", "fla"), loops=(3,), seeds=(0,))
    runs = sweep_summary(sweep)
    assert runs.resid_vs_flt.isna().all() and (runs.val_gap.dropna() >= 0).all()
    assert summary_table(sweep).resid_vs_flt.isna().all()
    assert set(results_table(sweep)["Peak ÷ FLT"]) == {"–"}
    assert P.FIGURES["collapse"].figure(P.study_of(sweep, ["collapse"])) is not None
    assert main(["summary", str(sweep)]) == 0 and "–" in capsys.readouterr().out
    assert "Peak ÷ FLT" in write_report(sweep).read_text()


def test_runs_of_other_depths_are_not_compared(tmp_path):
    """A depth-axis map folder: at L=1 FLT is best, at L=2 LT is; each is compared only at its depth."""
    from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
    out = tmp_path / "map"
    prepare_map_folder(MapSpec(config("lt", 3), ["lt", "flt"], [3], [0], "depth", [1, 2], ["training"]), out)
    shifts = {("lt", 1): 0.3, ("flt", 1): 0.0, ("lt", 2): 0.0, ("flt", 2): 0.5}
    for (variant, depth), shift in shifts.items():
        make_run(out / CELLS / f"{variant}_K03_seed0_lr1_L{depth}", variant, 3, depth=depth, val_shift=shift,
                 resid_scale=2.0 if variant == "lt" else 1.0)
    runs = sweep_summary(out).set_index(["variant", "depth"])
    cells = summary_table(out).set_index(["variant", "depth"])
    for table in (runs, cells):
        for depth, best, other in ((1, "flt", "lt"), (2, "lt", "flt")):
            assert table.val_gap[(best, depth)] == 0
            assert table.val_gap[(other, depth)] == pytest.approx(abs(shifts[("lt", depth)] - shifts[("flt", depth)]),
                                                                abs=1e-12)  # fake val losses: same curve + shift
        np.testing.assert_allclose([table.resid_vs_flt[("lt", 1)], table.resid_vs_flt[("lt", 2)]], 2.0, rtol=1e-6)
    assert "Depth" in results_table(out).columns


def test_a_depth_map_grid_has_depth_columns_and_one_panel_per_loop_count(tmp_path):
    """The ablation along depth: columns L, one grid per K; each cell's gap is to the best at its K and L,
    an unprobed (variant, K, L) is left blank."""
    from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
    out = tmp_path / "map"
    prepare_map_folder(MapSpec(config("lt", 3), ["lt", "flt"], [3, 6], [0], "depth", [1, 2, 3], ["training"]), out)
    shifts = {("lt", 3, 1): 0.3, ("flt", 3, 1): 0.0, ("lt", 3, 3): 0.0, ("flt", 3, 3): 0.5,
              ("lt", 6, 2): 0.2, ("flt", 6, 2): 0.0,
              ("lt", 6, 3): 0.1}  # no probe of L=2 at K=3, nor of L=1 at K=6; LT alone at K=6, L=3
    for (variant, loops, depth), shift in shifts.items():
        make_run(out / CELLS / f"{variant}_K{loops:02d}_seed0_lr1_L{depth}", variant, loops, depth=depth,
                 val_shift=shift)
    fig = P.FIGURES["collapse"].figure(P.study_of(out, ["collapse"]))
    panels = [ax for ax in fig.axes if ax.texts]
    assert [ax.get_title() for ax in panels] == ["K=3", "K=6"]
    for ax in panels:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3"]
        assert ax.get_xlabel().startswith("depth L")
    names = ["lt", "flt"]
    for ax, loops in zip(panels, (3, 6)):
        texts = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts}
        want = {(depth - 1, names.index(v)): shift for (v, k, depth), shift in shifts.items() if k == loops}
        assert set(texts) == set(want)  # exactly the probed cells, in their L column
        for (x, y), shift in want.items():
            peers = [s for (v, k, d), s in shifts.items() if k == loops and d == x + 1]
            gap = shift - min(peers)
            head = texts[(x, y)].split("\n")[0].rstrip("*")
            if len(peers) == 1:  # a lone probe has no gap (nothing to be behind), never "best"
                assert not head.startswith(("+", "best")), texts[(x, y)]
            else:
                assert head == ("best" if gap == 0 else f"+{gap:.2f}")
    lone = sweep_summary(out).set_index(["variant", "loops", "depth"])
    assert math.isnan(lone.val_gap[("lt", 6, 3)]) and lone.val_gap[("flt", 6, 2)] == 0


def test_sweeps_of_one_setting_pool_their_seeds_and_a_seed_run_twice_counts_once(tmp_path, capsys):
    first = write_sweep(tmp_path / "s0", seeds=(0,))
    more = write_sweep(tmp_path / "s12", seeds=(1, 2))
    again = write_sweep(tmp_path / "s0-again", seeds=(0,))  # seed 0 once more: counted once, from `first`
    pooled = pooled_summary([first, more, again])
    assert sorted(zip(pooled.variant, pooled.loops, pooled.seed)) == sorted(
        (v, k, s) for (v, k, s), plan in PLAN.items() if plan.get("finished", True))
    whole = write_sweep(tmp_path / "all")  # the same runs (deterministic) as one sweep, read by hand
    expected = hand_gaps(stored_runs(whole).to_dict("records"), ("loops", "seed"))
    for r in pooled.itertuples():
        assert r.val_gap == pytest.approx(expected[(r.variant, r.loops, r.seed)][0], abs=1e-12)
    assert main(["summary", str(first), str(more), str(again)]) == 0
    per_cell = capsys.readouterr().out.split("per cell: majority verdict")[1]
    lt6 = next(line for line in per_cell.splitlines() if re.match(r"\W*lt\W+6\W", line))
    assert re.search(r"collapsed\s*│\s*2/3\s*│", lt6)


def test_sweeps_of_different_settings_are_not_pooled(tmp_path, capsys):
    first = write_sweep(tmp_path / "a", seeds=(0,))
    other = write_sweep(tmp_path / "b", seeds=(1,))
    spec = read_json(other / "sweep.json")
    spec["base"]["train"]["steps"] += 1
    write_json(other / "sweep.json", spec)
    with pytest.raises(StorageError, match=r"train\.steps \(80 vs 81\)"):
        pooled_summary([first, other])
    assert main(["summary", str(first), str(other)]) == 2
    err = capsys.readouterr().err
    assert "cannot be pooled" in err and "Traceback" not in err
    assert main(["summary", str(first), str(first / CELLS / "lt_K03_seed0_lr1")]) == 2
    assert "is a run folder and" in (err := capsys.readouterr().err) and "not both" in err  # (runs: side by side)


def test_the_failure_rate_script_counts_failed_seeds_with_an_exact_interval(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("failure_rates", Path(__file__).parents[1] / "analysis" / "failure_rates.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    first, more = write_sweep(tmp_path / "s0", seeds=(0,)), write_sweep(tmp_path / "s12", seeds=(1, 2))
    table = script.failure_rates(pooled_summary([first, more])).set_index(["variant", "K"])
    for (variant, loops), (k, n) in FAILED.items():
        row = table.loc[(variant, loops)]
        assert row.failed == f"{k}/{n}"
        # Clopper-Pearson by hand: the bounds solve P(X >= k | p_lo) = 0.025 and P(X <= k | p_hi) = 0.025
        tail_hi = sum(math.comb(n, i) * row.ci_high ** i * (1 - row.ci_high) ** (n - i) for i in range(k + 1))
        assert row.ci_high == 1.0 if k == n else tail_hi == pytest.approx(0.025, abs=1e-6)
        tail_lo = sum(math.comb(n, i) * row.ci_low ** i * (1 - row.ci_low) ** (n - i) for i in range(k, n + 1))
        assert row.ci_low == 0.0 if k == 0 else tail_lo == pytest.approx(0.025, abs=1e-6)
    assert table.loc[("lt", 6)].verdicts == "0:C 1:C 2:s"
    runs = pooled_summary([first, more])
    wider = runs[(runs.variant == "lt") & (runs.loops == 6)].assign(width=128, verdict="stable")
    by_width = script.failure_rates(pd.concat([runs, wider])).set_index(["variant", "K", "d"])
    assert by_width.loc[("lt", 6, 128)].failed == "0/3"  # another width is another cell, not pooled seeds
    assert by_width.loc[("lt", 6, int(runs.width.iloc[0]))].failed == "2/3"
    assert script.main([str(first), str(more)]) == 0
    assert "| lt, K=6 | 0-2 | 2/3 |" in capsys.readouterr().out


def test_the_collapse_grid_and_report_of_pooled_sweeps_count_every_folders_seeds(tmp_path, capsys):
    first, more = write_sweep(tmp_path / "s0", seeds=(0,)), write_sweep(tmp_path / "s12", seeds=(1, 2))
    cells = P.figure_data("collapse", [first, more]).set_index(["variant", "loops"])
    for (variant, loops), (k, n) in FAILED.items():
        assert (cells.loc[(variant, loops)].failed, cells.loc[(variant, loops)].finished) == (k, n)
    assert main(["plot", "collapse", str(first), str(more), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "collapse.png").exists()
    assert main(["report", str(first), str(more), "--out", str(tmp_path / "r.html")]) == 0
    assert "2/3" in (tmp_path / "r.html").read_text()
    assert main(["plot", "collapse", str(first), str(first / CELLS / "lt_K03_seed0_lr1")]) == 2
    assert "is a run folder and" in (err := capsys.readouterr().err) and "not both" in err  # (runs: side by side)
