"""Every claim of docs/results.md and docs/early-warning.md that the committed data can give, recomputed (issue 53).
No torch.

    python analysis/check_claims.py [--results FILE] [--early-warning FILE] [--data DIR]

Each claim is a piece of text built from the data: from the gradient-path factorial's run archive
(DIR/runs/gradient-path/, read with flt_diag.storage), from the head-to-head's two rounds (DIR/runs/stabiliser-map/,
DIR/runs/stabiliser-bench-2/), from the loop-dynamics tables (DIR/loop-dynamics-*.csv) and
from the early-warning evaluations (DIR/warning-eval*/comparison.csv). PASS when the page says that text
(whitespace and ** aside), FAIL when it does not (the page says another number, or no longer says it). The
statements found wrong (issue 53) are checked too: FAIL if a page says one again. Exit 1 on any FAIL; bad input
(a missing page, folder or table) is one `error:` line and exit 2. Claims about runs that were not kept (most of
results.md) cannot be recomputed and are not listed.
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.stats import fisher_exact  # noqa: E402

import benchmark_claims as BC  # noqa: E402  (analysis/benchmark_claims.py: the head-to-head's lr x 1 claims)
import benchmark_2_claims as B2C  # noqa: E402  (analysis/benchmark_2_claims.py: round two's stage B reading)
from script_exit import Parser, folder, guarded  # noqa: E402  (an existing folder, or one line saying what the path is)
import factorial as F  # noqa: E402  (analysis/factorial.py: the plan's per-run quantities)
from flt_diag.storage import metric_names as M  # noqa: E402
from flt_diag.storage.files import read_table  # noqa: E402  (bounded, regular files only: DESIGN.md §9)
from flt_diag.storage.schema import read_text  # noqa: E402
from flt_diag.storage.folders import load_config, load_metrics, load_summary, run_dirs  # noqa: E402

CONVERGED = 0.01  # DESIGN.md §3: loop_spectral_residual below this = converged
RETRACTED = {  # what the pages said before issue 53, and why it is wrong
    "results": [
        ("`unstable` by the gradient-oscillation rule alone (8 of 10)",
         "the 8 truncated `unstable` runs are recovered loss spikes (transient_rebound), none oscillation-only"),
        ("spectral radius of the loop map at the stream is above 1 in every arm",
         "a statement about medians: FLT k=2 is below 1 in 4 of 10 runs"),
        ("two failing truncated runs passed 0.9", "8 of 10 truncated runs passed 0.9, failing or not"),
        ("whether A also falls in runs that do not fail was not part of the plan and is not reported",
         "the archive answers it: A falls as much in the full LT runs that do not fail"),
        ("(0.0053 inside FLT's 0.0054-0.0069)", "0.0053 lies outside 0.0054-0.0069"),
        ("LT-AI at L = 6 (all stable at 600 steps) at 7.2-8.1", "loop-dynamics-w4.csv holds 3.7-8.1"),
        ("(the L = 2 runs: 1.0-12.8)", "12.8 is the mean of the last two estimates, 34-107 the last estimate"),
    ],
    "early-warning": [],
}
RETRACTED["results"] += BC.RETRACTED_66  # what issue 66 found the head-to-head's reading saying beyond the archive


def rng(values, digits: int = 2, sep: str = "-") -> str:
    """'lo-hi' of the values at `digits` decimals ('x' when both ends print alike)."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}{sep}{hi}"


def auroc(failed, score) -> float:
    """P(a failing run scores above a non-failing one), ties half (the Mann-Whitney U over the pairs)."""
    f, s = np.asarray(score)[np.asarray(failed, bool)], np.asarray(score)[~np.asarray(failed, bool)]
    return float(((f[:, None] > s[None]).sum() + 0.5 * (f[:, None] == s[None]).sum()) / (len(f) * len(s)))


# ----------------------------------------------------------------------------- the factorial's archive
def factorial_runs(data: Path) -> pd.DataFrame:
    """factorial.run_row for every archived run, with the verdict's evidence, A at the last snapshot, the wall time."""
    rows = []
    for folder in (data / "runs" / "gradient-path" / "f-0", data / "runs" / "gradient-path" / "f-2"):
        for run in run_dirs(folder):
            if load_summary(run) is None:  # (the claims read a finished archive: a run without a summary is damage)
                raise ValueError(f"{run} has no summary (an unfinished or damaged run); the claims read finished runs")
            row, ev = F.run_row(run), load_summary(run).evidence
            cfg = load_config(run)
            K, k = cfg.model.loops, cfg.run_config().train.grad_loops
            A = F.agreement_series(load_metrics(run, [M.LOOP_GRAD_COSINE]), K - k if 0 < k < K else 0)
            row.update(spike=bool(ev.transient_rebound), climbed=ev.climb > ev.rebound_threshold,
                       osc=ev.osc_dlog_median, osc_threshold=ev.osc_dlog_threshold, A_last=float(A.iloc[-1]),
                       last_snapshot=int(A.index[-1]), wall=load_summary(run).wall_time)
            rows.append(row)
    if not rows:
        raise ValueError(f"no archived run under {data / 'runs' / 'gradient-path'}")
    return pd.DataFrame(rows)


def primary_claims(runs: pd.DataFrame, data: Path) -> list[str]:
    full, trunc, flt = (runs[runs.arm == a] for a in ("LT full", "LT k=2", "FLT k=2"))
    kf, kt = int(full.failed.sum()), int(trunc.failed.sum())
    _, p = fisher_exact([[kf, len(full) - kf], [kt, len(trunc) - kt]], alternative="greater")
    unstable = trunc[trunc.verdict == "unstable"]
    n = lambda g, c: f"{int(c.sum())} of {len(g)}"  # noqa: E731
    return [
        f"in {kf} of {len(full)} runs with full backpropagation and {kt} of {len(trunc)} with the last two loops only;"
        f" one-sided Fisher exact p = {p:.3f}",
        f"{n(full, full.verdict != 'stable')} full and {n(trunc, trunc.verdict != 'stable')} truncated LT runs end"
        " not `stable`",
        f"(median {trunc.final_loss.median():.2f} against {full.final_loss.median():.2f} nats)",
        f"The {len(unstable)} truncated `unstable` runs are {'all' if unstable.spike.all() else 'not all'} recovered"
        " loss spikes (`transient_rebound`",
        f"{'none' if not (unstable.osc > unstable.osc_threshold).any() else 'some'} is `unstable` by the"
        f" gradient-oscillation rule; every truncated LT run climbed {rng(trunc.climb)} nats",
        f"is {rng(full.osc, 3)} in full LT, above the threshold in {n(full, full.osc > full.osc_threshold)} runs, and"
        f" {rng(trunc.osc, 3)} in truncated LT, below it in all {int((trunc.osc < trunc.osc_threshold).sum())}:"
        f" the arms {'do not overlap' if trunc.osc.max() < full.osc.min() else 'overlap'}"
        f" (FLT k=2: {rng(flt.osc, 3)})",
        f"{int(trunc.climbed.sum())} of {len(trunc)} truncated and {int(full.climbed.sum())} of {len(full)} full LT"
        f" runs climbed past the rebound threshold (full: the {int((full.climbed & full.failed).sum())} `collapsed`",
        f"**FLT with the last two loops only: {int(flt.failed.sum())} of {len(flt)} failed** (all `stable`"
        if (flt.verdict == "stable").all() else "FLT k=2 not all stable",
        f"median final loss {flt.final_loss.median():.2f}",
        f"median wall time per run: LT full {full.wall.median():.0f} s, LT k=2 {trunc.wall.median():.0f} s,"
        f" FLT k=2 {flt.wall.median():.0f} s; up to {runs.wall.max():,.0f} s",
        f"archived in [data/runs/gradient-path/](data/runs/gradient-path/) ({archive_mb(data):.1f} MB)",
    ]


def archive_mb(data: Path) -> float:
    return sum(p.stat().st_size for p in (data / "runs" / "gradient-path").rglob("*") if p.is_file()) / 1e6


def agreement_claims(runs: pd.DataFrame) -> list[str]:
    full, trunc, flt = (runs[runs.arm == a] for a in ("LT full", "LT k=2", "FLT k=2"))
    fail = full[full.failed & full.agreement_fell]
    early = full[full.failed & ~full.agreement_fell]
    ok = full[~full.failed]
    last = int(runs.last_snapshot.max())
    return [
        f"in {int(fail.agreement_fell.sum())} of the {int(full.failed.sum())} failing full-backpropagation LT runs, A"
        f" fell from {rng(fail.A_first)} at step 200 to {rng(fail.A_before)} at the last snapshot before the climb's"
        f" onset (steps {int(fail.onset.min()):,}-{int(fail.onset.max()):,})",
        f"the fifth began to climb at step {int(early.onset.iloc[0])}, before a second snapshot"
        if len(early) == 1 and early.onset.iloc[0] < 2 * F.AGREEMENT_FROM else "A did not fall in several",
        "The two failing truncated runs climbed from steps "
        + " and ".join(str(int(x)) for x in sorted(trunc[trunc.failed].onset)) + ", before the first snapshot at 200",
        f"A fell by more than 0.1 before the largest climb's onset in {int(ok.agreement_fell.sum())} of the {len(ok)}"
        " full-backpropagation LT runs that did not fail",
        f"at the last snapshot (step {last:,}) A is {rng(full.A_last)} in all {len(full)} full LT runs, failing or"
        f" not ({rng(full.A_first)} at step 200)",
        f"In truncated LT it falls less ({rng(trunc.A_first)} at step 200, {rng(trunc.A_last)} at step {last:,}),"
        f" in FLT k=2 not at all ({rng(flt.A_first)} at 200, {rng(flt.A_last)} at {last:,})",
    ]


def cosine_claims(runs: pd.DataFrame) -> list[str]:
    full, trunc, lt = runs[runs.arm == "LT full"], runs[runs.arm == "LT k=2"], runs[runs.variant == "lt"]
    passed = trunc[trunc.degenerate_from.notna()]
    return [
        f"{'No' if not lt.degenerate.any() else 'Some'} LT run ends with the final loop's token cosine at or above"
        f" 0.9 (full: median {full.token_cosine.median():.2f}, effective rank {full.effective_rank.median():.1f} of"
        f" 64; truncated: at most {trunc.token_cosine.max():.2f})",
        f"{'No' if full.degenerate_from.isna().all() else 'Some'} full LT run passed 0.9 at any recorded step;"
        f" {len(passed)} of the {len(trunc)} truncated LT runs did (the {int(passed.failed.sum())} failing ones and"
        f" {int((~passed.failed).sum())} of the {int((~trunc.failed).sum())} that did not fail, first from steps"
        f" {int(passed.degenerate_from.min())}-{int(passed.degenerate_from.max()):,})",
        f"(median {trunc.token_cosine.median():.2f}, effective rank {trunc.effective_rank.median():.0f})",
    ]


def contraction_claims(runs: pd.DataFrame) -> list[str]:
    arms = [runs[runs.arm == a] for a in ("LT full", "LT k=2", "FLT k=2")]
    full, trunc, flt = arms
    conv = [int((g.spectral_residual < CONVERGED).sum()) for g in arms]
    below = flt[flt.spectral_radius < 1]
    lt = runs[runs.variant == "lt"]
    grows = runs[runs.growth >= 1]
    return [
        f"(step {int(runs.last_snapshot.max()):,}, final loop)",
        f"spectral radius LT full {full.spectral_radius.median():.2f} (Arnoldi residual"
        f" {full.spectral_residual.median():.2g}), LT k=2 {trunc.spectral_radius.median():.2f}"
        f" ({trunc.spectral_residual.median():.2g}), FLT k=2 {flt.spectral_radius.median():.2f}"
        f" ({flt.spectral_residual.median():.2g}); perturbation growth {full.growth.median():.2f},"
        f" {trunc.growth.median():.2f}, {flt.growth.median():.2f}; σ_max {full.sigma_max.median():.1f},"
        f" {trunc.sigma_max.median():.1f}, {flt.sigma_max.median():.1f}",
        f"in FLT k=2 ρ is below 1 in {len(below)} of {len(flt)} runs ({rng(below.spectral_radius)}), and in LT"
        f" {rng(lt.spectral_radius)} in all {len(lt)}",
        f"The residual is below DESIGN's convergence threshold (0.01) in {conv[0]} of {len(full)} LT full, {conv[1]}"
        f" of {len(trunc)} LT k=2 and {conv[2]} of {len(flt)} FLT k=2 runs",
        f"Of FLT's {len(below)} runs below 1, {int((below.spectral_residual < CONVERGED).sum())} is converged"
        f" ({rng(below[below.spectral_residual < CONVERGED].spectral_radius)})",
        f"(failing {rng(full[full.failed].spectral_radius)}, not failing {rng(full[~full.failed].spectral_radius)};"
        f" AUROC {auroc(full.failed, full.spectral_radius):.2f}",
        f"The perturbation growth is below 1 in {int((runs.growth < 1).sum())} of {len(runs)} runs"
        f" ({grows.arm.iloc[0]} seed {grows.seed.iloc[0]}: {grows.growth.iloc[0]:.2f})" if len(grows) == 1 else
        "growth >= 1 in several runs",
        f"(σ_max {rng(runs.sigma_max, 1)})",
    ]


# ----------------------------------------------------------------------------- the loop-dynamics tables
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def exact_p(failed, score) -> tuple[int, int, float]:
    """(placements at least as high, C(n, k), p): the exact one-sided permutation p of the AUROC, every placement
    of the k failures among the n runs."""
    from itertools import combinations
    score, k = np.asarray(score, float), int(np.sum(failed))
    observed, hits, total = auroc(failed, score), 0, 0
    for chosen in combinations(range(len(score)), k):
        mask = np.zeros(len(score), bool)
        mask[list(chosen)] = True
        hits += auroc(mask, score) >= observed - 1e-12
        total += 1
    return hits, total, hits / total


def ones_at(t: pd.DataFrame, record: str, steps=(100, 200, 300, 500)) -> list[int]:
    return [s for s in steps if round(auroc(t.failed, t[f"{record} @{s}"]), 2) == 1.0]


def set_d_claims(data: Path) -> list[str]:
    d = read_table(data / "loop-dynamics-d.csv")
    by = lambda v, K=12: d[(d.variant == v) & (d.loops == K)]  # noqa: E731
    lt12, lt9, flt, fla = by("lt"), by("lt", 9), by("flt"), by("fla")
    fp, gap = "final fixed-point residual (last loop)", "final exit-loss gap (last - best loop)"
    l6 = read_table(data / "loop-dynamics-fla-l6.csv")
    fpr, gain = "fixed-point residual (last loop)", "max loop gain"
    lt = d[d.variant == "lt"]
    exponent = f"{by('lt-ii')[fp].iloc[0]:.0e}".split("e")
    return [
        f"ends at {rng(flt.gain_last, 1)}, as high as the failing LTs' ({rng(lt12.gain_last, 1)}) and the 9-loop LTs'"
        f" that are stable at 600 steps ({rng(lt9.gain_last, 1)}). LT-AI ends at {rng(by('lt-ai').gain_last, 1)},"
        f" LT-II at {by('lt-ii').gain_last.iloc[0]:.2f}",
        f"at the last loop LT K = 12 {rng(lt12[fp])}, LT K = 9 {rng(lt9[fp])}, FLT {rng(flt[fp], 4)}, LT-AI"
        f" {rng(by('lt-ai')[fp], 4)}, LT-II {exponent[0]}·10{str(int(exponent[1])).translate(SUPERSCRIPT)}",
        f"(LT-AI's {rng(by('lt-ai')[fp], 4)}, one run, lies just below FLT's {rng(flt[fp], 4)}"
        if by("lt-ai")[fp].max() < flt[fp].min() else "LT-AI inside FLT's range",
        f"is at most {d[gap].max():.3f} nats in every run",
        f"FLA (2 seeds) ends at {rng(fla[fp], 3)}, above FLT's {rng(flt[fp], 4)} and below the 9-loop LT's"
        f" {rng(lt9[fp])}",
        f"its gain ends at {rng(fla.gain_last, 1)}, like FLT's",
        f"both `collapsed` (climbs from steps {' and '.join(str(int(x)) for x in sorted(l6.climb_start))})",
        f"and ends at {rng(l6.gain_last, 0)} (the L = 2 runs: {rng(d.gain_last, 1)})",
        f"the final fixed-point residual {rng(l6[fp], 3)}",
        "the fixed-point residual at the last loop reaches 1.00 at step "
        + " and ".join(map(str, ones_at(d, fpr))) + (" (within LT too)" if ones_at(lt, fpr) == ones_at(d, fpr) else ""),
        f"the largest gain 1.00 at step {' and '.join(map(str, ones_at(d, gain)))} but"
        f" {auroc(d.failed, d[f'{gain} @500']):.2f} at 500",
        f"the exit-loss gap 1.00 at step {' and '.join(map(str, ones_at(d, 'exit-loss gap (last - best loop)')))} only",
        f"the block weight norm 1.00 at {' and '.join(map(str, ones_at(d, 'block weight norm')))}",
    ]


def depth_claims(data: Path) -> list[str]:
    """The reading of the paper's claims at L = 6 (issue 56 part 2), from the archived runs (read once, by
    analysis/ablation_claims.py's runs_of), and the reading's copies of the generated block's tests."""
    import ablation_claims as AC  # noqa: PLC0415  (analysis/ablation_claims.py: the plan's runs and tests)
    runs = AC.runs_of(data / "runs" / "ablation-claims-depth")
    runs = runs[runs.loops == 12]
    by = {v: runs[runs.variant == v] for v in AC.AGAINST_FLT + ["flt"]}
    if any(g.empty for g in by.values()):
        raise LookupError("docs/data/runs/ablation-claims-depth: a variant of the paper's five has no run")
    lt, fla, flt, inj = by["lt"], by["fla"], by["flt"], runs[runs.variant.isin(["lt-ii", "lt-ai"])]
    n_failed = lambda g: int(g.failed.sum())  # noqa: E731
    kinds = lambda g: ", ".join(f"{(g.verdict == k).sum()} {k}" for k in AC.FAILED if (g.verdict == k).any())  # noqa: E731
    stalled = lt[lt.verdict == "stalled"].climb
    tests = AC.climb_tests(runs).set_index("variant")
    hl = lambda v: f"[{tests.low[v]:+.3f}, {tests.high[v]:+.3f}]"  # noqa: E731
    val = {v: AC.hodges_lehmann(by[v].val_loss.to_numpy(float), flt.val_loss.to_numpy(float)) for v in ("lt-ii", "lt-ai")}
    _, fisher = fisher_exact([[n_failed(fla), len(fla) - n_failed(fla)], [n_failed(flt), len(flt) - n_failed(flt)]],
                             alternative="greater")
    return [
        f"(p_Holm {tests.p_holm['lt']:.2g}): {n_failed(lt)} of {len(lt)} LT runs failed ({kinds(lt)}),"
        f" {n_failed(flt)} of {len(flt)} FLT runs",
        f"the {len(stalled)} stalled runs never learned (LT's val loss {rng(lt.val_loss)} against FLT's"
        f" {rng(flt.val_loss)})",
        f"({rng(stalled)} nats, still above every FLT run's {rng(flt.climb)})"
        if len(stalled) and stalled.min() > flt.climb.max() else "no stalled LT run climbs more than every FLT run",
        f"the shift's interval {hl('lt')} spans both kinds",
        f"(p_Holm {tests.p_holm['fla']:.2g}, shift {tests['shift']['fla']:+.3f} {hl('fla')} nats):"
        f" {n_failed(fla)} of {len(fla)} FLA runs failed ({kinds(fla)}), FLT {n_failed(flt)} of {len(flt)}"
        f" (one-sided Fisher p = {fisher:.3g})",
        f"all {len(inj)} runs `stable`" if n_failed(inj) == 0 else "an LT-II or LT-AI run failed",
        f"within [{min(tests.low[['lt-ii', 'lt-ai']]):+.3f}, {max(tests.high[['lt-ii', 'lt-ai']]):+.3f}] nats"
        f" (upper ends below the plan's {AC.PARTIAL})" if max(tests.high[["lt-ii", "lt-ai"]]) < AC.PARTIAL
        else "an upper end at or above the plan's partial effect",
        "(LT-II {:+.3f} [{:+.3f}, {:+.3f}], LT-AI {:+.3f} [{:+.3f}, {:+.3f}] nats)".format(*val["lt-ii"], *val["lt-ai"]),
        f"FLA's peak residual norm at any loop is {rng(fla.peak_any, 0)},"
        f" {rng(fla.peak_any / flt.peak_any.median(), 1)}× FLT's median and inside LT's range ({rng(lt.peak_any, 0)})"
        if lt.peak_any.min() <= fla.peak_any.min() and fla.peak_any.max() <= lt.peak_any.max()
        else "FLA's any-loop peak outside LT's range",
        f"is it below LT's ({rng(fla.peak, 0)} against {rng(lt.peak, 0)})"
        if fla.peak.max() < lt.peak.min() else "FLA's final loop not below LT's",
    ]


def w4_claims(data: Path) -> list[str]:
    t = read_table(data / "loop-dynamics-w4.csv")
    gain, fp = "final max loop gain", "final fixed-point residual (last loop)"
    lt, ai, ii = t[t.variant == "lt"], t[t.variant == "lt-ai"], t[t.variant == "lt-ii"]
    gap = "exit-loss gap (last - best loop) @300"
    hits, total, p = exact_p(t.failed, t[gap])
    return [
        f"gain over the loops of {rng(lt[gain], 1)}, far above 1, and LT-AI at L = 6 (all stable at 600 steps) at"
        f" {rng(ai[gain], 1)}; LT-II's stays at {rng(ii[gain])}",
        "final fixed-point residual below 0.0001" if ii[fp].max() < 1e-4 else "LT-II's residual above 0.0001",
        f"(AUROC {auroc(t.failed, t[gap]):.2f} at step 300 over the {len(t)} runs with records, {int(t.failed.sum())}"
        f" of them failing",
        f"p = {p:.3f}, {hits} of the C({len(t)}, {int(t.failed.sum())}) = {total} placements",
    ]


def comparison(data: Path, name: str) -> pd.DataFrame:
    return read_table(data / name / "comparison.csv")


def cell(c: pd.DataFrame, s: str, score: str, step: int, short: bool = False, ci: bool = False) -> str:
    row = c[(c.set == s) & (c.score == score) & (c.step == step)]
    if len(row) != 1:
        raise ValueError(f"comparison.csv: no single row for {s!r}, {score!r}, step {step}")
    x = f"{row.auroc.iloc[0]:.2f}"
    x = x[:-1] if short and x.endswith("0") else x
    return x + (f" [{row.auroc_lo.iloc[0]:.2f}, {row.auroc_hi.iloc[0]:.2f}]" if ci else "")


def early_warning_claims(data: Path) -> list[str]:
    c4, c3, c1 = (comparison(data, n) for n in ("warning-eval-w4", "warning-eval-w3", "warning-eval"))
    steps = (100, 200, 300, 500)
    out = []
    for score in ("packaged", "refit (config CV)", "refit, 8 features (config CV)", "olmo",
                  "loop gain (final loop)", "fixed-point residual (final loop)", "exit-loss gap (final - best loop)"):
        k8 = " / ".join(cell(c4, "LT K=8", score, s, short=True) for s in steps)
        out.append(" / ".join(cell(c4, "all", score, s) for s in steps) + (" (0.59 fired at 300)" if score == "olmo"
                   else "") + f" | [{cell(c4, 'all', score, 300, ci=True).split('[')[1]} | {k8} | "
                   + cell(c4, "LT K=9", score, 300, short=True) + " |")
    out.append(" / ".join(cell(c4, "all", "prior (config CV)", s) for s in steps)
               + f" | [{cell(c4, 'all', 'prior (config CV)', 300, ci=True).split('[')[1]}")
    out.append(f"the refit's configuration-grouped AUROC at step 300 ({cell(c4, 'all', 'refit (config CV)', 300)})"
               f" does not exceed the prior's ({cell(c4, 'all', 'prior (config CV)', 300)}) by 0.05")
    for score in ("packaged", "refit (config CV)", "prior (config CV)", "olmo", "loop gain (final loop)",
                  "fixed-point residual (final loop)", "exit-loss gap (final - best loop)"):
        out.append(f"| {cell(c3, 'all', score, 300, ci=True)} |")
    for score in ("packaged", "refit (config CV)", "prior (config CV)"):
        out.append(f"| {cell(c1, 'all', score, 300, ci=True)} |")
    return out


def results_w3_claims(data: Path) -> list[str]:
    c3 = comparison(data, "warning-eval-w3")
    gains = [float(cell(c3, "LT K=6, 9", "loop gain (final loop)", s)) for s in (100, 200, 300, 500)]
    return [f"(AUROC {cell(c3, 'LT K=6, 9', 'fixed-point residual (final loop)', 300)}: the stable K = 6 runs end"
            f" with the larger residual), the gain does not separate ({rng(gains)}), the exit-loss gap reaches"
            f" {cell(c3, 'LT K=6, 9', 'exit-loss gap (final - best loop)', 300, ci=True)} at step 300"]


# ----------------------------------------------------------------------------- checking the pages
def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("**", ""))


def check(pages: dict[str, str], claims: dict[str, list[str]]) -> list[tuple[bool, str]]:
    """(passed, line) for every claim (the page says it) and every retracted statement (the page does not)."""
    said = {name: normalise(text) for name, text in pages.items()}
    def says(page: str, claim: str) -> bool:  # (at a sentence's start, the claim's first letter upper-case)
        c = normalise(claim)
        return c in said[page] or c[:1].upper() + c[1:] in said[page]
    out = [(says(page, c), f"{page}: {c}") for page, cs in claims.items() for c in cs]
    out += [(normalise(old) not in said[page], f"{page}: not said again: {old!r} ({why})")
            for page, olds in RETRACTED.items() for old, why in olds]
    return out


def all_claims(data: Path) -> dict[str, list[str]]:
    runs = factorial_runs(data)
    return {"results": primary_claims(runs, data) + agreement_claims(runs) + cosine_claims(runs)
            + contraction_claims(runs) + set_d_claims(data) + w4_claims(data) + results_w3_claims(data)
            + depth_claims(data) + BC.head_to_head_claims(data, rng) + B2C.stage_b_claims(data)
            + B2C.stage_c_claims(data) + B2C.stage_e_claims(data) + B2C.stage_c_cpu_claims(data)
            + B2C.stage_d_claims(data) + B2C.long_run_claims(data),
            "early-warning": early_warning_claims(data)}


MAX_PAGE_BYTES = 4 << 20  # a docs page is tens of kilobytes


@guarded
def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--early-warning", type=Path, default=ROOT / "docs" / "early-warning.md")
    ap.add_argument("--data", type=folder, default=ROOT / "docs" / "data")
    args = ap.parse_args(argv)
    try:
        pages = {"results": read_text(args.results, MAX_PAGE_BYTES, "a docs page"),
                 "early-warning": read_text(args.early_warning, MAX_PAGE_BYTES, "a docs page")}
        lines = check(pages, all_claims(args.data))
    except (ValueError, OSError, LookupError, TypeError, AttributeError) as e:  # a missing or crafted file: one line
        what = f"a data table under {args.data} lacks the column {e}" if isinstance(e, KeyError) else \
            f"a data table under {args.data} lacks a column ({e})" if isinstance(e, AttributeError) else str(e)
        print(f"error: {what}", file=sys.stderr)
        return 2
    for ok, line in lines:
        print(("PASS " if ok else "FAIL ") + line)
    failed = sum(not ok for ok, _ in lines)
    print(f"{len(lines) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
