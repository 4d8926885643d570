"""analysis/stabiliser_benchmark_2.py (issue 66 part 4): round two's rules applied as the plan words them, on
synthetic archives whose answers are known by hand; the primary's statistics against scipy and brute force."""
import itertools
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import mannwhitneyu

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "analysis"), str(Path(__file__).resolve().parent)]
import benchmark_2_rules as R  # noqa: E402
import stabiliser_benchmark_2 as S  # noqa: E402
from fake_runs import make_run  # noqa: E402


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """One synthetic run (stable, with loop dynamics), copied and edited into every run of the tests."""
    return make_run(tmp_path_factory.mktemp("t") / "run", "lt", 3)


def fake(template, where: Path, variant: str, seed: int, lr: float, verdict: str, val: float,
         strength: float | None = None, **extra) -> Path:
    """A copy of the template whose summary (and config's model.strength, where given) says what the test chooses."""
    shutil.copytree(template, where)
    if strength is not None:
        c = json.loads((where / "config.json").read_text())
        c["model"].update(variant=variant, strength=strength)  # (a strength is refused on a variant without one)
        (where / "config.json").write_text(json.dumps(c))
    s = json.loads((where / "summary.json").read_text())
    s.update(variant=variant, seed=seed, lr_scale=lr, verdict=verdict, val_loss=val, **extra)
    (where / "summary.json").write_text(json.dumps(s))
    return where


# Stage A by hand: (variant, strength) -> seed 101, seed 102 as (verdict, val loss)
ST, UN = "stable", "unstable"
A_PLAN = {
    "jacobian-fro-source": {0.5: ((ST, 1.0), (UN, 1.0)), 1.0: ((ST, 2.0), (ST, 2.2)), 2.0: ((ST, 1.5), (ST, 1.7)),
                     4.0: ((ST, 3.0), (ST, 3.0))},  # 0.5 is lowest but one seed unstable: 2 chosen
    "stars-source": {x: ((UN, 1.0), (ST, 1.0)) for x in S.STRENGTHS},  # none stable on both: x 1, labelled
    "residual-scale": {0.5: ((ST, 2.5), (ST, 2.0)), 1.0: ((ST, 2.5), (ST, 2.5)), 2.0: ((ST, 1.75), (ST, 2.25)),
                       4.0: ((ST, 1.5), (ST, 2.5))},  # 2 and 4 tie at mean 2.0: nearest x 1 taken, 2
    "deeploop": {0.5: ((ST, 2.0), (ST, 2.0)), 1.0: ((ST, 2.5), (ST, 2.5)), 2.0: ((ST, 2.0), (ST, 2.0)),
                 4.0: ((ST, 1.0), (ST, 9.0))},  # 0.5 and 2 tie at the same distance: the lower, 0.5
    "parcae-source": {0.5: ((ST, 2.0), (ST, 2.0)), 1.0: ((ST, 2.0), (ST, 1.9)), 2.0: ((ST, 2.0), (ST, 2.0)),
               4.0: ((ST, 2.0), (ST, 2.0))},  # plain minimum: 1
}
A_CHOSEN = {"jacobian-fro-source": (2.0, ""), "stars-source": (1.0, "no stable strength at x 1"), "residual-scale": (2.0, ""),
            "deeploop": (0.5, ""), "parcae-source": (1.0, "")}


def stage_a_archive(template, root: Path, skip: int = 0) -> Path:
    n = 0
    for v, plan in A_PLAN.items():
        for x, seeds in plan.items():
            for seed, (verdict, val) in zip((101, 102), seeds):
                n += 1
                if n > 40 - skip:
                    continue
                fake(template, root / f"A-strength-{x:g}" / f"{v}-{seed}", v, seed, 1.0, verdict, val, strength=x)
    return root


def test_stage_a_chooses_each_strength_as_the_plan_words_it(template, tmp_path):
    stages = S.read_archive(stage_a_archive(template, tmp_path))
    chosen, lines = S.stage_a(stages["A"])
    assert lines == ["Stage A (strengths, seeds 101-102, lr x 1): all 40 runs in."]
    assert {v: (c["value"], c["label"]) for v, c in chosen.items()} == A_CHOSEN
    assert chosen["residual-scale"]["tie"] and chosen["deeploop"]["tie"] and not chosen["parcae-source"]["tie"]
    table = S.answer(chosen, None, None, pd.DataFrame(), pd.DataFrame()).set_index("variant")
    assert table.loc["stars-source", "strength"] == "x 1 (no stable strength at x 1)"
    assert table.loc["jacobian-fro-source", "strength"].startswith("x 2")
    assert table.loc["lt", "strength"] == "-" and table.loc["lt", "best lr"] == "not decided"


def test_a_stage_short_of_its_runs_decides_nothing(template, tmp_path):
    stages = S.read_archive(stage_a_archive(template, tmp_path, skip=3))
    chosen, lines = S.stage_a(stages["A"])
    assert chosen is None and lines == ["Stage A (strengths, seeds 101-102, lr x 1): not finished (37 of 40 runs)."]
    text = S.report(tmp_path)
    assert "not finished (37 of 40 runs)" in text and "Stage B (best lr): not run." in text
    assert "Stage C (the primary, seeds 1-8): not run." in text


def rows(spec) -> pd.DataFrame:
    return pd.DataFrame([dict(variant=v, seed=s, lr=lr, strength=x, verdict=vd, val_loss=val, exploded=False,
                              unigram=False, loops=12, path="")
                         for v, s, lr, x, vd, val in spec], columns=S.COLUMNS)


def test_stage_b_best_lr_reuses_stage_a_and_says_no_stable_lr():
    strengths = {v: dict(value=2.0 if v == "jacobian-fro-source" else 1.0, label="") for v in S.TUNED}
    spec = []
    for v in S.VARIANTS:
        x = strengths.get(v, {"value": 1.0})["value"]
        for lr in S.LRS:
            for seed in (101, 102):
                if v == "jacobian-fro-source" and lr == 1.0:
                    continue  # stage A's runs at the chosen strength stand in
                verdict = UN if (v == "lt" or (v == "flt" and lr == 4.0 and seed == 102)) else ST
                val = {"flt": {0.5: 2.0, 1.0: 1.8, 2.0: 1.9, 4.0: 1.0}}.get(v, {0.5: 2.0, 1.0: 2.0, 2.0: 1.5,
                                                                                    4.0: 1.7})[lr]
                spec.append((v, seed, lr, x, verdict, val))
    a_runs = rows([("jacobian-fro-source", s, 1.0, 1.0, ST, 9.0) for s in (101, 102)]  # another strength: not used
                  + [("jacobian-fro-source", s, 1.0, 2.0, ST, 0.5) for s in (101, 102)])
    best, lines = S.stage_b((rows(spec), 0), a_runs, strengths)
    assert lines[0].endswith("all 96 runs in.")
    assert best["flt"]["value"] == 1.0  # x 4 is lowest but seed 102 unstable there
    assert best["lt"]["value"] == 0.5 and best["lt"]["label"] == "no stable lr in x 0.5-4"
    assert best["jacobian-fro-source"]["value"] == 1.0  # stage A's runs at strength x 2 (0.5) reused; x 1's (9.0) not
    assert best["huginn"]["value"] == 2.0
    short, lines = S.stage_b((rows(spec[1:]), 0), a_runs, strengths)
    assert short is None and "not finished (95 of 96 runs)" in lines[0]


def brute_hl(x, y, level=0.95):
    """Hodges-Lehmann by brute force: the median of the differences, and the exact interval from the Mann-Whitney
    null counted over every split of the pooled sample."""
    d = sorted(a - b for a in x for b in y)
    n, m = len(x), len(y)
    pooled = list(range(n + m))
    us = sorted(sum(1 for i in idx for j in set(pooled) - set(idx) if i > j) for idx in itertools.combinations(pooled, n))
    c = max(u for u in range(n * m + 1) if sum(1 for w in us if w < u) / len(us) <= (1 - level) / 2)
    return float(np.median(d)), d[c - 1], d[n * m - c]


def test_primary_against_scipy_brute_force_and_holm_by_hand():
    rng = np.random.default_rng(7)
    shifts = dict(zip(S.VARIANTS, [0.3, 0.0, 0.01, -0.2, 0.0, 0.05, 0.5, -0.02, 0.0, 0.1, 0.2, 0.03]))
    spec = [(v, s, 1.0, 1.0, ST if s != 3 or v != "lt" else UN, 2.0 + shifts[v] + rng.normal(0, 0.05))
            for v in S.VARIANTS for s in S.CONFIRM_SEEDS]
    t = R.primary(rows(spec))
    assert list(t.variant) == [v for v in S.VARIANTS if v != "flt"]
    flt = np.array([r[5] for r in spec if r[0] == "flt"])
    for r in t.itertuples():
        x = np.array([q[5] for q in spec if q[0] == r.variant])
        assert r.p == pytest.approx(mannwhitneyu(x, flt, alternative="two-sided", method="exact").pvalue, rel=1e-9)
        if r.variant in ("lt", "fla"):
            assert (r.shift, r.low, r.high) == pytest.approx(brute_hl(x, flt))
        assert r.median == pytest.approx(np.median(x)) and r.sd == pytest.approx(np.std(x, ddof=1))
    assert t.set_index("variant").failed.to_dict()["lt"] == 1
    p = t.p.to_numpy()
    order = np.argsort(p)
    by_hand = np.empty(11)
    running = 0.0
    for i, j in enumerate(order):  # Holm: (m - i) p_(i), made monotone, capped at 1
        running = max(running, min(1.0, (11 - i) * p[j]))
        by_hand[j] = running
    assert t.p_holm.to_numpy() == pytest.approx(by_hand)
    words = t.set_index("variant").reading
    assert words["lt"] == "higher than FLT" and words["fla"] == "lower than FLT" and words["lt-ii"] == "indistinguishable"


def test_a_partial_stage_c_is_not_finished_and_has_no_test(template, tmp_path):
    for i, v in enumerate(["flt", "lt", "parcae-source"]):
        fake(template, tmp_path / "C" / f"{v}-1", v, 1, 1.0, ST, 2.0 + i)
    text = S.report(tmp_path)
    assert "Stage C (the primary, seeds 1-8): 3 runs archived, not read (stage B has not chosen the lrs)." in text
    assert "The primary (" not in text and "p (Holm)" not in text
    best = {v: dict(value=1.0) for v in S.VARIANTS}
    tests, _, said = S.stage_c(S.read_archive(tmp_path)["C"], {}, best)
    assert tests is None and said == ["Stage C (the primary, seeds 1-8): not finished (3 of 96 runs). Archived: flt 1, "
                                      "lt 1, parcae-source 1. No test until all are in."]


def test_stage_c_reads_only_runs_at_the_strength_and_lr_stages_a_and_b_chose():
    """96 runs at the chosen settings and two beside them (another lr, another strength): the two are counted and
    left out, and the test is the one of the 96 alone."""
    strengths = {v: dict(value=2.0) for v in S.TUNED}
    best = {v: dict(value=0.5 if v == "lt" else 1.0) for v in S.VARIANTS}
    spec = [(v, s, best[v]["value"], strengths.get(v, {"value": 1.0})["value"], ST, 2.0 + 0.01 * s)
            for v in S.VARIANTS for s in S.CONFIRM_SEEDS]
    extra = [("lt", 1, 1.0, 1.0, ST, 0.1), ("deeploop", 2, 1.0, 1.0, ST, 0.1)]  # lt at x 1; deeploop at strength 1
    tests, runs, said = S.stage_c((rows(extra + spec), 0), strengths, best)
    assert said == ["Stage C (the primary, seeds 1-8): all 96 runs in. 2 runs at another strength or lr than stages A "
                    "and B chose, left out."]
    assert len(runs) == 96 and 0.1 not in set(runs.val_loss)
    assert tests.set_index("variant").loc["lt", "median"] == pytest.approx(np.median([2.0 + 0.01 * s for s in range(1, 9)]))


def test_the_long_runs_are_the_three_lowest_medians_and_flt():
    """Medians written out by hand: huginn 1.60, lt-ii 1.61, fla 1.62 lead; flt (1.65) joins them; a variant whose
    mean is lowest but median is not (lt: one seed at 0.1) is not chosen."""
    medians = {"huginn": 1.60, "lt-ii": 1.61, "fla": 1.62, "flt": 1.65, "lt": 1.70, "deeploop": 1.63}
    spec = [(v, s, 1.0, 1.0, ST, m + (0.001 * s if s != 1 or v != "lt" else -1.6)) for v, m in medians.items()
            for s in S.CONFIRM_SEEDS]
    assert R.long_runs(rows(spec)) == ["huginn", "lt-ii", "fla", "flt"]
    spec = [r if r[0] != "flt" else (*r[:5], r[5] - 0.1) for r in spec]  # now flt leads: three in all
    assert R.long_runs(rows(spec)) == ["flt", "huginn", "lt-ii"]
    nan = [("lt-ai", s, 1.0, 1.0, ST, float("nan")) for s in S.CONFIRM_SEEDS]  # no val loss at all, listed first
    assert R.long_runs(rows(nan + spec)) == ["flt", "huginn", "lt-ii"]


def test_stage_d_breaking_lr_margin_and_failure_kind():
    spec = []
    for seed, (last, kind) in zip(D_SEEDS := (1, 2, 3), [(2.0, "collapsed"), (4.0, "diverged"), (8.0, "unstable")]):
        spec += [("lt", seed, lr, 1.0, ST, 2.0) for lr in (0.5, 1.0, last / 2, last)]
        spec.append(("lt", seed, last * 2, 1.0, kind, 5.0))
    spec += [("flt", 1, 1.0, 1.0, UN, 5.0), ("flt", 1, 4.0, 1.0, ST, 2.0)]  # not closed: 0.5 not probed
    runs = rows(spec)
    runs["steps_done"] = [150 + 100 * seed if vd != ST else 600 for _, seed, _, _, vd, _ in spec]
    m = S.stage_d((runs, 0), {"lt": dict(value=2.0), "flt": dict(value=1.0)})
    assert list(m.variant) == sorted(["lt", "flt"], key=S.VARIANTS.index)  # (the benchmark's order)
    flt = m[m.variant == "flt"].iloc[0]
    assert flt.lines == 0 and flt.open == 1 and math.isnan(flt.breaking)  # (started, not finished: said, no median)
    r = m[m.variant == "lt"].iloc[0]
    assert r.breaking == pytest.approx(8.0) and r.margin == pytest.approx(4.0)  # median of 4, 8, 16; / 2
    assert r.kinds == "collapsed diverged unstable"
    assert r.stopped == "250 350 450" and r.open == 0  # the step each breaking probe ended at, by seed
    assert S.stage_d((rows(spec), 0), None).set_index("variant").loc["lt"].stopped == "- - -"  # no step recorded: said, not guessed


def test_stage_e_extrapolation_is_the_median_of_loss_at_k_minus_at_12(tmp_path):
    spec = []
    for seed, add in zip((1, 2, 3), (0.0, 0.1, 0.5)):
        d = tmp_path / f"r{seed}"
        d.mkdir()
        pd.DataFrame(dict(loops=[6, 9, 12, 18, 24], val_loss=[3.0 + add, 2.5, 2.0, 2.2 + add, 2.4])).to_csv(
            d / "eval_loops.csv", index=False)
        spec.append(("parcae-source", seed, 1.0, 1.0, ST, 2.0))
    runs = rows(spec).assign(path=[str(tmp_path / f"r{s}") for s in (1, 2, 3)])
    e = S.stage_e(runs)
    row = e.loc["parcae-source"].to_dict()
    assert {k: row.pop(k) for k in ("within@18", "within@24")} == {"within@18": "no", "within@24": "no"}
    assert row == pytest.approx({"K=6": 1.1, "K=9": 0.5, "K=18": 0.3, "K=24": 0.4, "spread@12": 0.0, "runs": 3})
    # at K = 12 the seeds now differ by 0.35 (2.0, 2.35, 2.1); the differences at 18 are 0.3, 0.2, 0.34 (median
    # 0.3) and at 24 all 0.4: read against that spread
    for seed, at12 in zip((1, 2, 3), (2.0, 2.35, 2.1)):
        pd.DataFrame(dict(loops=[6, 9, 12, 18, 24], val_loss=[3.0, 2.5, at12, at12 + (0.3, 0.2, 0.34)[seed - 1],
                                                                 at12 + 0.4])).to_csv(tmp_path / f"r{seed}" /
                                                                                       "eval_loops.csv", index=False)
    e = S.stage_e(runs).loc["parcae-source"]
    assert e["spread@12"] == pytest.approx(0.35) and e["K=18"] == pytest.approx(0.3) and e["K=24"] == pytest.approx(0.4)
    assert (e["within@18"], e["within@24"]) == ("yes", "no")  # 0.3 <= 0.35 < 0.4


def test_the_dynamics_count_exploded_and_unigram_runs_instead_of_averaging_them(tmp_path):
    calm = make_run(tmp_path / "calm", "lt", 3)
    wild = make_run(tmp_path / "wild", "lt", 3, collapsed=True)
    runs = rows([("lt", 101, 1.0, 1.0, ST, 2.0), ("lt", 102, 1.0, 1.0, "collapsed", 5.0),
                 ("lt", 103, 1.0, 1.0, "collapsed", 5.0)])
    runs = runs.assign(path=[str(calm), str(wild), str(wild)], loops=3, exploded=[False, True, False],
                       unigram=[False, False, True])
    d = S.dynamics(runs).iloc[0]
    assert (d.runs, d.exploded, d.unigram) == (1, 1, 1)
    assert d["spectral radius"] == pytest.approx(0.7)  # the calm run's alone (the wild one's is 1.1)


def test_bad_input_is_one_line_and_exit_2(template, tmp_path, capsys):
    run = fake(template, tmp_path / "C" / "flt-1", "flt", 1, 1.0, ST, 2.0)
    (run / "summary.json").write_text('{"verdict": "sta')
    assert S.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert S.main([str(tmp_path / "missing")]) == 2
    capsys.readouterr()
    (tmp_path / "C").rename(tmp_path / "moved")
    (tmp_path / "C").write_text("not a folder")
    assert S.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and err.count("\n") == 1


def test_the_figures_points_are_medians_of_stable_runs_with_the_others_counted():
    """Per (variant, lr), written out: the median and range over the `stable` runs only (a broken run's val loss,
    9.0 here, is never a point), the broken ones counted; the frames (B's pool, C, D) are pooled."""
    import benchmark_2_figure as F
    b = rows([("lt", 101, 0.5, 1.0, ST, 1.70), ("lt", 102, 0.5, 1.0, ST, 1.74), ("lt", 101, 1.0, 1.0, UN, 9.0),
              ("lt", 102, 1.0, 1.0, ST, 1.80)])
    c = rows([("lt", s, 0.5, 1.0, ST if s != 2 else "collapsed", 1.60 + 0.1 * s) for s in (1, 2, 3)])
    p = F.points([b, c, None]).set_index(["variant", "lr"])
    assert p.loc[("lt", 0.5)][["median", "min", "max", "stable", "broken"]].tolist() == \
        pytest.approx([np.median([1.70, 1.74, 1.70, 1.90]), 1.70, 1.90, 4, 1])
    assert p.loc[("lt", 1.0)][["median", "min", "max", "stable", "broken"]].tolist() == pytest.approx([1.8, 1.8, 1.8, 1, 1])
    d = rows([("lt", 1, 0.5, 1.0, ST, 1.70 + 0.1), ("lt", 9, 0.5, 1.0, ST, 1.5)])  # seed 1 at 0.5: C's run again
    p = F.points([b, c, d]).set_index(["variant", "lr"])
    assert p.loc[("lt", 0.5)][["median", "stable", "broken"]].tolist() == \
        pytest.approx([np.median([1.70, 1.74, 1.70, 1.90, 1.5]), 5, 1])  # seed 1 counted once (C's), seed 9 added
    only_broken = F.points([rows([("fla", 1, 4.0, 1.0, "diverged", 7.0)])]).iloc[0]
    assert math.isnan(only_broken["median"]) and (only_broken.stable, only_broken.broken) == (0, 1)


def test_the_figure_is_drawn(template, tmp_path):
    for v in ("flt", "lt"):
        for lr in (0.5, 1.0):
            fake(template, tmp_path / "arch" / "B" / f"{v}-{lr:g}", v, 101, lr, ST, 2.0 + lr)
    assert S.main([str(tmp_path / "arch"), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "stabiliser-benchmark-2.png").stat().st_size > 1000


def test_a_stage_folder_reads_runs_two_levels_down_as_slices_archive_them(template, tmp_path):
    """`--archive-to A-strength-2/fixed` archives into A-strength-2/fixed/<study folder>/ (an archive of records):
    those runs are stage A's; a third level down is not read (the reader looks no deeper than a slice's archive)."""
    from flt_diag.cli import main
    runs = [fake(template, tmp_path / "runs" / f"deeploop-{seed}", "deeploop", seed, 1.0, ST, 2.0, strength=2.0)
            for seed in (101, 102)]
    root = tmp_path / "bench"
    assert main(["archive", *map(str, runs), "--to", str(root / "A-strength-2" / "fixed" / "study")]) == 0
    got, unfinished = S.read_archive(root)["A"]
    assert sorted(zip(got.variant, got.seed, got.strength)) == [("deeploop", 101, 2.0), ("deeploop", 102, 2.0)]
    deeper = tmp_path / "deeper" / "A-strength-2" / "a" / "b"
    deeper.mkdir(parents=True)
    (root / "A-strength-2" / "fixed").rename(deeper / "c")
    with pytest.raises(S.StorageError):
        S.read_archive(tmp_path / "deeper")


def test_the_benchmarks_hours_are_the_runs_own_wall_times_summed_per_stage():
    """Issue 64's real hours: 1,800 s + 3,600 s of stage A is 1.5 lane-hours; 900 of 1,200 steps trained is 75 %;
    a stage with no runs is not listed, and nothing archived lists nothing."""
    runs = pd.DataFrame([dict(zip(S.COLUMNS, ["lt", 101, 1.0, 1.0, "stable", 4.0, False, False, 12, "a", 600, 600,
                                              1800.0])),
                         dict(zip(S.COLUMNS, ["lt", 102, 1.0, 1.0, "collapsed", 9.0, True, False, 12, "b", 600, 300,
                                              3600.0]))], columns=S.COLUMNS)
    stages = {"A": (runs, 0), "B": None, "C": None, "D": None, "L2000": None}
    lines = S.compute(stages)
    assert "* stage A: 2 runs, 1.5 lane-hours, 75 % of their steps trained" in lines
    assert not any("stage B" in line for line in lines)
    assert S.compute({k: None for k in stages}) == []


def test_stage_d_cost_per_finished_line_counts_its_probes_and_hours():
    """Two finished lines (lt seed 1: 1 and 2 held, 4 broke, 3 probes of 1,200 s = 1.0 h; lt seed 2: 1 held, 2 broke,
    2 probes of 900 s = 0.5 h) and one open (flt seed 1: 4 broke, 2 not probed): 2 of 3 finished, 5 probes and
    1.5 probe-hours, means and medians 2.5 probes and 0.75 h; a seed outside 1-3 is not a line of stage D."""
    spec = [("lt", 1, lr, v, 1200.0) for lr, v in ((1.0, ST), (2.0, ST), (4.0, UN))]
    spec += [("lt", 2, lr, v, 900.0) for lr, v in ((1.0, ST), (2.0, UN))] + [("flt", 1, 4.0, UN, 500.0)]
    spec += [("flt", 9, 1.0, UN, 7000.0)]
    runs = pd.DataFrame([dict(variant=v, seed=s, lr=lr, strength=1.0, verdict=vd, val_loss=2.0, exploded=False,
                              unigram=False, loops=12, path="", steps=600, steps_done=600, wall_time=w)
                         for v, s, lr, vd, w in spec], columns=S.COLUMNS)
    got = R.line_cost(runs[runs.seed.isin(S.D_SEEDS)])
    assert ("of the 3 lines started, 2 are finished, with 5 probes and 1.5 lane-hours: a mean of 2.5 probes and "
            "0.75 lane-hours a line (medians 2.5 and 0.75)") in got
    assert "no line finished (1 started)" in R.line_cost(runs[(runs.variant == "flt") & (runs.seed == 1)])
    assert "stage D: 7 runs" in "".join(S.compute({"A": None, "B": None, "C": None, "D": (runs, 0), "L2000": None}))


def _with_cpu(run: Path, simd: list[str] | None) -> Path:
    c = json.loads((run / "config.json").read_text())
    c["env"] = {**(c.get("env") or {}), **({"cpu": {"model": "Test CPU", "simd": simd}} if simd is not None else {})}
    (run / "config.json").write_text(json.dumps(c))
    return run


def test_the_cpu_kind_check_against_scipy_and_the_kinds_from_each_runs_config(template, tmp_path):
    """FLT's eight stage-C runs on AVX2 (val 1.60 + 0.01 s) and eight re-runs on AVX-512 (0.015 higher each): the
    kinds read from each config, the p from scipy's exact test, the plan's reading for p >= 0.05 written out."""
    import benchmark_2_cpu as CPU
    old = [_with_cpu(fake(template, tmp_path / "C" / f"flt-{s}", "flt", s, 1.0, ST, 1.60 + 0.01 * s), ["avx2"])
           for s in range(1, 9)]
    new = [_with_cpu(fake(template, tmp_path / CPU.CHECK / "CPU-check-flt" / f"flt-{s}", "flt", s, 1.0, ST,
                          1.615 + 0.01 * s), ["avx2", "avx512f"]) for s in range(1, 9)]
    assert (CPU.kind(old[0]), CPU.kind(new[0]), CPU.kind(_with_cpu(fake(template, tmp_path / "x", "flt", 1, 1.0, ST,
                                                                            1.0), None))) == \
        ("Test CPU (AVX2)", "Test CPU (AVX-512)", "unknown")
    c_runs = rows([("flt", s, 1.0, 1.0, ST, 1.60 + 0.01 * s) for s in range(1, 9)]).assign(path=[str(p) for p in old])
    assert CPU.kinds_line(c_runs) == "Stage C's runs by CPU kind (each run's own env.cpu): Test CPU (AVX2): flt 8."
    (line,) = CPU.check_lines(tmp_path, c_runs)
    p = mannwhitneyu([1.615 + 0.01 * s for s in range(1, 9)], [1.60 + 0.01 * s for s in range(1, 9)],
                     alternative="two-sided", method="exact").pvalue
    assert p >= 0.05 and f"exact two-sided p = {p:.4f}" in line and "the primary stands as computed" in line
    _with_cpu(new[0], ["avx2"])  # one of the check's runs on stage C's own kind: no check of another kind
    with pytest.raises(ValueError, match="another CPU kind than stage C's FLT runs"):
        CPU.check_lines(tmp_path, c_runs)
    shutil.rmtree(new[-1])
    assert CPU.check_lines(tmp_path, c_runs) == [
        "CPU-kind check (amendment of 2026-12-07 14:50 UTC): not finished (7 of 8 runs)."]
    shutil.rmtree(tmp_path / CPU.CHECK)
    (tmp_path / CPU.CHECK).write_text("x")  # a file of its name: one line, as for every stage folder
    with pytest.raises(ValueError, match="is not a folder"):
        CPU.check_lines(tmp_path, c_runs)


def test_stage_ds_provenance_counts_each_probes_cpu_kind_and_commit_and_names_mixed_lines(template, tmp_path):
    """Four probes written by hand: flt seed 1 on AVX2 (commit a x 2) and AVX-512 (commit b); lt seed 1 on AVX2
    (commit b). Counted per kind and commit from each config; only flt seed 1 mixes kinds."""
    import benchmark_2_cpu as CPU

    def probe(name, variant, lr, simd, commit):
        run = _with_cpu(fake(template, tmp_path / name, variant, 1, lr, ST, 1.0), simd)
        c = json.loads((run / "config.json").read_text())
        c["env"]["code"] = {"commit": commit * 40}
        (run / "config.json").write_text(json.dumps(c))
        return str(run)
    paths = [probe("f1", "flt", 1.0, ["avx2"], "a"), probe("f2", "flt", 2.0, ["avx2"], "a"),
             probe("f3", "flt", 4.0, ["avx2", "avx512f"], "b"), probe("l1", "lt", 1.0, ["avx2"], "b")]
    runs = rows([("flt", 1, lr, 1.0, ST, 1.0) for lr in (1.0, 2.0, 4.0)] + [("lt", 1, 1.0, 1.0, ST, 1.0)])
    assert CPU.provenance_line(runs.assign(path=paths)) == (
        "Stage D's probes by CPU kind and code (each record's own env): Test CPU (AVX-512): bbbbbbbbbbbb 1; "
        "Test CPU (AVX2): aaaaaaaaaaaa 2, bbbbbbbbbbbb 1. Lines with probes of more than one CPU kind: flt seed 1.")
    c = json.loads((Path(paths[0]) / "config.json").read_text())
    c["env"]["code"] = "a hand-edited line"  # (crafted: no table) -> unknown, never a traceback
    c["env"]["cpu"] = ["not", "a", "table"]  # (and no CPU: not a second kind of its line)
    (Path(paths[0]) / "config.json").write_text(json.dumps(c))
    assert CPU.code(paths[0]) == "unknown" and CPU.kind(paths[0]) == "unknown"
    assert CPU.mixed_lines(runs.assign(path=paths).iloc[[0, 1]]) == []


def test_the_2000_step_runs_are_described_per_variant_as_far_as_archived():
    """Three runs by hand (flt seeds 1, 2 at 1.50 and 1.60, one `unstable`; parcae-source seed 1 at 1.40): the
    seeds, median, range and the count not stable, written out; the runs archived out of 16."""
    runs = rows([("parcae-source", 1, 1.0, 2.0, ST, 1.40), ("flt", 2, 1.0, 1.0, UN, 1.60),
                 ("flt", 1, 1.0, 1.0, ST, 1.50)]).assign(steps=2000)
    lines = S.descriptive((runs, 0))
    assert lines[0].startswith("At 2,000 steps (seeds 1-4, descriptive, no test; 3 of 16 runs archived, steps 2000)")
    table = lines[2].splitlines()
    assert table[2] == "| parcae-source | 1 | 1.4 | 1.4 | 1.4 | 0 |"
    assert table[3] == "| flt | 1 2 | 1.55 | 1.5 | 1.6 | 1 |"
    assert S.descriptive(None) == ["At 2,000 steps: not run."]
