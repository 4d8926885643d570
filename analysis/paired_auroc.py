"""The refit against the config-only prior, paired, with configurations resampled; and exact permutation p-values
of one score within a set (issue 40, item 5). Reads committed tables only: pandas, numpy, scipy and flt-diag's
torch-free layers (its AUROC); no torch, no run folder.

    python analysis/paired_auroc.py docs/data/warning-eval-w4/rows.csv                  # the paired table
    python analysis/paired_auroc.py docs/data/warning-eval-w4/rows.csv \
        --exact "exit-loss gap (final - best loop)" --where variant=lt loops=8           # exact p, one set

Paired table. ROWS is an `analysis/evaluate_warning.py` rows.csv (one row per run and scored step: the
configuration, the label `failed`, the early-warning features). At each step, every run's out-of-fold
P(fail) under configuration-grouped cross-validation (each (variant, loops, depth, width, lr_scale)
configuration predicted from a fit on the others) of

    refit   the packaged predictor's recipe refitted: class-balanced, L2 (1.0) logistic regression on
            grad_dlog and loss_climb, columns standardised and missing values filled from the training rows only
            (`--features` for another set, e.g. the eight of "refit, 8 features")
    prior   the same fitter on the configuration alone: one-hot variant, K, depth, log2 lr scale

(flt_diag.results.warning_evaluation's procedure, written again here: of flt_diag only its AUROC is imported;
tests/test_paired_auroc.py checks it against the committed comparison.csv). Then the AUROC of each, their
difference refit - prior, and its 95 % percentile interval over DRAWS cluster-bootstrap draws: configurations
drawn with replacement, every run of a drawn configuration kept, both AUROCs computed on the same draw (paired);
draws with one outcome only are skipped and counted. The out-of-fold scores are computed once and held fixed:
the interval is over which configurations are evaluated, not over the fits.

Exact p (`--exact SCORE`): among the rows meeting every `--where` KEY=V[,V2] (and, where the table has a step
column, at each step), the share of all C(n, k) ways to place the k failures among the n runs whose AUROC is at
least the observed one (one-sided: failures score higher). When all k failures rank first this is 1 / C(n, k).
Rows without the score are left out. Any CSV with a `failed` column works (e.g. docs/data/loop-dynamics-*.csv).
"""
from __future__ import annotations

import itertools
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import minimize

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # (a checkout)

from flt_diag.results.warning_evaluation import auroc  # noqa: E402  (torch-free: the one AUROC of the project)
from flt_diag.storage.files import read_table  # noqa: E402
from script_exit import Parser, guarded, whole  # noqa: E402  (analysis/script_exit.py: the one error path)

CONFIG = ["variant", "loops", "depth", "width", "lr_scale"]
RECIPE = ["grad_dlog", "loss_climb"]  # the packaged predictor's features (docs/data/early_warning_v4.json)
L2 = 1.0
EXACT_LIMIT = 2_000_000  # labelings enumerated at most
MAX_ROWS_BYTES = 256 << 20  # a rows.csv of hundreds of runs is a megabyte or two
TIE_BITS = 40  # out-of-fold probabilities to 40 mantissa bits (~1e-12 relative): closer ones tie (out_of_fold)


# --------------------------------------------------------------------------- statistics

def exact_p(y, score) -> tuple[float, int]:
    """One-sided exact permutation p of the AUROC: the share of the C(n, k) placements of the k failures among
    the n runs whose AUROC is >= the observed one; and C(n, k)."""
    y, score = np.asarray(y, bool), np.asarray(score, float)
    n, k = len(y), int(y.sum())
    total = math.comb(n, k)
    if not 0 < k < n:
        return math.nan, total
    if total > EXACT_LIMIT:
        raise ValueError(f"C({n}, {k}) = {total} placements: too many to enumerate")
    observed = auroc(y, score)
    hits = 0
    for placed in itertools.combinations(range(n), k):
        perm = np.zeros(n, bool)
        perm[list(placed)] = True
        hits += auroc(perm, score) >= observed - 1e-12
    return hits / total, total


# --------------------------------------------------------------------------- models under grouped CV

def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def _fit_logistic(X, y, weights):
    def loss(theta):
        w, b = theta[:-1], theta[-1]
        z = X @ w + b
        r = weights * (_sigmoid(z) - y)
        return (np.sum(weights * (np.logaddexp(0, z) - y * z)) + 0.5 * L2 * w @ w,
                np.concatenate([X.T @ r + L2 * w, [np.sum(r)]]))
    theta = minimize(loss, np.zeros(X.shape[1] + 1), jac=True, method="L-BFGS-B").x
    return theta[:-1], theta[-1]


def fit_predict(X_train, y_train, X_test) -> np.ndarray:
    """Class-balanced (each class weighs n / 2), L2-penalised logistic regression on columns standardised by the
    training rows' mean and spread (of the values present); a missing value on either side is the training mean."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        finite = np.where(np.isfinite(X_train), X_train, np.nan)
        mean, std = np.nan_to_num(np.nanmean(finite, axis=0)), np.nanstd(finite, axis=0)
    std = np.where(np.isfinite(std) & (std > 1e-12), std, 1.0)
    X_train = np.where(np.isfinite(X_train), X_train, mean)
    X_test = np.where(np.isfinite(X_test), X_test, mean)
    if y_train.min() == y_train.max():
        return np.full(len(X_test), float(y_train[0]))
    n, pos = len(y_train), y_train.sum()
    weights = np.where(y_train == 1, n / (2 * pos), n / (2 * (n - pos)))
    w, b = _fit_logistic((X_train - mean) / std, y_train, weights)
    return _sigmoid(((X_test - mean) / std) @ w + b)


def config_keys(table: pd.DataFrame) -> np.ndarray:
    return table[CONFIG].astype(str).agg("|".join, axis=1).to_numpy()


def prior_matrix(table: pd.DataFrame) -> np.ndarray:
    variants = sorted(table.variant.unique())
    onehot = np.stack([(table.variant == v).to_numpy(float) for v in variants], axis=1)
    numeric = np.stack([table.loops.to_numpy(float), table.depth.to_numpy(float),
                        np.log2(table.lr_scale.to_numpy(float))], axis=1)
    return np.concatenate([onehot, numeric], axis=1)


def out_of_fold(table: pd.DataFrame, X: np.ndarray) -> np.ndarray:
    """Every row's P(fail) from a fit on the other configurations (one step's rows), its mantissa to TIE_BITS bits:
    probabilities equal but for their last bits (1-2 ulp apart: ordered one way on one CPU and the other way on
    another) tie on every machine, as in flt_diag.results.warning_evaluation."""
    y, keys = table.failed.to_numpy(float), config_keys(table)
    out = np.full(len(table), math.nan)
    for key in np.unique(keys):
        test = keys == key
        if (~test).any():
            out[test] = fit_predict(X[~test], y[~test], X[test])
    mantissa, exponent = np.frexp(out)
    return np.ldexp(np.round(mantissa * 2.0 ** TIE_BITS) / 2.0 ** TIE_BITS, exponent)


def scores(table: pd.DataFrame, features: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(refit, prior) out-of-fold scores of one step's rows."""
    X = table.reindex(columns=features).to_numpy(float)
    return out_of_fold(table, X), out_of_fold(table, prior_matrix(table))


# --------------------------------------------------------------------------- the paired bootstrap

def cluster_draws(keys: np.ndarray, draws: int, seed: int):
    """Row indices of each draw: the configurations drawn with replacement, all rows of each drawn one."""
    groups = [np.flatnonzero(keys == k) for k in np.unique(keys)]
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        picked = rng.integers(0, len(groups), len(groups))
        yield np.concatenate([groups[g] for g in picked])


def paired(y, refit, prior, keys, draws: int = 2000, seed: int = 0) -> dict:
    """AUROC of refit and prior, their difference, and its percentile 95 % interval over cluster draws."""
    y = np.asarray(y, bool)
    diffs, skipped = [], 0
    for idx in cluster_draws(keys, draws, seed):
        if y[idx].all() or not y[idx].any():
            skipped += 1
            continue
        diffs.append(auroc(y[idx], refit[idx]) - auroc(y[idx], prior[idx]))
    diffs = np.asarray(diffs)
    a, b = auroc(y, refit), auroc(y, prior)
    lo, hi = (np.quantile(diffs, [0.025, 0.975]) if len(diffs) else (math.nan, math.nan))
    return dict(runs=len(y), failing=int(y.sum()), configurations=len(np.unique(keys)), refit=a, prior=b,
                difference=a - b, lo=float(lo), hi=float(hi),
                share_refit_better=float((diffs > 0).mean()) if len(diffs) else math.nan,
                draws_used=len(diffs), draws_skipped=skipped)


def paired_table(rows: pd.DataFrame, steps, features, draws: int, seed: int) -> pd.DataFrame:
    out = []
    for step in steps:
        at = rows[rows.step == step].reset_index(drop=True)
        if at.empty:
            continue
        refit, prior = scores(at, features)
        out.append(dict(step=step) | paired(at.failed.to_numpy(), refit, prior, config_keys(at), draws, seed))
    return pd.DataFrame(out)


def markdown(table: pd.DataFrame) -> str:
    lines = ["| step | runs (failing), configurations | refit AUROC | prior AUROC | refit - prior [95 %] "
             "| draws with refit > prior | draws used (one outcome: skipped) |",
             "|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        lines.append(f"| {r.step} | {r.runs} ({r.failing}), {r.configurations} | {r.refit:.2f} | {r.prior:.2f} "
                     f"| {r.difference:+.2f} [{r.lo:+.2f}, {r.hi:+.2f}] | {r.share_refit_better:.1%} "
                     f"| {r.draws_used} ({r.draws_skipped}) |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command

def checked_rows(rows: pd.DataFrame, name, columns: list[str]) -> pd.DataFrame:
    """The table, refused (one line) unless `failed` holds only 0/1 (True/False) on every row and each of
    `columns` (the configuration, the step) is filled on every row, the numeric ones with finite numbers (a
    positive lr_scale): an empty cell would be read as a failure, or as a configuration of its own."""
    failed = pd.to_numeric(rows["failed"].map({True: 1, False: 0, "True": 1, "False": 0}).fillna(rows["failed"]),
                           errors="coerce")
    if rows.empty or not failed.isin([0, 1]).all():
        raise ValueError(f"{name}: `failed` must be 0 or 1 on every row" if len(rows) else f"{name} has no rows")
    for c in columns:
        values = rows[c]
        if values.isna().any() or (values.astype(str).str.strip() == "").any():
            raise ValueError(f"{name}: column {c!r} is empty on {int(values.isna().sum())} row(s); it must be filled")
        if c != "variant":
            number = pd.to_numeric(values, errors="coerce")
            if not np.isfinite(number.to_numpy(float)).all() or (c == "lr_scale" and (number <= 0).any()):
                raise ValueError(f"{name}: column {c!r} must hold finite numbers{' above 0' * (c == 'lr_scale')}")
    return rows.assign(failed=failed.astype(int))


def select(table: pd.DataFrame, conditions: list[str]) -> pd.DataFrame:
    mask = np.ones(len(table), bool)
    for cond in conditions:
        key, sep, values = cond.partition("=")
        if not sep or key not in table:
            raise ValueError(f"--where {cond!r}: give KEY=V[,V2] with KEY a column of the table")
        column = table[key]
        any_of = np.zeros(len(table), bool)
        for v in values.split(","):
            any_of |= column.astype(str).to_numpy() == v
            try:
                any_of |= pd.to_numeric(column, errors="coerce").to_numpy() == float(v)
            except ValueError:
                pass
        mask &= any_of
    return table[mask]


def filled(table: pd.DataFrame, columns: list[str], name) -> None:
    """Each of `columns` holds a finite number somewhere in `table` (missing values are allowed, and left out or
    filled as documented, but a column with none would score every run alike: NaN or 0.5 AUROCs)."""
    for c in columns:
        if c not in table:
            raise ValueError(f"no column {c!r} in {name}")
        if not np.isfinite(pd.to_numeric(table[c], errors="coerce").to_numpy(float)).any():
            raise ValueError(f"{name}: column {c!r} holds no number in the rows selected")


def exact_lines(table: pd.DataFrame, score: str) -> list[str]:
    lines = ["| step | runs (failing) | AUROC | exact one-sided p | 1 / C(n, k) |", "|---|---|---|---|---|"]
    for step, at in (table.groupby("step") if "step" in table else [("-", table)]):
        at = at[np.isfinite(at[score].to_numpy(float))]
        y, s = at.failed.to_numpy(bool), at[score].to_numpy(float)
        p, total = exact_p(y, s)
        lines.append(f"| {step} | {len(y)} ({int(y.sum())}) | {auroc(y, s):.2f} | {p:.3f} | 1/{total} = {1 / total:.3f} |")
    return lines


@guarded
def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=Path, help="a rows.csv of analysis/evaluate_warning.py (or, with --exact, any CSV "
                                            "with a `failed` column)")
    ap.add_argument("--steps", nargs="+", type=whole(1), default=[100, 200, 300, 500])
    ap.add_argument("--features", nargs="+", default=RECIPE, help="the refit's features (default: %(default)s)")
    ap.add_argument("--draws", type=whole(1, 1_000_000), default=2000)
    ap.add_argument("--seed", type=whole(0, 2 ** 63 - 1), default=0)
    ap.add_argument("--exact", metavar="SCORE", help="print the exact permutation p of this column instead")
    ap.add_argument("--where", nargs="+", default=[], metavar="KEY=V", help="with --exact: the set's rows")
    args = ap.parse_args(argv)
    # a regular file (a FIFO, a device, a folder: one line, never read), at most MAX_ROWS_BYTES
    rows = read_table(args.rows, MAX_ROWS_BYTES, "a table of runs (CSV)")
    if "failed" not in rows:
        raise ValueError(f"{args.rows} has no `failed` column")
    if args.exact:
        sel = select(checked_rows(rows, args.rows, ["step"] if "step" in rows else []), args.where)
        if "step" in sel:
            sel = sel[sel.step.isin(args.steps)]
        if sel.empty:
            raise ValueError(f"no row of {args.rows} meets {' '.join(args.where) or 'the steps given'}")
        filled(sel, [args.exact], args.rows)
        print("\n".join(exact_lines(sel, args.exact)))
        return 0
    missing = [c for c in [*CONFIG, "step", *args.features] if c not in rows]
    if missing:
        raise ValueError(f"{args.rows} lacks the columns {', '.join(missing)}")
    rows = checked_rows(rows, args.rows, [*CONFIG, "step"])
    filled(rows[rows.step.isin(args.steps)], args.features, args.rows)
    table = paired_table(rows, args.steps, args.features, args.draws, args.seed)
    if table.empty:
        raise ValueError(f"no row of {args.rows} is at the steps {' '.join(map(str, args.steps))}")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
