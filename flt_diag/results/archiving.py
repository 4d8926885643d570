"""Writing run archives (`flt-diag archive RUN_OR_SWEEP... --to DIR`): each finished run as one compact
Parquet record (format and reading: flt_diag.storage.archive), thinned, and checked against the full run.

What a record keeps (every stored step of what the verdict reads; of other series the multiples of `every`,
the ends, the extremes and the non-finite values; short series whole) and the check against the full run:
DESIGN.md section 9, "Run archives".
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from flt_diag.judge import early_warning as EW
from flt_diag.judge.verdict import stored_config, summarize, tokens_per_step
from flt_diag.storage.file_models import RunConfigFile
from flt_diag.storage import archive, metric_names as M
from flt_diag.storage.folders import (EVAL_LOOPS, SWEEP_SPEC, StorageError, atomic_path, folder_lock, load_config,
                                      load_eval_loops, load_metrics, load_summary, make_folder, write_json,
                                      write_record)
from flt_diag.storage.safe_files import open_regular, stale_temporaries
from flt_diag.storage.schema import BadFile
from flt_diag.results.archive_checks import Plan, check_destination, plan_sources
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
    full = set(EW.loop_series(cfg.model.loops, cfg.model.depth)) if features_whole else set()  # (features' own)
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
    K, L, d = cfg.model.loops, cfg.model.depth, cfg.model.width
    steps_done = a["steps_done"]
    for at in SCORED_STEPS:
        if 2 * at <= steps_done:
            fa, fb = EW.features(full, at, K, L, d), EW.features(kept, at, K, L, d)
            out += [f"{k}@{at}" for k in fa if not _same(fa[k], fb.get(k))]
    return out


def _eval_loops_text(run_dir: Path) -> str | None:
    """eval_loops.csv's text, whole (a file over archive.MAX_EVAL_LOOPS_BYTES is one line, not archived)."""
    p = Path(run_dir) / EVAL_LOOPS
    if not (p.exists() or p.is_symlink()):
        return None
    limit = archive.MAX_EVAL_LOOPS_BYTES
    with open_regular(p) as f:  # (a FIFO there: one line, never a read that blocks)
        data = f.read(limit + 1)  # never more: a huge or growing file cannot fill the memory
    if len(data) > limit:
        raise BadFile(f"{p}: over {limit:,} bytes, more than a record keeps of an eval_loops.csv (a line per loop "
                      "count); not archived")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadFile(f"{p}: not text (UTF-8); not archived") from None
    load_eval_loops(run_dir)  # (checked as every reader checks it: a table they would refuse is not archived)
    return text


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


def archive_sources(sources: list[Path], to: Path, report=print, replace: bool = False) -> list[Archived]:
    """Archive run and sweep folders into `to`: a sweep or map S -> to/S.name/ (its sweep.json and one
    record per finished cell), a run R -> to/R.name.parquet. Unfinished cells are skipped (reported). Every
    source and the destination are checked first (flt_diag.results.archive_checks: nothing is written where one
    is refused, and no folder is left behind); `replace`: records another source wrote there are replaced."""
    to = Path(to)
    check_destination(to)
    made = [f for f in (to, *to.parents) if not (f.exists() or f.is_symlink())]  # what mkdir -p makes
    try:
        with folder_lock(to, "archive", root=to):  # (removes `to` again if it made it and nothing was written)
            return [a for plan in plan_sources(sources, to, replace) for a in _write(plan, to, report)]
    except BaseException:
        for folder in made[1:]:  # (`to` itself: folder_lock's)
            try:
                folder.rmdir()  # only if empty: a refused archive leaves no folder
            except OSError:
                break
        raise


def _write(plan: Plan, to: Path, report) -> list[Archived]:
    for record in plan.foreign:  # --replace: what another source wrote here
        record.unlink()
    if plan.dest is not None:
        make_folder(plan.dest, to)
        for stale in stale_temporaries(plan.dest / SWEEP_SPEC):
            stale.unlink()
        write_json(plan.dest / SWEEP_SPEC, plan.spec, root=to)
    for d in plan.skipped:
        report(f"{d}: not finished, not archived")
    for record, target in plan.copies:  # (records already: byte for byte)
        with atomic_path(target, to) as tmp:
            shutil.copyfile(record, tmp)
        report(f"{target}: copied (the folder held it as a record already)")
    out = []
    for run_dir, record, label in plan.runs:
        for stale in stale_temporaries(record):  # a killed archive's (we hold the lock: none is in flight)
            stale.unlink()
        out.append(archive_run(run_dir, record, label, to))
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
