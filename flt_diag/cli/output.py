"""What the commands print beyond flt_diag.cli.console and their own one-line reports (a sweep's model, a map's
plan and boundaries: flt_diag.cli.commands): a sweep's failed cells, eval-loops' lines, the early-warning
predictions and fits, and the command line a fitted predictor records."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from flt_diag.judge.early_warning import CHECK_EVERY, agreement
from flt_diag.results.fit_settings import DEFAULTS
from flt_diag.judge.spike_detectors import DETECTORS


def print_failed_cells(out: Path, n_cells: int, failed: list[str], missing: list[str]) -> None:
    names = failed + missing
    what = " and ".join(x for x in (f"{len(failed)} failed" if failed else "",
                                    f"{len(missing)} did not finish" if missing else "") if x)
    print(f"error: {len(names)} of {n_cells} cells not done ({what}: {', '.join(names[:4])}"
          f"{', ...' if len(names) > 4 else ''}); see {out}/cells/<cell>/error.txt where it exists", file=sys.stderr)


def print_eval_loops(run: Path, df: pd.DataFrame) -> None:
    """One line per run of `flt-diag eval-loops`: the best loss, and the loss (and a task's accuracy) at every count."""
    finite = df[df.val_loss.apply(lambda x: x == x and abs(x) != float("inf"))]
    best = finite.loc[finite.val_loss.idxmin()] if len(finite) else None
    on = f" (on {df.data[0]})" if "data" in df else ""
    line = (f"{run}: trained at K={int(df.trained_loops[0])}{on}; "
            + (f"best val loss {best.val_loss:.3f} at {int(best.loops)} loops; " if best is not None else
               "no finite val loss; ")
            + " ".join(f"{int(k)}:{x:.2f}" for k, x in zip(df.loops, df.val_loss)))
    if df.accuracy.notna().any():
        top = df.loc[df.accuracy.idxmax()]
        line += (f"; best accuracy {top.accuracy:.3f} at {int(top.loops)} loops; "
                 + " ".join(f"{int(k)}:{a:.2f}" for k, a in zip(df.loops, df.accuracy)))
    print(line)


# What the evaluation against baselines found (docs/early-warning.md, issue 34), said wherever the packaged
# predictor's numbers are printed, so that they are not read as more than was measured.
PACKAGED_CAVEAT = ("note: the packaged predictor is not shown to beat a prior that reads only the configuration "
                   "(variant, K, depth, lr scale) on held-out configurations: docs/early-warning.md")


def _verdict_word(r) -> str:
    return "agree" if r.agree else "FALSE ALARM" if r.false_alarm else "MISS"


def _agreement_text(a: dict, target: str) -> str:
    return (f"agreement {a['accuracy']:.0%} over {a['cells']} cells ({a['positives']} with target {target}); "
            f"{a['false_alarms']} false alarms, {a['misses']} misses")


def print_predictions_at(table: pd.DataFrame, step: int, target: str, longest: int = 0,
                         try_at: int | None = None) -> None:
    """`predict --at`: each cell's prediction at `step` beside its final verdict, and the agreement; with no
    cell that ran past `step` (nothing left to predict there), the longest finished cell's steps and `try_at`,
    the predictor's last fitted step before it."""
    if table.empty:
        hint = f" (the longest finished one has {longest}" + (f": try --at {try_at})" if try_at else ")") if longest else ""
        print(f"step {step}: no finished cell has more than {step} steps, so there is nothing left to predict{hint}")
        return
    for r in table.itertuples():
        print(f"{r.cell:28s} step {step}: P({target}) {r.p_collapse:.2f} -> {'WARN' if r.predicted else 'ok':4s} | "
              f"final: {r.verdict:9s} {_verdict_word(r)}  [{r.evidence}]")
    print(f"step {step}: {_agreement_text(agreement(table), target)}")


def print_online(table: pd.DataFrame, target: str) -> None:
    """`predict --online`: where the --warn checks would have warned, beside the final verdict."""
    for r in table.itertuples():
        said = f"warned at step {int(r.warned_at)} (P={r.p_warn:.2f})" if pd.notna(r.warned_at) else "never warned"
        lead = f" (loss minimum at step {r.onset:.0f})" if pd.notna(r.onset) else ""
        print(f"{r.cell:28s} {said:30s} max P {r.p_max:.2f} | final: {r.verdict + lead:9s}  {_verdict_word(r)}"
              + (f"  [{r.evidence}]" if r.evidence else ""))
    if table.empty:
        print("no finished cell")
    else:
        print(f"online (checks every {CHECK_EVERY} steps, whole run): {_agreement_text(agreement(table), target)}")


def print_cross_validation(step: int, a: dict, wrong: dict, target: str) -> None:
    print(f"step {step}: leave-one-cell-out agreement {a['accuracy']:.0%} over {a['cells']} runs "
          f"({a['positives']} with target {target}); {a['false_alarms']} false alarms, {a['misses']} misses"
          + "".join(f"\n  {kind.replace('_', ' ')}: {run}" for kind, runs in wrong.items() for run in runs))


def print_fitted(model: dict, out: Path) -> None:
    for s, m in model["models"].items():
        print(f"step {s}: {m['runs']} runs ({m['positives']} with target {model['target']}), training accuracy "
              f"{m['train_accuracy']:.0%}; " + ", ".join(f"{f} {c:+.2f}" for f, c in zip(model["features"], m["coef"])))
    print(f"predictor: {out}")


def fit_command(o, features: list[str]) -> str:
    """The `flt-diag fit-predictor` command line of these options (FitPredictorOptions; stored in the
    predictor), with the options left at their defaults (the fields') left out."""
    fields = type(o).model_fields

    def changed(name: str) -> bool:
        return getattr(o, name) != fields[name].get_default(call_default_factory=True)
    return "flt-diag fit-predictor " + " ".join(map(str, o.paths)) + f" --out {o.out} --at " \
        + " ".join(map(str, o.at)) + (f" --l2 {o.l2:g}" if changed("l2") else "") \
        + (f" --target {o.target}" if changed("target") else "") \
        + (" --features " + " ".join(features) if features != DEFAULTS.features else "") \
        + (f" --class-weight {o.class_weight}" if changed("class_weight") else "") \
        + (" --cross-validate" if o.cross_validate else "")


def print_detectors(table: pd.DataFrame) -> None:
    """`predict --online`: the loss-spike detectors of other libraries (judge.spike_detectors) on the
    same runs: each one's first warning step, and how often it caught a failing run or warned on a stable one."""
    if table.empty:
        return
    print("baselines on the same runs (documented rules, default settings): Lightning SpikeDetection, "
          "llm-foundry KillLossSpike")

    def said(step, kind=None) -> str:
        return "never" if step is None or pd.isna(step) else f"step {int(step)}" + (f" ({kind})" if kind else "")
    for r in table.itertuples():
        print(f"{r.cell:28s} lightning {said(r.lightning):14s} kill_loss_spike "
              f"{said(r.kill_loss_spike, r.kill_loss_spike_kind):26s} | final: {r.verdict}")
    failing, stable = table[table.fails], table[~table.fails]
    flt = stable[stable.variant == "flt"]
    for k in DETECTORS:
        print(f"{k}: warned on {int(failing[f'{k}_caught'].sum())} of {len(failing)} failing runs; false alarms on "
              f"{int(stable[f'{k}_false_alarm'].sum())} of {len(stable)} stable runs "
              f"({int(flt[f'{k}_false_alarm'].sum())} of {len(flt)} FLT)")
