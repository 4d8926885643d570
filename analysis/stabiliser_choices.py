"""The values each stabiliser's file marks as flt-diag's own choice (`ours`) and what its --strength multiplies, as
one markdown table generated from the files (flt_diag/model/stabilisers/, via flt_diag.config.variants; docs/
DESIGN.md §2b holds it between generated markers: `python analysis/docs_tables.py` rewrites it).

    python analysis/stabiliser_choices.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from flt_diag.config.variants import STABILISERS  # noqa: E402
from script_exit import Parser, run  # noqa: E402


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table() -> str:
    """| stabiliser | --strength multiplies | flt-diag's choice | value and why |, one row per `ours` entry."""
    rows = ["| stabiliser | `--strength` multiplies | flt-diag's choice | value (and the source's, where it has one) |",
            "|---|---|---|---|"]
    for name, stab in STABILISERS.items():
        strength = cell(stab.strength) if stab.strength else "(none: S = 1 only)"
        items = list(stab.ours.items()) or [("(none)", "every value is the source's")]
        for i, (what, why) in enumerate(items):
            rows.append(f"| {f'`{name}`' if i == 0 else ''} | {strength if i == 0 else ''} | {cell(what)} | "
                        f"{cell(why)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    run(main)
