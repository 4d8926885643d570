"""Early warning: P(the run collapses by its end) from the signals recorded up to step s.

A logistic regression on a few named features of the window of the last W = min(100, s // 2)
recorded steps before s (numpy/scipy/pandas only; no torch):

    resid_level     log10(final-loop residual norm / sqrt(d)), window mean   (residual explosion)
    resid_growth    slope of log10(final-loop residual norm) per 100 steps    (still exploding?)
    loop_ratio      log10(final-loop / first-loop residual norm)              (later vs earlier loops)
    grad_cv         coefficient of variation of the global gradient norm      (oscillation)
    grad_dlog       mean |delta log gradient norm|                            (oscillation)
    grad_cos        mean cosine between successive gradients                  (oscillation: < 0 when
                    each step undoes part of the last)
    act_grad_decay  log10(||dL/d out(loop 1, block 1)|| / ||dL/d out(loop K, block L)||)
                    (how the backward signal changes through the loops)
    loss_slope      slope of the training loss per 100 steps
    loss_climb      trailing-mean loss minus its running minimum so far

The target (what "collapse" means for a predictor) is stored with it: "fails" (the final verdict is
unstable, collapsed or diverged; the packaged predictor's), "collapse" (collapsed or diverged) or
"climbs" (fails, or the loss climbed above the verdict's rebound threshold and recovered).
A predictor names the features it uses (a subset of FEATURES; `fit-predictor --features`).
Features are standardised with the training set's mean and std (a missing feature, e.g. a run
recorded without diagnostics, counts as the mean); the fit maximises the L2-penalised likelihood
(scipy L-BFGS), by default with class-balanced weights (each class weighs half, whatever share of
the training runs fail: that share is an artefact of which sweeps were run, not a prior). One model
per fitted step s (100, 200, 300, 500 by default); at another step the model of the largest fitted
s at or below it is used. The fitted model is plain JSON (features, means, stds, coefficients,
intercept, class weights, what it was fitted on and the command that refits it):
flt_diag/early_warning.json ships with the package.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.analysis import metric_names as M
from flt_diag.training.callbacks import Callback
from flt_diag.analysis.storage import load_config, load_metrics, load_summary, run_dirs, series

FEATURES = ["resid_level", "resid_growth", "loop_ratio", "grad_cv", "grad_dlog", "grad_cos", "act_grad_decay",
            "loss_slope", "loss_climb"]  # every feature `features` computes
DEFAULT_FEATURES = ["resid_level", "resid_growth", "loop_ratio", "grad_cv", "grad_dlog", "act_grad_decay",
                    "loss_slope", "loss_climb"]  # what `fit-predictor` uses unless told otherwise
CLASS_WEIGHTS = ("balanced", "none")
DEFAULT_STEPS = [100, 200, 300, 500]
PACKAGED = Path(__file__).with_name("early_warning.json")
COLLAPSE = ("collapsed", "diverged")
SMOOTH = 50


def _slope_per_100(s: pd.Series) -> float:
    s = s[np.isfinite(s.to_numpy())]
    if len(s) < 3:
        return math.nan
    x = s.index.to_numpy(dtype=float)
    return float(np.polyfit(x - x.mean(), s.to_numpy(dtype=float), 1)[0] * 100)


def _window(s: pd.Series, lo: int, hi: int) -> pd.Series:
    return s[(s.index >= lo) & (s.index < hi)]


def features(df: pd.DataFrame, at: int, loops: int, n_layer: int, d_model: int) -> dict:
    """The features at step `at` (from rows with step < at) of one run's metrics table."""
    W = max(2, min(100, at // 2))
    lo = at - W
    final = _window(series(df, M.RESID_NORM_LOOP_END, loop=loops), lo, at)
    first = _window(series(df, M.RESID_NORM_LOOP_END, loop=1), lo, at)
    g = _window(series(df, M.GRAD_NORM), lo, at)
    g = g[np.isfinite(g.to_numpy()) & (g.to_numpy() > 0)]
    cos = _window(series(df, M.GRAD_COSINE), lo, at)
    cos = cos[np.isfinite(cos.to_numpy())]
    a_first = _window(series(df, M.ACT_GRAD_NORM, loop=1, layer=1), lo, at)
    a_last = _window(series(df, M.ACT_GRAD_NORM, loop=loops, layer=n_layer), lo, at)
    loss = series(df, M.LOSS)
    loss = loss[loss.index < at]
    smooth = loss.rolling(SMOOTH, min_periods=1).mean()

    def log_mean(s):
        v = s.to_numpy(dtype=float)
        v = v[np.isfinite(v) & (v > 0)]
        return float(np.log10(v.mean())) if len(v) else math.nan

    out = dict(
        resid_level=log_mean(final) - 0.5 * math.log10(d_model) if len(final) else math.nan,
        resid_growth=_slope_per_100(np.log10(final.clip(lower=1e-30))) if len(final) else math.nan,
        loop_ratio=log_mean(final) - log_mean(first) if len(final) and len(first) else math.nan,
        grad_cv=float(g.std(ddof=0) / g.mean()) if len(g) > 1 else math.nan,  # population std, as osc cv
        grad_dlog=float(np.abs(np.diff(np.log(g.to_numpy()))).mean()) if len(g) > 1 else math.nan,
        grad_cos=float(cos.mean()) if len(cos) else math.nan,
        act_grad_decay=log_mean(a_first) - log_mean(a_last) if len(a_first) and len(a_last) else math.nan,
        loss_slope=_slope_per_100(_window(loss, lo, at)),
        loss_climb=float(smooth.iloc[-1] - smooth.cummin().iloc[-1]) if len(smooth) else math.nan,
    )
    return {k: (v if v is None or math.isfinite(v) else math.nan) for k, v in out.items()}


def run_features(run_dir: Path, at: int) -> dict:
    cfg = load_config(run_dir)
    m = cfg["model"]
    return features(load_metrics(run_dir), at, m["loops"], m["n_layer"], m["n_embd"])


FAILS = ("unstable", "collapsed", "diverged")
# target -> (the final verdicts it counts, whether a loss climb that recovered counts too)
TARGETS = {"fails": (FAILS, False),      # the run ends not stable (default)
           "collapse": (COLLAPSE, False),  # the run ends collapsed or diverged
           "climbs": (FAILS, True)}        # ... or its loss climbed and recovered (transient_rebound)


def label(summary: dict, kind: str = "fails") -> int:
    verdicts, rebound = TARGETS[kind]
    return int(summary.get("verdict") in verdicts
               or rebound and bool((summary.get("evidence") or {}).get("transient_rebound")))


def target_text(kind: str) -> str:
    verdicts, rebound = TARGETS[kind]
    return f"final verdict in {', '.join(verdicts)}" + (
        ", or a loss climb that recovered (the verdict's transient_rebound)" if rebound else "")


# --------------------------------------------------------------------------- the model

def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1.0,
                 weights: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Coefficients and intercept maximising sum_i weight_i log-likelihood_i - l2/2 |w|^2 (intercept
    unpenalised; weights 1 unless given)."""
    from scipy.optimize import minimize
    c = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)

    def loss(theta):
        w, b = theta[:-1], theta[-1]
        z = X @ w + b
        nll = np.sum(c * (np.logaddexp(0, z) - y * z)) + 0.5 * l2 * w @ w
        r = c * (_sigmoid(z) - y)
        grad = np.concatenate([X.T @ r + l2 * w, [np.sum(r)]])
        return nll, grad

    res = minimize(loss, np.zeros(X.shape[1] + 1), jac=True, method="L-BFGS-B")
    return res.x[:-1], float(res.x[-1])


def class_weights(y: np.ndarray, kind: str = "balanced") -> np.ndarray:
    """Per-run weights: "none" = 1 each; "balanced" = n / (2 n_class), so each class weighs n / 2."""
    if kind not in CLASS_WEIGHTS:
        raise ValueError(f"class weight must be one of {', '.join(CLASS_WEIGHTS)}, got {kind!r}")
    y = np.asarray(y, dtype=float)
    n, pos = len(y), float(y.sum())
    if kind == "none" or pos in (0.0, float(n)):
        return np.ones(n)
    return np.where(y == 1, n / (2 * pos), n / (2 * (n - pos)))


def design(rows: list[dict], features: list[str], mean=None,
           std=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    X = np.array([[r.get(f, math.nan) for f in features] for r in rows], dtype=float).reshape(len(rows), len(features))
    if mean is None:
        mean = np.nanmean(np.where(np.isfinite(X), X, np.nan), axis=0) if len(X) else np.zeros(len(features))
        mean = np.where(np.isfinite(mean), mean, 0.0)
        std = np.nanstd(X, axis=0) if len(X) else np.ones(len(features))
        std = np.where(np.isfinite(std) & (std > 1e-12), std, 1.0)
    Z = (X - mean) / std
    Z = np.where(np.isfinite(Z), Z, 0.0)  # a missing feature counts as the training mean
    return Z, np.asarray(mean, float), np.asarray(std, float)


def labelled_runs(sources) -> list[Path]:
    """Finished runs (summary.json) of the given run or sweep folders."""
    out = []
    for src in sources:
        out += [d for d in run_dirs(Path(src)) if load_summary(d) is not None]
    return out


def training_runs(sources) -> list[Path]:
    """Finished runs whose verdict is an outcome: a run ended by --stop-on-collapse carries a prediction
    as its verdict, and fitting on it would teach the predictor its own guesses."""
    return [d for d in labelled_runs(sources) if not load_summary(d).get("prediction")]


def cell_identity(run_dir: Path) -> tuple:
    """What makes two runs the same experiment apart from their length: variant, K, depth, width, seed,
    lr scale. (A cell trained for 800 and for 2,000 steps has the same first 800 steps.)"""
    m, t = (cfg := load_config(run_dir))["model"], cfg["train"]
    return m["variant"], m["loops"], m["n_layer"], m["n_embd"], t["seed"], t["lr_scale"]


def training_examples(sources, steps, target: str = "fails") -> list[dict]:
    """Per usable run (`training_runs`): its folder, summary, label, cell identity, and its features at
    every step of `steps` it ran past: what `fit` and `cross_validate` share (computed once)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    runs = training_runs(sources)
    if not runs:
        raise ValueError("no finished runs to fit on")
    out = []
    for d in runs:
        s = load_summary(d)
        out.append(dict(run=d, summary=s, y=label(s, target), identity=cell_identity(d),
                        feats={at: run_features(d, at) for at in steps if s.get("steps_done", 0) > at}))
    return out


def _fit_step(examples: list[dict], at: int, l2: float, features: list[str], class_weight: str) -> dict | None:
    usable = [e for e in examples if at in e["feats"]]
    if not usable:
        return None
    y = np.array([e["y"] for e in usable], dtype=float)
    Z, mean, std = design([e["feats"][at] for e in usable], features)
    w, b = fit_logistic(Z, y, l2, class_weights(y, class_weight))
    p = _sigmoid(Z @ w + b)
    return dict(mean=mean.tolist(), std=std.tolist(), coef=w.tolist(), intercept=b, runs=len(usable),
                positives=int(y.sum()), train_accuracy=float(((p >= 0.5) == (y == 1)).mean()))


def _both_kinds(examples: list[dict], at: int) -> bool:
    """Whether the runs that ran past step `at` include one with the target and one without."""
    return len({e["y"] for e in examples if at in e["feats"]}) == 2


def _nothing_to_fit(examples: list[dict], steps, target: str) -> str:
    """Why no step of `steps` can be fitted (one line)."""
    labels = {e["y"] for e in examples}
    if len(labels) == 1:
        kind = "has" if labels == {1} else "does not have"
        return (f"every one of the {len(examples)} finished runs {kind} the target {target} "
                f"({target_text(target)}); a predictor needs runs of both kinds")
    longest = max((e["summary"].get("steps_done", 0) for e in examples), default=0)
    if not any(e["feats"] for e in examples):
        return (f"no finished run ran past any step of --at ({', '.join(map(str, steps))}); the longest ran "
                f"{longest} steps")
    return (f"at no step of --at ({', '.join(map(str, steps))}) do the runs that ran past it include runs with "
            f"and without the target {target}")


def check_features(features) -> list[str]:
    features = list(features)
    unknown = [f for f in features if f not in FEATURES]
    if unknown or not features or len(set(features)) < len(features):
        raise ValueError(f"features must be distinct names among {', '.join(FEATURES)}"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return features


def fit(sources, steps=DEFAULT_STEPS, l2: float = 1.0, command: str = "", target: str = "fails",
        examples: list[dict] | None = None, features=DEFAULT_FEATURES, class_weight: str = "balanced") -> dict:
    """Fit one model per step from the finished runs of `sources` (run or sweep folders), or from their
    `training_examples` when given. target: a key of TARGETS ("fails", "collapse", "climbs");
    features: a subset of FEATURES; class_weight: "balanced" or "none" (`class_weights`)."""
    features = check_features(features)
    class_weights([], class_weight)  # a wrong name fails before any run is read
    examples = training_examples(sources, steps, target) if examples is None else examples
    models = {str(s): m for s in steps
              if _both_kinds(examples, s) and (m := _fit_step(examples, s, l2, features, class_weight)) is not None}
    if not models:  # a predictor without a model (or one that can only say one thing) is refused here
        raise ValueError(_nothing_to_fit(examples, steps, target))
    return dict(features=features, models=models, threshold=0.5, l2=l2, class_weight=class_weight,
                window="min(100, s // 2) steps before s", target=target, label=target_text(target),
                fitted_on=[str(s) for s in sources], runs=[str(e["run"]) for e in examples], command=command)


def cross_validate(sources, steps=DEFAULT_STEPS, l2: float = 1.0, target: str = "fails",
                   examples: list[dict] | None = None, features=DEFAULT_FEATURES,
                   class_weight: str = "balanced") -> pd.DataFrame:
    """Leave-one-cell-out agreement: every run is predicted at every step by a model fitted on the
    other cells only (runs with the same cell identity, e.g. one cell trained for two lengths, are
    left out together). Columns as `predict_sweep`'s, plus `step` and `run` (the folder)."""
    features = check_features(features)
    examples = training_examples(sources, steps, target) if examples is None else examples
    rows = []
    for at in steps:
        for identity in dict.fromkeys(e["identity"] for e in examples):
            held = [e for e in examples if e["identity"] == identity and at in e["feats"]]
            m = _fit_step([e for e in examples if e["identity"] != identity], at, l2, features,
                          class_weight) if held else None
            if m is None:
                continue
            predictor = dict(features=features, threshold=0.5, target=target, models={str(at): m})
            rows += [_prediction_row(e["run"], e["summary"], predictor, e["feats"][at], at)
                     | dict(step=at, run=str(e["run"])) for e in held]
    return pd.DataFrame(rows, columns=COLUMNS + ["step", "run"])


def load_predictor(path=None) -> dict:
    """A predictor JSON (None: the packaged one), checked field by field (flt_diag.analysis.files): a
    predictor without means, with a text coefficient or a threshold outside (0, 1) is one line. An
    empty name is an error, not the packaged predictor."""
    from flt_diag.analysis.files import load_predictor as load_checked
    return load_checked(PACKAGED if path is None else path)


def model_at(predictor: dict, step: int) -> tuple[int, dict] | None:
    fitted = sorted(int(s) for s in predictor["models"])
    usable = [s for s in fitted if s <= step]
    return (usable[-1], predictor["models"][str(usable[-1])]) if usable else None


def probability(predictor: dict, feats: dict, step: int) -> tuple[float, list[tuple[str, float]]]:
    """P(collapse) at `step` and each feature's contribution to the logit (largest first)."""
    found = model_at(predictor, step)
    if found is None:
        raise ValueError(f"the predictor is fitted from step {min(map(int, predictor['models']))} on; "
                         f"step {step} is too early")
    _, m = found
    names = predictor["features"]
    Z, _, _ = design([feats], names, np.array(m["mean"]), np.array(m["std"]))
    contrib = Z[0] * np.array(m["coef"])
    p = float(_sigmoid(contrib.sum() + m["intercept"]))
    return p, sorted(zip(names, contrib.tolist()), key=lambda t: -abs(t[1]))


def evidence_text(feats: dict, contributions: list[tuple[str, float]], n: int = 3) -> str:
    return ", ".join(f"{name} {feats[name]:.3g} ({c:+.2f})" for name, c in contributions[:n]
                     if feats.get(name) is not None and math.isfinite(feats[name]))


COLUMNS = ["cell", "variant", "loops", "seed", "lr_scale", "p_collapse", "predicted", "verdict", "actual", "agree",
           "false_alarm", "miss", "evidence"]


def _scored(run_dir: Path, summary: dict, predictor: dict, predicted: bool) -> dict:
    """The fields every row of a prediction table has: the cell, its final verdict, and how the
    prediction fares against the predictor's target."""
    actual = bool(label(summary, predictor.get("target", "collapse")))
    return dict(cell=run_dir.name, variant=summary.get("variant"), loops=summary.get("loops"),
                seed=summary.get("seed"), lr_scale=summary.get("lr_scale"), verdict=summary.get("verdict"),
                actual=actual, agree=predicted == actual, false_alarm=predicted and not actual,
                miss=actual and not predicted)


def _prediction_row(run_dir: Path, summary: dict, predictor: dict, feats: dict, at: int) -> dict:
    """One run's prediction at `at` beside its final verdict (a row of `predict` / `cross_validate`)."""
    p, contrib = probability(predictor, feats, at)
    predicted = bool(p >= predictor.get("threshold", 0.5))
    return _scored(run_dir, summary, predictor, predicted) | dict(
        p_collapse=p, predicted=predicted, evidence=evidence_text(feats, contrib))


def predict_sweep(path, at: int, predictor: dict) -> pd.DataFrame:
    """Per finished cell: P(collapse) at step `at`, the prediction, the final verdict, agreement."""
    rows = [_prediction_row(d, s, predictor, run_features(d, at), at)
            for d in labelled_runs([path]) if (s := load_summary(d)).get("steps_done", 0) > at]
    return pd.DataFrame(rows, columns=COLUMNS)


CHECK_EVERY = 25  # steps between two online checks (CollapseWarning and its replay, `first_warning`)


def first_warning(df: pd.DataFrame, predictor: dict, loops: int, n_layer: int, d_model: int, steps_done: int,
                  every: int = CHECK_EVERY, threshold: float | None = None) -> dict:
    """Replay of the online warning on a recorded run: the checks `--warn` makes (every `every` steps
    from the predictor's first fitted step), the first step where P reaches the threshold (None if
    never), that P and its evidence, and the largest P of all checks."""
    threshold = predictor.get("threshold", 0.5) if threshold is None else threshold
    first = min(int(s) for s in predictor["models"])
    start = -(-first // every) * every  # the first multiple of `every` at or after the first fitted step
    checks = range(start, steps_done + 1, every)
    p_max, out = 0.0, dict(warned_at=None, p_warn=math.nan, evidence="")
    for at in checks:
        feats = features(df, at, loops, n_layer, d_model)
        p, contrib = probability(predictor, feats, at)
        p_max = max(p_max, p)
        if p >= threshold and out["warned_at"] is None:
            out = dict(warned_at=at, p_warn=p, evidence=evidence_text(feats, contrib))
    return out | dict(p_max=p_max, checks=len(checks))


def online_sweep(path, predictor: dict) -> pd.DataFrame:
    """Per finished cell: what `--warn` would have said over the whole run (first warning step, its P and
    evidence, the largest P), beside the final verdict; `onset` is the step of the smoothed loss's minimum
    before a collapse (collapsed runs), so `onset - warned_at` is the warning's lead."""
    rows = []
    for d in labelled_runs([path]):
        s, m = load_summary(d), load_config(d)["model"]
        w = first_warning(load_metrics(d), predictor, m["loops"], m["n_layer"], m["n_embd"], s.get("steps_done", 0))
        onset = (s.get("evidence") or {}).get("min_step") if s.get("verdict") == "collapsed" else None
        rows.append(_scored(d, s, predictor, w["warned_at"] is not None) | dict(
            warned_at=w["warned_at"], p_warn=w["p_warn"], p_max=w["p_max"], onset=onset, evidence=w["evidence"]))
    return pd.DataFrame(rows, columns=["cell", "variant", "loops", "seed", "lr_scale", "warned_at", "p_warn", "p_max",
                                       "verdict", "onset", "actual", "agree", "false_alarm", "miss", "evidence"])


def agreement(table: pd.DataFrame) -> dict:
    n = len(table)
    return dict(cells=n, accuracy=float(table.agree.mean()) if n else math.nan,
                false_alarms=int(table.false_alarm.sum()), misses=int(table.miss.sum()),
                positives=int(table.actual.sum()) if n else 0)


def draw_agreement(curves: dict[str, list[dict]], runs: str | None = None):
    """Agreement of the prediction at step s with the final verdict, against s: one line per set of
    runs (e.g. "fitted on", "held out") or per predictor on the same `runs`, from `agreement` dicts
    that carry their "step"."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5.6, 3.6 + 0.25 * len(curves)), layout="constrained")
    ax = fig.subplots()
    styles = ["-", "--", ":", "-."]
    for (name, rows), ls in zip(curves.items(), styles):
        rows = sorted(rows, key=lambda r: r["step"])
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["accuracy"] for r in rows], ls=ls, marker="o", color="#000000",
                label=f"{name}: agreement ({rows[0]['cells'] if rows else 0} runs)")
        ax.plot(steps, [r["false_alarms"] / max(r["cells"], 1) for r in rows], ls=ls, marker="^", color="#d55e00",
                label=f"{name}: false alarms")
        ax.plot(steps, [r["misses"] / max(r["cells"], 1) for r in rows], ls=ls, marker="v", color="#0072b2",
                label=f"{name}: misses")
    ax.set_xlabel("step s of the prediction")
    ax.set_ylabel("share of runs")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3 if len(curves) == 1 else 1, fontsize=7, frameon=False)
    fig.suptitle("early warning: prediction at step s vs the final verdict" + (f"\non {runs}" if runs else ""),
                 fontsize=9, fontweight="bold")
    return fig


# --------------------------------------------------------------------------- online

class CollapseWarning(Callback):
    """Checks P(collapse) every `every` steps from the predictor's first fitted step on; the first
    time it reaches the threshold, prints a warning with the evidence, and with `stop` ends the run
    there (verdict collapsed, predicted at that step). Keeps the few series the features need: the
    global ones (GLOBAL), the first and last loop's residual norm, the activation gradient at the first
    and the last block. Added to a run that resumes without its state (`--warn` may change on reuse),
    it reads the series of the steps already trained back from the run's metrics table."""

    GLOBAL = (M.LOSS, M.GRAD_NORM, M.GRAD_COSINE)

    def __init__(self, predictor: dict, stop: bool = False, threshold: float | None = None, every: int = CHECK_EVERY,
                 say=None):
        self.predictor, self.stop, self.every = predictor, stop, every
        self.threshold = predictor.get("threshold", 0.5) if threshold is None else threshold
        self.rows: list[tuple] = []
        self.warned_at: int | None = None
        self.say = say or (lambda text: print(text, file=__import__("sys").stderr, flush=True))
        self.first = min(int(s) for s in predictor["models"])
        self.restored = False

    def on_start(self, trainer) -> None:
        m = trainer.cfg.model
        self.loops, self.n_layer, self.d = m.loops, m.n_layer, m.n_embd
        self.label = f"{m.variant} K={m.loops}"
        if getattr(trainer, "start_step", 0) and not self.restored:
            stored = load_metrics(trainer.run_dir, [*self.GLOBAL, M.RESID_NORM_LOOP_END, M.ACT_GRAD_NORM])
            stored = stored[stored.step < trainer.start_step]
            self._keep((int(step), str(metric), int(loop), int(layer), float(v)) for step, metric, loop, layer, v in
                       stored.itertuples(index=False, name=None))

    def _keep(self, rows) -> None:
        keep = {(M.RESID_NORM_LOOP_END, 1), (M.RESID_NORM_LOOP_END, self.loops)}
        for r in rows:
            if r[1] in self.GLOBAL or (r[1], r[2]) in keep or (
                    r[1] == M.ACT_GRAD_NORM and (r[2], r[3]) in ((1, 1), (self.loops, self.n_layer))):
                self.rows.append(tuple(r))

    def on_rows(self, trainer, step: int, rows: list[tuple]) -> None:
        self._keep(rows)
        done = step + 1
        if self.warned_at is not None or done < self.first or done % self.every:
            return
        df = pd.DataFrame(self.rows, columns=["step", "metric", "loop", "layer", "value"])
        feats = features(df, done, self.loops, self.n_layer, self.d)
        p, contrib = probability(self.predictor, feats, done)
        if p >= self.threshold:
            self.warned_at = done
            text = evidence_text(feats, contrib)
            self.say(f"warning: {self.label}: collapse predicted at step {done} (P={p:.2f}; {text})")
            if self.stop:
                trainer.request_stop(f"collapse predicted at step {done}",
                                     prediction=dict(step=done, p_collapse=p, evidence=text, features=feats))

    def state_dict(self) -> dict:
        return {"rows": list(self.rows), "warned_at": self.warned_at}

    def load_state_dict(self, state: dict) -> None:
        self.rows, self.warned_at = [tuple(r) for r in state["rows"]], state["warned_at"]
        self.restored = True
