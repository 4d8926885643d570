"""Writing run archives (`flt-diag archive RUN_OR_SWEEP... --to DIR`): each finished run as one compact
Parquet record (format and reading: flt_diag.storage.archive), thinned, and checked against the full run.

What a record keeps (every stored step of what the verdict reads; of other series the multiples of `every`,
the ends, the extremes and the non-finite values; short series whole) and the check against the full run:
DESIGN.md section 9, "Run archives".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.judge import early_warning as EW
from flt_diag.judge.verdict import stored_config, summarize, tokens_per_step
from flt_diag.storage.file_models import RunConfigFile
from flt_diag.storage import archive, metric_names as M
from flt_diag.storage.folders import (EVAL_LOOPS, SWEEP_SPEC, StorageError, folder_lock, is_archive, is_sweep,
                                      load_config, load_metrics, load_spec, load_summary, make_folder, read_json,
                                      refuse_links, run_dirs, write_json, write_record)
from flt_diag.storage.safe_files import open_regular
from flt_diag.storage.code_version import code_version, describe

FULL = (M.LOSS, M.GRAD_NORM, M.GRAD_COSINE, M.VAL_LOSS, M.VAL_ACCURACY, M.LOOPS_RUN)
EVERY, SPARSE = 25, 250
SCORED_STEPS = (100, 200, 300, 500)
VOLATILE = ("wall_time", "tokens_per_s")  # summary fields that depend on the machine, not on the rows


@dataclass
class Archived:
    source: Path
    record: Path
    rows: int
    kept: int
    bytes: int
    whole: bool  # the check failed: archived with every row

    def line(self) -> str:
        how = "every row (the thinned record changed the summary)" if self.whole else \
            f"{self.kept:,} of {self.rows:,} rows"
        return f"{self.record}: {how}, {self.bytes / 1024:.1f} KB"


def thin(df: pd.DataFrame, cfg: RunConfigFile, every: int = EVERY, sparse: int = SPARSE,
         features_whole: bool = False) -> pd.DataFrame:
    """The rows a record keeps (see the module's docstring)."""
    if not len(df):
        return df
    keep = np.zeros(len(df), dtype=bool)
    full = set(EW.loop_series(cfg.model.loops, cfg.model.n_layer)) if features_whole else set()  # (features' own)
    keyed = df.assign(_i=np.arange(len(df)))
    for (metric, loop, layer), g in keyed.groupby(["metric", "loop", "layer"], sort=False):
        idx = g._i.to_numpy()
        if metric in FULL or (metric, loop, layer) in full or g.step.nunique() <= sparse:
            keep[idx] = True
            continue
        steps, values = g.step.to_numpy(), g.value.to_numpy()
        sel = steps % every == 0
        sel[[0, -1]] = True
        finite = np.isfinite(values)
        if finite.any():
            where = np.flatnonzero(finite)
            sel[where[np.argmax(values[finite])]] = sel[where[np.argmin(values[finite])]] = True
        sel |= ~finite  # a non-finite value is evidence: kept
        keep[idx[sel]] = True
    return df[keep].reset_index(drop=True)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def differences(full: pd.DataFrame, kept: pd.DataFrame, stored: RunConfigFile) -> list[str]:
    """What the thinned rows change: summary fields, and early-warning features at the scored steps."""
    cfg = stored_config(stored)
    kw = dict(unigram_entropy=stored.unigram_entropy, tokens_per_step=tokens_per_step(cfg))
    a, b = (summarize(df, cfg, **kw).as_written() for df in (full, kept))
    out = [k for k in a if k not in VOLATILE and not _same(a[k], b.get(k))]
    K, L, d = cfg.model.loops, cfg.model.n_layer, cfg.model.n_embd
    steps_done = a["steps_done"]
    for at in SCORED_STEPS:
        if 2 * at <= steps_done:
            fa, fb = EW.features(full, at, K, L, d), EW.features(kept, at, K, L, d)
            out += [f"{k}@{at}" for k in fa if not _same(fa[k], fb.get(k))]
    return out


def _eval_loops_text(run_dir: Path) -> str | None:
    p = Path(run_dir) / EVAL_LOOPS
    if not p.exists():
        return None
    with open_regular(p, text=True) as f:
        return f.read(1 << 20)


def archive_run(run_dir: Path, record: Path, source: str, root: Path) -> Archived:
    """One finished run folder -> one record (thinned where the check allows)."""
    summary = load_summary(run_dir)
    if summary is None:
        raise StorageError(f"{run_dir} has not finished (no summary.json): only finished runs are archived")
    cfg = load_config(run_dir)
    full = load_metrics(run_dir)
    for features_whole in (False, True):
        table = thin(full, cfg, every=EVERY, sparse=SPARSE, features_whole=features_whole)
        if not (changed := differences(full, table, cfg)):
            break
    else:
        table = full
    kept = dict(full=list(FULL), every=EVERY, sparse=SPARSE, features_whole=features_whole, thinned=not changed)
    run_code = (cfg.env or {}).get("code")  # the code that made the run (config.json's env; none before 2026-12-04)
    code = dict(run=run_code if isinstance(run_code, dict) else None, archive=code_version())
    write_record(record, table, dict(config=cfg, summary=summary, eval_loops=_eval_loops_text(run_dir),
                                     source=source, kept=kept, code=code), root)
    return Archived(run_dir, record, len(full), len(table), record.stat().st_size, bool(changed))


def archive_sources(sources: list[Path], to: Path, report=print) -> list[Archived]:
    """Archive run and sweep folders into `to`: a sweep or map S -> to/S.name/ (its sweep.json and one
    record per finished cell), a run R -> to/R.name.parquet. Unfinished runs are skipped (reported)."""
    to = Path(to)
    out: list[Archived] = []
    for src in sources:
        src = Path(src)
        if is_archive(src):
            raise StorageError(f"{src} is already an archive; copy it, or archive the run folders it came from")
        dirs = run_dirs(src)  # a clear error for a path that is neither a run nor a sweep
        if to.resolve() == src.resolve() or src.resolve() in to.resolve().parents:
            raise StorageError(f"--to {to} is inside {src}; archive into a folder of its own")
        make_folder(to, to.parent)
        if is_sweep(src):
            dest = to / src.name
            with folder_lock(dest, "archive", root=to):
                load_spec(src)  # checked before it is copied
                write_json(dest / SWEEP_SPEC, read_json(src / SWEEP_SPEC), root=to)
                for d in dirs:
                    if load_summary(d) is None:
                        report(f"{d}: not finished, not archived")
                        continue
                    out.append(archive_run(d, dest / (d.name + archive.SUFFIX), f"{src.name}/{d.name}", to))
                    report(out[-1].line())
        else:
            record = to / (src.name + archive.SUFFIX)
            refuse_links(record, to)
            out.append(archive_run(src, record, src.name, to))
            report(out[-1].line())
    return out


def code_lines(path: Path) -> list[str]:
    """What `flt-diag summary` of an archive says of its code: for each distinct code that made its runs, the
    runs it made, and the code that archived them (flt_diag.storage.code_version)."""
    made: dict[str, list[str]] = {}
    archived: set[str] = set()
    for record in ([Path(path)] if archive.is_record(path) else archive.records_in(path)):
        code = archive.read_meta(record).code or {}
        made.setdefault(describe(code.get("run")), []).append(record.stem)
        archived.add(describe(code.get("archive")))
    lines = [f"made by {who}: {len(names)} run(s)" + (f" ({', '.join(names)})" if len(names) <= 3 else "")
             for who, names in made.items()]
    return lines + [f"archived by {who}" for who in sorted(archived)]
