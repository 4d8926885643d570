"""`flt-diag status FOLDER` (and the status column of `--list`): where each cell of a sweep, or each line of a map,
stands: finished, open, running (the step it reached, whose process, how long since it last wrote) or failed (why),
and the commits of the code that made its runs; and above them the code and machine the folder's campaign is pinned
to (flt_diag.storage.campaign) and the code changes it was allowed. A folder holding sweeps and maps (a campaign's
stages or a chain's studies, or their archive) gets a line of counts per folder and the total. Torch-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from flt_diag.judge.map_boundaries import boundaries, map_lines, probe_cell, spec_from_folder
from flt_diag.storage import archive
from flt_diag.storage.campaign import describe_code, read_campaign, same_code
from flt_diag.storage.code_snapshot import read_marker, recorded_folder
from flt_diag.storage.cells import RunId
from flt_diag.storage.file_models import MapSpecFile
from flt_diag.storage.folders import SWEEP_SPEC, StorageError, cell_path, is_sweep, load_spec, read_json
from flt_diag.storage.machine import describe_machine
from flt_diag.storage.run_activity import Activity, activity


@dataclass(frozen=True)
class Row:
    index: int
    name: str
    state: str
    detail: str
    commits: tuple[str, ...]
    progress: tuple[int, int] | None = None  # a running run's (steps done, steps); a map line's: its running probe's
    wall_s: float | None = None  # a finished run's wall time
    probe_walls: tuple[float, ...] = ()  # a map line's finished probes' wall times

    def line(self, width: int = 32) -> str:
        """The row as `flt-diag status` prints it, its name padded to `width` (the longest name of the folder's)."""
        commits = ", ".join(self.commits) or "-"
        return f"{self.index:4d}  {self.name:{width}s} {self.state:9s} {self.detail}{'  ' if self.detail else ''}" \
               f"code {commits}"


def _duration(seconds: float) -> str:
    """A time to go as status says it: seconds under two minutes, else minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def time_left(walls: list[float], open_runs: int, running: list[float | None]) -> str | None:
    """A sweep's time to go, roughly: each open run at the finished runs' median wall time `walls`, each running
    one at the part of it not yet done (`running`: its share of steps done, None where unknown: a whole run), over
    as many lanes as run now. None without a finished run to time, a running one to count lanes, or runs to go."""
    import statistics
    if not walls or not running or not open_runs + len(running):
        return None
    median = statistics.median(walls)
    lane_s = median * (open_runs + sum(1.0 - (0.0 if d is None else d) for d in running))
    left, lanes = lane_s / len(running), len(running)
    when = _duration(left)
    return (f"about {when} left: {open_runs} open and {lanes} running at the finished runs' median of {median:.0f} s "
            f"a run, on the {lanes} lane{'s' if lanes > 1 else ''} running now")


def row_lines(rows: list[Row]) -> list[str]:
    """The rows as `flt-diag status` prints them: names padded to the longest (at least 32), so the states line up."""
    width = max([32, *(len(r.name) for r in rows)])
    return [r.line(width) for r in rows]


def _commits(acts: list[Activity]) -> tuple[str, ...]:
    return tuple(sorted({a.commit for a in acts if a.commit}))


def _where(out: Path, name: str) -> Path:
    """The path status reads for cell `name`: its record, its run folder in cells/, or a path named like its record
    that is none (a folder, a link), which activity() then says is damaged instead of the cell looking open."""
    odd = Path(out) / f"{name}{archive.SUFFIX}"
    return odd if os.path.lexists(odd) and not archive.is_record(odd) else cell_path(out, name)


def sweep_rows(out: Path) -> list[Row]:
    """One row per cell of a sweep folder (cell order)."""
    rows = []
    for i, name in enumerate(load_spec(out).cell_names):  # type: ignore[union-attr]  # (a sweep's spec)
        a = activity(_where(out, name))
        rows.append(Row(i, name, a.state, a.detail(), _commits([a]), a.progress, a.wall_s))
    return rows


def sweep_time_left(rows: list[Row]) -> str | None:
    """time_left of a sweep folder's rows: its finished cells' own wall times (their summaries)."""
    walls = [float(r.wall_s) for r in rows if r.state == "finished" and r.wall_s]
    running = [None if r.progress is None else r.progress[0] / max(r.progress[1], 1) for r in rows
               if r.state == "running"]
    return time_left(walls, sum(r.state == "open" for r in rows), running)


def map_time_left(rows: list[Row]) -> str | None:
    """A map's time to go, more roughly than a sweep's (its probes are not known in advance): every line neither
    finished nor failed takes as many probes as the finished lines' median (at least one more), each at the median
    wall time of the map's finished probes (a probe stopped once decided is shorter, and counts so), the running
    probe at its share not done, over as many lanes as run now. None without a finished line, a timed probe, a
    running line to count lanes, or lines to go."""
    import statistics
    finished = [r for r in rows if r.state == "finished"]
    walls = [w for r in rows for w in r.probe_walls]
    running = [r for r in rows if r.state == "running"]
    if not finished or not walls or not running:
        return None
    per_line = statistics.median(len(r.probe_walls) for r in finished)
    to_go = 0.0
    for r in rows:
        if r.state in ("open", "running"):
            share = 0.0 if r.state == "open" or r.progress is None else r.progress[0] / max(r.progress[1], 1)
            to_go += max(per_line - len(r.probe_walls), 1.0) - share
    median = statistics.median(walls)
    left = median * to_go / len(running)
    when = _duration(left)
    return (f"roughly {when} left: about {to_go:.0f} probes to go (a finished line took a median of {per_line:g} "
            f"probes, a probe a median of {median:.0f} s), on the {len(running)} lane{'s' if len(running) > 1 else ''} "
            "running now")


def map_rows(out: Path) -> list[Row]:
    """One row per line of a map folder: running where a probe runs now (which), failed where a probe failed and the
    search stopped there (why), finished where every criterion's bracket is closed, else open (probes so far)."""
    spec = spec_from_folder(out)
    table = boundaries(out)
    rows = []
    for line in map_lines(spec):
        probes = {v: activity(_where(out, probe_cell(spec, line, v).name)) for v in spec.grid}
        mine = table[(table.variant == line.variant) & (table.loops == line.loops) & (table.seed == line.seed)]
        done = [a for a in probes.values() if a.state == "finished"]
        running = [(v, a) for v, a in probes.items() if a.state == "running"]
        failed = [(v, a) for v, a in probes.items() if a.state == "failed"]
        damaged = [(v, a) for v, a in probes.items() if a.state == "damaged"]
        progress = None
        if running:
            v, a = running[0]
            state, detail, progress = "running", f"{spec.axis} {v:g}: {a.detail()}", a.progress
        elif damaged:  # (its summary reads, so the bracket may look closed: the line is not finished for that)
            v, a = damaged[0]
            state, detail = "damaged", f"{spec.axis} {v:g}: {a.detail()}"
        elif not mine.status.isin(["open", "failed"]).any():
            state, detail = "finished", f"{len(done)} probes"
        elif failed:
            v, a = failed[0]
            state, detail = "failed", f"{spec.axis} {v:g}: {a.detail()}"
        else:
            state, detail = "open", f"{len(done)} probes finished"
        rows.append(Row(line.index, line.name, state, detail, _commits(list(probes.values())), progress,
                        probe_walls=tuple(float(a.wall_s) for a in done if a.wall_s)))
    return rows


def status_rows(out: Path) -> list[Row]:
    if not is_sweep(out):
        raise StorageError(f"{out} is not a sweep or map folder (no {SWEEP_SPEC})")
    return map_rows(out) if isinstance(load_spec(out), MapSpecFile) else sweep_rows(out)


STATES = ("finished", "running", "open", "failed", "damaged")


def counts_line(rows: list[Row]) -> str:
    """"3 finished, 1 running, 20 open" (the states with any), or "nothing to show"."""
    counts = {s: sum(r.state == s for r in rows) for s in STATES}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing to show"


def campaign_folders(path: Path, depth: int = 3) -> list[Path]:
    """The sweep and map folders a campaign's folder holds (e.g. one per study of a chain, or per stage: its
    children and theirs, `depth` levels down: a stage's strengths, their slices, their studies), not through links
    and not into a sweep, in name order."""
    found: list[Path] = []
    try:
        subs = sorted(p for p in Path(path).iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return found
    for p in subs:
        if is_sweep(p):
            found.append(p)
        elif depth > 1:
            found += campaign_folders(p, depth - 1)
    return found


def folders_lines(path: Path) -> tuple[list[str], bool]:
    """(one line per sweep or map folder under `path`: its place and its counts, then the total; whether every one
    could be read and holds no damaged run). A folder that cannot be read is its own line, the others still
    counted."""
    lines, total, ok = [], [], True
    for folder in campaign_folders(path):
        name = folder.relative_to(path)
        try:
            rows = status_rows(folder)
        except (StorageError, OSError) as e:
            lines.append(f"{name}: cannot be read ({e})")
            ok = False
            continue
        lines.append(f"{name}: {counts_line(rows)}")
        ok = ok and not any(r.state == "damaged" for r in rows)
        total += rows
    if not lines:
        raise StorageError(f"{path} is not a sweep or map folder (no {SWEEP_SPEC}) and holds none")
    return lines + [f"all: {counts_line(total)}"], ok


def campaign_lines(out: Path) -> list[str]:
    """The folder's pinned code and machine, and each code change a resume was allowed."""
    campaign = read_campaign(read_json(Path(out) / SWEEP_SPEC), Path(out) / SWEEP_SPEC)
    if campaign is None:
        return ["code: not pinned (a folder started before campaigns were pinned: its next run pins it)"]
    lines = [f"code: {describe_code(campaign.code)}", f"machine: {describe_machine(campaign.machine)}"]
    if campaign.snapshot:
        where = recorded_folder(Path(out), campaign.snapshot)
        lines.append(f"snapshot: {where} (commit {str(campaign.snapshot.get('commit'))[:12]}, "
                     + ("present)" if read_marker(where) else "missing: the next run makes it again)"))
    codes = [campaign.code]
    for change in campaign.changes:
        code = change.get("code")
        if isinstance(code, dict) and any(same_code(code, c) for c in codes):  # (the same code, another machine kind)
            lines.append(f"machine added {change.get('at', '?')} on {change.get('host', '?')}: "
                         f"{describe_machine(change.get('machine'))}")
        else:
            lines.append(f"code change allowed {change.get('at', '?')} on {change.get('host', '?')}: "
                         f"{describe_code(code)}, machine {describe_machine(change.get('machine'))}")
        if isinstance(code, dict):
            codes.append(code)
    return lines


def line_status(out: Path, lines: list[RunId]) -> dict[str, str]:
    """Each of `lines`' (a map's) state, by line name: the status column of `map --list`."""
    if not (Path(out) / SWEEP_SPEC).exists():
        return {line.name: "open" for line in lines}
    return {row.name: row.state for row in map_rows(out)}
