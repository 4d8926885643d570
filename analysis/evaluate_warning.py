"""Evaluate the early warning against its baselines on finished run folders (issue 34's plan:
docs/plans/2026-12-01-verdict-v3-and-warning-evaluation.md). Writes CSV tables and prints them as Markdown.

    python analysis/evaluate_warning.py runs/default runs/w1-lt9 runs/w2-lr --out docs/data/warning-eval \
        --set "LT K=9 seeds" variant=lt loops=9 --set "lr x4 vs x8 at L=6" depth=6 --set "LT K=6, 9" variant=lt loops=6,9

Labels are the runs' summary.json verdicts (run `flt-diag summary --recompute` first to judge them with
the current verdict). No torch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # (a checkout)

import numpy as np  # noqa: E402

from flt_diag.results import warning_evaluation as W  # noqa: E402
from flt_diag.results.predictor_fit import DEFAULT_FEATURES  # noqa: E402
from flt_diag.storage.files import load_predictor  # noqa: E402
from flt_diag.storage.folders import atomic_write_text, make_folder, refuse_links  # noqa: E402
from flt_diag.storage.safe_files import new_file  # noqa: E402
from flt_diag.storage.predictor_names import PACKAGED  # noqa: E402
from script_exit import Parser, guarded, whole, source  # noqa: E402  (analysis/script_exit.py: the one error path)


def selector(conditions: list[str]):
    """The rows meeting every KEY=VALUE (KEY=V1,V2: any of the values) of `conditions`."""
    if bad := [c for c in conditions if "=" not in c]:
        raise ValueError(f"--set: {bad[0]!r} is not KEY=VALUE[,VALUE2]")
    pairs = [(key, values.split(",")) for key, values in (c.split("=", 1) for c in conditions)]

    def select(table):
        mask = np.ones(len(table), bool)
        for key, values in pairs:
            if key not in table:
                raise ValueError(f"--set: no column {key!r} (the columns: {', '.join(map(str, table.columns))})")
            column, any_of = table[key], np.zeros(len(table), bool)
            for value in values:
                any_of |= (column.astype(str) == value) | (column.astype(float, errors="ignore") == _num(value))
            mask &= any_of
        return mask
    return select


def _num(value: str):
    try:
        return float(value)
    except ValueError:
        return value


@guarded
def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=source)
    ap.add_argument("--at", nargs="+", type=whole(1), default=[100, 200, 300, 500])
    ap.add_argument("--out", type=Path, required=True, help="folder for the CSV tables")
    ap.add_argument("--set", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                    help="a within-variant set: its name, then conditions on the runs' columns")
    args = ap.parse_args(argv)
    if short := [s[0] for s in args.set if len(s) < 2]:  # (checked before anything is read or written)
        raise ValueError(f"--set {short[0]!r}: give the set's name, then KEY=VALUE conditions")
    for s in args.set:
        selector(s[1:])
    outputs = {name: args.out / name for name in ("rows.csv", "comparison.csv", "ablation.csv", "runs.json", "ship.json")}
    for path in outputs.values():  # refused before any run is read: a link, a FIFO, a folder (as flt-diag writes)
        refuse_links(new_file(path), args.out)

    def write(name: str, text: str) -> None:  # a temporary file renamed into place, never through a link
        atomic_write_text(new_file(outputs[name]), text, args.out)
    packaged = load_predictor(PACKAGED)
    table = W.evaluation_table(args.folders, args.at, packaged)
    if table.empty:
        print("error: no finished run in the given folders", file=sys.stderr)
        return 2
    make_folder(args.out, args.out)
    write("rows.csv", table.to_csv(index=False))
    sets = {s[0]: selector(s[1:]) for s in args.set}
    # the refit is the packaged model's recipe (its features) refitted; "refit, 8 features" is fit-predictor's default set
    comparison = W.comparison(table, packaged.features, sets, wide_features=DEFAULT_FEATURES)
    write("comparison.csv", comparison.to_csv(index=False))
    ablation = W.ablation(table, DEFAULT_FEATURES)
    write("ablation.csv", ablation.to_csv(index=False))
    runs = table.drop_duplicates("run")
    write("runs.json", json.dumps(
        {"runs": len(runs), "failing": int(runs.failed.sum()),
         "verdicts": runs.verdict.value_counts().to_dict()}, indent=1))
    fmt = {c: "{:.2f}".format for c in ("auroc", "auroc_lo", "auroc_hi", "agreement", "agreement_lo", "agreement_hi")}
    print(f"{len(runs)} runs, {int(runs.failed.sum())} failing: {runs.verdict.value_counts().to_dict()}\n")
    print(comparison.to_string(index=False, formatters=fmt))
    print()
    print(ablation.to_string(index=False, formatters=fmt))
    ships, reason = W.ship_decision(comparison)
    write("ship.json", json.dumps({"refit_ships": ships, "reason": reason}, indent=1))
    print(f"\nwhat ships, by the plan's rule: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
