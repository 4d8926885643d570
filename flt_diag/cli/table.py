"""docs/cli.md: the table of every option of train, run-ablation and map (and summary's thresholds),
generated from the command line's options; a test keeps the file equal to it. Regenerate: `python -m
flt_diag.cli.table`."""
from __future__ import annotations

import sys
from pathlib import Path

from flt_diag.cli.options import command_options, config_options, default_text
from flt_diag.config.option_fields import flag, form

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
START, END = "<!-- options:start -->", "<!-- options:end -->"
HEADER = """# Command-line options

Every option of `flt-diag train`, `run-ablation` and `map` (and the verdict thresholds of `summary
--recompute`), with its default and meaning. The options come from one typed config
(`flt_diag/config/run_config.py`, `flt_diag/config/grid_options.py`); which command takes which is `flt_diag/cli/options.py`. `flt-diag COMMAND
--help` shows the same, grouped by config section.

This file is generated: after changing an option, run `python -m flt_diag.cli.table` (a test fails
while the table and the options differ).
"""


def options_markdown() -> str:
    """The option table (one row per flag and meaning, with the commands that take it)."""
    rows, seen = ["| option | commands | default | meaning |", "|---|---|---|---|"], dict[tuple, tuple]()
    for command in ("run-ablation", "map", "train"):
        for p in command_options(command):
            seen.setdefault((flag(*p[1:]), p[2].description), (p, []))[1].append(command)
    for p in config_options("summary"):
        seen[(flag(*p[1:]), p[2].description)][1].append("summary --recompute")
    for (name, help), (p, commands) in seen.items():
        name = f"`{name}`" + (f" / `--no-{name[2:]}`" if form(p[2]).kind is bool and p[0] != "cli" else "")
        default = default_text(*p).strip()[1:-1].replace("default: ", "").replace("default by preset: ", "")
        rows.append(f"| {name} | {', '.join(commands)} | {default or '-'} | {help.replace('|', '/')} |")
    return "\n".join(rows)


def document(current: str = "") -> str:
    """docs/cli.md with its option table generated; what follows the table in `current` (the page's hand-written
    sections) is kept."""
    tail = current.split(END, 1)[1] if END in current else "\n"
    return f"{HEADER}\n{START}\n{options_markdown()}\n{END}{tail}"


if __name__ == "__main__":
    DOC.write_text(document(DOC.read_text() if DOC.exists() else ""))
    print(DOC, file=sys.stderr)
