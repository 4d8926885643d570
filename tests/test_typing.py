"""The public API is typed (flt_diag/py.typed), checked by mypy in one run (one subprocess, its cache in a
temporary folder; pyproject.toml's [tool.mypy] configures it): no error in any module of the package (flt_diag/:
the public ones, the package's __init__, integrations/, the callback moments and the step record of instruments/,
and every other), nor in typed user code written against it
(tests/typing/user_code.py: watch, LoopProbe, the results, the callbacks), nor in tests/typing/hosts.py (flt-diag's
Trainer and the probe's stand-in are each the callbacks' Host); and each misuse in tests/typing/misuse.py (a
keyword of the wrong type) is reported, so that the check can fail. --check-untyped-defs: the bodies of functions
without annotations are checked too (the trainers' callback moments). --follow-imports=silent: what the checked
files import is read for its types, its own errors are not reported."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "tests" / "typing"
PACKAGE = "flt_diag/"  # every module of the package
EXTRAS = {"transformers": "hf-trainer", "lightning": "lightning"}  # the optional libraries the public modules type against


@pytest.fixture(scope="session")
def mypy_report(tmp_path_factory) -> str:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install 'flt-diag[test]')")
    for extra, name in EXTRAS.items():  # the callbacks are checked against the libraries' own types
        if importlib.util.find_spec(extra) is None:
            pytest.skip(f"{extra} is not installed: the typed callbacks need it (pip install 'flt-diag[{name}]')")
    cache = tmp_path_factory.mktemp("mypy-cache")
    env = {**os.environ, "MYPYPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--check-untyped-defs",
                           "--cache-dir", str(cache),
                           "--no-error-summary", "--show-error-codes", PACKAGE,
                           *(str(HERE / name) for name in ("user_code.py", "hosts.py", "misuse.py"))],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.stdout


def test_typed_user_code_has_no_error(mypy_report):
    assert "user_code.py" not in mypy_report, mypy_report


def test_the_package_has_no_error(mypy_report):
    errors = [line for line in mypy_report.splitlines() if line.startswith("flt_diag") and ": error:" in line]
    assert not errors, "\n".join(errors)


def test_the_trainer_and_the_probe_are_the_callbacks_host(mypy_report):
    assert "hosts.py" not in mypy_report, mypy_report


def test_each_misuse_is_reported(mypy_report):
    lines = (HERE / "misuse.py").read_text().splitlines()
    expected = {(i + 1, m.group(1)) for i, line in enumerate(lines) if (m := re.search(r"# error: ([\w-]+)", line))}
    found = {(int(n), code) for n, code in re.findall(r"misuse\.py:(\d+): error: .*\[([\w-]+)\]", mypy_report)}
    assert len(expected) == 4 and expected == found, mypy_report


def test_the_callbacks_options_are_watchs_keywords():
    import inspect

    from flt_diag.integrations.watch import LoopProbe, WatchOptions, watch
    keywords = {n for n, p in inspect.signature(watch).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == set(WatchOptions.__annotations__)
    options = inspect.signature(LoopProbe.__init__).parameters["options"]  # (LoopProbe takes them once)
    assert options.kind is options.VAR_KEYWORD and "Unpack[WatchOptions]" in str(options.annotation)
