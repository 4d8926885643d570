"""The generated tables of docs/: each block between

    <!-- generated: COMMAND -->
    ...
    <!-- end generated -->

in docs/results.md, docs/early-warning.md and docs/DESIGN.md is the output of COMMAND run from the repository root over the
run archive in docs/data/runs/ (COMMAND is `python analysis/<script>.py ...` or `flt-diag ...`). No torch
beyond what the commands import.

    python analysis/docs_tables.py            # rewrite every block from its command
    python analysis/docs_tables.py --check    # exit 1, naming each block, if a committed block differs

A page that cannot be read (missing, not a regular file, over MAX_PAGE_BYTES, not UTF-8), a block whose
command is not one of those two forms, names docs_tables.py itself (it would run itself over and over: refused
before it runs, and a docs_tables.py started inside a block's command refuses to run), fails, or runs over
TIMEOUT seconds: one `error:` line, exit 2, and that page left as it was.
"""
from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]  # run from a checkout without installing

from flt_diag.storage.folders import atomic_write_text  # noqa: E402
from flt_diag.storage.schema import read_text  # noqa: E402
from script_exit import Parser, guarded  # noqa: E402  (analysis/script_exit.py: the one error path)

PAGES = [ROOT / "docs" / "results.md", ROOT / "docs" / "early-warning.md", ROOT / "docs" / "DESIGN.md"]
BLOCK = re.compile(r"(<!-- generated: (?P<command>.+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
MAX_PAGE_BYTES = 4 << 20  # the pages are tens of kilobytes
TIMEOUT = 600  # seconds one block's command may run
INSIDE = "FLT_DIAG_DOCS_TABLES"  # set in a block's command's environment: a docs_tables.py under it refuses to run
SELF = Path(__file__).name


def argv_of(command: str) -> list[str]:
    """The command as an argument list: `python analysis/X.py ...` or `flt-diag ...` (run with this Python);
    never this script (a block that ran it would run its own page's blocks, itself among them, without end)."""
    try:
        args = shlex.split(command)
    except ValueError as e:  # an unclosed quote
        raise ValueError(f"a generated block's command {command!r} does not parse ({e})") from None
    if args[:1] == ["python"] and len(args) > 1 and re.fullmatch(r"analysis/[a-z0-9_]+\.py", args[1]):
        if args[1] == f"analysis/{SELF}":
            raise ValueError(f"a generated block may not run {SELF} itself: {command!r}")
        return [sys.executable, *args[1:]]
    if args[:1] == ["flt-diag"]:
        return [sys.executable, "-m", "flt_diag", *args[1:]]
    raise ValueError(f"not a command a generated block may run: {command!r} (python analysis/<script>.py or flt-diag)")


def output_of(command: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", INSIDE: command[:200]}
    try:
        done = subprocess.run(argv_of(command), cwd=ROOT, capture_output=True, text=True, env=env, timeout=TIMEOUT,
                              errors="replace")
    except subprocess.TimeoutExpired:
        raise ValueError(f"{command!r} ran over {TIMEOUT} s; stopped") from None
    if done.returncode != 0:
        raise ValueError(f"{command!r} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return done.stdout.rstrip("\n") + "\n"


def blocks(text: str) -> list[re.Match]:
    return list(BLOCK.finditer(text))


def regenerate(page: Path, check: bool) -> list[str]:
    """Rewrite (or with check, compare) the page's blocks; the commands whose committed block differs."""
    text = read_text(page, MAX_PAGE_BYTES, "a docs page")  # a regular UTF-8 file of a bounded size, or one line
    stale, out, last = [], [], 0
    for m in blocks(text):
        new = output_of(m.group("command"))
        if new != m.group("body"):
            stale.append(m.group("command"))
            if check:
                diff = difflib.unified_diff(m.group("body").splitlines(), new.splitlines(), "committed", "regenerated",
                                            lineterm="", n=1)
                print("\n".join(list(diff)[:20]), file=sys.stderr)
        out += [text[last:m.start("body")], new]
        last = m.end("body")
    out.append(text[last:])
    if not check and stale:
        atomic_write_text(page, "".join(out))
    return stale


@guarded
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a block differs")
    args = parser.parse_args(argv)
    if os.environ.get(INSIDE):
        raise ValueError(f"{SELF} started by a generated block's command ({os.environ[INSIDE]!r}); refused, "
                         "so that it never runs itself")
    stale = []
    for page in PAGES:
        for command in regenerate(page, args.check):
            stale.append(f"{page.relative_to(ROOT)}: {command}")
    for line in stale:
        print(("differs: " if args.check else "rewritten: ") + line)
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
