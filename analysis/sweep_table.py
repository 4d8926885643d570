"""One sweep (a folder or its archive) as a Markdown table, for a generated block of docs/results.md. No torch.

    python analysis/sweep_table.py docs/data/runs/readme-main-job

One row per finished run, in the sweep's order (K, then the variants as `flt-diag summary` lists them): the
verdict v3 its summary holds, the val loss, its gap to the best variant at the same K, seed, lr scale, depth and
width (`val_gap`), the peak final-loop residual norm (* an explosion) and the median |dlog g| oscillation index;
then the code that made the runs, and the count of runs not finished. The numbers are those `flt-diag summary` prints
(the same sweep_summary), rounded as it rounds them.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pandas as pd  # noqa: E402

from flt_diag.judge.peers import gap_text  # noqa: E402
from flt_diag.judge.summary_table import sweep_summary  # noqa: E402
from flt_diag.results.report import markdown  # noqa: E402
from flt_diag.results.archiving import code_lines  # noqa: E402
from flt_diag.storage.file_models import SweepSpecFile  # noqa: E402
from flt_diag.storage.folders import StorageError, is_archive, is_sweep, load_spec  # noqa: E402
from script_exit import Parser, guarded, source  # noqa: E402


def table(sweep: Path) -> str:
    """The Markdown of one sweep (module docstring)."""
    if not is_sweep(sweep):
        raise StorageError(f"{sweep} is not a sweep folder or an archived sweep (no sweep.json)")
    df = sweep_summary(sweep)
    if not len(df):
        return f"No finished run in {sweep}.\n"
    rows = pd.DataFrame({
        "variant": df.variant, "K": df.loops, "seed": df.seed, "lr x": df.lr_scale.map("{:g}".format),
        "verdict": df.verdict, "val loss": df.val_loss.map("{:.3f}".format),
        "gap to best": df.val_gap.map(gap_text),  # (compare_runs's gap, as `flt-diag summary` shows it)
        "peak final-loop norm": [(f"{n:.3g}" if n < 1000 else f"{n:.0f}") + ("*" if e else "")
                                 for n, e in zip(df.peak_resid_norm, df.residual_explosion)],
        "median abs dlog g": df.osc_dlog_median.map("{:.3f}".format)})
    spec = load_spec(sweep)  # (a map's spec names no cells: its probes are a search)
    unfinished = len(spec.cell_names) - len(df) if isinstance(spec, SweepSpecFile) else 0
    lines = [markdown(rows), "Marked *: a residual explosion (the verdict's explosion ratio); gap to best: val loss minus "
             "the lowest at the same K, seed, lr scale, depth and width (nats).", ""]
    lines += [f"Code: {text}." for text in code_lines(sweep)] if is_archive(sweep) else []
    if unfinished:
        lines.append(f"Runs of the grid not finished{' (or not archived)' if is_archive(sweep) else ''}: {unfinished}.")
    return "\n".join(lines) + "\n"


@guarded
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=source, help="a sweep folder or an archived sweep")
    args = parser.parse_args(argv)
    print(table(args.sweep), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
