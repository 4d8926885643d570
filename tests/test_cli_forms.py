"""The typer command line: every list option takes `--x 3 6`, `--x 3,6`, `--x 3 --x 6` and `--x=3`;
negative numbers are values and `--` ends the options; `--help` has typer's panels; shell completion
installs and completes; every usage error is one `error:` line with exit status 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_errors import one_error_line
from flt_diag.cli import main
from flt_diag.cli.app import parse
from flt_diag.cli.commands import COMMANDS
from flt_diag.cli.options import POSITIONALS, command_options
from flt_diag.config.option_fields import default, form


def _view(p):
    """An option (section, field name, field) as this test reads it: its flag, the name typed, its type."""
    _, name, info = p
    dest = info.alias or name
    f = form(info)
    return SimpleNamespace(flag="--" + dest.replace("_", "-"), dest=dest, kind=f.kind, many=f.many, choices=f.choices,
                           low=f.low, above=f.above, required=not f.optional and default(info) is None)


def _two_values(o) -> tuple[list[str], list]:
    """Two valid values of a list option: as typed, and as parsed."""
    if o.choices:
        return list(o.choices[:2]), list(o.choices[:2])
    if o.kind is int:
        low = int(o.low or 0) + 1
        return [str(low), str(low + 1)], [low, low + 1]
    if o.kind is float:
        x = (o.above if o.above is not None else o.low or 0) + 0.5
        return [str(x), str(x + 1)], [x, x + 1]
    if o.kind is Path:
        return ["a", "b"], [Path("a"), Path("b")]
    return ["a", "b"], ["a", "b"]


LIST_OPTIONS = [(name, o) for name in COMMANDS for o in map(_view, command_options(name)) if o.many]


def test_the_list_options_cover_every_command_that_has_one():
    assert {name for name, _ in LIST_OPTIONS} == {"run-ablation", "map", "eval-loops", "predict", "fit-predictor",
                                                   "plot", "train"}  # (train: --stop-when-decided)


@pytest.mark.parametrize("command, o", LIST_OPTIONS, ids=[f"{c} {o.flag}" for c, o in LIST_OPTIONS])
def test_every_list_option_takes_spaces_commas_repetition_and_equals(command, o):
    words = ["plot", "loss"] if command == "plot" else [command]
    words += ["folder"] * len(POSITIONALS.get(command, []))
    words += [w for r in map(_view, command_options(command)) if r.required for w in (r.flag, "x")]
    (a, b), parsed = _two_values(o)
    forms = {"spaces": [o.flag, a, b], "commas": [o.flag, f"{a},{b}"], "repeated": [o.flag, a, o.flag, b],
             "equals": [f"{o.flag}={a}"]}
    for form, args in forms.items():
        _, values, _ = parse([*words, *args])
        assert values[o.dest] == (parsed[:1] if form == "equals" else parsed), form


def test_a_negative_number_is_a_value_refused_by_its_range_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--lr-scale", "-1"]) == 2
    assert "--lr-scale must be > 0, got -1.0" in one_error_line(capsys)
    assert main(["run-ablation", "--loops", "3", "-6", "--list"]) == 2
    assert "--loops must be in 1..1024, got -6" in one_error_line(capsys)
    assert parse(["run-ablation", "--lr-scale", "-0.5", "2e-1"])[1]["lr_scale"] == [-0.5, 0.2]
    assert list(tmp_path.iterdir()) == []


def test_double_dash_ends_the_options():
    _, values, _ = parse(["predict", "--at", "100", "200", "--", "-odd", "runs"])
    assert values["at"] == [100, 200] and values["paths"] == [Path("-odd"), Path("runs")]
    _, values, _ = parse(["summary", "--", "--recompute"])
    assert values["paths"] == [Path("--recompute")] and values["recompute"] is False


@pytest.mark.parametrize("args, words", [
    (["train", "--no-such-option"], "No such option: --no-such-option"),
    (["no-such-command"], "No such command"),
    (["train", "--steps"], "--steps"),
    (["train", "--steps", "abc"], "--steps"),
    (["train", "--loops", "3", "6"], "unexpected extra argument"),
    (["fit-predictor", "folder"], "--out"),
    (["run-ablation", "--loops", "3,"], "--loops: empty value"),
    (["plot"], "plot needs a figure"),
    ([], "Missing command"),
])
def test_every_usage_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert words in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_help_is_typers_with_panels_by_config_section_and_defaults(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(word in out for word in ("Commands", "run-ablation", "fit-predictor", "--install-completion"))
    assert main(["run-ablation", "--help"]) == 0
    out = capsys.readouterr().out
    for panel in ("sweep grid", "preset", "model", "training", "diagnostics", "verdict thresholds", "this command"):
        assert f"─ {panel} ─" in out, panel
    assert "[default: 3 6 9 12]" in out and "[default: 2000]" in out


def test_shell_completion_installs_and_completes_choices(tmp_path):
    # (the shell named, not detected: typer detects it from the process's ancestors, and a test process reparented to
    # init, as one started in the background from a subshell, has no shell among them: "Shell None is not supported")
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash",
           "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    done = subprocess.run([sys.executable, "-m", "flt_diag", "--install-completion", "bash"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    script = tmp_path / ".bash_completions" / "flt-diag.sh"
    assert "_FLT_DIAG_COMPLETE" in script.read_text() and str(script) in (tmp_path / ".bashrc").read_text()
    asked = {**env, "_FLT_DIAG_COMPLETE": "complete_bash", "COMP_WORDS": "flt-diag train --variant fl", "COMP_CWORD": "3"}
    done = subprocess.run([sys.executable, "-m", "flt_diag"], env=asked, capture_output=True, text=True, timeout=120)
    got = done.stdout.split()
    assert done.returncode == 0 and got[:2] == ["fla", "flt"] and all(n.startswith(("fla+", "flt+")) for n in got[2:])
    asked["COMP_WORDS"] = "flt-diag train --variant hu"
    done = subprocess.run([sys.executable, "-m", "flt_diag"], env=asked, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["huginn"]


def test_the_command_line_starts_without_the_heavy_libraries():
    """`flt-diag --help` (and parsing any command line) imports neither torch, pandas, scipy nor matplotlib
    (nor seaborn): each command imports them when it runs. The machine-independent form of "--help in under
    a second" (they take seconds to import)."""
    heavy = ("torch", "pandas", "scipy", "matplotlib", "seaborn")
    code = ("import sys, flt_diag.cli.app as app\n"
            "app.parse(['train', '--loops', '3']); app.parse(['plot', 'loss', 'x'])\n"
            f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
