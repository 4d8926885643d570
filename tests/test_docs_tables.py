"""Every generated table of docs/ (analysis/docs_tables.py: the blocks between `<!-- generated: COMMAND -->`
and `<!-- end generated -->`) is what its command prints over the run archive today, and the checker
itself catches a block that differs."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))
import docs_tables  # noqa: E402


def test_the_pages_have_generated_tables_and_each_matches_its_command():
    found = [m.group("command") for page in docs_tables.PAGES for m in docs_tables.blocks(page.read_text())]
    assert found, "no generated block in docs/results.md or docs/early-warning.md"
    stale = [c for page in docs_tables.PAGES for c in docs_tables.regenerate(page, check=True)]
    assert not stale, f"committed tables differ from their commands (python analysis/docs_tables.py): {stale}"


def test_the_checker_catches_a_changed_block_and_rewrites_it(tmp_path):
    right = docs_tables.output_of("flt-diag variants")
    assert "flt" in right and right.endswith("\n")
    page = tmp_path / "page.md"
    page.write_text(f"intro\n<!-- generated: flt-diag variants -->\n{right.replace('flt', 'FLT', 1)}<!-- end generated -->\nend\n")
    assert docs_tables.regenerate(page, check=True) == ["flt-diag variants"]
    assert docs_tables.regenerate(page, check=False) == ["flt-diag variants"]
    assert page.read_text() == f"intro\n<!-- generated: flt-diag variants -->\n{right}<!-- end generated -->\nend\n"
    assert docs_tables.regenerate(page, check=True) == []


def test_a_block_may_run_only_the_projects_commands():
    with pytest.raises(ValueError):
        docs_tables.argv_of("rm -rf /")
    with pytest.raises(ValueError):
        docs_tables.argv_of("python /tmp/evil.py")


ROUND_TWO = "python analysis/stabiliser_benchmark_2.py docs/data/runs/stabiliser-bench-2"


def test_round_two_has_its_generated_block_and_it_matches():
    """docs/results.md's "The head-to-head, round two" carries the answer generated from its archive (issue 66
    part 4), and the committed block is what the command prints today (it reads "not run" until the runs land)."""
    page = docs_tables.PAGES[0]
    found = {m.group("command"): m.group("body") for m in docs_tables.blocks(page.read_text())}
    assert ROUND_TWO in found
    assert found[ROUND_TWO] == docs_tables.output_of(ROUND_TWO)
