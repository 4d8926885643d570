"""The generated tables of docs/: each block between

    <!-- generated: COMMAND -->
    ...
    <!-- end generated -->

in docs/results.md and docs/early-warning.md is the output of COMMAND run from the repository root over the
run archive in docs/data/runs/ (COMMAND is `python analysis/<script>.py ...` or `flt-diag ...`). No torch
beyond what the commands import.

    python analysis/docs_tables.py            # rewrite every block from its command
    python analysis/docs_tables.py --check    # exit 1, naming each block, if a committed block differs
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from flt_diag.storage.folders import atomic_write_text  # noqa: E402
PAGES = [ROOT / "docs" / "results.md", ROOT / "docs" / "early-warning.md"]
BLOCK = re.compile(r"(<!-- generated: (?P<command>.+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def argv_of(command: str) -> list[str]:
    """The command as an argument list: `python analysis/X.py ...` or `flt-diag ...` (run with this Python)."""
    args = shlex.split(command)
    if args[:1] == ["python"] and len(args) > 1 and re.fullmatch(r"analysis/[a-z_]+\.py", args[1]):
        return [sys.executable, *args[1:]]
    if args[:1] == ["flt-diag"]:
        return [sys.executable, "-m", "flt_diag", *args[1:]]
    raise ValueError(f"not a command a generated block may run: {command!r} (python analysis/<script>.py or flt-diag)")


def output_of(command: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    done = subprocess.run(argv_of(command), cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{command!r} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return done.stdout.rstrip("\n") + "\n"


def blocks(text: str) -> list[re.Match]:
    return list(BLOCK.finditer(text))


def regenerate(page: Path, check: bool) -> list[str]:
    """Rewrite (or with check, compare) the page's blocks; the commands whose committed block differs."""
    text = page.read_text()
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a block differs")
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        for command in regenerate(page, args.check):
            stale.append(f"{page.relative_to(ROOT)}: {command}")
    for line in stale:
        print(("differs: " if args.check else "rewritten: ") + line)
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
