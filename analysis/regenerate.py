"""Regenerate every figure, the results table and the HTML report of a study from its folders alone.

    python analysis/regenerate.py SWEEP [--out DIR]

Writes <DIR>/<figure>.png|pdf, <DIR>/table.csv (one row per cell, full precision),
<DIR>/table.md (the report's table) and the report (<DIR>/report.html with --out, else
<SWEEP>/report.html). Default DIR: <SWEEP>/figures. Works on a run folder too, and on a sweep
still in progress. Imports only flt_diag.results.tables / figures / report / storage: never the training code.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # (a checkout)

from flt_diag.results import figures, report  # noqa: E402
from flt_diag.judge.map_boundaries import critical_table  # noqa: E402
from flt_diag.results.tables import collect, results_table, summary_table  # noqa: E402
from flt_diag.storage.folders import atomic_write_text, make_folder  # noqa: E402
from flt_diag.storage.safe_files import new_file  # noqa: E402
from script_exit import Parser, guarded, source  # noqa: E402  (analysis/script_exit.py: the one error path)


def _missing(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first: the folders a write would make."""
    return [p for p in [folder, *folder.parents] if not os.path.lexists(p)]


def regenerate(sweep: Path, out: Path | None = None, formats=("png", "pdf")) -> list[Path]:
    """Write every output, as flt-diag's own commands do (a temporary file renamed into place; no write through
    a link below the folder given, --out or SWEEP, nor over a FIFO); returns the paths written. The study is
    read and drawn before anything is made, and a failure removes the folders this call made with what it
    wrote in them: a refusal leaves nothing it created (an empty --out included)."""
    root = out if out is not None else sweep  # the user's own choice (which may itself be a link)
    study = collect(sweep)
    drawn, skipped = figures.render(study)
    table = critical_table(sweep) if study.kind == "map" else None  # a stability map: its critical values too
    fig_dir = out if out is not None else sweep / "figures"
    made, written = _missing(fig_dir), list[Path]()
    try:
        _write_all(study, drawn, skipped, table, sweep, out, make_folder(fig_dir, root), root, formats, written)
    except BaseException:
        for path in written if made else []:  # (only in a folder this call made: nothing of the user's)
            Path(path).unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # (empty only)
        raise
    return written


def _write_all(study, drawn, skipped, table, sweep, out, fig_dir, root, formats, written: list) -> None:
    def write(path: Path, text: str) -> None:
        atomic_write_text(new_file(path), text, root)
        written.append(path)
    for kind, fig in drawn.items():
        for fmt in formats:
            written.append(figures.save(fig, new_file(fig_dir / f"{kind}.{fmt}"), root=root))
    for kind, why in skipped.items():
        print(f"skipped {why}", file=sys.stderr)
    write(fig_dir / "table.csv", summary_table(study).to_csv(index=False))
    write(fig_dir / "table.md", report.markdown(results_table(study)))
    if table is not None:
        write(fig_dir / "map_table.csv", table.to_csv(index=False))
        write(fig_dir / "map_table.md", report.markdown(table))
    html = (out / report.REPORT) if out is not None else sweep / report.REPORT
    written.append(report.write_html(study, drawn, skipped, new_file(html), root))


@guarded
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=source, help="sweep folder (or a single run folder)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: SWEEP/figures)")
    args = parser.parse_args(argv)
    for path in regenerate(args.sweep, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
