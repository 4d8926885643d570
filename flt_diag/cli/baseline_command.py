"""`flt-diag map --baseline ARCHIVE --variants NEW`: a new variant against an archived baseline map, its spec reused,
canaries first, old and new lines pooled (flt_diag.grids.baseline; docs/DESIGN.md §5 "Extending a benchmark")."""
from __future__ import annotations

import sys
from pathlib import Path

from flt_diag.cli.options import MapOptions
from flt_diag.storage.errors import StorageError

SPEC_OPTIONS = ("loops", "seeds", "axis", "criteria")  # each may be given only as the baseline has it


def contradiction(o: MapOptions, spec: dict) -> str | None:
    """The first option that contradicts the baseline's spec, as one line (None: none does)."""
    fields = type(o).model_fields
    for name in SPEC_OPTIONS:
        if getattr(o, name) != fields[name].get_default(call_default_factory=True) and getattr(o, name) != spec[name]:
            return f"--{name}: the baseline has {spec[name]}"
    if any(getattr(o, n) != fields[n].get_default(call_default_factory=True) for n in ("lo", "hi", "ratio")):
        mine = o.values(spec["axis"])
        if len(mine) != len(spec["grid"]) or any(abs(a - b) > 1e-9 * b for a, b in zip(mine, spec["grid"])):
            return f"--lo/--hi/--ratio: the baseline's grid is {', '.join(f'{x:g}' for x in spec['grid'])}"
    if o.config:
        return f"--{next(iter(o.config)).replace('_', '-')}: the baseline's base recipe is fixed"
    return None


def baseline_out(o: MapOptions) -> Path:
    """The pooled folder: --out, or runs/<baseline>+<new variants>."""
    assert o.baseline is not None
    return o.out or Path("runs") / f"{Path(o.baseline).resolve().name}+{'+'.join(o.variants)}"


def cmd_map_baseline(o: MapOptions, campaign) -> int:
    """The pooled map (`campaign`: the command's CampaignOptions)."""
    from flt_diag.grids.baseline import read_baseline, run_baseline_map
    from flt_diag.grids.worker_pool import auto_workers
    from flt_diag.judge.map_boundaries import critical_values, unfinished
    assert o.baseline is not None
    spec, _ = read_baseline(o.baseline)
    problem = contradiction(o, spec)
    if problem:
        raise StorageError(f"{problem}; map --baseline reuses the baseline's spec: give only --variants (new ones) "
                           "and folder options")
    if o.list_cells:
        raise StorageError("--list with --baseline: list the pooled folder with `flt-diag status FOLDER`")
    out = baseline_out(o)
    print(f"map --baseline {o.baseline}: {len(spec['variants'])} baseline variants + {', '.join(o.variants)}; "
          f"canaries first", flush=True)
    run_baseline_map(o.baseline, list(o.variants), out, o.accept_baseline_drift,
                     report=lambda text: print(text, flush=True), options=campaign,
                     submit=(o.submit, o, o.workers) if o.submit else None,
                     workers=o.workers or auto_workers(spec["base"]["train"].get("device", "cpu")), only_line=o.cell,
                     probe_ends=o.probe_ends, run_to_end=o.run_to_end)
    for criterion, g in critical_values(out).groupby("criterion", sort=False):
        print(f"{criterion}: " + "; ".join(f"{r.variant} K={r.loops}: {r.text}" for r in g.itertuples()))
    print(f"pooled map folder: {out}  (flt-diag summary {out}; flt-diag plot breaking {out})")
    problem = unfinished(out)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problem else 0
