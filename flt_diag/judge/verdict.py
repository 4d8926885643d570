"""Derived metrics and the verdict, computed from stored series only (numpy/pandas, no torch).

Oscillation indices of a gradient-norm series g_1..g_n (one definition each, used everywhere):
  cv               std(g) / mean(g)                           (population std)
  mean_abs_dlog    mean_i |log g_{i+1} - log g_i|
  sign_alternation share of i with (g_{i+1} - g_i) * (g_{i+2} - g_{i+1}) < 0
  neg_cosine_share share of recorded consecutive-gradient cosines that are < 0
Each is computed per window of `osc_window` recorded steps and over the whole run. A series
recorded every N steps gives indices over N-step differences.

Verdict (thresholds in VerdictConfig). s = the loss smoothed by a trailing mean over
`smooth_window` steps; climb = max over t of (s_t - min_{u<=t} s_u), the largest rise above the
running minimum; gap = s_final - min(s).
  diverged   a non-finite training loss
  collapsed  climb > max(rebound_abs, rebound_rel * min(s)) and the loss did not recover:
             gap > max(recovery_abs, recovery_rel * min(s)); or min(s) never gets below the
             unigram entropy of the training data
  unstable   not collapsed, but a loss spike: the smoothed loss climbed more than the same threshold
             above its running minimum and then recovered (`transient_rebound`; the evidence says how
             far it climbed, at which step, and how much of the climb it recovered); or the gradient
             norm oscillates beyond anything stable runs show: its coefficient of variation over the
             dense steps exceeds osc_cv_threshold (the paper's "gradient oscillation" failure, e.g.
             FLA stalling on a plateau at L=6, K=12)
  stable     otherwise: the loss fell and stayed down
Residual explosion (reported beside the verdict): the peak over steps of the final loop's
loop-end residual norm exceeds explosion_ratio * sqrt(d) (a normalised stream has norm sqrt(d)).
`residual_explosion_any` applies the same test to every (loop, layer) and loop end: FLA can
explode its first loop while its final loop stays bounded. `peak_resid_loop` names the loop.

The reference's milestone statistics (scripts/base_check.py), same definitions: at the end of the
warm-up (step 0: the recipe has no lr warm-up), at the start of the warm-down (step
steps - round(warmdown_frac * steps)) and at the last step, the population std of the training
loss and of the pre-clipping global gradient norm over the steps since the previous milestone
(the milestone's own step included). The summary's `loss_std` / `grad_norm_std` are those of the
warm-down milestone (the constant-lr phase, steps 1 .. steps - warmdown); `loss_std_warmdown` /
`grad_norm_std_warmdown` those of the last step (the warm-down itself). (The reference's own
last-step milestone never fires: its loop breaks before training when step == num_iterations.)
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import SUMMARY, load_config, load_metrics, load_summary, series, write_json
from flt_diag.vocab.config import RunConfig, VerdictConfig

OSC_INDICES = ("cv", "mean_abs_dlog", "sign_alternation", "neg_cosine_share")


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


def dense_oscillation(grad_norm: pd.Series, cosine: pd.Series | None, dense_steps) -> dict:
    """The run's oscillation indices (the summary's osc_*, the verdict's CV): over the dense steps only."""
    return oscillation_indices(grad_norm[grad_norm.index < dense_steps],
                               cosine[cosine.index < dense_steps] if cosine is not None else None)


def windowed_oscillation(grad_norm: pd.Series, cosine: pd.Series | None, window: int) -> pd.DataFrame:
    """Oscillation indices per window of steps [start, start + window)."""
    if grad_norm.empty:
        return pd.DataFrame(columns=["start", "end", *OSC_INDICES])
    rows = []
    last = int(grad_norm.index.max())
    for start in range(0, last + 1, window):
        g = grad_norm[(grad_norm.index >= start) & (grad_norm.index < start + window)]
        c = cosine[(cosine.index >= start) & (cosine.index < start + window)] if cosine is not None else None
        if len(g):
            rows.append(dict(start=start, end=start + window - 1, **oscillation_indices(g, c)))
    return pd.DataFrame(rows)


def smoothed(loss: pd.Series, window: int) -> pd.Series:
    return loss.rolling(window, min_periods=min(window, len(loss))).mean()


def verdict(loss: pd.Series, unigram_entropy: float | None, smooth_window: int = 50,
            rebound_abs: float = 0.25, rebound_rel: float = 0.1, recovery_abs: float = 0.1,
            recovery_rel: float = 0.05) -> tuple[str, dict]:
    """("diverged" | "collapsed" | "unstable" | "stable", evidence) for a step-indexed loss series
    (the loss-only part of the verdict; `summarize` adds the gradient-oscillation test)."""
    values = loss.to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        return "diverged", dict(nonfinite_step=int(loss.index[bad[0]]), reason="non-finite loss")
    if len(values) == 0:
        return "diverged", dict(reason="no loss recorded")
    s = smoothed(loss, smooth_window).dropna()
    lo, final = float(s.min()), float(s.iloc[-1])
    rise = s - s.cummin()
    climb, gap = float(rise.max()), final - lo
    threshold = max(rebound_abs, rebound_rel * lo)
    tolerance = max(recovery_abs, recovery_rel * lo)
    peak_at = rise.idxmax()
    ev = dict(min_smoothed_loss=lo, min_step=int(s.idxmin()), final_smoothed_loss=final, climb=climb,
              climb_step=int(peak_at), climb_start_step=int(s.loc[:peak_at].idxmin()),
              recovered=float(s.loc[peak_at] - final), rebound=gap, rebound_threshold=threshold,
              recovery_tolerance=tolerance,
              transient_rebound=bool(climb > threshold and gap <= tolerance),
              unigram_entropy=unigram_entropy, smooth_window=smooth_window)
    if climb > threshold and gap > tolerance:
        return "collapsed", {**ev, "reason": f"smoothed loss climbed {climb:.3f} above its running minimum "
                                             f"and ended {gap:.3f} above its best"}
    if unigram_entropy is not None and lo >= unigram_entropy:
        return "collapsed", {**ev, "reason": "loss never got below the unigram entropy of the data"}
    if ev["transient_rebound"]:
        return "unstable", {**ev, "reason": f"loss spike: smoothed loss climbed {climb:.3f} above its running minimum "
                                            f"(steps {ev['climb_start_step']}-{ev['climb_step']}), then recovered "
                                            f"{ev['recovered']:.3f} (ends {gap:.3f} above its best)"}
    return "stable", {**ev, "reason": "loss fell and stayed down"}


def warmdown_start(steps: int, warmdown_frac: float) -> int:
    """The warm-down milestone: the first step of the warm-down (the last step without one)."""
    return min(steps - round(warmdown_frac * steps), steps - 1)


def milestone_steps(steps: int, warmdown_frac: float) -> list[int]:
    """Steps at which the reference logs train/loss_std and train/grad_norm_std (see the module doc)."""
    return sorted({0, warmdown_start(steps, warmdown_frac), steps - 1})


def milestone_stds(loss: pd.Series, grad_norm: pd.Series, steps: int, warmdown_frac: float) -> list[dict]:
    """[{step, loss_std, grad_norm_std}] per milestone reached: population std (ddof 0) of the
    series over (previous milestone, this milestone]; NaN where a window holds a non-finite value."""
    out, prev = [], -1
    for m in milestone_steps(steps, warmdown_frac):
        lw = loss[(loss.index > prev) & (loss.index <= m)].to_numpy(dtype=float)
        gw = grad_norm[(grad_norm.index > prev) & (grad_norm.index <= m)].to_numpy(dtype=float)
        if not len(lw) or int(loss.index.max()) < m:
            break
        out.append(dict(step=m, loss_std=float(np.std(lw)), grad_norm_std=float(np.std(gw)) if len(gw) else math.nan))
        prev = m
    return out


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


def summarize(df: pd.DataFrame, cfg, unigram_entropy: float | None = None, wall_time: float | None = None,
              stop_reason: str | None = None, tokens_per_step: int | None = None,
              prediction: dict | None = None) -> dict:
    """The run's summary.json: verdict, evidence and key figures, from its metrics table."""
    v = cfg.verdict
    loss = series(df, M.LOSS)
    name, evidence = verdict(loss, unigram_entropy, v.smooth_window, v.rebound_abs, v.rebound_rel,
                             v.recovery_abs, v.recovery_rel)
    resid = residual_explosion(df, cfg.model.loops, cfg.model.n_embd, v.explosion_ratio)
    g, cos = series(df, M.GRAD_NORM), series(df, M.GRAD_COSINE)
    dense = cfg.diagnostics.dense_steps
    osc = dense_oscillation(g, cos, dense)
    if prediction is not None:  # the run was ended early by the collapse predictor (--stop-on-collapse)
        name, evidence = "collapsed", {**evidence, "predicted_at": prediction["step"],
                                       "reason": f"collapse predicted at step {prediction['step']} "
                                                 f"(P={prediction['p_collapse']:.2f}; {prediction['evidence']})"}
    elif name == "stable" and osc["cv"] > v.osc_cv_threshold:
        name, evidence = "unstable", {**evidence, "reason": f"gradient-norm CV {osc['cv']:.2f} over the first "
                                      f"{min(dense, len(g))} steps exceeds {v.osc_cv_threshold:g} (gradient oscillation)"}
    val = series(df, M.VAL_LOSS).dropna()
    accuracy = series(df, M.VAL_ACCURACY).dropna()
    finite_loss = loss[np.isfinite(loss.to_numpy())]
    milestones = milestone_stds(loss, g, cfg.train.steps, cfg.train.warmdown_frac)
    at = {m["step"]: m for m in milestones}
    wd = warmdown_start(cfg.train.steps, cfg.train.warmdown_frac)
    mid, last = at.get(wd, {}), at.get(cfg.train.steps - 1, {}) if wd < cfg.train.steps - 1 else {}
    steps_done = int(loss.index.max()) + 1 if len(loss) else 0
    out = dict(
        verdict=name, evidence=evidence, residual_explosion=resid.pop("residual_explosion"), **resid,
        variant=cfg.model.variant, loops=cfg.model.loops, seed=cfg.train.seed, lr_scale=cfg.train.lr_scale,
        final_loss=float(smoothed(finite_loss, v.smooth_window).iloc[-1]) if len(finite_loss) else math.nan,
        best_loss=evidence.get("min_smoothed_loss", math.nan),
        val_loss=float(val.iloc[-1]) if len(val) else math.nan,
        val_ppl=float(math.exp(min(val.iloc[-1], 700))) if len(val) else math.nan,
        val_accuracy=float(accuracy.iloc[-1]) if len(accuracy) else math.nan,
        **{f"osc_{k}": val_ for k, val_ in osc.items()},
        loss_std=mid.get(M.LOSS_STD, math.nan), grad_norm_std=mid.get(M.GRAD_NORM_STD, math.nan),
        loss_std_warmdown=last.get(M.LOSS_STD, math.nan), grad_norm_std_warmdown=last.get(M.GRAD_NORM_STD, math.nan),
        milestones=milestones,
        oscillation_windows=windowed_oscillation(g, cos, v.osc_window).to_dict("records"),
        steps_done=steps_done, steps=cfg.train.steps, wall_time=wall_time, stop_reason=stop_reason,
        prediction=prediction,
        tokens_per_s=(tokens_per_step * steps_done / wall_time) if wall_time and tokens_per_step else None,
    )
    return out


def tokens_per_step(cfg, world_size: int = 1) -> int:
    """Tokens one optimizer step trains on, over every data-parallel rank: batch_size * grad_accum *
    sequence_len * world_size (the one count behind a run's tokens_per_s, at training and on recompute)."""
    t = cfg.train
    return t.batch_size * t.grad_accum * cfg.model.sequence_len * int(world_size)


def resummarize(run_dir, verdict_overrides: dict | None = None, root=None) -> dict:
    """Recompute a finished run's summary.json from its stored metrics (for example with other
    verdict thresholds); wall time and stop reason are kept from the old summary. `root`: the folder
    the command was given (a sweep): no link below it is written through."""
    old = load_summary(run_dir)
    if old is None:
        raise ValueError(f"{run_dir} has not finished (no {SUMMARY})")
    cfg_dict = load_config(run_dir)
    cfg = RunConfig.from_dict(cfg_dict)
    if verdict_overrides:
        cfg.verdict = VerdictConfig(**{**cfg.verdict.__dict__, **verdict_overrides})
    new = summarize(load_metrics(run_dir), cfg, unigram_entropy=cfg_dict.get("corpus", {}).get("unigram_entropy"),
                    wall_time=old.get("wall_time"), stop_reason=old.get("stop_reason"), prediction=old.get("prediction"),
                    tokens_per_step=tokens_per_step(cfg, cfg_dict.get("env", {}).get("world_size", 1)))
    write_json(Path(run_dir) / SUMMARY, new, root)
    return new
