"""Round two's CPU kinds (the plan's amendment of 2026-12-07 14:50 UTC): which CPU kind ran each of stage C's runs
(each record's own `env.cpu`: model and whether it has AVX-512), and the check fixed before its runs: FLT's eight
confirmation seeds re-run on the other kind (docs/data/runs/stabiliser-bench-2/CPU-check/), the two kinds' FLT runs
compared by a two-sided exact Mann-Whitney with the Hodges-Lehmann shift (AVX-512 minus AVX2) and its 95 %
interval, read by the plan's words. Torch-free; read by analysis/stabiliser_benchmark_2.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

import benchmark_2_rules as R
from flt_diag.storage.folders import load_config, load_summary

CHECK = "CPU-check"  # the check's folder in the benchmark's archive


def kind(run: str | Path) -> str:
    """A run's CPU kind as its config records it: "<model> (AVX-512)" or "<model> (AVX2)" ("unknown" without)."""
    cpu = (load_config(Path(run)).env or {}).get("cpu") or {}
    if not isinstance(cpu, dict) or not cpu.get("model"):
        return "unknown"
    simd = cpu.get("simd") or []
    return f"{cpu['model']} ({'AVX-512' if 'avx512f' in simd else 'AVX2' if 'avx2' in simd else 'neither'})"


def kinds_line(c_runs: pd.DataFrame) -> str:
    """"Stage C's runs by CPU kind: AMD EPYC (AVX2): flt 8, ...; AMD EPYC (AVX-512): ...\""""
    by = c_runs.assign(kind=[kind(p) for p in c_runs.path])
    parts = [f"{k}: " + ", ".join(f"{v} {len(g)}" for v, g in g_k.groupby("variant", sort=False))
             for k, g_k in by.groupby("kind", sort=True)]
    return "Stage C's runs by CPU kind (each run's own env.cpu): " + "; ".join(parts) + "."


def check_lines(root: Path, c_runs: pd.DataFrame) -> list[str]:
    """The check's reading once its eight runs are in (else what it holds); [] without its folder."""
    folder = Path(root) / CHECK
    import stabiliser_benchmark_2 as B2  # (its reader of a stage's folder, slices and archives alike)
    if not B2.present(folder):  # (absent: not run; a file of its name: one line, as for every stage folder)
        return []
    runs = [d for d in B2._dirs(folder) if load_summary(d) is not None]
    if len(runs) < 8:
        return [f"CPU-kind check (amendment of 2026-12-07 14:50 UTC): not finished ({len(runs)} of 8 runs)."]
    flt_c = c_runs[c_runs.variant == "flt"].path
    if {kind(d) for d in runs} & {kind(p) for p in flt_c} or {load_summary(d).variant for d in runs} != {"flt"}:
        raise ValueError(f"{folder}: the CPU-kind check must hold FLT's runs on another CPU kind than stage C's FLT "
                         "runs; these are not")
    new = np.array([float(load_summary(d).val_loss) for d in runs])
    old = c_runs[c_runs.variant == "flt"].val_loss.to_numpy(float)
    p = R.exact_p(new, old)
    shift, low, high = R.hodges_lehmann(new, old)
    reading = ("the primary stands as computed; the interval is the CPU-kind shift this check cannot rule out"
               if p >= R.ALPHA else "the primary is to be computed again against the AVX-512 FLT runs as well")
    return [f"CPU-kind check (amendment of 2026-12-07 14:50 UTC): FLT's eight stage-C runs on {kind(runs[0])}, "
            f"median {np.median(new):.3f} ({new.min():.3f}-{new.max():.3f}), against its stage-C runs on "
            f"{kind(c_runs[c_runs.variant == 'flt'].path.iloc[0])}, median {np.median(old):.3f} ({old.min():.3f}-"
            f"{old.max():.3f}): exact two-sided p = {p:.4f}, shift {shift:+.3f} [{low:+.3f}, {high:+.3f}] nats; by "
            f"the plan, {reading}."]


def code(run: str | Path) -> str:
    """The commit (12 hex digits) that trained a run, as its config's env.code records it ("unknown" without)."""
    code = (load_config(Path(run)).env or {}).get("code")
    commit = code.get("commit") if isinstance(code, dict) else None
    return str(commit)[:12] if commit else "unknown"


def provenance_line(d_runs: pd.DataFrame) -> str:
    """Stage D's probes by CPU kind and, within each, by the commit that trained them (each record's own env), and
    the lines (variant, seed) whose probes ran on more than one CPU kind (the plan's lines of 17:08 and 18:48 UTC)."""
    by = d_runs.assign(kind=[kind(p) for p in d_runs.path], code=[code(p) for p in d_runs.path])
    parts = [f"{k}: " + ", ".join(f"{c} {len(g)}" for c, g in g_k.groupby("code", sort=True))
             for k, g_k in by.groupby("kind", sort=True)]
    mixed = _mixed(by)
    return ("Stage D's probes by CPU kind and code (each record's own env): " + "; ".join(parts) + ". Lines with "
            "probes of more than one CPU kind: " + (", ".join(mixed) if mixed else "none") + ".")


def mixed_lines(d_runs: pd.DataFrame) -> list[str]:
    """"<variant> seed <s>" for each line of `d_runs` whose probes ran on more than one CPU kind."""
    return _mixed(d_runs.assign(kind=[kind(p) for p in d_runs.path]))


def _mixed(by: pd.DataFrame) -> list[str]:
    """mixed_lines of runs whose `kind` column is read already."""
    by = by[by.kind != "unknown"]  # (a probe that records no CPU is no second kind)
    return [f"{v} seed {s}" for (v, s), g in by.groupby(["variant", "seed"], sort=False) if g.kind.nunique() > 1]
