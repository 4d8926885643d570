"""The commands that run grids of runs and watch them (flt_diag.cli.commands lists them with the others):
`run-ablation`, `map`, `study` (either, from a file) and `status`; each with the campaign options (--archive-to,
--allow-code-change, --snapshot: docs/DESIGN.md §5, "Campaigns")."""
from __future__ import annotations

import sys
from pathlib import Path

from flt_diag.cli.options import (FOLDER_OPTIONS, MapOptions, RunAblationOptions, StatusOptions, StudyOptions,
                                  UserError)
from flt_diag.config.option_fields import dest


def cmd_run_ablation(o: RunAblationOptions) -> int:
    """Train every variant at every loop count (x seeds x lr scales) and summarise how they collapse."""
    from flt_diag.cli.console import print_sweep_table
    from flt_diag.cli.specs import sweep_spec
    from flt_diag.grids.sweep import run_sweep
    from flt_diag.model.transformer import count_parameters
    _submit_or_cell(o)
    spec = sweep_spec(o, settled=not o.list_cells)  # --list runs nothing: no tokenizer needed
    out = o.out or Path("runs") / f"ablation-{spec.base.preset}"
    cells, cell = spec.cells(), o.cell
    status = _cell_states(out) if o.list_cells else {}
    if _listed_or_picked(cells, o, lambda c: f"{c.index:4d}  {c.name:32s} {status.get(c.name, 'open')}"):
        return 0
    _snapshot(o, out)
    m, n = spec.base.model, count_parameters(spec.base.model)
    print(f"model: L={m.depth} d={m.width} heads={m.heads}, {n:,} parameters ({n / 1e6:.1f}M) per cell", flush=True)
    if o.submit:  # the workers to a scheduler, cells claimed under leases (flt_diag.grids.slurm)
        from flt_diag.grids.slurm import submit_sweep
        df = submit_sweep(spec, out, o.submit, o, o.workers, _campaign(o), report=lambda text: print(text, flush=True))
    else:
        df = run_sweep(spec, out, workers=o.workers, only_cell=cell, show_progress=not o.quiet, options=_campaign(o))
    print_sweep_table(df)
    print(f"sweep folder: {out}  (plots: flt-diag plot all {out}; report: flt-diag report {out})")
    return _failed_cells(out, cells if cell is None else [cells[cell]])


def _submit_or_cell(o: RunAblationOptions | MapOptions) -> None:
    """--submit and --cell are two ways to spread a grid over machines: one at a time."""
    if o.submit and o.cell is not None:
        raise UserError("--submit hands every cell (map line) to workers that claim them under leases; --cell I is "
                        "for a job array of your own: give one of them")


def _cell_states(out: Path) -> dict[str, str]:
    """A sweep folder's cells' states as `flt-diag status` says them (none yet: every cell open)."""
    from flt_diag.results.campaign_status import sweep_rows
    from flt_diag.storage.folders import is_sweep
    return {row.name: row.state for row in sweep_rows(out)} if is_sweep(out) else {}


def _campaign(o: RunAblationOptions | MapOptions):
    """The campaign options of a grid command: --allow-code-change, --archive-to."""
    from flt_diag.grids.campaign import CampaignOptions
    from flt_diag.results.run_archiver import FolderArchive
    return CampaignOptions(o.allow_code_change, None if o.archive_to is None else FolderArchive(o.archive_to))


def _snapshot(o: RunAblationOptions | MapOptions, out: Path) -> None:
    """--snapshot (or a folder that records one): re-run this command from the campaign's code snapshot (exec)."""
    from flt_diag.cli.snapshot_exec import run_from_snapshot
    run_from_snapshot(out, o.snapshot, o.snapshot_dir, o.archive_to, o.allow_code_change)


def _listed_or_picked(items: list, o: RunAblationOptions | MapOptions, line) -> bool:
    """`--list`: print one line per cell (or map line) and say so; `--cell I` must name one of them."""
    from flt_diag.grids.sweep import only
    if o.list_cells:
        for item in items:
            print(line(item))
        return True
    only(items, o.cell)  # a bad --cell: the one check the sweep and the map also use
    return False


def _failed_cells(out: Path, cells) -> int:
    """Exit status 1, with one line, when a cell failed or has no summary although the sweep ran it."""
    from flt_diag.cli.output import print_failed_cells
    from flt_diag.grids.progress import cell_status
    status = {c.name: cell_status(out, c) for c in cells}
    failed = [n for n, s in status.items() if s == "failed"]
    missing = [n for n, s in status.items() if s not in ("done", "failed")]
    if failed or missing:
        print_failed_cells(out, len(cells), failed, missing)
        return 1
    return 0


def cmd_map(o: MapOptions) -> int:
    """Where each variant's training breaks: bisection along lr scale or depth, per variant and K."""
    if o.baseline is not None:
        from flt_diag.cli.baseline_command import baseline_out, cmd_map_baseline
        _submit_or_cell(o)  # (refused before a snapshot is written into the pooled folder)
        if not o.list_cells:
            _snapshot(o, baseline_out(o))
        return cmd_map_baseline(o, _campaign(o))
    from flt_diag.cli.specs import map_spec
    from flt_diag.grids.stability_map import run_map
    from flt_diag.grids.worker_pool import auto_workers
    from flt_diag.judge.map_boundaries import critical_values, unfinished
    from flt_diag.results.campaign_status import line_status
    _submit_or_cell(o)
    spec = map_spec(o, settled=not o.list_cells)
    out = o.out or Path("runs") / f"map-{spec.axis}-{spec.base.preset}"
    status = line_status(out, spec.lines()) if o.list_cells else {}
    if _listed_or_picked(spec.lines(), o, lambda line: f"{line.index:4d}  {line.name:32s} {status[line.name]}"):
        return 0
    _snapshot(o, out)
    print(f"map: {len(spec.lines())} lines x {len(spec.criteria)} criteria; {spec.axis} grid "
          f"{', '.join(f'{x:g}' for x in spec.grid)} (each boundary within x{o.ratio:g})", flush=True)
    if o.submit:  # the workers to a scheduler, probes claimed under leases (flt_diag.grids.slurm)
        from flt_diag.grids.slurm import submit_map
        submit_map(spec, out, o.submit, o, o.workers, o.probe_ends, o.run_to_end, _campaign(o),
                   report=lambda text: print(text, flush=True))
    else:
        run_map(spec, out, workers=o.workers or auto_workers(spec.base.train.device), only_line=o.cell,
                report=lambda text: print(text, flush=True), probe_ends=o.probe_ends, run_to_end=o.run_to_end,
                options=_campaign(o))
    for criterion, g in critical_values(out).groupby("criterion", sort=False):
        print(f"{criterion}: " + "; ".join(f"{r.variant} K={r.loops}: {r.text}" for r in g.itertuples()))
    print(f"map folder: {out}  (figure: flt-diag plot map {out}; report: flt-diag report {out})")
    problem = unfinished(out, spec.lines() if o.cell is None else [spec.lines()[o.cell]])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problem else 0


def cmd_study(o: StudyOptions) -> int:
    """Run a named study: the [ablation] (run-ablation options) or [map] (map options) table of a TOML file; or
    several, one after another (every file read and checked first; the first that fails ends the command)."""
    from flt_diag.cli.specs import load_study
    folder = {dest(n, f): getattr(o, n) for _, n, f in FOLDER_OPTIONS}
    studies = [(path, *load_study(path, **folder)) for path in o.paths]
    if len(studies) > 1:
        if o.cell is not None:
            raise UserError("--cell runs one cell of one study: give one study file")
        if unnamed := [str(path) for path, _, args in studies if args.out is None]:
            raise UserError(f"{unnamed[0]} names no `out`: with several study files each names its own folder")
        paths = [args.out.resolve() for _, _, args in studies if args.out is not None]  # (every one: checked above)
        names = [p.name for p in paths]  # (its archive is named so: FolderArchive.dest)
        if twice := sorted({str(p) for p in paths if paths.count(p) > 1}):
            raise UserError(f"two of the study files write the folder {twice[0]} (their `out`): each needs its own")
        if o.archive_to is not None and (twice := sorted({n for n in names if names.count(n) > 1})):
            raise UserError(f"two of the study files' folders are named {twice[0]}: under --archive-to both would be "
                            "archived into one folder of that name; give each its own name")
    for path, _, args in studies:
        if len(studies) > 1:
            print(f"study {path}", flush=True)
        code = cmd_run_ablation(args) if isinstance(args, RunAblationOptions) else cmd_map(args)  # (command's options)
        if code:
            return code
    return 0


def cmd_status(o: StatusOptions) -> int:
    """Where each cell of a sweep (each line of a map) stands: finished, open, running (whose process, seen when),
    failed (why), and the code that made its runs; and the code and machine the folder is pinned to."""
    from flt_diag.results.campaign_status import (campaign_lines, counts_line, folders_lines, map_time_left,
                                                  row_lines, status_rows, sweep_time_left)
    from flt_diag.storage.file_models import MapSpecFile
    from flt_diag.storage.folders import is_sweep, load_spec
    if not is_sweep(o.path):  # a campaign's folder of sweeps and maps: a line of counts each
        lines, ok = folders_lines(o.path)
        print("\n".join(lines))
        return 0 if ok else 1
    rows = status_rows(o.path)
    for line in campaign_lines(o.path) + row_lines(rows):
        print(line)
    from flt_diag.grids.leases import lease_lines  # (a map worked by --submit: whose probe is whose)
    for line in lease_lines(o.path):
        print(line)
    print(counts_line(rows))
    if any(r.state == "damaged" for r in rows):
        print(f"error: {sum(r.state == 'damaged' for r in rows)} of {len(rows)} runs are damaged (above: why); "
              "nothing was changed", file=sys.stderr)
        return 1
    if left := (map_time_left if isinstance(load_spec(o.path), MapSpecFile) else sweep_time_left)(rows):
        print(left)
    return 0
