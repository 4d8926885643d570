"""Fitting the early-warning predictor (`flt-diag fit-predictor`): the class-weighted, L2-penalised
logistic regression of early_warning.py's features on the final verdicts of finished runs, one model
per step, and its leave-one-cell-out cross-validation (numpy/scipy/pandas only; no torch)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import minimize

from flt_diag.judge.early_warning import (COLUMNS, FEATURES, TARGETS, feature_matrix, finished_runs, label,
                                             prediction_row, run_features_at, sigmoid, standardised, target_text)
from flt_diag.storage.file_models import STALL_EVIDENCE, Evidence, ExampleRow, Summary, Verdict
from flt_diag.storage.cells import STORED, RunId
from flt_diag.storage.files import load_examples
from flt_diag.storage.folders import BadFile, atomic_path, load_config
from flt_diag.storage.schema import MAX_ITEMS

from flt_diag.results.fit_settings import DEFAULTS
from flt_diag.storage.predictor_names import CLASS_WEIGHTS

DEFAULT_FEATURES, DEFAULT_STEPS = DEFAULTS.features, DEFAULTS.at  # what `fit-predictor` uses unless told otherwise


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1.0,
                 weights: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Coefficients and intercept maximising sum_i weight_i log-likelihood_i - l2/2 |w|^2 (intercept
    unpenalised; weights 1 unless given)."""
    c = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)

    def loss(theta):
        w, b = theta[:-1], theta[-1]
        z = X @ w + b
        nll = np.sum(c * (np.logaddexp(0, z) - y * z)) + 0.5 * l2 * w @ w
        r = c * (sigmoid(z) - y)
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


def training_runs(sources) -> list[tuple[Path, Summary]]:
    """Finished runs (with their summaries) whose verdict is an outcome: a run ended by --stop-on-collapse
    carries a prediction as its verdict, and fitting on it would teach the predictor its own guesses."""
    return [(d, s) for d, s in finished_runs(sources) if s.prediction is None]


def training_examples(sources, steps, target: str = DEFAULTS.target) -> list[dict]:
    """Per usable run (`training_runs`): its folder, summary, label, identity (RunId: a cell trained for 800 and
    for 2,000 steps is one, with the same first 800 steps), and its features at
    every step of `steps` it ran past: what `fit` and `cross_validate` share (computed once). A source
    ending in .csv is a fit-examples table (`examples_table`) instead of a folder."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    tables = [Path(s) for s in sources if Path(s).suffix == ".csv"]
    folders = [s for s in sources if Path(s).suffix != ".csv"]
    out = [e for t in tables for e in examples_from_rows(load_examples(t), steps, target)]
    for d, s in training_runs(folders):
        cfg = load_config(d)
        out.append(dict(run=d, summary=s, y=label(s, target), identity=RunId.read(cfg.model, cfg.train),
                        feats=run_features_at(d, [at for at in steps if s.steps_done > at])))
    if not out:
        raise ValueError("no finished runs to fit on")
    return out


# --------------------------------------------------------------------------- fit-examples tables

# A fit set as one small file (`--examples-out`; docs/DESIGN.md section 6): refits and audits a predictor without
# the run folders; a run judged before a verdict change is relabelled from its evidence (relabelled()).
EXAMPLE_COLUMNS = list(ExampleRow.model_fields)  # the file model's fields, in its order


def examples_table(examples: list[dict]) -> pd.DataFrame:
    """`training_examples` as a table (EXAMPLE_COLUMNS): one row per run and step it has features at."""
    rows = []
    for e in examples:
        s, evidence = e["summary"], e["summary"].evidence
        run = dict(run=str(e["run"]), **{STORED[k]: v for k, v in e["identity"].row().items()},
                   steps_done=s.steps_done, verdict=s.verdict, climb=evidence.climb, rebound_threshold=evidence.rebound_threshold,
                   transient_rebound=bool(evidence.transient_rebound), verdict_version=s.verdict_version,
                   **{k: getattr(evidence, k) for k in STALL_EVIDENCE})
        rows += [{**run, "step": at, **{f: feats.get(f) for f in FEATURES}} for at, feats in sorted(e["feats"].items())]
    return pd.DataFrame(rows, columns=EXAMPLE_COLUMNS)


def write_examples(path: Path, examples: list[dict]) -> None:
    """The fit-examples table (`fit-predictor --examples-out`), written only if load_examples reads it
    back (at most MAX_ITEMS rows; every value within its field's bounds): checked in its temporary file,
    so a table flt-diag would refuse is never left behind."""
    table = examples_table(examples)
    if len(table) > MAX_ITEMS:
        raise ValueError(f"the fit-examples table would have {len(table):,} rows; one holds at most {MAX_ITEMS:,} "
                         "(fewer --at steps or runs)")
    with atomic_path(path) as tmp:
        table.to_csv(tmp, index=False)
        try:
            load_examples(tmp)
        except BadFile as e:
            raise BadFile(str(e).replace(str(tmp), str(path))) from None


def judged_before_v3(row: ExampleRow | Summary) -> bool:
    """Whether a fit-examples row (or a summary) was judged before verdict v3 (a lower version, or none: a
    table written before the column existed)."""
    return (row.verdict_version or 0) < 3  # (v4 changed rule 4b only; a v3 row's verdict needs no relabelling)


def relabelled(row: ExampleRow) -> Verdict:
    """The run's verdict by v3's loss rules, as far as its row allows (docs/DESIGN.md section 6): an older
    row's `stable` with a loss climb that recovered (transient_rebound) is `unstable`; v3's stall and
    oscillation rules need the run's metrics (`summary --recompute` on the folders)."""
    if not judged_before_v3(row):
        return row.verdict
    return "unstable" if row.verdict == "stable" and row.transient_rebound else row.verdict


def examples_from_rows(rows: list[ExampleRow], steps, target: str) -> list[dict]:
    """The examples of a fit-examples table (rows as load_examples returns them), relabelled; each keeps its
    row's verdict version and evidence, so that a table written from them reads back the same. Its summary
    holds what a row keeps of one (built from the checked row, without the figures a row has not)."""
    runs: dict[str, list[ExampleRow]] = {}
    for r in rows:
        runs.setdefault(r.run, []).append(r)
    out = []
    for run, group in runs.items():
        r = group[0]
        evidence = Evidence.model_construct(climb=r.climb, rebound_threshold=r.rebound_threshold,
                                            transient_rebound=r.transient_rebound,
                                            **{k: getattr(r, k) for k in STALL_EVIDENCE})
        summary = Summary.model_construct(  # type: ignore[call-arg]  # (a partial summary: what the labels read)
            verdict=relabelled(r), verdict_version=r.verdict_version, evidence=evidence, variant=r.variant,
            loops=r.loops, seed=r.seed, lr_scale=r.lr_scale, steps_done=r.steps_done)
        feats = {x.step: {f: (math.nan if getattr(x, f) is None else getattr(x, f)) for f in FEATURES}
                 for x in group if x.step in steps}
        out.append(dict(run=Path(run), summary=summary, y=label(summary, target),
                        identity=RunId.read(r), feats=feats))
    return out


def _fit_step(examples: list[dict], at: int, l2: float, features: list[str], class_weight: str) -> dict | None:
    usable = [e for e in examples if at in e["feats"]]
    if not usable:
        return None
    y = np.array([e["y"] for e in usable], dtype=float)
    Z, mean, std = standardised(feature_matrix([e["feats"][at] for e in usable], features))
    w, b = fit_logistic(Z, y, l2, class_weights(y, class_weight))
    p = sigmoid(Z @ w + b)
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
    longest = max((e["summary"].steps_done for e in examples), default=0)
    if not any(e["feats"] for e in examples):
        return (f"no finished run ran past any step of --at ({', '.join(map(str, steps))}); the longest ran "
                f"{longest} steps")
    return (f"at no step of --at ({', '.join(map(str, steps))}) do the runs that ran past it include runs with "
            f"and without the target {target}")


def uninformative(examples: list[dict], steps, features) -> dict[str, str]:
    """The features that tell no two runs apart at any step of `steps` that has runs of both kinds, with
    why: every value missing (NaN), infinite, the same, or too large to standardise (a spread that
    overflows). A predictor fitted on them would only say one thing."""
    why: dict[str, str] = {}
    fitted = [s for s in steps if _both_kinds(examples, s)]
    for f in features:
        reasons = set()
        for s in fitted:
            x = np.array([e["feats"][s].get(f, math.nan) for e in examples if s in e["feats"]], dtype=float)
            finite = x[np.isfinite(x)]
            with np.errstate(all="ignore"):
                spread = float(np.std(finite)) if len(finite) else math.nan
            reasons.add("missing (NaN)" if np.isnan(x).all() else "infinite" if not len(finite) else
                        "too large to standardise" if not math.isfinite(spread) else
                        "constant" if spread <= 1e-12 * max(1.0, float(np.max(np.abs(finite)))) else "")
        if "too large to standardise" in reasons:  # at any step: its standardised values would overflow the fit
            why[f] = "too large to standardise"
        elif fitted and "" not in reasons:
            why[f] = " or ".join(sorted(reasons))
    return why


def check_features(features) -> list[str]:
    features = list(features)
    unknown = [f for f in features if f not in FEATURES]
    if unknown or not features or len(set(features)) < len(features):
        raise ValueError(f"features must be distinct names among {', '.join(FEATURES)}"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return features


def fit(sources, steps=DEFAULT_STEPS, l2: float = DEFAULTS.l2, command: str = "", target: str = DEFAULTS.target,
        examples: list[dict] | None = None, features=DEFAULT_FEATURES, class_weight: str = DEFAULTS.class_weight) -> dict:
    """Fit one model per step from the finished runs of `sources` (run or sweep folders), or from their
    `training_examples` when given. target: a key of TARGETS ("fails", "collapse", "climbs");
    features: a subset of FEATURES; class_weight: "balanced" or "none" (`class_weights`)."""
    features = check_features(features)
    class_weights([], class_weight)  # type: ignore[arg-type]  # a wrong name fails before any run is read
    examples = training_examples(sources, steps, target) if examples is None else examples
    empty = uninformative(examples, steps, features)
    if len(empty) < len(features):  # a constant feature beside informative ones only gets a zero coefficient
        empty = {f: why for f, why in empty.items() if why != "constant"}
    if empty:
        raise ValueError("feature " + "; ".join(f"{f} is {why}" for f, why in empty.items()) + " at every step of "
                         "--at in these runs, so it carries no information: leave it out with --features")
    models = {str(s): m for s in steps
              if _both_kinds(examples, s) and (m := _fit_step(examples, s, l2, features, class_weight)) is not None}
    if not models:  # a predictor without a model (or one that can only say one thing) is refused here
        raise ValueError(_nothing_to_fit(examples, steps, target))
    return dict(features=features, models=models, threshold=0.5, l2=l2, class_weight=class_weight,
                window="min(100, s // 2) steps before s", target=target, label=target_text(target),
                fitted_on=[str(s) for s in sources], runs=[str(e["run"]) for e in examples], command=command)


def cross_validate(sources, steps=DEFAULT_STEPS, l2: float = DEFAULTS.l2, target: str = DEFAULTS.target,
                   examples: list[dict] | None = None, features=DEFAULT_FEATURES,
                   class_weight: str = DEFAULTS.class_weight) -> pd.DataFrame:
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
            rows += [prediction_row(e["run"], e["summary"], predictor, e["feats"][at], at)
                     | dict(step=at, run=str(e["run"])) for e in held]
    return pd.DataFrame(rows, columns=COLUMNS + ["step", "run"])
