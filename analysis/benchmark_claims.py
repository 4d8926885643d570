"""The head-to-head reading's claims about the lr x 1 probes (issue 66 part 6), recomputed from round one's archive
(DIR/runs/stabiliser-map/) for analysis/check_claims.py, and the reading's sentences that issue 66 found saying more
than the archive shows (checked never to be said again). No torch.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from flt_diag.storage.folders import load_summary, run_dirs

RETRACTED_66 = [
    ("which broke at lr x 1 on all six seeds, as LT did",
     "STARS's six are `unstable` by the oscillation rule alone, none collapsed (LT: 5 of 6)"),
    ("at this shape and their default strengths they do not rescue LT",
     "jacobian-fro's gamma = 0.1 is flt-diag's choice, STARS's penalty is not its source's"),
    ("the two stabilisers that change the loop start (Huginn's adapter, Parcae's decay)",
     "Huginn also changes the block, the loop count and the gradient path"),
    ("what it shows is that FLT's stability does not depend on the gradient path",
     "0/10 against 0/10 at one setting where FLT does not fail"),
    ("the forward map alone (which both arms share) does not account for the size of the climbs",
     "the arms share the initialisation, not the trained map"),
    ("6 runs (seeds 0-2, not kept) showed the same", "the runs were not kept: nothing can show it now"),
]


def x1_probes(data: Path) -> pd.DataFrame:
    """Round one's probes at lr x 1: variant, seed, verdict, its reason's rule, largest climb, val loss, index."""
    rows = []
    for d in run_dirs(data / "runs" / "stabiliser-map"):
        s = load_summary(d)
        if s is None or float(s.lr_scale) != 1.0:
            continue
        ev = s.evidence.model_dump() if s.evidence is not None else {}
        rows.append(dict(variant=s.variant, seed=int(s.seed), verdict=s.verdict, val_loss=float(s.val_loss),
                         climb=float(ev.get("climb", float("nan"))), osc=float(ev.get("osc_dlog_median", "nan")),
                         reason=str(ev.get("reason", ""))))
    if not rows:
        raise LookupError(f"{data / 'runs' / 'stabiliser-map'}: no probe at lr x 1")
    return pd.DataFrame(rows)


def head_to_head_claims(data: Path, rng) -> list[str]:
    """The sentences of the head-to-head's reading about LT, STARS, jacobian-fro and loop-embed at lr x 1."""
    t = x1_probes(data)
    by = {v: t[t.variant == v] for v in ("lt", "stars", "jacobian-fro", "loop-embed")}
    lt, stars = by["lt"], by["stars"]
    count = lambda g, k: int((g.verdict == k).sum())  # noqa: E731
    osc_only = stars.reason.str.startswith("gradient oscillation").all() and count(stars, "unstable") == len(stars)
    return [
        f"were not `stable` on all six seeds (LT: {count(lt, 'collapsed')} collapsed, {count(lt, 'unstable')} unstable)"
        if all(len(g) == 6 and count(g, "stable") == 0 for g in by.values()) else "a probe at x 1 was stable",
        "jacobian-fro's and loop-embed's six collapsed"
        if count(by["jacobian-fro"], "collapsed") == 6 == count(by["loop-embed"], "collapsed") else "not all collapsed",
        f"STARS's six are `unstable` by the gradient-oscillation rule alone (median |Δ log g| {rng(stars.osc)} against"
        f" 0.405), none collapsed" if osc_only and count(stars, "collapsed") == 0 else "STARS not oscillation-only",
        f"their largest climbs {rng(stars.climb)} nats (LT's {rng(lt.climb)})",
        f"their val loss {rng(stars.val_loss)}, below every LT seed's ({rng(lt.val_loss)})"
        if stars.val_loss.max() < lt.val_loss.min() else "STARS's val loss not below every LT seed's",
    ]
