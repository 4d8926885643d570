"""The head-to-head figure (issue 56, `flt-diag plot breaking MAP`) on a map whose thresholds are set by hand
(tests/test_stability_map.py's Synthetic runner): each seed's dot inside its bracket, beyond-grid lines at the
grid's edges as arrows, the variants sorted by their median breaking point, the paper's five in bold."""
import math

import numpy as np

from test_stability_map import Synthetic, _spec
from flt_diag.grids.stability_map import run_map
from flt_diag.results.figures.breaking import breaking_data, draw


def test_breaking_points_are_sorted_with_their_seeds_and_the_paper_marked(tmp_path):
    thresholds = {"lt": 1.3, "flt": 9.0, "parcae": 3.5, "deeploop": 100.0, "flt+residual-scale": 0.1}
    spec = _spec(variants=list(thresholds), loops=[12], seeds=[0, 1, 2, 3], criteria=["training"])
    run_map(spec, tmp_path / "m", runner=Synthetic(thresholds), report=lambda s: None)
    df = breaking_data(tmp_path / "m")
    assert len(df) == 5 * 4
    for r in df.itertuples():
        t = thresholds[r.variant] * (1 + 0.1 * r.seed)  # the runner's threshold for this seed
        if r.beyond is None or (isinstance(r.beyond, float) and math.isnan(r.beyond)):
            assert r.value / 1.42 < t <= r.value * 1.42  # the bracket's middle, within one grid ratio
        elif r.beyond == "above":
            assert t >= spec.grid[-1] and r.value == spec.grid[-1]
        else:
            assert t < spec.grid[0] and r.value == spec.grid[0]
    order = list(dict.fromkeys(df.sort_values("rank").variant))
    assert order == sorted(thresholds, key=thresholds.get, reverse=True)  # held longest first
    # an even count of seeds: the median is the geometric middle of the middle two (the log axis's middle); parcae's
    # middle two seeds (thresholds 3.85 and 4.2) straddle a grid value, so the arithmetic middle would differ
    med = df.groupby("variant").value.apply(lambda x: math.sqrt(sorted(x)[1] * sorted(x)[2]))
    assert np.isclose(df.set_index("variant")["median"].groupby(level=0).first(), med).all()
    assert set(df[df.paper].variant) == {"lt", "flt"}
    fig = draw(df)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == order
    bold = {t.get_text() for t in ax.get_xticklabels() if t.get_fontweight() == "bold"}
    assert bold == {"lt", "flt"}
    arrows = [ln for ln in ax.lines if ln.get_marker() in ("^", "v")]
    assert len(arrows) == 8  # deeploop held at the top (4 seeds), flt+residual-scale broke at the bottom (4)
    fig.savefig(tmp_path / "breaking.png")
    assert (tmp_path / "breaking.png").stat().st_size > 10_000


def test_the_figure_reads_a_maps_archive_as_the_map_itself(tmp_path):
    """`flt-diag archive MAP` keeps sweep.json and one record per probe (no cells/): the figure, the boundaries and
    `flt-diag plot breaking` read the archive as they read the map."""
    from flt_diag.cli import main
    from flt_diag.results.archiving import archive_sources
    thresholds = {"lt": 1.3, "flt": 9.0, "parcae": 3.0}
    spec = _spec(variants=list(thresholds), loops=[12], seeds=[0, 1], criteria=["training"])
    run_map(spec, tmp_path / "m", runner=Synthetic(thresholds), report=lambda s: None)
    archive_sources([tmp_path / "m"], tmp_path / "archive", report=lambda s: None)
    assert not (tmp_path / "archive" / "m" / "cells").exists()
    want, got = breaking_data(tmp_path / "m"), breaking_data(tmp_path / "archive" / "m")
    assert len(want) == 6 and got.reset_index(drop=True).equals(want.reset_index(drop=True))
    assert main(["plot", "breaking", str(tmp_path / "archive" / "m"), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "breaking.png").stat().st_size > 10_000


def test_each_panel_says_what_breaking_means_on_its_criterion():
    """The y label names the panel's criterion: where the residual stream explodes is not where training breaks."""
    import pandas as pd
    rows = [dict(criterion=c, loops=12, variant=v, seed=0, value=x, beyond=None, median=x, rank=r, paper=True)
            for c in ("explosion", "training") for r, (v, x) in enumerate([("flt", 32.0), ("lt", 2.0)])]
    df = pd.DataFrame(rows)
    df.attrs.update(axis="lr", grid=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    fig = draw(df)
    explosion, training = (ax.get_ylabel() for ax in fig.axes[:2])
    assert "explodes" in explosion and "training" not in explosion
    assert "training breaks" in training
