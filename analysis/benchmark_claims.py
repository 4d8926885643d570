"""The head-to-head reading's claims about the lr x 1 probes (issue 66 part 6), recomputed from round one's archive
(DIR/runs/stabiliser-map/) for analysis/check_claims.py, and the reading's sentences that issue 66 found saying more
than the archive shows (checked never to be said again). No torch.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from flt_diag.storage.folders import load_summary, run_dirs

RETRACTED_66 = [
    ("STARS's six are `unstable` by the gradient-oscillation rule alone",
     "under verdict v4 (net of the sampled loop count) three of the six are `stable` at x 1"),
    ("LT, STARS, jacobian-fro and loop-embed break at x 1", "STARS's seeds 1, 3 and 6 hold at x 1 under v4"),
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


def stabiliser_probes(data: Path, lrs: tuple[float, ...] = (1.0, 2.0)) -> pd.DataFrame:
    """Round one's probes at the lr scales `lrs`: variant, seed, lr, verdict (v4) and v3's, the reason's rule,
    largest climb, val loss and oscillation index (v4's, net of a sampled loop count)."""
    rows = []
    for d in run_dirs(data / "runs" / "stabiliser-map"):
        s = load_summary(d)
        if s is None or float(s.lr_scale) not in lrs:
            continue
        ev = s.evidence.model_dump() if s.evidence is not None else {}
        rows.append(dict(variant=s.variant, seed=int(s.seed), lr=float(s.lr_scale), verdict=s.verdict,
                         verdict_v3=getattr(s, "verdict_v3", None) or s.verdict, val_loss=float(s.val_loss),
                         climb=float(ev.get("climb", float("nan"))), osc=float(ev.get("osc_dlog_median", "nan")),
                         reason=str(ev.get("reason", ""))))
    if not any(r["lr"] == 1.0 for r in rows):
        raise LookupError(f"{data / 'runs' / 'stabiliser-map'}: no probe at lr x 1")
    return pd.DataFrame(rows)


def _seeds(g: pd.DataFrame) -> str:
    """'1, 3 and 6' of the rows' seeds."""
    s = [str(x) for x in sorted(g.seed)]
    return ", ".join(s[:-1]) + f" and {s[-1]}" if len(s) > 1 else "".join(s)


def head_to_head_claims(data: Path, rng) -> list[str]:
    """The sentences of the head-to-head's reading about LT, STARS, jacobian-fro and loop-embed at lr x 1 (and
    STARS at x 2), under the records' verdict (v4) with v3's beside."""
    t = stabiliser_probes(data)
    x1, x2 = t[t.lr == 1.0], t[t.lr == 2.0]
    by = {v: x1[x1.variant == v] for v in ("lt", "stars", "jacobian-fro", "loop-embed")}
    lt, stars = by["lt"], by["stars"]
    count = lambda g, k: int((g.verdict == k).sum())  # noqa: E731
    held, osc = stars[stars.verdict == "stable"], stars[stars.verdict == "unstable"]
    osc_only = len(osc) and osc.reason.str.startswith("gradient oscillation").all()
    stars2 = x2[x2.variant == "stars"]
    kinds = ", ".join(f"{count(stars2, k)} {k}" for k in ("collapsed", "stalled", "unstable", "diverged")
                      if count(stars2, k))
    return [
        f"whose probes at lr x 1 were not all `stable` (LT: {count(lt, 'collapsed')} collapsed, "
        f"{count(lt, 'unstable')} unstable)" if all(len(g) == 6 for g in by.values()) and
        all(count(g, "stable") == 0 for v, g in by.items() if v != "stars") else "a probe at x 1 was stable",
        "jacobian-fro's and loop-embed's six collapsed"
        if count(by["jacobian-fro"], "collapsed") == 6 == count(by["loop-embed"], "collapsed") else "not all collapsed",
        f"STARS was `stable` at x 1 on {len(held)} seeds ({_seeds(held)}) and `unstable` by the gradient-oscillation "
        f"rule alone on the other {len(osc)} (index net of its loop count {rng(osc.osc)} against 0.405)"
        if osc_only and len(held) + len(osc) == 6 else "STARS not stable-or-oscillation-only at x 1",
        f"under verdict v3, which read the loop count's own changes as oscillation, all six were `unstable`"
        if (stars.verdict_v3 == "unstable").all() else "STARS's v3 verdicts not all unstable",
        f"none collapsed at x 1, its largest climbs {rng(stars.climb)} nats (LT's {rng(lt.climb)})"
        if count(stars, "collapsed") == 0 else "a STARS probe collapsed at x 1",
        f"its val loss {rng(stars.val_loss)}, below every LT seed's ({rng(lt.val_loss)})"
        if stars.val_loss.max() < lt.val_loss.min() else "STARS's val loss not below every LT seed's",
        f"at x 2 every STARS seed broke ({kinds})" if len(stars2) == 6 and count(stars2, "stable") == 0
        else "a STARS seed held at x 2",
    ]
