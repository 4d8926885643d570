"""The stabiliser benchmark (issue 56; plan fixed before its runs: docs/plans/2026-12-04-stabiliser-benchmark.md).
No torch.

    python analysis/stabiliser_benchmark.py docs/data/runs/stabiliser-map [--final] [--out FILE]

Reads the benchmark's archive (one record per probe of `experiments/stabiliser-map.toml`: 12 variants at K = 12,
L = 2, seeds 1-6, lr scale 1 ... 256 by 2, 600 steps), or a map pooled with it by `flt-diag map --baseline` (new
variants beside the 12): the variants, seeds, grid and K are read from the folder's sweep.json (`Bench`; the plan's
where there is none), and the families are each variant against LT and against FLT, where the map has them. It
prints Markdown: the probes archived and the code that
made them; per line (variant, seed) its breaking lr read as the plan says (the lowest grid value whose probe is not
`stable`; "> 256" when it held at the top); per variant the median (on the log2 scale) and range over its finished
lines; and, once all 72 lines are finished (or with --final at the plan's cut-off), the primary: every variant
against LT (one-sided exact Mann-Whitney, H1: breaks at a higher lr) and against FLT (two-sided), Holm-corrected
within each family of 11.
The secondary failure count at lr x 1 is over the lines whose bisection probed x 1; the secondary loop dynamics
(descriptive) are, per variant, the medians over its finished lines of the records at the last loop-dynamics
snapshot of the probe just below the breaking lr (the last stable) and of the probe at it (the first broken).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.stats import PermutationMethod, mannwhitneyu  # noqa: E402

from flt_diag.judge.map_boundaries import log_median  # noqa: E402  (amendment of 2026-12-04 22:35 UTC)
from flt_diag.results.report import markdown  # noqa: E402
from flt_diag.storage import archive  # noqa: E402
from flt_diag.storage import metric_names as M  # noqa: E402
from flt_diag.storage.code_version import describe  # noqa: E402
from flt_diag.storage.folders import StorageError, load_metrics, load_summary, run_dirs  # noqa: E402
from script_exit import plan_report  # noqa: E402

VARIANTS = ["lt", "lt-ii", "lt-ai", "fla", "flt", "parcae", "huginn", "stars", "jacobian-fro", "residual-scale",
            "deeploop", "loop-embed"]  # the plan's 12, in experiments/stabiliser-map.toml's order
PAPER = VARIANTS[:5]
SEEDS = [1, 2, 3, 4, 5, 6]  # (the 13:15 amendment: six, not five)
GRID = [2.0 ** i for i in range(9)]  # 1, 2, ..., 256 (ratio 2)
ABOVE = 2 * GRID[-1]  # the rank of "held at the top of the grid" (above every grid value; rank tests only)
ALPHA = 0.05
FAMILIES = (("lt", "greater"), ("flt", "two-sided"))  # each variant against LT (holds longer), against FLT (differs)


@dataclass(frozen=True)
class Bench:
    """What is analysed: the variants (in the map's order), the seeds, the grid, the loop count K, and the
    families (reference, alternative), each reference one of the variants. PLAN is the plan's; `of_spec` reads them
    from a map's sweep.json (a map pooled with new variants by `flt-diag map --baseline`: the baseline's and the
    new ones), so a new variant needs no edit here."""

    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    grid: tuple[float, ...]
    loops: int
    families: tuple[tuple[str, str], ...] = FAMILIES

    @property
    def above(self) -> float:
        return 2 * self.grid[-1]

    @classmethod
    def of_spec(cls, spec: dict) -> "Bench":
        if spec.get("kind") != "map" or spec.get("axis") != "lr" or len(spec.get("loops") or []) != 1:
            raise StorageError("the benchmark is a map along the lr scale at one loop count; this folder's map is not")
        return cls(tuple(spec["variants"]), tuple(int(x) for x in spec["seeds"]), tuple(float(x) for x in spec["grid"]),
                   int(spec["loops"][0]), tuple(f for f in FAMILIES if f[0] in spec["variants"]))


PLAN = Bench(tuple(VARIANTS), tuple(SEEDS), tuple(GRID), 12)


def bench_of(root: Path) -> Bench:
    """The benchmark a map folder holds, from its sweep.json (the plan's where it holds no map's)."""
    path = Path(root) / "sweep.json"
    try:
        spec = json.loads(path.read_text()) if path.is_file() else {}
        return Bench.of_spec(spec) if isinstance(spec, dict) and spec.get("kind") == "map" else PLAN
    except StorageError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise StorageError(f"{path}: not a map's spec ({str(e)[:80] or type(e).__name__})") from None


def probes_table(root: Path) -> pd.DataFrame:
    """One row per archived probe: variant, seed, lr scale, verdict, val loss and the code that made it."""
    rows = []
    for d in run_dirs(Path(root)):
        s = load_summary(d)
        if s is None:
            continue
        code = archive.read_meta(d).code if archive.is_record(d) else None
        rows.append(dict(variant=s.variant, seed=int(s.seed), lr=float(s.lr_scale), loops=int(s.loops),
                         verdict=s.verdict, val_loss=s.val_loss, code=describe((code or {}).get("run")), path=str(d)))
    if not rows:
        raise StorageError(f"no finished probes of the benchmark in {root}")
    return pd.DataFrame(rows)


def read_line(probes: pd.DataFrame, grid=tuple(GRID)) -> dict:
    """One line's probes -> its breaking lr as the plan reads it (`probes`: lr, verdict of one variant and seed).

    breaking: the lowest grid value not `stable` (ABOVE when every probe held and the top was probed);
    finished: the bracket is closed (broke at the grid's first value, held at its top, or the grid value just
    below the breaking one held); monotone: no probe above the breaking one held."""
    held = {lr for lr, v in zip(probes.lr, probes.verdict) if v == "stable"}
    broke = {lr for lr, v in zip(probes.lr, probes.verdict) if v != "stable"}
    if broke:
        b = min(broke)
        i = grid.index(b) if b in grid else None
        finished = i == 0 or (i is not None and grid[i - 1] in held)
        return dict(breaking=b, finished=finished, monotone=not any(lr > b for lr in held), probes=len(probes))
    return dict(breaking=2 * grid[-1], finished=grid[-1] in held, monotone=True, probes=len(probes))


def lines_table(probes: pd.DataFrame, bench: Bench = PLAN) -> pd.DataFrame:
    rows = [dict(variant=v, seed=s, **read_line(g, bench.grid)) for (v, s), g in probes.groupby(["variant", "seed"], sort=False)]
    out = pd.DataFrame(rows, columns=["variant", "seed", "breaking", "finished", "monotone", "probes"])
    order = {v: i for i, v in enumerate(bench.variants)}
    return out.sort_values(["variant", "seed"], key=lambda c: c.map(order) if c.name == "variant" else c,
                           ignore_index=True)


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1), in the input's order."""
    order = np.argsort(p, kind="stable")
    adjusted, running = np.empty(len(p)), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def exact_p(x, y, alternative: str) -> float:
    """Mann-Whitney on log2 breaking lr, exact over every split of the lines, ties included."""
    x, y = np.log2(np.asarray(x, float)), np.log2(np.asarray(y, float))
    return float(mannwhitneyu(x, y, alternative=alternative, method=PermutationMethod(n_resamples=np.inf)).pvalue)


def comparisons(lines: pd.DataFrame, bench: Bench = PLAN) -> pd.DataFrame:
    """The plan's two families (of 11 for its 12 variants: one less than the variants): each variant against LT
    (one-sided, holds longer) and against FLT (two-sided), Holm within each family."""
    done = lines[lines.finished]
    of = {v: done[done.variant == v].breaking.to_numpy(float) for v in bench.variants}
    rows = [dict(variant=v, against=ref, alternative=alt, n=len(of[v]), p=exact_p(of[v], of[ref], alt))
            for ref, alt in bench.families for v in bench.variants if v != ref]
    out = pd.DataFrame(rows)
    out["p (Holm)"] = out.groupby("against").p.transform(lambda p: holm(p.tolist()))
    out["decision"] = np.where(out["p (Holm)"] < ALPHA,
                               np.where(out.against == "lt", "holds longer than LT", "differs from FLT"), "-")
    return out


DYNAMICS = [M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_PERTURBATION_GROWTH, M.TOKEN_COSINE,
            M.LOOP_GRAD_COSINE]


def snapshot(path: str, loops: int) -> dict:
    """A probe's loop dynamics at its last snapshot (the last step with a spectral radius): the final loop's
    spectral radius and its Ritz residual, the geometric mean perturbation growth per loop, the final loop's
    token cosine (its last record), and the gradient agreement (loop_grad_cosine) averaged over loops and layers
    (values outside [-1, 1], a recording error of the runs' code, left out and counted)."""
    df = load_metrics(path, DYNAMICS)
    radius = df[df.metric == M.LOOP_SPECTRAL_RADIUS]
    if radius.empty:
        return {}
    at = df[df.step == radius.step.max()]

    def final(metric):
        sel = at[(at.metric == metric) & (at.loop == loops)].value
        return float(sel.iloc[-1]) if len(sel) else np.nan
    growth = at[at.metric == M.LOOP_PERTURBATION_GROWTH].value.to_numpy(float)
    cosine = df[(df.metric == M.TOKEN_COSINE) & (df.loop == loops)].sort_values("step").value
    # (the frozen code of the benchmark's runs gave |cosine| > 1 where a loop's gradient was ~1e-20: float32
    # underflow, fixed in flt_diag after those runs; such values are left out and counted)
    agreement = at[at.metric == M.LOOP_GRAD_COSINE].value
    return {"spectral radius": final(M.LOOP_SPECTRAL_RADIUS), "residual": final(M.LOOP_SPECTRAL_RESIDUAL),
            "growth": float(np.exp(np.log(np.clip(growth, 1e-30, None)).mean())) if len(growth) else np.nan,
            "token cosine": float(cosine.iloc[-1]) if len(cosine) else np.nan,
            "agreement": float(agreement[agreement.abs() <= 1].mean()), "agreement outside [-1, 1]":
            int((agreement.abs() > 1).sum())}


def dynamics_table(lines: pd.DataFrame, probes: pd.DataFrame, grid=tuple(GRID)) -> pd.DataFrame:
    """Per variant and side (last stable, first broken): the medians of `snapshot` over its finished lines."""
    rows = []
    for line in lines[lines.finished].itertuples() if "path" in probes else ():
        i = grid.index(line.breaking) if line.breaking in grid else len(grid)
        sides = {"last stable": grid[i - 1] if i > 0 else None, "first broken": line.breaking if i < len(grid) else None}
        for side, lr in sides.items():
            hit = probes[(probes.variant == line.variant) & (probes.seed == line.seed) & (probes.lr == lr)]
            if lr is not None and len(hit):
                rows.append(dict(variant=line.variant, side=side, **snapshot(hit.path.iloc[0], int(hit.loops.iloc[0]))))
    if not rows:
        return pd.DataFrame()
    table = pd.DataFrame(rows).groupby(["variant", "side"], sort=False).agg(
        lambda c: float(np.nanmedian(c)) if c.notna().any() else np.nan)
    n = pd.DataFrame(rows).groupby(["variant", "side"], sort=False).size().rename("lines")
    return table.join(n).reset_index().round(3)


def lr_text(v: float, grid=tuple(GRID)) -> str:
    """A breaking lr as the table writes it: "> 256" above the grid's top (a median with a line above the grid
    among its middle two is above the top as well), else three significant digits."""
    return f"> {grid[-1]:g}" if v > grid[-1] else f"{v:.3g}"


def variants_table(lines: pd.DataFrame, probes: pd.DataFrame, bench: Bench = PLAN) -> pd.DataFrame:
    rows, grid = [], bench.grid

    def text(x):
        return lr_text(x, grid)
    for v in bench.variants:
        g, p1 = lines[lines.variant == v], probes[(probes.variant == v) & (probes.lr == grid[0])]
        done = g[g.finished].sort_values("seed")
        rows.append({"variant": v + (" (paper)" if v in PAPER else ""), "lines finished": f"{len(done)}/{len(bench.seeds)}",
                     "breaking lr (median)": text(log_median(done.breaking)) if len(done) else "-",
                     "range": f"{text(done.breaking.min())}-{text(done.breaking.max())}" if len(done) else "-",
                     "per seed": " ".join(f"{s}:{text(b)}" + ("" if m else "*")
                                          for s, b, m in zip(done.seed, done.breaking, done.monotone)) or "-",
                     "failed at x 1 (where probed)": f"{int((p1.verdict != 'stable').sum())}/{len(p1)}"})
    return pd.DataFrame(rows)


def report_from(probes: pd.DataFrame, final: bool = False, bench: Bench = PLAN) -> str:
    probes = probes[probes.variant.isin(bench.variants) & probes.seed.isin(bench.seeds) & (probes.loops == bench.loops)]
    if probes.empty:
        raise StorageError(f"no probe of the benchmark (its {len(bench.variants)} variants at K = {bench.loops}, seeds "
                           f"{', '.join(map(str, bench.seeds))}) in these records")
    lines = lines_table(probes, bench)
    n_done, n_all = int(lines.finished.sum()), len(bench.variants) * len(bench.seeds)
    out = [f"Probes archived: {len(probes)}; lines finished: {n_done} of {n_all}.", "",
           "Code: " + "; ".join(f"{c} ({n} probes)" for c, n in probes.code.value_counts().items()), "",
           markdown(variants_table(lines, probes, bench)), "",
           f"A breaking lr is the lowest lr scale whose probe was not `stable` (criterion `training`); \"> {bench.grid[-1]:g}\": held "
           "at the grid's top; the median is taken on the log2 scale (with an even count, the geometric middle of the "
           "middle two lines); * marks a line whose probes were not monotone (one held above the breaking lr).", ""]
    dynamics = dynamics_table(lines, probes, bench.grid)
    if len(dynamics):
        out += ["Secondary, descriptive: the loop dynamics at the last snapshot of the last stable and the "
                "first broken probe, medians over the finished lines (spectral radius and growth of the final loop's "
                "map; a residual above 0.01 marks an unconverged radius):", "", markdown(dynamics), ""]
    if n_done < n_all and not final:
        out.append(f"**No test yet** (the plan: the primary is tested once all {n_all} lines are finished; "
                   f"{n_all - n_done} are not). The medians above are progress, not a result.")
        return "\n".join(out) + "\n"
    few = [v for v in bench.variants if (lines.finished & (lines.variant == v)).sum() < 2]
    if few:
        out.append(f"**No test**: the exact test needs two finished lines of each variant ({', '.join(few)} "
                   "has fewer).")
        return "\n".join(out) + "\n"
    table = comparisons(lines, bench)
    shown = table.assign(p=table.p.map(lambda p: f"{p:.4f}"), **{"p (Holm)": table["p (Holm)"].map(lambda p: f"{p:.4f}")})
    out += [f"The primary (exact Mann-Whitney on log2 breaking lr, Holm within each family of {len(bench.variants) - 1}, "
            "alpha 0.05):", "",
            markdown(shown), ""]
    longer = table[(table.against == "lt") & (table["p (Holm)"] < ALPHA)].variant.tolist()
    differ = table[(table.against == "flt") & (table["p (Holm)"] < ALPHA)].variant.tolist()
    out.append(f"By the plan: holds longer than LT: {', '.join(longer) or 'none'}; differs from FLT: "
               f"{', '.join(differ) or 'none (every other variant is indistinguishable from FLT at this power)'}.")
    if n_done < n_all:
        out.append(f"(--final: {n_all - n_done} lines unfinished at the cut-off are left out.)")
    return "\n".join(out) + "\n"


def report(root: Path, final: bool = False) -> str:
    """The report of a benchmark folder or archive: variants, seeds, grid and K read from its sweep.json."""
    return report_from(probes_table(root), final, bench_of(root))


main = plan_report(__doc__, report, "the benchmark's archive (docs/data/runs/stabiliser-map)")


if __name__ == "__main__":
    sys.exit(main())
