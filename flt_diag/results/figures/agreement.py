"""The early warning's agreement figure (`flt-diag fit-predictor --figure`): a plain function over
`early_warning.agreement` rows, not a registered figure of run folders."""
from __future__ import annotations

from matplotlib.figure import Figure


STYLES = ["-", "--", ":", "-.", (0, (8, 2, 1, 2, 1, 2)), (0, (1, 4)), (0, (12, 3)), (0, (4, 1, 1, 1, 1, 1))]


def draw_agreement(curves: dict[str, list[dict]], runs: str | None = None):
    """Agreement of the prediction at step s with the final verdict, against s: one line per set of
    runs (e.g. "fitted on", "held out") or per predictor on the same `runs`, from `agreement` dicts
    that carry their "step"."""
    fig = Figure(figsize=(5.6, 3.6 + 0.25 * len(curves)), layout="constrained")
    ax = fig.subplots()
    if len(curves) > len(STYLES):
        raise ValueError(f"the agreement figure tells at most {len(STYLES)} curves apart (one line style each); "
                         f"got {len(curves)}: draw them in groups")
    for (name, rows), ls in zip(curves.items(), STYLES):
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
