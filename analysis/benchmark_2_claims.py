"""The sentences of results.md's reading of round two's stage B ("Stage B, read as measured"), recomputed from the
archive (DIR/runs/stabiliser-bench-2/, through analysis/stabiliser_benchmark_2.py's reading of it and the rules of
analysis/benchmark_2_rules.py) for analysis/check_claims.py. Each is a piece of text built from the data; where the
data no longer gives it, the text says what it found instead (so the page's sentence FAILs). No torch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

import benchmark_2_rules as R
import stabiliser_benchmark_2 as B2
from flt_diag.storage.folders import load_summary


def _names(variants: list[str]) -> str:
    """'a, b and c'."""
    return ", ".join(variants[:-1]) + f" and {variants[-1]}" if len(variants) > 1 else "".join(variants)


def stage_b_pool(data: Path) -> tuple[pd.DataFrame, dict, dict]:
    """(stage B's runs at the chosen strengths, lr x 0.5-4, selection seeds; the strengths; the best lrs)."""
    got = B2.read_archive(data / "runs" / "stabiliser-bench-2")
    strengths, _ = B2.stage_a(got["A"])
    best, _ = B2.stage_b(got["B"], None if got["A"] is None else got["A"][0], strengths)
    if strengths is None or best is None or got["B"] is None:
        raise LookupError("round two's stages A and B are not complete in the archive")
    return B2.stage_b_pool(got["B"], got["A"][0], strengths), strengths, best


def _means(runs: pd.DataFrame) -> dict[float, float]:
    """Mean val loss per lr over the two selection seeds, at the lrs where both are `stable` (the rule's own)."""
    return dict(R.choose(runs, "lr")["means"])


def _broken_runs(runs: pd.DataFrame) -> str:
    """'`unstable` on seed 101 (ended at step 481, index 0.439) and `stable` on seed 102 (index 0.396)': each
    run's verdict, the step it ended at where it ended early, and its oscillation index (net of a sampled loop
    count), with the rule that made an `unstable` verdict where it is not the oscillation rule."""
    parts = []
    for r in runs.sort_values("seed").itertuples():
        s = load_summary(Path(r.path))
        ev = s.evidence.model_dump() if s is not None and s.evidence is not None else {}
        rule = "" if r.verdict != "unstable" or str(ev.get("reason", "")).startswith("gradient oscillation") \
            else f", by {str(ev.get('reason', '?')).split(':')[0]}"
        ended = f"ended at step {r.steps_done}, " if r.steps_done < r.steps else ""
        parts.append(f"`{r.verdict}` on seed {r.seed} ({ended}index {float(ev.get('osc_dlog_median', np.nan)):.3f}"
                     f"{rule})")
    return " and ".join(parts)


def stage_b_claims(data: Path) -> list[str]:
    pool, strengths, best = stage_b_pool(data)
    lr = lambda x: [v for v in B2.VARIANTS if best[v]["value"] == x and not best[v]["label"]]  # noqa: E731
    unlabelled = [v for v in B2.VARIANTS if best[v]["label"]]
    leads = {}
    for v in B2.VARIANTS:
        m = _means(pool[pool.variant == v])
        if len(m) >= 2:
            chosen = m.pop(best[v]["value"])
            leads[v] = min(m.values()) - chosen
    only = [v for v in B2.VARIANTS if len(_means(pool[pool.variant == v])) == 1]
    close = sorted(v for v, d in leads.items() if d < 0.01)
    return [
        f"stage B chose lr × 1 for {_names(lr(1.0))} and × 0.5 for {_names(lr(0.5))}",
        f"{_names(unlabelled)} have no stable lr in × 0.5-4",
        *(f"at × 0.5 {v} was {_broken_runs(pool[(pool.variant == v) & (pool.lr == 0.5)])}" for v in unlabelled),
        f"{_names(only)} were `stable` on both seeds at × 0.5 only",
        f"over the {len(leads)} variants with two stable lrs or more, the chosen lr's mean val loss leads the next "
        f"stable lr's by {min(leads.values()):.3f}-{max(leads.values()):.3f} nats (two seeds each), under 0.01 for "
        f"{len(close)} of them ({_names(close)})",
    ]


def stage_c(data: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(stage C's tests against FLT, its 96 runs), as the reader computes them; LookupError short of its runs."""
    got = B2.read_archive(data / "runs" / "stabiliser-bench-2")
    strengths, _ = B2.stage_a(got["A"])
    best, _ = B2.stage_b(got["B"], None if got["A"] is None else got["A"][0], strengths)
    tests, runs, _ = B2.stage_c(got["C"], strengths, best)
    if tests is None:
        raise LookupError("round two's stage C is not complete in the archive")
    return tests, runs


def stage_c_claims(data: Path) -> list[str]:
    """The sentences of "Stage C, read as measured": the failures, the three readings after Holm with each
    difference's shift and interval, FLT's spread and the lowest median."""
    tests, runs = stage_c(data)
    failed = runs[runs.verdict != "stable"]
    by = {w: [r for r in tests.itertuples() if r.reading == w] for w in ("lower than FLT", "higher than FLT",
                                                                         "indistinguishable")}
    flt = runs[runs.variant == "flt"].val_loss
    medians = runs.groupby("variant", sort=False).val_loss.median().sort_values(kind="stable")

    def shifts(rows) -> str:
        return "; ".join(f"{r.variant} {r.shift:+.3f} [{r.low:+.3f}, {r.high:+.3f}], p_Holm {r.p_holm:.4f}" for r in rows)
    said = [f"all {len(runs)} runs of stage C are in, {len(failed)} of them not `stable`"
            + (f" ({', '.join(f'{v} {len(g)}' for v, g in failed.groupby('variant', sort=False))})" if len(failed) else "")]
    said.append(f"FLT's eight seeds reached {flt.min():.3f}-{flt.max():.3f} nats (median {flt.median():.3f})")
    for word, rows in by.items():
        if rows and word != "indistinguishable":
            said.append(f"{_names([r.variant for r in rows])} reached a {word.split()[0]} val loss than FLT "
                        f"(shift variant - FLT [95 %]: {shifts(rows)})")
    if by["indistinguishable"]:
        rows = by["indistinguishable"]
        said.append(f"{_names([r.variant for r in rows])} are indistinguishable from FLT at eight seeds (shifts "
                    f"{min(r.shift for r in rows):+.3f} to {max(r.shift for r in rows):+.3f} nats, intervals within "
                    f"{min(r.low for r in rows):+.3f} to {max(r.high for r in rows):+.3f})")
    said.append(f"the lowest median is {medians.index[0]}'s ({medians.iloc[0]:.3f}), then {medians.index[1]}'s "
                f"({medians.iloc[1]:.3f}) and {medians.index[2]}'s ({medians.iloc[2]:.3f})")
    return said


def stage_e_claims(data: Path) -> list[str]:
    """The sentences of stage E's reading: which variants stay within their seed spread at K = 18 and 24."""
    _, runs = stage_c(data)
    e = B2.stage_e(runs)
    said = []
    for k in (18, 24):
        within = [v for v in e.index if e.loc[v, f"within@{k}"] == "yes"]
        out = [f"{v} ({e.loc[v, f'K={k}']:+.3f} against {e.loc[v, 'spread@12']:.3f})" for v in e.index
               if e.loc[v, f"within@{k}"] == "no"]
        said.append(f"at K = {k}, {_names(within) if within else 'none'} stay within their seed spread at 12"
                    + (f"; {', '.join(out)} do not" if out else ""))
    return said


def stage_c_cpu_claims(data: Path) -> list[str]:
    """The reading's sentence on the CPU kinds stage C's runs ran on (each record's own env.cpu)."""
    import benchmark_2_cpu as CPU
    _, runs = stage_c(data)
    by = runs.assign(kind=[CPU.kind(p) for p in runs.path])
    parts = [f"{', '.join(f'{v} ({len(g)})' for v, g in g_k.groupby('variant', sort=False))} on {k}"
             for k, g_k in by.groupby("kind", sort=True)]
    return ["stage C's runs span two CPU kinds: " + "; ".join(parts)] if len(parts) == 2 else \
        [f"stage C's runs ran on {len(parts)} CPU kind(s): " + "; ".join(parts)]


def stage_d(data: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(stage D's per-variant table as the reader prints it, its probes); LookupError before stage B is complete."""
    got = B2.read_archive(data / "runs" / "stabiliser-bench-2")
    strengths, _ = B2.stage_a(got["A"])
    best, _ = B2.stage_b(got["B"], None if got["A"] is None else got["A"][0], strengths)
    table = B2.stage_d(got["D"], best) if best is not None and got["D"] is not None else pd.DataFrame()
    if table.empty:
        raise LookupError("round two's stage D is not in the archive")
    return table, got["D"][0]


def _kinds(table: pd.DataFrame, allowed: set[str]) -> list[str]:
    """The variants every one of whose breaking probes has a kind in `allowed` (a line that held at the grid's top
    has none)."""
    out = []
    for r in table.itertuples():
        kinds = set(str(r.kinds).split()) - {"held"}
        if kinds and kinds <= allowed:
            out.append(r.variant)
    return out


def stage_d_claims(data: Path) -> list[str]:
    """The sentences of "Stage D, read as measured": the lines finished and probes, the variants by median margin,
    the failure kinds at the breaking lr, the margins below 1, and which lines span two CPU kinds."""
    import benchmark_2_cpu as CPU
    table, probes = stage_d(data)
    probes = probes[probes.seed.isin(B2.D_SEEDS)]
    by_margin = table[table.margin.notna()].sort_values("margin", ascending=False, kind="stable")
    none_yet = table[table.margin.isna()].variant.tolist()
    said = [f"{int(table.lines.sum())} lines of stage D are finished and {int(table.open.sum())} open, with "
            f"{len(probes)} probes",
            "by median margin (breaking lr over best lr, seeds 1-3): "
            + ", ".join(f"{r.variant} {r.margin:.3g}" for r in by_margin.itertuples())
            + (f"; no margin yet (no line finished): {_names(none_yet)}" if none_yet else "")]
    stalled = _kinds(table, {"stalled"})
    if stalled:
        said.append(f"every breaking probe of {_names(stalled)} is `stalled`")
    blown = _kinds(table, {"unstable", "collapsed", "diverged"})
    if blown:
        said.append(f"those of {_names(blown)} are `unstable`, `collapsed` or `diverged`")
    below = [f"{r.variant} ({r.margin:.3g})" for r in by_margin.itertuples() if r.margin < 1]
    if below:
        said.append(f"the breaking lr is below the best lr for {_names(below)}")
    lines = [(v, seed, R.breaking(g)) for (v, seed), g in probes.groupby(["variant", "seed"], sort=False)]
    floor = [f"{v} seed {seed}" for v, seed, b in lines if b["finished"] and b["breaking"] == R.GRID_D[0]]
    top = [f"{v} seed {seed}" for v, seed, b in lines if b["finished"] and b["breaking"] is None]
    said.append("censored: broke at the grid's lowest lr (× 1/16): " + (_names(floor) if floor else "none")
                + "; held at its highest (× 256): " + (_names(top) if top else "none"))
    said += _what_decided(lines, probes)
    mixed = CPU.mixed_lines(probes)
    said.append(f"lines with probes of both CPU kinds: {', '.join(mixed) if mixed else 'none'}")
    return said


RULES = {"oscillation": "the gradient-oscillation window", "spike threshold": "the climb past the spike threshold",
         "non-finite": "a non-finite loss", "explosion": "the residual explosion", "the run's end": "the run's end"}


def _what_decided(lines: list, probes: pd.DataFrame) -> list[str]:
    """What ended each breaking probe (its summary's stop reason: the certainty rule that fired, or the run's end),
    counted; and the highest lr that held on every line of a variant, where all its lines share it."""
    reasons: dict[str, int] = {}
    for v, seed, b in lines:
        if b["breaking"] is None:
            continue
        at = probes[(probes.variant == v) & (probes.seed == seed) & (probes.lr == b["breaking"])]
        s = load_summary(Path(at.path.iloc[0]))
        why = str(s.stop_reason or "the run's end")
        why = next((name for key, name in RULES.items() if key in why), why)
        reasons[why] = reasons.get(why, 0) + 1
    order = sorted(reasons.items(), key=lambda kv: -kv[1])
    counted = _names([f"{why} {'decided ' if i == 0 else ''}{n}" for i, (why, n) in enumerate(order)])
    held: dict[float, list[str]] = {}
    for v in dict.fromkeys(v for v, _, _ in lines):
        tops = {max((lr for lr, vd in zip(g.lr, g.verdict) if vd == "stable" and (b := R.breaking(g))["breaking"]
                     and lr < b["breaking"]), default=None)
                for _, g in probes[probes.variant == v].groupby("seed")}
        if len(tops) == 1 and None not in tops:
            held.setdefault(tops.pop(), []).append(v)
    def loss_there(v: str, lr: float) -> str:
        at = probes[(probes.variant == v) & (probes.lr == lr) & (probes.verdict == "stable")].val_loss
        return f"{v} {at.median():.3f}"
    return [f"of the {sum(reasons.values())} breaking probes, {counted}",
            *(f"× {lr:g} held on every line of {_names(vs)}" for lr, vs in sorted(held.items(), reverse=True)),
            "the median val loss of the runs at that lr: " + "; ".join(
                f"× {lr:g}: " + ", ".join(loss_there(v, lr) for v in vs) for lr, vs in sorted(held.items(), reverse=True))]


def long_run_claims(data: Path) -> list[str]:
    """The sentences of the 2,000-step runs' reading (descriptive, as far as archived): the runs in, each variant's
    median and range at 2,000 steps over its seeds (lowest first), and how far each is below its stage-C median at
    600 steps."""
    got = B2.read_archive(data / "runs" / "stabiliser-bench-2")
    if got["L2000"] is None or got["L2000"][0].empty:
        raise LookupError("round two's 2,000-step runs are not in the archive")
    runs = got["L2000"][0]
    _, c_runs = stage_c(data)
    at_600 = c_runs.groupby("variant").val_loss.median()
    rows = sorted(((g.val_loss.median(), v, g) for v, g in runs.groupby("variant", sort=False)), key=lambda t: t[0])
    not_stable = runs[runs.verdict != "stable"]
    return [
        f"{len(runs)} of the {B2.L2000_RUNS} runs of 2,000 steps are archived ("
        + "; ".join(f"{v}: seeds {' '.join(str(s) for s in sorted(g.seed))}" for _, v, g in rows) + ")",
        "median val loss at 2,000 steps, lowest first: " + ", ".join(
            f"{v} {m:.3f} ({g.val_loss.min():.3f}-{g.val_loss.max():.3f}, {len(g)} seed{'s' if len(g) > 1 else ''})"
            for m, v, g in rows),
        "below its stage-C median at 600 steps by " + ", ".join(f"{v} {at_600[v] - m:.3f}" for m, v, _ in rows),
        f"{len(not_stable)} of them not `stable`"
        + (f" ({', '.join(f'{r.variant} seed {r.seed}: `{r.verdict}`' for r in not_stable.itertuples())})"
           if len(not_stable) else ""),
    ]
