"""Derived metrics and the verdict, computed from stored series only (numpy/pandas, no torch).

The oscillation indices (OSC_INDICES, per window of `osc_window` recorded steps and over the whole run; a series
recorded every N steps gives indices over N-step differences), the reference's milestone statistics, verdict v4's
rules in the order applied (thresholds in VerdictConfig; rule 4b, net of a sampled loop count, in
gradient_oscillation.py; v3's verdict beside) and residual explosion: docs/DESIGN.md section 3.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.storage import archive, metric_names as M
from flt_diag.storage.file_models import RunConfigFile, Summary
from flt_diag.storage.folders import (SUMMARY, StorageError, load_config, load_metrics, load_summary,
                                     metrics_missing, rewrite_record_summary, series, write_json)
from flt_diag.config.run_config import RunConfig, VerdictConfig, with_overrides
from flt_diag.judge.gradient_oscillation import (MIN_DIFFERENCES, log_differences, oscillation_index,  # noqa: F401
                                                 window_starts)  # (rule 4b; re-exported where it was)

OSC_INDICES = ("cv", "mean_abs_dlog", "sign_alternation", "neg_cosine_share")


@dataclass(frozen=True)
class Recipe:
    """What the verdict and the instruments read of a run, and only that: the steps and the warm-down's share of
    them, the gradient accumulation and what the loss is on, the model's loops, layers and width, the dense
    steps of the records, the verdict's thresholds, and the run's identity (variant, seed, lr scale; None where
    not given: a flt_diag.watch run). `Recipe.of` reads it off a RunConfig (flt-diag's runs, a stored config.json)."""

    steps: int
    loops: int
    width: int
    depth: int
    dense_steps: int
    warmdown_frac: float = 0.0
    grad_accum: int = 1
    loss_on: str = "end"
    variant: str | None = None
    seed: int | None = None
    lr_scale: float | None = None
    verdict: VerdictConfig = field(default_factory=VerdictConfig)

    @classmethod
    def of(cls, cfg: "RunConfig | Recipe") -> "Recipe":
        if isinstance(cfg, Recipe):
            return cfg
        m, t = cfg.model, cfg.train
        return cls(steps=t.steps, loops=m.loops, width=m.width, depth=m.depth,
                   dense_steps=cfg.diagnostics.dense_steps, warmdown_frac=t.warmdown_frac, grad_accum=t.grad_accum,
                   loss_on=t.loss_on, variant=m.variant, seed=t.seed, lr_scale=t.lr_scale, verdict=cfg.verdict)


def quiet(fn):
    """A judge of the stored values: a figure of huge or non-finite values (a loss of 1e300, a crafted 1e308)
    is inf or NaN, as each docstring says, without numpy's overflow and invalid-value warnings on stderr."""
    @functools.wraps(fn)
    def judge(*args, **kwargs):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            return fn(*args, **kwargs)
    return judge


def coefficient_of_variation(g) -> float:
    g = np.asarray(g, dtype=float)
    return float(g.std() / g.mean()) if len(g) and g.mean() != 0 else math.nan


def mean_abs_dlog(g) -> float:
    g = np.asarray(g, dtype=float)
    return float(np.abs(np.diff(np.log(g))).mean()) if len(g) > 1 else math.nan


def sign_alternation(g) -> float:
    d = np.diff(np.asarray(g, dtype=float))
    return float((d[1:] * d[:-1] < 0).mean()) if len(d) > 1 else math.nan


def neg_cosine_share(cosines) -> float:
    c = np.asarray(cosines, dtype=float)
    return float((c < 0).mean()) if len(c) else math.nan


def oscillation_indices(grad_norm: pd.Series, cosine: pd.Series | None = None) -> dict:
    g = grad_norm[np.isfinite(grad_norm.to_numpy()) & (grad_norm.to_numpy() > 0)]
    c = cosine.dropna() if cosine is not None else pd.Series(dtype=float)
    return dict(cv=coefficient_of_variation(g), mean_abs_dlog=mean_abs_dlog(g),
                sign_alternation=sign_alternation(g), neg_cosine_share=neg_cosine_share(c))


@quiet
def dense_oscillation(grad_norm: pd.Series, cosine: pd.Series | None, dense_steps) -> dict:
    """The run's oscillation indices (the summary's osc_*, the verdict's CV): over the dense steps only."""
    return oscillation_indices(grad_norm[grad_norm.index < dense_steps],
                               cosine[cosine.index < dense_steps] if cosine is not None else None)


@quiet
def windowed_oscillation(grad_norm: pd.Series, cosine: pd.Series | None, window: int) -> pd.DataFrame:
    """Oscillation indices per window of steps [start, start + window) (each holds a stored step)."""
    rows = []
    for start in window_starts(grad_norm.index.to_numpy(), window):
        g = grad_norm[(grad_norm.index >= start) & (grad_norm.index < start + window)]
        c = cosine[(cosine.index >= start) & (cosine.index < start + window)] if cosine is not None else None
        rows.append(dict(start=start, end=start + window - 1, **oscillation_indices(g, c)))
    return pd.DataFrame(rows, columns=["start", "end", *OSC_INDICES])


def smoothed(loss: pd.Series, window: int) -> pd.Series:
    return loss.rolling(window, min_periods=min(window, len(loss))).mean()


def verdict(loss: pd.Series, unigram_entropy: float | None, v: VerdictConfig = VerdictConfig(),
            stall_scale: float = 1.0) -> tuple[str, dict]:
    """("diverged" | "collapsed" | "stalled" | "unstable" | "stable", evidence) for a step-indexed loss
    series under the thresholds `v` (default: VerdictConfig's): rules 1-3 of verdict v3 and 4a (the loss
    spike); `judged` adds 4b, the gradient oscillation. `stall_scale` multiplies the stall margin tol(H1)
    (the sensitivity table moves it)."""
    values = loss.to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        return "diverged", dict(nonfinite_step=int(loss.index[bad[0]]), reason="non-finite loss")
    if len(values) == 0:
        return "diverged", dict(reason="no loss recorded")
    s = smoothed(loss, v.smooth_window).dropna()
    lo, final = float(s.min()), float(s.iloc[-1])
    rise = s - s.cummin()
    climb, gap = float(rise.max()), final - lo
    threshold = max(v.rebound_abs, v.rebound_rel * lo)
    tolerance = max(v.recovery_abs, v.recovery_rel * lo)
    peak_at = rise.idxmax()
    ev = dict(min_smoothed_loss=lo, min_step=int(s.idxmin()), final_smoothed_loss=final, climb=climb,
              climb_step=int(peak_at), climb_start_step=int(s.loc[:peak_at].idxmin()),
              recovered=float(s.loc[peak_at] - final), rebound=gap, rebound_threshold=threshold,
              recovery_tolerance=tolerance,
              transient_rebound=bool(climb > threshold and gap <= tolerance),
              unigram_entropy=unigram_entropy, smooth_window=v.smooth_window,
              **stall_evidence(final, unigram_entropy, v, stall_scale))
    if climb > threshold and gap > tolerance:
        return "collapsed", {**ev, "reason": f"smoothed loss climbed {climb:.3f} above its running minimum "
                                             f"and ended {gap:.3f} above its best"}
    if ev["stalled"]:
        return "stalled", {**ev, "reason": f"final smoothed loss {final:.3f} is not below the unigram entropy "
                                           f"{unigram_entropy:.3f} by more than {ev['stall_margin']:.3f} nats "
                                           "(no better than token frequencies alone)"}
    if ev["transient_rebound"]:
        return "unstable", {**ev, "reason": f"loss spike: smoothed loss climbed {climb:.3f} above its running minimum "
                                            f"(steps {ev['climb_start_step']}-{ev['climb_step']}), then recovered "
                                            f"{ev['recovered']:.3f} (ends {gap:.3f} above its best)"}
    return "stable", {**ev, "reason": "loss fell and stayed down"}


def stall_evidence(final: float, unigram_entropy: float | None, v: VerdictConfig, stall_scale: float = 1.0) -> dict:
    """Rule 3: stalled if the final smoothed loss is above H1 - tol(H1), tol(x) = max(recovery_abs,
    recovery_rel * x) (the recovery tolerance of rule 2), H1 the training tokens' unigram entropy."""
    if unigram_entropy is None or not math.isfinite(unigram_entropy):
        return dict(stall_reference=None, stall_margin=None, stalled=False,
                    stall_judged="no: no unigram entropy recorded (an imported run)")
    margin = stall_scale * max(v.recovery_abs, v.recovery_rel * unigram_entropy)
    return dict(stall_reference=float(unigram_entropy), stall_margin=margin,
                stalled=bool(final > unigram_entropy - margin), stall_judged="yes: against the unigram entropy")


def warmdown_start(steps: int, warmdown_frac: float) -> int:
    """The warm-down milestone: the first step of the warm-down (the last step without one)."""
    return min(steps - round(warmdown_frac * steps), steps - 1)


def milestone_stds(loss: pd.Series, grad_norm: pd.Series, steps: int, warmdown_frac: float) -> list[dict]:
    """[{step, loss_std, grad_norm_std}] per milestone reached: population std (ddof 0) of the
    series over (previous milestone, this milestone]; NaN where a window holds a non-finite value. The
    milestones are the steps at which the reference logs train/loss_std and train/grad_norm_std."""
    out, prev = [], -1
    for m in sorted({0, warmdown_start(steps, warmdown_frac), steps - 1}):
        lw = loss[(loss.index > prev) & (loss.index <= m)].to_numpy(dtype=float)
        gw = grad_norm[(grad_norm.index > prev) & (grad_norm.index <= m)].to_numpy(dtype=float)
        if not len(lw) or int(loss.index.max()) < m:
            break
        out.append(dict(step=m, loss_std=float(np.std(lw)), grad_norm_std=float(np.std(gw)) if len(gw) else math.nan))
        prev = m
    return out


@quiet
def residual_explosion(df: pd.DataFrame, loops: int, d_model: int, ratio: float) -> dict:
    """Peak loop-end residual norm of the final loop, and whether it exploded."""
    final = series(df, M.RESID_NORM_LOOP_END, loop=loops)
    finite = final[np.isfinite(final.to_numpy())]
    peak = float(finite.max()) if len(finite) else math.nan
    every = df[df.metric.isin([M.RESID_NORM, M.RESID_NORM_LOOP_END])]
    every = every[np.isfinite(every.value.to_numpy())]
    peak_any = float(every.value.max()) if len(every) else math.nan
    return dict(peak_resid_norm=peak, peak_resid_norm_any=peak_any,
                peak_resid_loop=int(every.loop.loc[every.value.idxmax()]) if len(every) else None,
                residual_explosion_any=bool(len(every) and peak_any > ratio * math.sqrt(d_model)),
                peak_resid_step=int(finite.idxmax()) if len(finite) else None,
                final_resid_norm=float(finite.iloc[-1]) if len(finite) else math.nan,
                resid_ratio=peak / math.sqrt(d_model) if len(finite) else math.nan,
                residual_explosion=bool(len(finite) and peak > ratio * math.sqrt(d_model)),
                explosion_threshold=ratio * math.sqrt(d_model))


VERDICT_VERSION = 4  # recorded in summary.json (`summary --recompute` rewrites older summaries)


def _oscillation_reason(index: dict, threshold: float) -> str:
    a, b = index["osc_dlog_window"]
    if index["osc_loop_count"] == "sampled":
        return (f"gradient oscillation net of the loop count: median |dlog g - {index['osc_loop_slope']:.2f} dlog r| "
                f"{index['osc_dlog_median']:.3f} over steps {a}-{b} exceeds {threshold:.3f} "
                f"(alternation {index['osc_alternation']:.2f})")
    return (f"gradient oscillation: median |dlog g| {index['osc_dlog_median']:.3f} over steps {a}-{b} exceeds "
            f"{threshold:.3f} (alternation {index['osc_alternation']:.2f})")


@quiet
def judged(df: pd.DataFrame, recipe: Recipe | RunConfig, unigram_entropy: float | None, prediction: dict | None = None,
           stall_scale: float = 1.0) -> tuple[str, dict, dict]:
    """(verdict, evidence, oscillation index) of a run's metrics table under its recipe's verdict thresholds:
    `verdict`'s loss rules, then rule 4b (gradient oscillation before the warm-down, net of the loop count where
    `loops_run` changes: v4) for a run they call stable. The index also holds v3's verdict and index
    (`verdict_v3`, `osc_dlog_median_v3`: rule 4b on the gradient norm alone; v4's own at a fixed loop count)."""
    r = Recipe.of(recipe)
    v = r.verdict
    name, evidence = verdict(series(df, M.LOSS), unigram_entropy, v, stall_scale)
    span_end = r.steps - round(r.warmdown_frac * r.steps)  # the warm-down's start
    grad = series(df, M.GRAD_NORM)
    index = oscillation_index(grad, span_end, v.osc_window, v.osc_dlog_threshold, series(df, M.LOOPS_RUN))
    v3 = (oscillation_index(grad, span_end, v.osc_window, v.osc_dlog_threshold)
          if index["osc_loop_count"] == "sampled" else index)
    windows = index.pop("osc_dlog_windows")
    evidence = {**evidence, **{k: x for k, x in index.items() if k != "oscillating"}}
    name_v3 = name
    if prediction is not None:  # the run was ended early by the collapse predictor (--stop-on-collapse)
        name = name_v3 = "collapsed"
        evidence = {**evidence, "predicted_at": prediction["step"],
                    "reason": f"collapse predicted at step {prediction['step']} "
                              f"(P={prediction['p_collapse']:.2f}; {prediction['evidence']})"}
    elif name == "stable":
        name_v3 = "unstable" if v3["oscillating"] else name
        if index["oscillating"]:
            name, evidence = "unstable", {**evidence, "reason": _oscillation_reason(index, v.osc_dlog_threshold)}
    return name, evidence, {**index, "osc_dlog_windows": windows, "verdict_v3": name_v3,
                            "osc_dlog_median_v3": v3["osc_dlog_median"]}


@quiet
def summarize(df: pd.DataFrame, recipe: Recipe | RunConfig, unigram_entropy: float | None = None,
              wall_time: float | None = None, stop_reason: str | None = None, tokens_per_step: int | None = None,
              prediction: dict | None = None) -> Summary:
    """The run's summary (summary.json; v4, v3's verdict beside): verdict, evidence and key figures, from its metrics table."""
    r = Recipe.of(recipe)
    v, steps = r.verdict, r.steps
    loss = series(df, M.LOSS)
    name, evidence, index = judged(df, r, unigram_entropy, prediction)
    resid = residual_explosion(df, r.loops, r.width, v.explosion_ratio)
    g, cos = series(df, M.GRAD_NORM), series(df, M.GRAD_COSINE)
    osc = dense_oscillation(g, cos, r.dense_steps)
    val = series(df, M.VAL_LOSS).dropna()
    accuracy = series(df, M.VAL_ACCURACY).dropna()
    finite_loss = loss[np.isfinite(loss.to_numpy())]
    milestones = milestone_stds(loss, g, steps, r.warmdown_frac)
    at = {m["step"]: m for m in milestones}
    wd = warmdown_start(steps, r.warmdown_frac)
    mid, last = at.get(wd, {}), at.get(steps - 1, {}) if wd < steps - 1 else {}
    steps_done = int(loss.index.max()) + 1 if len(loss) else 0
    return Summary.model_validate(dict(
        verdict=name, verdict_version=VERDICT_VERSION, verdict_v3=index["verdict_v3"], evidence=evidence,
        residual_explosion=resid.pop("residual_explosion"), **resid,
        variant=r.variant, loops=r.loops, seed=r.seed, lr_scale=r.lr_scale,
        final_loss=float(smoothed(finite_loss, v.smooth_window).iloc[-1]) if len(finite_loss) else math.nan,
        best_loss=evidence.get("min_smoothed_loss", math.nan),
        val_loss=float(val.iloc[-1]) if len(val) else math.nan,
        val_ppl=float(math.exp(min(val.iloc[-1], 700))) if len(val) else math.nan,
        val_accuracy=float(accuracy.iloc[-1]) if len(accuracy) else math.nan,
        **{f"osc_{k}": val_ for k, val_ in osc.items()},
        osc_dlog_median=index["osc_dlog_median"], osc_alternation=index["osc_alternation"],
        osc_dlog_median_v3=index["osc_dlog_median_v3"],
        stall_reference=evidence.get("stall_reference"), stall_margin=evidence.get("stall_margin"),
        loss_std=mid.get(M.LOSS_STD, math.nan), grad_norm_std=mid.get(M.GRAD_NORM_STD, math.nan),
        loss_std_warmdown=last.get(M.LOSS_STD, math.nan), grad_norm_std_warmdown=last.get(M.GRAD_NORM_STD, math.nan),
        milestones=milestones,
        oscillation_windows=windowed_oscillation(g, cos, v.osc_window).to_dict("records"),
        osc_dlog_windows=index["osc_dlog_windows"],
        steps_done=steps_done, steps=steps, wall_time=wall_time, stop_reason=stop_reason,
        prediction=prediction,
        tokens_per_s=(tokens_per_step * steps_done / wall_time) if wall_time and tokens_per_step else None))


def tokens_per_step(cfg, world_size: int = 1) -> int:
    """Tokens one optimizer step trains on, over every data-parallel rank: batch_size * grad_accum *
    seq_len * world_size (the one count behind a run's tokens_per_s, at training and on recompute)."""
    t = cfg.train
    return t.batch_size * t.grad_accum * cfg.model.seq_len * int(world_size)


def stored_config(stored: RunConfigFile, verdict_overrides: dict | None = None) -> RunConfig:
    """A run's config read back from its config.json, with other verdict thresholds where given."""
    cfg = stored.run_config()
    return with_overrides(cfg, verdict=verdict_overrides) if verdict_overrides else cfg


PROBE_NOTES = ("oscillation", "warmdown", "not_recorded")  # evidence a flt_diag.watch run adds (its LoopProbe)


def with_not_recorded(summary: Summary, callbacks) -> Summary:
    """The summary with evidence.not_recorded: the records the run's instruments could not take (name -> why; the
    record guard, flt_diag.instruments.guard), for flt-diag's Trainer as for flt_diag.watch; unchanged if none."""
    missed: dict[str, str] = {}
    for cb in callbacks:
        missed.update(getattr(getattr(cb, "records", None), "not_recorded", None) or {})
    if not missed:
        return summary
    return Summary.model_validate({**summary.as_written(),
                                   "evidence": {**summary.evidence.as_written(), "not_recorded": missed}})


def resummarize(run_dir, verdict_overrides: dict | None = None, root=None) -> Summary:
    """Recompute a finished run's summary.json from its stored metrics (for example with other
    verdict thresholds) and write it; wall time and stop reason are kept from the old summary. `root`: the folder
    the command was given (a sweep): no link below it is written through."""
    new = rejudged(run_dir, verdict_overrides)
    write_rejudged(run_dir, new, root)
    return new


def write_rejudged(run_dir, new: Summary, root=None) -> None:
    """A summary `rejudged` computed, written where the run keeps its summary."""
    if archive.is_record(run_dir):  # an archived run: its record's summary is rewritten in place
        rewrite_record_summary(Path(run_dir), new.as_written(), root)
    else:
        write_json(Path(run_dir) / SUMMARY, new, root)


def rejudged(run_dir, verdict_overrides: dict | None = None) -> Summary:
    """The summary `resummarize` writes, computed and not written (a run without stored metrics: one line)."""
    old = load_summary(run_dir)
    if old is None:
        raise ValueError(f"{run_dir} has not finished (no {SUMMARY})")
    stored = load_config(run_dir)
    cfg = stored_config(stored, verdict_overrides)
    if (why := metrics_missing(run_dir)) is not None:
        raise StorageError(f"{why}: nothing to judge, its {SUMMARY} is left as it was")
    new = summarize(load_metrics(run_dir), cfg, unigram_entropy=stored.unigram_entropy,
                    wall_time=old.wall_time, stop_reason=old.stop_reason,
                    prediction=old.prediction and old.prediction.as_written(),
                    tokens_per_step=tokens_per_step(cfg, (stored.env or {}).get("world_size", 1)))
    # a flt_diag.watch run's notes (warm-down, unjudged, not recorded) stay; a Trainer run's records not taken too
    kept = PROBE_NOTES if stored.probe is not None else ("not_recorded",)
    notes = {k: v for k in kept if (v := getattr(old.evidence, k, None)) is not None}
    if notes:
        new = Summary.model_validate({**new.as_written(), "evidence": {**notes, **new.evidence.as_written()}})
    if old.decided_at is not None:  # a run stopped once decided (flt_diag.judge.decided): where, kept
        new = Summary.model_validate({**new.as_written(), "decided_at": old.decided_at})
    return new
