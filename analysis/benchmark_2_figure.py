"""Round two's figure: val loss against lr scale, one panel per variant (the curves optimiser benchmarks show).

Each panel pools the runs of stages B, C and D at the variant's chosen strength (selection seeds 101-102 at x 0.5-4,
stage A's runs at x 1 among them as stage B reuses them; confirmation seeds 1-8 at the best lr; stage D's probes
on seeds 1-3 along 1/16 ... 256): per lr the median val loss
over the runs whose verdict is `stable` (a line, its range as a bar), the runs that are not `stable` as crosses on
the panel's top edge (their val loss is not what the variant reaches: the plan reads a broken run's loss nowhere),
the best lr that stage B chose as a star, stage D's breaking lr (median over its lines) as a dotted line, and FLT's
median curve in grey (dashed) in every other panel for reference. A run in two frames (a stage-D probe of a seed
and lr stage C ran too) counts once. Drawn with flt-diag's figure style (seaborn,
flt_diag.results.figures.style)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.results.figures import save
from flt_diag.results.figures.style import OTHER_COLOR, empty, finish, new_figure, style, variant_color

NAME = "stabiliser-benchmark-2.png"
COLUMNS = ["variant", "lr", "median", "min", "max", "stable", "broken"]


def points(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Per (variant, lr) over the runs of `frames` (stage B's pool, C's runs, D's probes): the median, min and max
    val loss of the `stable` runs (NaN where none), and the counts of stable and of other runs."""
    frames = [f for f in frames if f is not None and len(f)]
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.concat(frames, ignore_index=True)  # (a run in two frames, e.g. stage D's probe at the best lr of a
    df = df.drop_duplicates(["variant", "seed", "lr", "strength"])  # seed stage C ran too, counts once: the first)
    rows = []
    for (v, lr), g in df.groupby(["variant", "lr"], sort=False):
        held = g.val_loss[(g.verdict == "stable") & np.isfinite(g.val_loss.astype(float))].astype(float)
        rows.append(dict(variant=v, lr=float(lr), median=held.median() if len(held) else math.nan,
                         min=held.min() if len(held) else math.nan, max=held.max() if len(held) else math.nan,
                         stable=len(held), broken=int(len(g) - len(held))))
    return pd.DataFrame(rows, columns=COLUMNS).sort_values(["variant", "lr"], kind="stable").reset_index(drop=True)


def _limits(p: pd.DataFrame) -> tuple[float, float]:
    """The y range of the stable medians and ranges, with a margin for the crosses on top."""
    lo, hi = float(np.nanmin(p["min"])), float(np.nanmax(p["max"]))
    pad = max(0.02, 0.08 * (hi - lo))
    return lo - pad, hi + 2 * pad


def _panel(ax, v: str, g: pd.DataFrame, ref: pd.DataFrame | None, best: float | None, breaking: float | None,
           top: float) -> None:
    c = variant_color(v)
    if ref is not None:
        ax.plot(ref.lr, ref["median"], color=OTHER_COLOR, ls="--", lw=1, label="flt")
    ok = g[g.stable > 0]
    ax.errorbar(ok.lr, ok["median"], yerr=[ok["median"] - ok["min"], ok["max"] - ok["median"]], color=c, marker="o",
                ms=3.5, capsize=2, label=v)
    bad = g[g.broken > 0]
    ax.plot(bad.lr, [top] * len(bad), marker="x", ms=6, mew=1.5, color=c, ls="")  # (top: just below the edge)
    if best is not None and (ok.lr == best).any():
        ax.plot([best], [float(ok[ok.lr == best]["median"].iloc[0])], marker="*", ms=12, color=c, ls="")
    if breaking is not None and math.isfinite(breaking):
        ax.axvline(breaking, color=c, ls=":", lw=1.2)
    ax.set_title(v, fontsize="medium")
    ax.set_xscale("log", base=2)


def draw(frames: list[pd.DataFrame], order, best: dict | None, margins: pd.DataFrame, out: Path) -> Path:
    """The figure of `frames` (see points), a panel per variant in `order` (others after), into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    p = points(frames)
    seen = set(p.variant)
    names = [v for v in order if v in seen] + sorted(seen - set(order))
    cols = 4
    with style():
        fig, axes = new_figure(max(1, math.ceil(len(names) / cols)), cols if names else 1, panel=(3.0, 2.4),
                               sharex=True, sharey=True)
        if not names or p["median"].isna().all():
            empty(axes[0, 0], "no stage B, C or D run with a stable verdict archived")
        else:
            low, high = _limits(p)
            ref = p[(p.variant == "flt") & (p.stable > 0)]
            breaks = dict(zip(margins.variant, margins.breaking)) if len(margins) else {}
            for ax, v in zip(axes.flat, names):
                _panel(ax, v, p[p.variant == v], None if v == "flt" or ref.empty else ref,
                       (best or {}).get(v, {}).get("value"), breaks.get(v), high - 0.04 * (high - low))
                ax.set_ylim(low, high)
            for ax in axes.flat[len(names):]:
                ax.set_visible(False)
            for ax in axes[-1, :]:
                ax.set_xlabel("lr scale (x recipe)")
            for ax in axes[:, 0]:
                ax.set_ylabel("val loss (nats)")
        finish(fig, "Val loss against lr at each variant's tuned strength\n(median of the stable runs, range as a "
                    "bar; x: runs not stable; *: best lr; dotted: breaking lr; grey dashed: FLT)")
        path = save(fig, out / NAME, dpi=120)  # (atomic, links refused: flt-diag's one figure writer)
    return path
