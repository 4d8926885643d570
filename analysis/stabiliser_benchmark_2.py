"""The head-to-head, round two (issue 66 part 4; plan fixed before its runs: docs/plans/2026-12-05-stabiliser-
benchmark-2.md), generated from its archive. No torch.

    python analysis/stabiliser_benchmark_2.py docs/data/runs/stabiliser-bench-2 [--out DIR]

Reads the stage folders under the root, each holding archived records or run folders (directly or one level
down), whichever exist: A-strength-<x> (x = 0.5, 1, 2, 4: stage A), B and B-<anything> (stage B), C (stage C; its
runs' eval_loops.csv: stage E), D (stage D's maps), L2000. Prints Markdown: the answer table first (per variant its
tuned strength, best lr, val loss there against FLT, stability margin, failure kind at the breaking lr,
extrapolation), then each stage as the plan reads it (rules in analysis/benchmark_2_rules.py). A stage not complete
is "not run" or "not finished (n of N runs)" and decides nothing; stage C's test is made only once all its 96 runs
are in. --out DIR also draws the figure (val loss against lr per variant, breaking points marked) there.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import benchmark_2_cpu as CPU  # noqa: E402  (which CPU kind and code ran each run)
import benchmark_2_rules as R  # noqa: E402
from flt_diag.config.variants import STABILISERS  # noqa: E402
from flt_diag.results.report import markdown as _markdown  # noqa: E402
from flt_diag.storage.folders import StorageError, load_config, load_eval_loops, load_summary, run_dirs  # noqa: E402
from script_exit import Parser, emit, folder, guarded  # noqa: E402
from stabiliser_benchmark import VARIANTS as ROUND_ONE, snapshot  # noqa: E402


def markdown(df: pd.DataFrame) -> str:
    return _markdown(df).rstrip("\n")


STRENGTHS = (0.5, 1.0, 2.0, 4.0)  # stage A's multipliers of the source's value
LRS = (0.5, 1.0, 2.0, 4.0)  # stage B's lr scales
SOURCE_RECIPES = {"parcae": "parcae-source", "stars": "stars-source", "jacobian-fro": "jacobian-fro-source"}
VARIANTS = [SOURCE_RECIPES.get(v, v) for v in ROUND_ONE]  # the plan's 12: round one's, three as their sources train them
STRENGTH_KEY = {"parcae-source": "decay", "stars-source": "lambda", "jacobian-fro-source": "gamma",
                "residual-scale": "lambda", "deeploop": "exponent"}  # the five strengths, by the name `ours` gives them
TUNED = list(STRENGTH_KEY)
CONFIRM_SEEDS = tuple(range(1, 9))
D_SEEDS = (1, 2, 3)
EXTRAPOLATE = (6, 9, 18, 24)  # stage E: val loss at these K minus at 12
COLUMNS = ["variant", "seed", "lr", "strength", "verdict", "val_loss", "exploded", "unigram", "loops", "path",
           "steps", "steps_done", "wall_time"]


def _dirs(folder: Path, depth: int = 2) -> list[Path]:
    """The runs of a stage folder: its records or run folders, or those of the folders up to `depth` levels down
    (a stage's slice folder holding the archive `--archive-to` names after its study: A-strength-1/fixed/<study>/)."""
    try:
        return run_dirs(folder)
    except StorageError:
        subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
        if not subs or depth == 0:
            raise
        return [d for p in subs for d in _dirs(p, depth - 1)]


def runs_in(folder: Path, strength: float | None = None) -> tuple[pd.DataFrame, int]:
    """(one row per finished run, the count of unfinished ones); `strength`: the stage folder's, which a run's
    model.strength (where its config has one) must equal."""
    rows, unfinished = [], 0
    for d in _dirs(folder):
        s = load_summary(d)
        if s is None:
            unfinished += 1
            continue
        given = getattr(load_config(d).model, "strength", None)
        if strength is not None and given is not None and float(given) != strength:
            raise StorageError(f"{d}: model.strength {given}, but it is in the folder of strength x {strength:g}")
        h1 = s.evidence.unigram_entropy
        val = math.nan if s.val_loss is None else float(s.val_loss)
        rows.append(dict(variant=s.variant, seed=int(s.seed), lr=float(s.lr_scale),
                         strength=float(given if given is not None else (strength or 1.0)), verdict=s.verdict,
                         val_loss=val, exploded=bool(s.residual_explosion_any or s.residual_explosion),
                         unigram=bool(h1 is not None and not val < h1), loops=int(s.loops), path=str(d),
                         steps=int(s.steps), steps_done=int(s.steps_done), wall_time=float(s.wall_time or 0.0)))
    return pd.DataFrame(rows, columns=COLUMNS), unfinished


def present(path: Path) -> bool:
    """Whether a stage's folder is there (absent: not run); a file or FIFO under its name is one line."""
    if not os.path.lexists(path):
        return False
    if not path.is_dir():
        raise StorageError(f"{path} is not a folder (a stage's runs are archived in a folder of that name)")
    return True


def read_archive(root: Path) -> dict:
    """Every stage's runs as far as archived: {stage: (runs, unfinished) or None where its folder is absent}."""
    root = Path(root)
    out: dict = {}
    a = [runs_in(root / f"A-strength-{x:g}", x) for x in STRENGTHS if present(root / f"A-strength-{x:g}")]
    out["A"] = (pd.concat([r for r, _ in a], ignore_index=True), sum(n for _, n in a)) if a else None
    b = [runs_in(p) for p in sorted(root.glob("B*")) if (p.name == "B" or p.name.startswith("B-")) and present(p)]
    out["B"] = (pd.concat([r for r, _ in b], ignore_index=True), sum(n for _, n in b)) if b else None
    for stage in ("C", "D", "L2000"):
        out[stage] = runs_in(root / stage) if present(root / stage) else None
    return out


def status(got, expected: int, what: str) -> tuple[bool, str]:
    """(complete, the plan's words): "not run" without a folder, "not finished (n of N runs)" short of N."""
    if got is None:
        return False, f"{what}: not run."
    runs, unfinished = got
    n = len(runs)
    more = f"; {unfinished} unfinished" if unfinished else ""
    if n < expected:
        return False, f"{what}: not finished ({n} of {expected} runs{more})."
    return True, f"{what}: all {expected} runs in{more}."


def stage_a(got) -> tuple[dict | None, list[str]]:
    """{variant: choice} once stage A is complete (its 40 runs), else None; and its lines."""
    runs = None if got is None else got[0][got[0].variant.isin(TUNED) & got[0].seed.isin(R.SELECTION_SEEDS)
                                           & (got[0].lr == 1.0)]
    done, said = status(None if got is None else (runs.drop_duplicates(["variant", "strength", "seed"]), got[1]),
                        len(TUNED) * len(STRENGTHS) * 2, "Stage A (strengths, seeds 101-102, lr x 1)")
    if not done:
        return None, [said]
    chosen = {}
    for v in TUNED:
        c = R.choose(runs[runs.variant == v], "strength")
        chosen[v] = dict(c, value=c["value"] if c["value"] is not None else 1.0,
                         label="" if c["value"] is not None else "no stable strength at x 1")
    return chosen, [said]


def stage_b_pool(got, a_runs, strengths: dict) -> pd.DataFrame:
    """Stage B's runs and stage A's reused ones at each variant's chosen strength, lr x 0.5-4, selection seeds."""
    pool = pd.concat([x for x in (None if got is None else got[0], a_runs) if x is not None], ignore_index=True)
    want = pool.variant.map(lambda v: strengths.get(v, {"value": 1.0})["value"])
    pool = pool[(pool.strength == want) & pool.lr.isin(LRS) & pool.seed.isin(R.SELECTION_SEEDS)]
    return pool.drop_duplicates(["variant", "lr", "seed"])


def stage_b(got, a_runs, strengths: dict | None) -> tuple[dict | None, list[str]]:
    """{variant: choice} once stage B is complete (every variant at its strength, 4 lrs x 2 seeds, with stage A's
    runs at lr x 1 reused), else None; and its lines."""
    if strengths is None:
        return None, ["Stage B (best lr): not read (stage A not finished)." if got is not None else
                      "Stage B (best lr): not run."]
    pool = stage_b_pool(got, a_runs, strengths)
    done, said = status(None if got is None else (pool[pool.variant.isin(VARIANTS)], got[1]),
                        len(VARIANTS) * len(LRS) * 2, "Stage B (lr x 0.5-4 at the chosen strength, seeds 101-102)")
    if not done:
        return None, [said]
    best = {}
    for v in VARIANTS:
        c = R.choose(pool[pool.variant == v], "lr")
        best[v] = dict(c, value=c["value"] if c["value"] is not None else 0.5,
                       label="" if c["value"] is not None else "no stable lr in x 0.5-4")
    return best, [said]


def stage_c(got, strengths: dict | None = None,
            best: dict | None = None) -> tuple[pd.DataFrame | None, pd.DataFrame, list[str]]:
    """(the primary's table once all 96 runs are in, else None; C's runs; its lines). A partial stage C is
    listed, never tested (the plan's cut-off); nor is one before stage B has chosen each variant's lr, and a run at
    another strength or lr than stages A and B chose is counted and left out (the plan runs C at those only)."""
    runs = pd.DataFrame(columns=COLUMNS) if got is None else got[0]
    runs = runs[runs.variant.isin(VARIANTS) & runs.seed.isin(CONFIRM_SEEDS)]
    if got is not None and best is None:
        return None, runs.drop_duplicates(["variant", "seed"]), [
            f"Stage C (the primary, seeds 1-8): {len(runs)} runs archived, not read (stage B has not chosen the lrs)."]
    off = 0
    if best is not None:
        chosen = runs.variant.map(lambda v: (strengths or {}).get(v, {"value": 1.0})["value"])
        at = (runs.strength == chosen) & (runs.lr == runs.variant.map(lambda v: best[v]["value"]))
        runs, off = runs[at], int((~at).sum())
    runs = runs.drop_duplicates(["variant", "seed"])
    done, said = status(None if got is None else (runs, got[1]), len(VARIANTS) * len(CONFIRM_SEEDS),
                        "Stage C (the primary, seeds 1-8)")
    if off:
        said += f" {off} runs at another strength or lr than stages A and B chose, left out."
    if not done:
        if len(runs):
            said += " Archived: " + ", ".join(f"{v} {len(g)}" for v, g in runs.groupby("variant", sort=False)) + \
                    ". No test until all are in."
        return None, runs, [said]
    order = {v: i for i, v in enumerate(VARIANTS)}
    runs = runs.sort_values(["variant", "seed"], key=lambda c: c.map(order) if c.name == "variant" else c)
    return R.primary(runs), runs, [said]


def stage_d(got, best: dict | None) -> pd.DataFrame:
    """Per variant (in the benchmark's order): finished lines of stage D (seeds 1-3), median breaking lr (log2),
    margin over the best lr, failure kinds at the breaking lr, the step each breaking probe ended at (`stopped`: a
    kind is the verdict there), and the lines started but not finished (`open`: left out of the medians)."""
    if got is None or got[0].empty:
        return pd.DataFrame()
    runs = got[0][got[0].seed.isin(D_SEEDS)]
    if runs.empty:  # (probes of other seeds only: no line of the plan's)
        return pd.DataFrame()
    lines = pd.DataFrame([dict(variant=v, seed=s, **R.breaking(g)) for (v, s), g in runs.groupby(["variant", "seed"])])
    rows = []
    order = {v: i for i, v in enumerate(VARIANTS)}
    for v, g in sorted(lines.groupby("variant"), key=lambda vg: order.get(vg[0], len(order))):
        open_lines, g = int((~g.finished).sum()), g[g.finished]
        if g.empty:  # (started, none finished: a row that says so, no median)
            rows.append(dict(variant=v, lines=0, breaking=math.nan, margin=math.nan, kinds="", stopped="",
                             open=open_lines))
            continue
        at = g.breaking.fillna(2 * R.GRID_D[-1]).to_numpy(float)
        b = best.get(v, {}).get("value") if best else None
        rows.append(dict(variant=v, lines=len(g), breaking=R.log2_median(at),
                         margin=R.log2_median(at / b) if b else math.nan, kinds=" ".join(g.kind),
                         stopped=" ".join("-" if s is None or s != s else str(int(s)) for s in g.stop),
                         open=open_lines))
    return pd.DataFrame(rows)


def eval_loops(path: str) -> pd.DataFrame | None:
    """A run's or record's eval_loops table, checked as every reader checks it (None: not evaluated)."""
    return load_eval_loops(Path(path))


def stage_e(c_runs: pd.DataFrame) -> pd.DataFrame:
    """Per variant: the median over its seeds of val loss at each K of EXTRAPOLATE minus at K = 12; the seed spread
    at K = 12 (max - min over its seeds of the val loss there, "spread@12"); and, for K = 18 and 24 (the loop counts
    above training's), whether that median lies within the spread (|median| <= spread: the plan's "stays within the
    seed spread of their loss at 12"; the amendment of 2026-12-07 12:52 UTC fixed this reading)."""
    rows = []
    for r in c_runs.itertuples():
        t = eval_loops(r.path)
        if t is None:
            continue
        at = dict(zip(t.loops.astype(int), t.val_loss.astype(float)))
        if 12 in at:
            rows.append(dict(variant=r.variant, at12=at[12],
                             **{f"K={k}": at.get(k, math.nan) - at[12] for k in EXTRAPOLATE}))
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    g = df.groupby("variant", sort=False)
    out = g[[f"K={k}" for k in EXTRAPOLATE]].median()
    out["spread@12"] = g.at12.max() - g.at12.min()
    for k in (18, 24):
        out[f"within@{k}"] = ["yes" if abs(m) <= s else "no" if math.isfinite(m) else "-"
                              for m, s in zip(out[f"K={k}"], out["spread@12"])]
    return out.join(g.size().rename("runs"))


def dynamics(b_runs: pd.DataFrame | None) -> pd.DataFrame:
    """The secondary loop dynamics at matched lrs (stage B's): per variant and lr the medians of the last
    snapshot over runs neither exploded nor at unigram level; those are counted, not averaged in."""
    rows = []
    for (v, lr), g in ([] if b_runs is None else b_runs.groupby(["variant", "lr"])):
        bad = g.exploded | g.unigram
        snaps = [snapshot(r.path, r.loops) for r in g[~bad].itertuples()]
        snaps = [s for s in snaps if s]
        row = dict(variant=v, lr=lr, runs=len(snaps), exploded=int(g.exploded.sum()),
                   unigram=int((g.unigram & ~g.exploded).sum()))
        for k in ("spectral radius", "growth", "token cosine"):
            row[k] = float(np.nanmedian([s[k] for s in snaps])) if snaps else math.nan
        rows.append(row)
    return pd.DataFrame(rows).round(3) if rows else pd.DataFrame()


def ours(v: str) -> bool:
    """Whether the variant's strength (its source value, the grid's x 1) is flt-diag's choice (`flt-diag variants`)."""
    s = STABILISERS.get(v)
    return bool(s and STRENGTH_KEY.get(v) in s.ours)


def fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def answer(strengths, best, tests, margins, extra, c_runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """The table a researcher reads first: a row per variant; FLT's val loss is its own stage-C runs' (the
    reference every test is against), once stage C is tested."""
    rows = []
    for v in VARIANTS:
        s = (strengths or {}).get(v)
        strength = ("-" if v not in TUNED else "not decided" if s is None else
                    f"x {s['value']:g}" + (" (ours)" if ours(v) else "") + (f" ({s['label']})" if s["label"] else ""))
        b = (best or {}).get(v)
        t = tests[tests.variant == v] if tests is not None and len(tests) else pd.DataFrame()
        m = margins[margins.variant == v] if len(margins) else pd.DataFrame()
        row = {"variant": v, "strength": strength,
               "best lr": "not decided" if b is None else f"x {b['value']:g}" + (f" ({b['label']})" if b["label"] else "")}
        ref = c_runs.val_loss[c_runs.variant == v] if v == "flt" and tests is not None and c_runs is not None else ()
        if len(t):
            r = t.iloc[0]
            row["val loss (median, range)"] = f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
            row["minus FLT [95 %]"] = f"{r['shift']:+.3f} [{r.low:+.3f}, {r.high:+.3f}]: {r.reading}"
        elif len(ref):
            row["val loss (median, range)"] = f"{ref.median():.3f} ({ref.min():.3f}-{ref.max():.3f})"
            row["minus FLT [95 %]"] = "(the reference)"
        else:
            row["val loss (median, range)"] = row["minus FLT [95 %]"] = "-"
        row["margin"] = fmt(m.margin.iloc[0], ".3g") if len(m) else "-"
        row["failure at breaking lr"] = (m.kinds.iloc[0] or "-") if len(m) else "-"
        row["val loss at K=6/9/18/24 minus K=12"] = (" / ".join(fmt(extra.loc[v, f"K={k}"], "+.3f") for k in EXTRAPOLATE)
                                                     if len(extra) and v in extra.index else "-")
        rows.append(row)
    return pd.DataFrame(rows)


def primary_table(tests: pd.DataFrame) -> str:
    shown = pd.DataFrame({
        "variant": tests.variant, "runs (failed)": [f"{n} ({k})" for n, k in zip(tests.n, tests.failed)],
        "median (range)": [f"{m:.3f} ({a:.3f}-{b:.3f})" for m, a, b in zip(tests["median"], tests["min"], tests["max"])],
        "sd": tests.sd.map(fmt), "FLT median": tests.flt_median.map(fmt),
        "p (Holm)": [f"{p:.4f} ({q:.4f})" for p, q in zip(tests.p, tests.p_holm)],
        "shift [95 %]": [f"{s:+.3f} [{lo:+.3f}, {hi:+.3f}]" for s, lo, hi in zip(tests["shift"], tests.low, tests.high)],
        "by the plan": tests.reading})
    return markdown(shown)


L2000_RUNS = 16  # the plan's 2,000-step runs: four variants, seeds 1-4


def descriptive(got) -> list[str]:
    """The 2,000-step runs as far as archived: per variant (in the archive's order) the seeds in, val loss median
    and range over them, and the runs not `stable` (counted, their val loss kept: descriptive, no test)."""
    if got is None or got[0].empty:
        return ["At 2,000 steps: not run."]
    runs = got[0]
    rows = [dict(variant=v, seeds=" ".join(str(s) for s in sorted(g.seed)), median=g.val_loss.median(),
                 min=g.val_loss.min(), max=g.val_loss.max(), not_stable=int((g.verdict != "stable").sum()))
            for v, g in runs.groupby("variant", sort=False)]
    t = pd.DataFrame(rows).round(3)
    return [f"At 2,000 steps (seeds 1-4, descriptive, no test; {len(runs)} of {L2000_RUNS} runs archived, "
            f"steps {', '.join(str(x) for x in sorted(set(runs.steps)))}):", "", markdown(t)]


def compute(stages: dict) -> list[str]:
    """The benchmark's real hours as far as archived (issue 64): per stage its runs, the sum of their own wall times,
    and the share of their steps trained (a run stopped once its outcome was certain trains fewer)."""
    lines = []
    for stage in ("A", "B", "C", "D", "L2000"):
        runs = stages[stage][0] if stages[stage] else None
        if runs is None or runs.empty:
            continue
        lines.append(f"stage {stage}: {len(runs)} runs, {runs.wall_time.sum() / 3600:.1f} lane-hours, "
                     f"{100 * runs.steps_done.sum() / runs.steps.sum():.0f} % of their steps trained"
                     + (R.line_cost(runs[runs.seed.isin(D_SEEDS)]) if stage == "D" else ""))
    if not lines:
        return []
    return ["Compute so far (each archived run's own wall time, summed: lane-hours on the machine that ran it, shared "
            "with other work, so not a cost benchmark; the steps not trained are those the stop once decided saved):",
            "", *[f"* {line}" for line in lines], ""]


def sections(stages: dict, root: Path | None = None) -> tuple[list[str], dict]:
    a_runs = stages["A"][0] if stages["A"] else None
    strengths, a_lines = stage_a(stages["A"])
    best, b_lines = stage_b(stages["B"], a_runs, strengths)
    tests, c_runs, c_lines = stage_c(stages["C"], strengths, best)
    margins, extra = stage_d(stages["D"], best), stage_e(c_runs)
    out = ["**The answer** (stage C's val loss at each variant's tuned strength and best lr against FLT; "
           "margin: stage D's breaking lr over the best lr, median over seeds 1-3 on the log2 scale, over the lines "
           "finished so far: the stage-D table counts them):", "",
           markdown(answer(strengths, best, tests, margins, extra, c_runs)), "", *a_lines, *b_lines, *c_lines, ""]
    if tests is not None:
        out += [CPU.kinds_line(c_runs), "", *(CPU.check_lines(root, c_runs) + [""] if root is not None else [])]
        out += ["The primary (two-sided exact Mann-Whitney against FLT, Holm over the 11, Hodges-Lehmann shift "
                "variant - FLT with its exact 95 % interval):", "", primary_table(tests), "",
                "At 2,000 steps by the plan's rule (the three lowest stage-C medians, and FLT): "
                + ", ".join(R.long_runs(c_runs)) + ".", ""]
    out += (["Stage D (breaking lr, seeds 1-3, as far as archived; kinds: the verdict at each breaking probe's "
             "stop, `stopped` the step it ended at):", "", markdown(margins.round(3).astype(object).where(
                 margins.round(3).notna(), "-")), "", CPU.provenance_line(stages["D"][0]), ""]
            if len(margins) else ["Stage D (stability margin): not run.", ""])
    out += (["Stage E (val loss at K minus at K = 12, median over seeds):", "", markdown(extra.round(3).reset_index()), ""]
            if len(extra) else ["Stage E (loop extrapolation): not run.", ""])
    dyn = dynamics(stages["B"][0] if stages["B"] else None)
    out += (["Secondary loop dynamics at matched lrs (stage B's runs; medians of the last snapshot over runs neither "
             "exploded nor at unigram level, which are counted instead):", "", markdown(dyn), ""]
            if len(dyn) else ["Secondary loop dynamics: not run.", ""])
    pool = stage_b_pool(stages["B"], a_runs, strengths) if strengths is not None and stages["B"] else None
    d_runs = stages["D"][0] if stages["D"] else None
    if d_runs is not None and strengths is not None:  # (stage D runs each variant at its chosen strength only)
        d_runs = d_runs[d_runs.strength == d_runs.variant.map(lambda v: strengths.get(v, {"value": 1.0})["value"])]
    curves = [x for x in (pool, c_runs, d_runs) if x is not None]
    return out + descriptive(stages["L2000"]) + [""] + compute(stages), dict(best=best, margins=margins,
                                                                             curves=curves)


def report(root: Path, out: Path | None = None) -> str:
    lines, data = sections(read_archive(root), Path(root))
    if out is not None:
        from benchmark_2_figure import draw
        path = draw(data["curves"], VARIANTS, data["best"], data["margins"], Path(out))
        lines += ["", f"Figure: {path}"]
    return "\n".join(lines).rstrip("\n") + "\n"


@guarded
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=folder, help="the benchmark's archive (docs/data/runs/stabiliser-bench-2)")
    parser.add_argument("--out", type=Path, help="a folder to draw the figure in")
    args = parser.parse_args(argv)
    return emit(report(args.root, args.out), None)


if __name__ == "__main__":
    sys.exit(main())
