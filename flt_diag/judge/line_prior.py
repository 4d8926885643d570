"""Where a map line's search starts: the boundary its variant's earlier lines found (torch-free).

A line (variant, K, seed) of a stability map bisects its grid for the first value that breaks a criterion.
Its variant's lines of earlier seeds (lower line index, same variant and K) have often found that boundary
already; a line whose first probes are there (the earlier lines' median first-broken index, then the index
below it) closes its bracket in two probes where a plain bisection from the middle of 9 values takes three or
four. Outcomes along a line are assumed monotone (docs/DESIGN.md §5), so the boundary a line finds does not
depend on where its search starts; analysis/replay_early_stop.py shows it on the stabiliser benchmark's
lines. Only closed, monotone brackets of finished lines count.
"""
from __future__ import annotations

from pathlib import Path

from flt_diag.judge.map_boundaries import bracket, map_lines, probe_outcomes
from flt_diag.storage.cells import RunId


def closed_boundary(known: dict[int, bool], n: int) -> int | None:
    """The first-broken index b (n: held everywhere) of a closed, monotone bracket; None if the line is open or
    not monotone."""
    a, b, monotone = bracket(known, n)
    return b if monotone and b - a == 1 else None


def prior_index(boundaries: list[int]) -> int | None:
    """The index a line's search probes first: the lower median of its earlier lines' first-broken indices
    (n for a line that held everywhere); None without any."""
    if not boundaries:
        return None
    ordered = sorted(boundaries)
    return ordered[(len(ordered) - 1) // 2]


def start_probes(prior: int | None) -> tuple[int, ...]:
    """The probes a search makes first from a prior boundary b: b (expected to break) then b - 1 (expected to
    hold); the search skips any that lies outside its bracket by then (b held: b - 1 is known to hold)."""
    return () if prior is None else (prior, prior - 1)


def earlier_lines(spec, line: RunId) -> list[RunId]:
    """The lines of the same variant and K before `line` (earlier seeds, in the map's order)."""
    return [x for x in map_lines(spec) if x.index < line.index and (x.variant, x.loops) == (line.variant, line.loops)]


def line_prior(spec, out: Path, line: RunId, criterion: str) -> int | None:
    """The prior boundary of `line` under `criterion` from its earlier lines' finished probes in map folder `out`."""
    n = len(spec.grid)
    found = [closed_boundary(probe_outcomes(spec, out, x, criterion), n) for x in earlier_lines(spec, line)]
    return prior_index([b for b in found if b is not None])
