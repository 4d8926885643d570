"""Fake run and sweep folders with synthetic series, written through the storage API (no training).

make_sweep: variants lt, fla, flt x loops 3, 6, one seed:
    lt  K3   stable, residual norms flat
    lt  K6   collapsed: the loss rebounds, residual norms grow with step and loop, oscillating gradients
    flt K3, flt K6   stable
    fla K3   in progress: config and half its metrics, no summary.json
    fla K6   pending: no run folder
    eval_loops.csv for lt K3 and flt K3.
"""
from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.records import attention as ATTENTION
from flt_diag.storage import metric_names as M
from flt_diag.config.run_config import build_config
from flt_diag.judge.verdict import summarize
from flt_diag.storage.folders import CELLS, CONFIG, EVAL_LOOPS, SUMMARY, MetricsWriter, load_metrics, write_json
from flt_diag.grids.sweep import SweepSpec, write_summary

STEPS = 80
UNIGRAM_ENTROPY = 4.5
CORPUS = {"train_tokens": 100_000, "val_tokens": 10_000, "unigram_entropy": UNIGRAM_ENTROPY}  # as the Trainer writes it
ENV = {"python": "3.11", "torch": "fake", "device": "cpu", "host": "test", "flt_diag": "0.1.0"}


def config(variant: str, loops: int, seed: int = 0, lr_scale: float = 1.0, depth: int | None = None):
    depth_override = {} if depth is None else dict(depth=depth)
    return build_config("tiny", model=dict(variant=variant, loops=loops, **depth_override),
                        train=dict(steps=STEPS, seed=seed, lr_scale=lr_scale),
                        verdict=dict(smooth_window=10, osc_window=20))


def _rows(cfg, collapsed: bool, steps: int, rng: np.random.Generator, val_shift: float = 0.0,
          resid_scale: float = 1.0):
    """Synthetic (step, metric, loop, layer, value) rows of one run: val losses `val_shift` above the
    training loss plus 0.05, residual norms multiplied by `resid_scale`."""
    K, L, d = cfg.model.loops, cfg.model.depth, cfg.model.width
    rows = []
    for t in range(steps):
        grow = math.exp(0.07 * t) if collapsed else 1.0
        loss = 2.0 + 3.5 * math.exp(-t / 12) + (0.05 * max(0, t - 40) if collapsed else 0.0)
        rows.append((t, M.LOSS, M.NONE, M.NONE, loss + 0.02 * rng.standard_normal()))
        rows.append((t, M.LR, M.NONE, M.NONE, 0.02))
        if t % 20 == 19:
            rows.append((t, M.VAL_LOSS, M.NONE, M.NONE, loss + 0.05 + val_shift))
        for k in range(1, K + 1):
            rows.append((t, M.RESID_NORM_LOOP_END, k, M.NONE, resid_scale * math.sqrt(d) * (1 + 0.1 * k) * grow ** (k / K)))
            for layer in range(1, L + 1):
                rows.append((t, M.RESID_NORM, k, layer,
                             resid_scale * math.sqrt(d) * (1 + 0.1 * k + 0.02 * layer) * grow ** (k / K)))
                rows.append((t, M.ACT_GRAD_NORM, k, layer, 0.1 * (1.5 if collapsed else 0.9) ** k))
        wobble = 1 + (0.5 if collapsed else 0.05) * (-1) ** t
        rows.append((t, M.GRAD_NORM, M.NONE, M.NONE, 0.5 * wobble * (1 + rng.random() * 0.1)))
        for group in ("embedding", "head"):
            rows.append((t, f"{M.GRAD_NORM}/{group}", M.NONE, M.NONE, 0.1 * wobble))
        for layer in range(1, L + 1):
            for kind in ("attn", "mlp"):
                rows.append((t, f"{M.GRAD_NORM}/{kind}", M.NONE, layer, 0.2 * wobble))
        if t > 0:
            rows.append((t, M.GRAD_COSINE, M.NONE, M.NONE, (-0.4 if collapsed and t % 2 else 0.6)))
        for group, layer in [("embedding", M.NONE), ("head", M.NONE)] + [(kind, ly) for ly in range(1, L + 1)
                                                                           for kind in ("attn", "mlp")]:
            rows.append((t, f"{M.PARAM_NORM}/{group}", M.NONE, layer, 10 * grow * (1 + 0.01 * t)))
            rows.append((t, f"{M.UPDATE_RATIO}/{group}", M.NONE, layer, 0.01 * wobble))
        for k in range(1, K + 1):  # loop dynamics (DESIGN.md §3), every step here
            rows.append((t, M.EXIT_LOSS, k, M.NONE, loss + 0.5 / k))
            if t % 10 == 0:
                rows.append((t, M.TOKEN_COSINE, k, M.NONE, min(0.2 + (0.01 * t if collapsed else 0.0) * k / K, 1.0)))
            for layer in range(1, L + 1):
                rows.append((t, ATTENTION.ENTROPY, k, layer, 1.0 + 0.1 * k - 0.05 * layer))
            if k > 1:
                rows.append((t, M.FIXED_POINT_RESIDUAL, k, M.NONE, 0.1 * grow / k))
                if t % 10 == 0:
                    rows.append((t, M.LOOP_GAIN, k, M.NONE, (1.2 if collapsed else 0.8) * (1 + 0.01 * t)))
                    rows.append((t, M.LOOP_SPECTRAL_RADIUS, k, M.NONE, (1.1 if collapsed else 0.7)))
                    rows.append((t, M.LOOP_PERTURBATION_GROWTH, k, M.NONE, (1.05 if collapsed else 0.6)))
    return rows


def make_run(run_dir: Path, variant: str, loops: int, seed: int = 0, lr_scale: float = 1.0,
             collapsed: bool = False, finished: bool = True, eval_loops: bool = False, depth: int | None = None,
             val_shift: float = 0.0, resid_scale: float = 1.0) -> Path:
    """A run folder: config.json, metrics parts (40 steps each), and when finished summary.json
    (`depth` blocks, default the tiny preset's; val_shift and resid_scale: see _rows)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config(variant, loops, seed, lr_scale, depth)
    write_json(run_dir / CONFIG, {**cfg.to_dict(), "env": ENV, "corpus": CORPUS})
    rng = np.random.default_rng(zlib.crc32(f"{variant}-{loops}-{seed}-{lr_scale}".encode()))
    rows = _rows(cfg, collapsed, STEPS if finished else STEPS // 2, rng, val_shift, resid_scale)
    writer = MetricsWriter(run_dir)
    writer.truncate_after(-1)  # (as the Trainer starts a run from step 0: the parts of an earlier try go)
    for t0 in range(0, STEPS, 40):
        writer.extend(r for r in rows if t0 <= r[0] < t0 + 40)
        writer.flush()
    if finished:
        write_json(run_dir / SUMMARY, summarize(load_metrics(run_dir), cfg, UNIGRAM_ENTROPY, wall_time=1.0))
    if eval_loops:
        _write_eval_loops(run_dir, loops, collapsed or variant == "lt")
    return run_dir


def _write_eval_loops(run_dir: Path, trained: int, degrades: bool) -> None:
    ks = np.arange(1, 2 * trained + 1)
    loss = 2.2 + 2.0 / ks + np.where(ks > trained, (0.3 if degrades else 0.0) * (ks - trained), 0.0)
    pd.DataFrame(dict(loops=ks, trained_loops=trained, val_loss=loss, perplexity=np.exp(loss), data="stdlib",
                      batches=2)).to_csv(run_dir / EVAL_LOOPS, index=False)


CELLS_PLAN = {  # (variant, loops): make_run options; None = pending (no folder)
    ("lt", 3): dict(eval_loops=True), ("lt", 6): dict(collapsed=True),
    ("fla", 3): dict(finished=False), ("fla", 6): None,
    ("flt", 3): dict(eval_loops=True), ("flt", 6): dict(),
}
EXPECTED_VERDICTS = {("lt", 3): "stable", ("lt", 6): "collapsed", ("fla", 3): "running", ("fla", 6): "pending",
                     ("flt", 3): "stable", ("flt", 6): "stable"}


def make_sweep(out: Path, seeds=(0,), lr_scale=(1.0,)) -> Path:
    """A sweep folder (sweep.json, cells/, summary.csv) following CELLS_PLAN for every seed and lr scale."""
    out = Path(out)
    spec = SweepSpec(config("flt", 3), ["lt", "fla", "flt"], [3, 6], list(seeds), list(lr_scale))
    (out / CELLS).mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", spec.to_dict())
    for cell in spec.cells():
        plan = CELLS_PLAN[(cell.variant, cell.loops)]
        if plan is not None:
            make_run(out / CELLS / cell.name, cell.variant, cell.loops, cell.seed, lr_scale=cell.lr_scale, **plan)
    write_summary(out)
    return out


def series_config(steps: int, variant: str = "flt", loops: int = 3, seed: int = 0, warmdown_frac: float = 0.2):
    """The tiny preset at `steps` steps with the verdict's default thresholds (smoothing 50, windows 200)."""
    return build_config("tiny", model=dict(variant=variant, loops=loops),
                        train=dict(steps=steps, seed=seed, warmdown_frac=warmdown_frac))


def series_metrics(loss, grad_norm, val_loss: float | None = None, steps=None) -> pd.DataFrame:
    """A metrics table of a training loss and a global gradient norm (at `steps`, default 0, 1, ...; the
    loss at every step) and one final validation loss."""
    loss, grad_norm = np.asarray(loss, dtype=float), np.asarray(grad_norm, dtype=float)
    g_steps = np.arange(len(grad_norm)) if steps is None else np.asarray(steps)
    rows = [(t, M.LOSS, M.NONE, M.NONE, v) for t, v in enumerate(loss)]
    rows += [(int(t), M.GRAD_NORM, M.NONE, M.NONE, v) for t, v in zip(g_steps, grad_norm)]
    if val_loss is not None:
        rows.append((len(loss) - 1, M.VAL_LOSS, M.NONE, M.NONE, float(val_loss)))
    return pd.DataFrame(rows, columns=["step", "metric", "loop", "layer", "value"]).astype(
        {"step": "int64", "loop": "int16", "layer": "int16", "value": "float64"})


def make_series_run(run_dir: Path, loss, grad_norm, variant: str = "flt", loops: int = 3, seed: int = 0,
                    unigram_entropy: float | None = UNIGRAM_ENTROPY, val_loss: float | None = None) -> Path:
    """A finished run folder whose training loss and gradient norm are the given series (one per step)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = series_config(len(loss), variant, loops, seed)
    corpus = {} if unigram_entropy is None else {"corpus": {"unigram_entropy": unigram_entropy}}
    write_json(run_dir / CONFIG, {**cfg.to_dict(), "env": ENV, **corpus})
    writer = MetricsWriter(run_dir)
    writer.extend(series_metrics(loss, grad_norm, val_loss).itertuples(index=False, name=None))
    writer.flush()
    write_json(run_dir / SUMMARY, summarize(load_metrics(run_dir), cfg, unigram_entropy, wall_time=1.0))
    return run_dir
