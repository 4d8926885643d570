"""Replay a stability map's archive through the search of issue 64: training-only criteria, probes that stop when
decided, lines that start from their variant's earlier lines' boundary. No torch; nothing is trained.

    python analysis/replay_early_stop.py docs/data/runs/stabiliser-map [--criteria training] [--out FILE]

For every archived probe: the step at which its records make the criteria certain (flt_diag.judge.decided), the
`training` outcome of its records cut there against that of all its records (never different: the certainty
rules), and the steps it would have run (through the decided step, and one more where that step took no
loop-dynamics snapshot; all of them where nothing was decided). For every line: the probes plain bisection from
the grid's middle makes under the criteria alone, and those the informed search (flt_diag.judge.line_prior: the
variant's earlier seeds' median boundary, then the index below) makes, each outcome read from the archive; a
probe the archive lacks is read off the line's archived bracket (monotone outcomes: below it held, from it
broke) and costed at the median time of its variant's archived probes at that lr. Probe-hours are the archived
wall times, scaled by the share of steps a stopped probe runs. Prints Markdown: the hours of each step of the
change and whether any line's breaking lr moved.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from flt_diag.grids.stability_map import search  # noqa: E402  (torch-free: the search, with its informed start)
from flt_diag.judge.decided import decided_at  # noqa: E402
from flt_diag.judge.line_prior import closed_boundary, earlier_lines, prior_index  # noqa: E402
from flt_diag.judge.map_boundaries import CRITERIA, map_lines, probe_cell, probe_path, spec_from_folder  # noqa: E402
from flt_diag.judge.verdict import Recipe, judged  # noqa: E402
from flt_diag.results.report import markdown  # noqa: E402
from flt_diag.storage.folders import StorageError, load_config, load_metrics, load_summary  # noqa: E402
from script_exit import Parser, guarded  # noqa: E402

TRAINING = CRITERIA["training"]


def stopped_steps(decided: int | None, steps: int, dynamics_every: int) -> int:
    """Steps a probe runs when it stops once decided at `decided` (None: all `steps`): through the decided step,
    and one more for the loop-dynamics snapshot where the decided step took none (flt_diag.training.decided_stop)."""
    if decided is None:
        return steps
    snapshot = dynamics_every > 0 and decided % dynamics_every != 0
    return min(steps, decided + 1 + int(snapshot))


def probe_replay(path: Path, criteria: list[str]) -> dict:
    """One archived probe: its decided step under `criteria`, its `training` outcome from all its records and from
    its records cut at that step, the archived one, and its wall time and steps."""
    stored, summary = load_config(path), load_summary(path)
    if summary is None:
        raise StorageError(f"{path} has no summary: not a finished probe")
    cfg = stored.run_config()
    recipe = Recipe.of(cfg)
    df = load_metrics(path)
    decision = decided_at(df, recipe, criteria)
    full = judged(df, recipe, stored.unigram_entropy)[0]
    cut = judged(df[df.step <= decision.step], recipe, stored.unigram_entropy)[0] if decision else None
    steps = stopped_steps(decision.step if decision else None, cfg.train.steps, cfg.diagnostics.dynamics_every)
    return dict(decided=decision.step if decision else None, verdict=summary.verdict, full=full, cut=cut,
                broke=TRAINING(summary), **{f"broke_{c}": CRITERIA[c](summary) for c in criteria}, wall=float(summary.wall_time or np.nan), steps=cfg.train.steps,
                ran=steps, wall_stopped=float(summary.wall_time or np.nan) * steps / cfg.train.steps)


def probes(root: Path, criteria: list[str]) -> pd.DataFrame:
    """Every archived probe of the map at `root`, replayed (probe_replay), with its line and grid index."""
    spec = spec_from_folder(root)
    rows = []
    for line in map_lines(spec):
        for i, value in enumerate(spec.grid):
            path = probe_path(root, probe_cell(spec, line, value).name)
            if load_summary(path) is not None:
                rows.append(dict(line=line.index, variant=line.variant, seed=line.seed, index=i, value=value,
                                 name=path.name, **probe_replay(path, criteria)))
    if not rows:
        raise StorageError(f"no finished probe in {root}")
    return pd.DataFrame(rows)


def line_searches(spec, table: pd.DataFrame, criteria: list[str]) -> pd.DataFrame:
    """Per line and criterion: the archived bracket's boundary, and the probes and boundary of plain bisection
    and of the informed search, replayed on the archived outcomes (inferred from the bracket where missing)."""
    n, rows, found = len(spec.grid), [], {}
    for line in map_lines(spec):
        mine = table[table.line == line.index]
        for criterion in criteria:
            archived = {int(i): bool(x) for i, x in zip(mine["index"], mine[f"broke_{criterion}"])}
            b = closed_boundary(archived, n)

            def read(i: int, seen: list) -> bool | None:
                seen.append(i)
                if i in archived:
                    return archived[i]
                return None if b is None else i >= b  # (monotone: held below the bracket, broke from it)
            plain: list[int] = []
            informed: list[int] = []
            p = search(n, lambda i: read(i, plain))
            prior = prior_index([found[(x.index, criterion)] for x in earlier_lines(spec, line)
                                 if found.get((x.index, criterion)) is not None])
            q = search(n, lambda i: read(i, informed), prior=prior)
            found[(line.index, criterion)] = q["b"] if q["b"] - q["a"] == 1 else None
            rows.append(dict(line=line.index, variant=line.variant, seed=line.seed, criterion=criterion,
                             archived=b, plain=p["b"], informed=q["b"], prior=prior, plain_probes=plain,
                             informed_probes=informed, inferred=[i for i in informed if i not in archived]))
    return pd.DataFrame(rows)


def cost(table: pd.DataFrame, line: int, variant: str, index: int, stop: bool) -> tuple[float, bool]:
    """(seconds, estimated) of one probe: its archived wall time (scaled to the steps it runs when `stop`), or, not
    archived, the median of its variant's archived probes at that grid index (any seed)."""
    column = "wall_stopped" if stop else "wall"
    hit = table[(table.line == line) & (table["index"] == index)]
    if len(hit):
        return float(hit[column].iloc[0]), False
    peers = table[(table.variant == variant) & (table["index"] == index)]
    peers = peers if len(peers) else table[table.variant == variant]
    return float(peers[column].median()), True


def hours(table: pd.DataFrame, lines: pd.DataFrame, which: str, stop: bool) -> tuple[float, int, int]:
    """(probe-hours, probes, of them estimated) of the union over criteria of each line's `which` probes."""
    total, count, estimated = 0.0, 0, 0
    for (line, variant), g in lines.groupby(["line", "variant"], sort=False):
        for i in sorted({i for probes in g[f"{which}_probes"] for i in probes}):
            seconds, guess = cost(table, line, variant, i, stop)
            total, count, estimated = total + seconds, count + 1, estimated + int(guess)
    return total / 3600, count, estimated


def report(root: Path, criteria: list[str]) -> str:
    spec = spec_from_folder(root)
    table = probes(root, criteria)
    lines = line_searches(spec, table, criteria)
    everything = table.wall.sum() / 3600
    steps = [("archived (criteria " + ", ".join(spec.criteria) + ", bisection from the middle, every probe to its "
              f"last step)", everything, len(table), 0)]
    for label, which, stop in [(f"criteria {', '.join(criteria)} only, bisection from the middle", "plain", False),
                               ("... and each probe stopped once decided", "plain", True),
                               ("... and each line started at its variant's earlier seeds' boundary", "informed", True)]:
        h, n, guessed = hours(table, lines, which, stop)
        steps.append((label, h, n, guessed))
    changed = lines[lines.archived != lines.informed]
    guessed = lines[lines.inferred.map(len) > 0]
    open_lines = lines[lines.archived.isna()]
    flipped = table[table.cut.notna() & (table.cut.ne("stable") != table.full.ne("stable"))]
    decided = table[table.decided.notna()]
    plain = {(r.line, i) for r in lines.itertuples() for i in r.plain_probes}
    informed = {(r.line, i) for r in lines.itertuples() for i in r.informed_probes}
    out = [f"Archive: {root} ({len(table)} probes, {table.line.nunique()} lines; criteria replayed: "
           f"{', '.join(criteria)}).", "",
           markdown(pd.DataFrame([dict(search=s, **{"probe-hours": f"{h:.1f}", "probes": n,
                                                     "of them not archived (estimated)": g}) for s, h, n, g in steps])).rstrip(),
           "",
           f"Probes decided before their last step: {len(decided)} of {len(table)} (of the "
           f"{int(table.broke.sum())} broken under `training`); decided step median {decided.decided.median():.0f}, "
           f"range {decided.decided.min():.0f}-{decided.decided.max():.0f}. The `training` outcome of the records cut "
           f"at the decided step differs from that of all the records in {len(flipped)} probes.",
           f"The informed start skips {len(plain - informed)} of the {len(plain)} probes of plain bisection and adds "
           f"{len(informed - plain)} ({int(lines.inferred.map(len).sum())} of its probes are not in the archive: read "
           "off the line's archived bracket).",
           f"Lines whose boundary moved (informed search against the archived bracket): {len(changed)} of "
           f"{len(lines)}" + (f" ({', '.join(map(str, changed.line))})" if len(changed) else "") +
           (f"; {len(open_lines)} archived lines not closed" if len(open_lines) else "") +
           f". {len(lines) - len(guessed)} lines' informed searches read archived probes only; the other "
           f"{len(guessed)} each read a probe the archive lacks off the line's bracket (monotone outcomes).",
           f"Probe-hours: the archived wall times (sum {everything:.1f} h), a stopped probe's scaled by the share "
           "of its steps it runs; the replay: this script, no training."]
    return "\n".join(out) + "\n"


@guarded
def main(argv=None) -> int:
    from flt_diag.storage.folders import atomic_write_text
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="an archived stability map (docs/data/runs/stabiliser-map)")
    parser.add_argument("--criteria", nargs="+", default=["training"], choices=sorted(CRITERIA),
                        help="the criteria the new search runs [default: training]")
    parser.add_argument("--out", type=Path, help="write the Markdown here instead of printing it")
    args = parser.parse_args(argv)
    text = report(args.root, list(dict.fromkeys(args.criteria)))
    if args.out:
        atomic_write_text(args.out, text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
