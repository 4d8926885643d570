"""The early-warning predictor: features against hand computations, the fit against known
separable data, `predict` on a sweep, and --warn / --stop-on-collapse end to end."""
import json
import math

import numpy as np
import pandas as pd
import pytest

from conftest import tiny_config
from flt_diag.storage.files import load_predictor
from flt_diag.judge import early_warning as EW
from flt_diag.results import predictor_fit as FIT
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_config, load_summary
from flt_diag.instruments.warning_callback import CollapseWarning


def _rows(steps, loops=3, depth=2, resid=lambda s, k: 10.0, grad=lambda s: 1.0, loss=lambda s: 3.0,
          act=lambda s, k: 1.0, cos=lambda s: 0.0):
    rows = []
    for s in range(steps):
        rows += [(s, M.LOSS, -1, -1, loss(s)), (s, M.GRAD_NORM, -1, -1, grad(s)), (s, M.GRAD_COSINE, -1, -1, cos(s)),
                 (s, M.GRAD_COSINE + "/matrix", -1, 0, 0.9)]  # a per-group cosine: not the feature
        for k in range(1, loops + 1):
            rows.append((s, M.RESID_NORM_LOOP_END, k, -1, resid(s, k)))
        rows += [(s, M.ACT_GRAD_NORM, 1, 1, act(s, 1)), (s, M.ACT_GRAD_NORM, loops, depth, act(s, loops))]
    return pd.DataFrame(rows, columns=["step", "metric", "loop", "layer", "value"])


def test_features_against_hand_computation():
    rng = np.random.default_rng(0)
    g = rng.lognormal(0, 0.5, 300)
    c = rng.uniform(-1, 1, 300)
    df = _rows(300, resid=lambda s, k: 8.0 * 10 ** (s / 100) if k == 3 else 8.0, grad=lambda s: g[s],
               loss=lambda s: 3 - 0.01 * s if s < 150 else 1.5 + 0.02 * (s - 150), act=lambda s, k: 4.0 if k == 1 else 0.4,
               cos=lambda s: c[s])
    f = EW.features(df, at=300, loops=3, depth=2, d_model=64)
    win = np.arange(200, 300)  # W = min(100, 300 // 2) steps before 300
    assert f["resid_level"] == pytest.approx(math.log10(np.mean(8.0 * 10 ** (win / 100))) - math.log10(8), rel=1e-9)
    assert f["resid_growth"] == pytest.approx(1.0, rel=1e-9)  # log10 grows by 1 per 100 steps
    assert f["loop_ratio"] == pytest.approx(math.log10(np.mean(8.0 * 10 ** (win / 100)) / 8.0), rel=1e-9)
    assert f["grad_cv"] == pytest.approx(np.std(g[200:300]) / np.mean(g[200:300]), rel=1e-9)
    assert f["grad_dlog"] == pytest.approx(np.mean(np.abs(np.diff(np.log(g[200:300])))), rel=1e-9)
    assert f["grad_cos"] == pytest.approx(sum(c[200:300]) / 100, rel=1e-9)
    assert f["act_grad_decay"] == pytest.approx(1.0, rel=1e-9)
    assert f["loss_slope"] == pytest.approx(2.0, rel=1e-9)  # +0.02 per step = +2 per 100 steps
    loss = np.array([3 - 0.01 * s if s < 150 else 1.5 + 0.02 * (s - 150) for s in range(300)])
    sm = pd.Series(loss).rolling(50, min_periods=1).mean()
    assert f["loss_climb"] == pytest.approx(sm.iloc[-1] - sm.min(), rel=1e-9)


def test_features_use_only_steps_before_s():
    df = _rows(400, loss=lambda s: 3.0 if s < 300 else 100.0)
    assert EW.features(df, 300, 3, 2, 64)["loss_slope"] == pytest.approx(0.0, abs=1e-12)


def test_logistic_fit_matches_known_direction_and_probabilities():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 2))
    y = (X[:, 0] - 0.5 * X[:, 1] + 0.3 * rng.normal(size=400) > 0).astype(float)
    w, b = FIT.fit_logistic(X, y, l2=1e-3)
    assert w[0] > 0 > w[1] and abs(w[1] / w[0] + 0.5) < 0.15
    # the optimum: gradient of the penalised likelihood vanishes (checked independently of the optimiser)
    p = 1 / (1 + np.exp(-(X @ w + b)))
    assert np.allclose(X.T @ (p - y) + 1e-3 * w, 0, atol=1e-3) and abs(np.sum(p - y)) < 1e-3


def test_weighted_fit_equals_the_fit_on_duplicated_rows():
    """Weight 3 on a run is the same likelihood as three copies of it (an independent construction)."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(60, 3))
    y = (X[:, 0] + rng.normal(size=60) > 0.8).astype(float)
    weights = np.where(y == 1, 3.0, 1.0)
    w, b = FIT.fit_logistic(X, y, l2=0.5, weights=weights)
    reps = weights.astype(int)
    w2, b2 = FIT.fit_logistic(np.repeat(X, reps, axis=0), np.repeat(y, reps), l2=0.5)
    assert np.allclose(w, w2, atol=1e-4) and b == pytest.approx(b2, abs=1e-4)


def test_balanced_class_weights():
    y = np.array([1, 0, 0, 0, 0, 0, 0, 0.0])
    c = FIT.class_weights(y, "balanced")
    assert c[y == 1].sum() == pytest.approx(4.0) and c[y == 0].sum() == pytest.approx(4.0)
    assert (FIT.class_weights(y, "none") == 1).all() and (FIT.class_weights(np.zeros(3)) == 1).all()
    with pytest.raises(ValueError, match="class weight"):
        FIT.class_weights(y, "inverse")


def test_balanced_weights_move_the_boundary_toward_the_rare_class():
    """1-D data, 5 positives near x = 1 among 45 negatives around 0: balanced weights raise every
    positive's P, and the fitted P = 0.5 point lies between the two class means."""
    rng = np.random.default_rng(3)
    X = np.concatenate([rng.normal(1.0, 0.2, 5), rng.normal(0.0, 0.5, 45)])[:, None]
    y = np.array([1.0] * 5 + [0.0] * 45)
    p = {}
    for kind in ("none", "balanced"):
        w, b = FIT.fit_logistic(X, y, 0.1, FIT.class_weights(y, kind))
        p[kind] = 1 / (1 + np.exp(-(X[:5, 0] * w[0] + b)))
        if kind == "balanced":
            assert 0.0 < -b / w[0] < 1.0
    assert (p["balanced"] > p["none"]).all()


def _toy_predictor(tmp_path, coef_climb=6.0, intercept=-3.0, steps=(20,), features=EW.FEATURES):
    model = dict(features=list(features), threshold=0.5, models={
        str(s): dict(mean=[0.0] * len(features), std=[1.0] * len(features),
                     coef=[coef_climb if f == "loss_climb" else 0.0 for f in features], intercept=intercept)
        for s in steps})
    path = tmp_path / "predictor.json"
    path.write_text(json.dumps(model))
    return path


def test_probability_is_the_logistic_of_the_written_out_logit(tmp_path):
    pred = load_predictor(_toy_predictor(tmp_path))
    feats = {f: 0.0 for f in EW.FEATURES} | {"loss_climb": 0.75}
    p, contrib = EW.probability(pred, feats, 40)
    assert p == pytest.approx(1 / (1 + math.exp(-(6.0 * 0.75 - 3.0))))
    assert contrib[0] == ("loss_climb", pytest.approx(4.5))
    with pytest.raises(ValueError, match="too early"):
        EW.probability(pred, feats, 10)


def test_a_predictor_uses_its_own_features(tmp_path):
    """A predictor on two features ignores the others, whatever their values."""
    pred = load_predictor(_toy_predictor(tmp_path, features=["grad_cos", "loss_climb"]))
    feats = {f: 100.0 for f in EW.FEATURES} | {"grad_cos": -0.5, "loss_climb": 0.75}
    p, contrib = EW.probability(pred, feats, 40)
    assert p == pytest.approx(1 / (1 + math.exp(-(6.0 * 0.75 - 3.0))))
    assert [name for name, _ in contrib] == ["loss_climb", "grad_cos"]


@pytest.mark.parametrize("edit, field", [(lambda m: m | {"features": ["loss_climb", "no_such_feature"]}, "features"),
                                         (lambda m: m | {"models": {"20": m["models"]["20"] | {"coef": [1.0]}}},
                                          "models.20.coef"),
                                         (lambda m: m | {"features": []}, "features")])
def test_malformed_predictors_are_refused(tmp_path, edit, field):
    path = _toy_predictor(tmp_path, features=["grad_cos", "loss_climb"])
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ValueError, match=f"predictor.json: {field}"):
        load_predictor(path)


def test_cli_feature_choices_are_the_computed_features():
    from flt_diag.cli.options import command_options
    from flt_diag.config.option_fields import form
    opt = form(next(f for _, name, f in command_options("fit-predictor") if name == "features"))
    assert list(opt.choices) == EW.FEATURES and set(FIT.DEFAULT_FEATURES) <= set(EW.FEATURES)


def test_packaged_predictor_loads():
    pred = load_predictor()
    assert set(pred.features) <= set(EW.FEATURES) and set(pred.models) >= {100, 200, 300}
    assert pred.target == "fails" and pred.command.startswith("flt-diag fit-predictor")


def test_bad_predictor_file_is_one_line(tmp_path, capsys):
    from flt_diag.cli import main
    (tmp_path / "p.json").write_text("{}")
    code = main(["train", "--steps", "2", "--device", "cpu", "--warn", "--predictor", str(tmp_path / "p.json"),
                 "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "p.json: features is missing" in err[0]
    assert not (tmp_path / "r").exists()


def test_stop_on_collapse_ends_the_run_with_a_complete_folder(tmp_path, capsys):
    """A predictor that fires at its first check (step 25: fitted from step 20, checked every 25):
    the run stops there, the summary says why, and every reader works on the folder.
    (The real predictor on a collapsing 12-loop LT run: test_stop_on_collapse_on_12_loop_lt, slow.)"""
    from flt_diag.cli import main
    pred = _toy_predictor(tmp_path, coef_climb=1.0, intercept=5.0)
    out = tmp_path / "run"
    code = main(["train", "--variant", "lt", "--loops", "3", "--steps", "400", "--device", "cpu",
                 "--eval-every", "0", "--stop-on-collapse", "--predictor", str(pred), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    s = load_summary(out)
    assert s.verdict == "collapsed" and s.prediction.step == 25 == s.steps_done
    assert "collapse predicted at step 25 (P=" in s.evidence.reason and s.prediction.evidence
    assert f"collapsed (predicted at step {s.prediction.step})" in captured.out
    assert "warning: lt K=3: collapse predicted" in captured.err
    assert (out / "checkpoint.pt").exists() and not (out / "resume.pt").exists()
    from flt_diag.judge.verdict import resummarize
    assert resummarize(out).verdict == "collapsed"  # a recomputed summary keeps the prediction
    from flt_diag.results.figures import plot
    assert plot("all", out, tmp_path / "figs", ("png",))


def test_warn_only_warns_and_trains_to_the_end(tmp_path, capsys):
    from flt_diag.training.trainer import train
    pred = _toy_predictor(tmp_path, coef_climb=0.0, intercept=5.0)  # always P > 0.5
    cfg = tiny_config(variant="flt", loops=2, steps=60, diagnostics=dict(warn=True, predictor=str(pred)))
    s = train(cfg, tmp_path / "run")
    assert s.steps_done == 60 and s.prediction is None
    err = capsys.readouterr().err
    assert err.count("collapse predicted at step 25") == 1  # once, at the first check from step 20 on


def test_predict_command_on_a_sweep(tmp_path, capsys):
    from flt_diag.cli import main
    from flt_diag.grids.sweep import SweepSpec, run_sweep
    base = tiny_config(steps=40)
    run_sweep(SweepSpec(base, ["lt", "flt"], [2], [0], [1.0]), tmp_path / "sw", workers=1, show_progress=False)
    pred = _toy_predictor(tmp_path, coef_climb=0.0, intercept=5.0)  # predicts collapse everywhere
    code = main(["predict", str(tmp_path / "sw"), "--at", "20", "--predictor", str(pred), "--csv", str(tmp_path / "p.csv")])
    out = capsys.readouterr().out
    assert code == 0
    table = pd.read_csv(tmp_path / "p.csv")
    assert len(table) == 2 and table.predicted.all()
    stable = (table.verdict == "stable").sum()
    assert f"{stable} false alarms" in out and table.false_alarm.sum() == stable
    assert "not shown to beat a prior" not in out  # a predictor of one's own: no word about the packaged one
    assert main(["predict", str(tmp_path / "sw"), "--at", "100"]) == 0, capsys.readouterr().err
    assert "the packaged predictor is not shown to beat a prior that reads only the configuration" in \
        capsys.readouterr().out  # (issue 34's measurement, said where its numbers are printed)
    from flt_diag.storage.predictor_names import PACKAGED
    assert main(["predict", str(tmp_path / "sw"), "--at", "100", "--predictor", str(PACKAGED)]) == 0
    assert "not shown to beat a prior" in capsys.readouterr().out  # the packaged file named explicitly
    # --at past every run (40 steps here): nothing left to predict, said with the longest run and a step to try
    assert main(["predict", str(tmp_path / "sw"), "--at", "40", "--predictor", str(pred)]) == 0
    out = capsys.readouterr().out
    fitted = max(int(k) for k in json.loads(pred.read_text())["models"] if int(k) < 40)  # (the toy's last step)
    assert "step 40: no finished cell has more than 40 steps" in out and \
        f"longest finished one has 40: try --at {fitted})" in out
    assert main(["predict", str(tmp_path / "sw"), "--at", str(fitted), "--predictor", str(pred)]) == 0
    assert f"step {fitted}: agreement" in capsys.readouterr().out


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """A finished sweep (lt, flt x seeds 0, 1; 30 steps) and one more run of the sweep's lt seed-0 cell,
    trained for 24 steps (the same cell at another length). 30 steps are too few for any run to fail, so
    the lt runs are labelled collapsed (their summary's verdict): a predictor needs runs of both kinds."""
    from flt_diag.storage.folders import SUMMARY, write_json
    from flt_diag.grids.sweep import SweepSpec, run_sweep
    from flt_diag.training.trainer import train
    root = tmp_path_factory.mktemp("labelled")
    run_sweep(SweepSpec(tiny_config(steps=30), ["lt", "flt"], [2], [0, 1], [1.0]), root / "sw", workers=1,
              show_progress=False)
    train(tiny_config(variant="lt", loops=2, seed=0, steps=24), root / "lt-short")
    for run in [*root.glob("sw/cells/lt_*"), root / "lt-short"]:
        write_json(run / SUMMARY, load_summary(run).as_written() | {"verdict": "collapsed"})
    return root


def test_fit_predictor_command_writes_a_loadable_model(labelled, tmp_path, capsys):
    from flt_diag.cli import main
    code = main(["fit-predictor", str(labelled / "sw"), "--at", "10", "20", "--out", str(tmp_path / "m.json")])
    assert code == 0, capsys.readouterr().err
    m = load_predictor(tmp_path / "m.json")
    assert set(m.models) == {10, 20} and m.models[20].runs == 4
    assert m.command.startswith("flt-diag fit-predictor") and "cross_validation" not in m.model_extra


def test_the_fit_set_reads_each_run_once_and_gives_each_steps_features_of_its_table(labelled, monkeypatch):
    """training_examples: a run's features at every step of --at equal EW.features on its metrics table at that
    step, and its metrics are read once for all the steps (not once per step)."""
    from flt_diag.storage.folders import load_metrics
    reads = []
    monkeypatch.setattr(EW, "load_metrics", lambda d: reads.append(d) or load_metrics(d))
    examples = FIT.training_examples([labelled / "sw"], [5, 10, 20])
    assert len(reads) == len(examples) == 4 and len(set(reads)) == 4
    for e in examples:
        m = load_config(e["run"]).model
        table = load_metrics(e["run"])
        assert set(e["feats"]) == {5, 10, 20}
        for at, feats in e["feats"].items():
            by_hand = EW.features(table, at, m.loops, m.depth, m.width)
            assert feats.keys() == by_hand.keys() and all(
                feats[k] == pytest.approx(by_hand[k], nan_ok=True) for k in feats), at


def test_fit_predictor_features_and_class_weight_reach_the_model(labelled, tmp_path, capsys):
    """--features and --class-weight: the model has those features (one coefficient each), the weights
    named, and the refit command repeats them; the fit equals fit_logistic on the same standardised rows."""
    from flt_diag.cli import main
    out = tmp_path / "m.json"
    code = main(["fit-predictor", str(labelled / "sw"), "--at", "20", "--features", "grad_cos", "loss_climb",
                 "--class-weight", "none", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    m = load_predictor(out)
    assert m.features == ["grad_cos", "loss_climb"] and m.class_weight == "none"
    assert len(m.models[20].coef) == 2
    assert "--features grad_cos loss_climb" in m.command and "--class-weight none" in m.command
    runs = [d for d, _ in FIT.training_runs([labelled / "sw"])]
    X = np.array([[EW.run_features(d, 20)[f] for f in ("grad_cos", "loss_climb")] for d in runs])
    y = np.array([EW.label(load_summary(d)) for d in runs], dtype=float)
    std = np.where(X.std(axis=0) > 1e-12, X.std(axis=0), 1.0)
    w, b = FIT.fit_logistic((X - X.mean(axis=0)) / std, y, 1.0)
    assert np.allclose(m.models[20].coef, w, atol=1e-6) and m.models[20].intercept == pytest.approx(b, abs=1e-6)


def _cell(run) -> tuple:
    """A run's cell, read here from its config: variant, K, depth, width, seed, lr scale (not its length)."""
    m, t = load_config(run).model, load_config(run).train
    return m.variant, m.loops, m.depth, m.width, t.seed, t.lr_scale


def test_cross_validation_predicts_each_run_from_the_other_cells_only(labelled):
    """Leave-one-cell-out: a run's prediction is the one of a model fitted on the runs of the other cells,
    and both lengths of the lt seed-0 cell are left out together."""
    from flt_diag.storage.folders import run_dirs
    sweep_runs = run_dirs(labelled / "sw")
    short = labelled / "lt-short"
    table = FIT.cross_validate([labelled / "sw", short], steps=[10, 20])
    assert sorted(table.step.unique()) == [10, 20] and len(table) == 5 + 5
    for r in table.itertuples():
        run = next(d for d in sweep_runs + [short] if str(d) == r.run)
        others = [d for d in sweep_runs + [short] if _cell(d) != _cell(run)]
        assert len(others) == (3 if run.name.startswith("lt_K02_seed0") or run == short else 4)
        alone = FIT.fit(others, [r.step])
        p, _ = EW.probability(alone, EW.run_features(run, r.step), r.step)
        assert r.p_collapse == pytest.approx(p, rel=1e-9, abs=1e-12)
        assert r.agree == (r.predicted == r.actual) and r.actual == (load_summary(run).verdict != "stable")


def test_runs_stopped_by_a_prediction_are_not_training_labels(labelled, tmp_path):
    import shutil
    from flt_diag.storage.folders import SUMMARY, write_json
    stopped = tmp_path / "stopped"
    shutil.copytree(labelled / "lt-short", stopped)
    write_json(stopped / SUMMARY, load_summary(stopped).as_written() | {"verdict": "collapsed", "prediction": {"step": 20}})
    assert [d for d, _ in EW.finished_runs([stopped])] == [stopped] and FIT.training_runs([stopped]) == []
    with pytest.raises(ValueError, match="no finished runs"):
        FIT.fit([stopped], [10])


def test_fit_predictor_cross_validate_reports_and_stores_agreement(labelled, tmp_path, capsys):
    from flt_diag.cli import main
    out = tmp_path / "m.json"
    code = main(["fit-predictor", str(labelled / "sw"), "--at", "10", "20", "--cross-validate", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    m = load_predictor(out)
    assert m.command.endswith("--cross-validate") and set(m.cross_validation) == {"10", "20"}
    table = FIT.cross_validate([labelled / "sw"], steps=[10, 20])
    for s, cv in m.cross_validation.items():
        t = table[table.step == int(s)]
        assert cv["cells"] == 4 and cv["accuracy"] == pytest.approx(t.agree.mean())
        assert len(cv["false_alarm"]) == cv["false_alarms"] and len(cv["miss"]) == cv["misses"]
        assert f"step {s}: leave-one-cell-out agreement {cv['accuracy']:.0%} over 4 runs" in text


def test_online_replay_warns_where_the_callback_warns():
    """`first_warning` (the replay behind `predict --online`) fires at the same check as the live
    CollapseWarning fed the same rows step by step, and at the step computed by hand: the first multiple
    of 25 (from the first fitted step, 20) whose smoothed loss has climbed more than 0.5 above its minimum."""
    from types import SimpleNamespace
    loss = lambda s: 3 - 0.01 * s if s < 150 else 1.5 + 0.02 * (s - 150)
    df = _rows(400, loss=loss)
    pred = dict(features=EW.FEATURES, threshold=0.5, models={"20": dict(
        mean=[0.0] * len(EW.FEATURES), std=[1.0] * len(EW.FEATURES), coef=[6.0 if f == "loss_climb" else 0.0 for f in EW.FEATURES], intercept=-3.0)})
    smooth = pd.Series([loss(s) for s in range(400)]).rolling(50, min_periods=1).mean()
    climb = smooth - smooth.cummin()  # climb after step s-1 decides the check at s
    by_hand = next(s for s in range(25, 401, 25) if climb[s - 1] > 0.5)
    replay = EW.first_warning(df, pred, loops=3, depth=2, d_model=64, steps_done=400)
    said = []
    cb = CollapseWarning(pred, say=said.append)
    cb.on_start(SimpleNamespace(recipe=SimpleNamespace(loops=3, depth=2, width=64, variant="lt")))
    for step, rows in df.groupby("step"):
        cb.on_rows(None, int(step), list(rows.itertuples(index=False, name=None)))
    assert replay["warned_at"] == cb.warned_at == by_hand and len(said) == 1
    assert max(r[0] for r in cb.rows) == by_hand - 1  # (nothing kept once it has warned)
    assert replay["p_warn"] == pytest.approx(1 / (1 + math.exp(-(6 * climb[by_hand - 1] - 3))))
    assert replay["checks"] == 16 and replay["p_max"] >= replay["p_warn"]


def test_every_online_check_reads_what_the_whole_table_gives_and_keeps_a_bounded_window():
    """The live CollapseWarning keeps only the rows its features read, and forgets the windowed series' rows
    older than the window: each check's features equal those of the whole metrics table at that step
    (EW.features on every row, per-group rows included), and what it keeps is the loss plus one window."""
    from types import SimpleNamespace
    rng = np.random.default_rng(1)
    g, c = rng.lognormal(0, 0.5, 700), rng.uniform(-1, 1, 700)
    df = _rows(700, resid=lambda s, k: 8.0 * 10 ** (s / 300) if k == 3 else 8.0, grad=lambda s: g[s],
               loss=lambda s: 3 - 0.004 * s if s < 350 else 1.6 + 0.01 * (s - 350), cos=lambda s: c[s])
    df = pd.concat([df, pd.DataFrame([(s, M.GRAD_NORM, -1, 2, 5.0) for s in range(700)],  # a group's norm
                                     columns=df.columns)], ignore_index=True).sort_values("step", kind="stable")
    pred = dict(features=EW.FEATURES, threshold=0.99, models={"20": dict(  # (never warns: every check is made)
        mean=[0.0] * len(EW.FEATURES), std=[1.0] * len(EW.FEATURES), coef=[0.1] * len(EW.FEATURES), intercept=-30.0)})
    cb = CollapseWarning(pred, say=lambda text: None)
    cb.on_start(SimpleNamespace(recipe=SimpleNamespace(loops=3, depth=2, width=64, variant="lt")))
    checked = []
    for step, rows in df.groupby("step"):
        cb.on_rows(None, int(step), list(rows.itertuples(index=False, name=None)))
        if cb.last is not None and cb.last["step"] == step + 1:
            whole = EW.features(df, step + 1, 3, 2, 64)
            checked.append(step + 1)
            assert cb.last["p_collapse"] == pytest.approx(EW.probability(pred, whole, step + 1)[0], rel=1e-12)
            assert cb.last["evidence"] == EW.evidence_text(whole, EW.probability(pred, whole, step + 1)[1])
    assert checked == list(range(25, 701, 25))
    kept = pd.DataFrame(cb.rows, columns=df.columns)
    assert (kept.metric == M.LOSS).sum() == 700 and kept[kept.metric != M.LOSS].step.min() >= 700 - EW.WINDOW
    assert not ((kept.metric == M.GRAD_NORM) & (kept.layer != -1)).any()


def test_predict_online_on_a_sweep(labelled, tmp_path, capsys):
    from flt_diag.cli import main
    pred = _toy_predictor(tmp_path, coef_climb=0.0, intercept=5.0)  # fires at the first check (25)
    code = main(["predict", str(labelled / "sw"), "--online", "--predictor", str(pred), "--csv", str(tmp_path / "o.csv")])
    out = capsys.readouterr().out
    assert code == 0
    table = pd.read_csv(tmp_path / "o.csv")
    assert len(table) == 4 and (table.warned_at == 25).all()
    stable = (table.verdict == "stable").sum()
    assert table.false_alarm.sum() == stable and f"{stable} false alarms" in out
    assert "online (checks every 25 steps, whole run): agreement" in out
    code = main(["predict", str(labelled / "sw"), "--online", "--figure", str(tmp_path / "f.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--online" in err[0] and not (tmp_path / "f.png").exists()


@pytest.mark.slow
def test_stop_on_collapse_on_12_loop_lt(tmp_path, capsys):
    """The packaged predictor stops a collapsing 12-loop LT run (tiny preset, seed 1, 800 steps: it
    collapses, measured in README) early, and lets the same run of FLT train to the end."""
    from flt_diag.cli import main
    for variant in ("lt", "flt"):
        code = main(["train", "--variant", variant, "--loops", "12", "--steps", "800", "--seed", "1", "--device",
                     "cpu", "--stop-on-collapse", "--out", str(tmp_path / variant)])
        assert code == 0
    out = capsys.readouterr().out
    lt, flt = load_summary(tmp_path / "lt"), load_summary(tmp_path / "flt")
    assert lt.verdict == "collapsed" and lt.prediction.step < 800 and lt.steps_done < 800
    assert f"predicted at step {lt.prediction.step}" in out
    assert flt.verdict == "stable" and flt.steps_done == 800 and not flt.prediction
    # the stopped run's folder is complete: every figure draws from it
    from flt_diag.results.figures import plot
    assert plot("all", tmp_path / "lt", tmp_path / "fig", ("png",))


def test_predict_compares_several_predictors_on_the_same_runs(labelled, tmp_path, capsys):
    from flt_diag.cli import main
    always = _toy_predictor(tmp_path, coef_climb=0.0, intercept=5.0)
    (tmp_path / "never").mkdir()
    never = _toy_predictor(tmp_path / "never", coef_climb=0.0, intercept=-5.0)
    code = main(["predict", str(labelled / "sw"), "--at", "20", "25", "--predictor", str(always), str(never),
                 "--csv", str(tmp_path / "p.csv"), "--figure", str(tmp_path / "f.png")])
    out = capsys.readouterr().out
    assert code == 0 and f"predictor {always}:" in out and f"predictor {never}:" in out
    t = pd.read_csv(tmp_path / "p.csv")
    assert len(t) == 2 * 2 * 4 and set(t.predictor) == {str(always), str(never)}
    assert t[t.predictor == str(always)].predicted.all() and not t[t.predictor == str(never)].predicted.any()
    assert (tmp_path / "f.png").stat().st_size > 0


@pytest.mark.parametrize("verdict,rebound,fails,collapse,climbs", [
    ("stable", False, 0, 0, 0), ("stable", True, 0, 0, 1), ("unstable", False, 1, 0, 1),
    ("stalled", False, 1, 1, 1), ("collapsed", False, 1, 1, 1), ("diverged", False, 1, 1, 1)])
def test_targets_label_the_verdict_as_documented(verdict, rebound, fails, collapse, climbs):
    from flt_diag.storage.file_models import Evidence, Summary
    s = Summary.model_construct(verdict=verdict, evidence=Evidence.model_construct(transient_rebound=rebound))
    assert (EW.label(s, "fails"), EW.label(s, "collapse"), EW.label(s, "climbs")) == (fails, collapse, climbs)
