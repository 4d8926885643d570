"""Round two's figure: val loss against lr scale per variant (stage B's selection seeds and stage C's confirmation
seeds: the median with the range as a bar), each variant's breaking lr (stage D, median over its lines) marked by
a cross on the axis' floor. Drawn with flt-diag's figure style (seaborn, flt_diag.results.figures.style)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from flt_diag.results.figures.style import empty, finish, new_figure, style, variant_color

NAME = "stabiliser-benchmark-2.png"


def points(stages: dict, best: dict | None) -> pd.DataFrame:
    """Per (variant, lr): median, min and max of the val loss over stage B's and C's runs at that lr."""
    runs = [s[0] for k, s in stages.items() if k in ("B", "C") and s is not None]
    if not runs:
        return pd.DataFrame(columns=["variant", "lr", "median", "min", "max"])
    df = pd.concat(runs, ignore_index=True)
    return df.groupby(["variant", "lr"]).val_loss.agg(["median", "min", "max"]).reset_index()


def draw(stages: dict, best: dict | None, margins: pd.DataFrame, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = points(stages, best)
    with style():
        fig, axes = new_figure(1, 1, panel=(7.0, 4.5))
        ax = axes[0, 0]
        if p.empty:
            empty(ax, "no stage B or C run archived")
        for v, g in p.groupby("variant", sort=False):
            g = g.sort_values("lr")
            c = variant_color(v)
            ax.errorbar(g.lr, g["median"], yerr=[g["median"] - g["min"], g["max"] - g["median"]], color=c,
                        marker="o", ms=4, capsize=2, label=v)
        if not p.empty:
            floor = p["min"].min()
            for r in margins.itertuples() if len(margins) else ():
                ax.plot([r.breaking], [floor], marker="x", ms=9, mew=2, color=variant_color(r.variant), ls="")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("lr scale (x recipe)")
            ax.set_ylabel("val loss (nats)")
            ax.legend(fontsize="small", ncol=2)
        finish(fig, "Val loss against lr (x: breaking lr, stage D)")
        path = out / NAME
        fig.savefig(path, dpi=120)
    return path
