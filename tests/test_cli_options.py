"""The command line, the option table (docs/cli.md) and `--help` agree option for option with the
typed config.

Every field of every config section is walked: each command that should accept it does (and
parses a value into the field), each that should not refuses it, and docs/cli.md lists it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flt_diag.config import run_config as C
from flt_diag.config.option_fields import form
from flt_diag.cli import main
from flt_diag.cli.app import build_app, parse
from flt_diag.cli.commands import COMMANDS
from flt_diag.cli.options import POSITIONALS, UserError, command_options
from flt_diag.cli.table import options_markdown

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()
TRAINING_COMMANDS = ("train", "run-ablation", "map")


class Field:
    """A config field as a user meets it, read here from its pydantic field: flag, name typed, type, default."""

    def __init__(self, section: str, name: str, info):
        self.section, self.name, self.dest = section, name, info.alias or name
        self.flag = "--" + self.dest.replace("_", "-")
        self.kind, self.many, _, self.choices, bounds = form(info)
        self.low, self.above, self.below = bounds.get("ge"), bounds.get("gt"), bounds.get("lt")
        self.default = info.default


# every field of every config section, and the preset
FIELDS = [Field(s, n, f) for s, cls in {"run": C.PresetOption, **C.SECTIONS}.items() for n, f in cls.model_fields.items()]


def _should_accept(o: Field) -> set[str]:
    """The training commands that take a config option: the rule, written out here independently of
    flt_diag.cli.options (the grids take lists where train takes one value)."""
    if o.name == "vocab_size":  # set from the tokenizer
        return set()
    if o.flag in ("--variant", "--loops", "--seed"):
        return {"train"}
    if o.flag == "--lr-scale":  # run-ablation's --lr-scale is its grid's list
        return {"train", "map"}
    if o.flag == "--stop-when-decided":  # a map sets it to its --criteria (and --run-to-end to none)
        return {"train", "run-ablation"}
    return set(TRAINING_COMMANDS)


def _sample(o):
    """A valid value of an option other than its default, as text and as the parsed value."""
    if o.choices:
        value = next((c for c in o.choices if c != o.default), o.choices[0])
        return value, [value] if o.many else value  # (a list option given one value)
    if o.kind is int:
        value = int(o.low or 0) + 3
        return str(value), value
    if o.kind is float:
        value = (o.above if o.above is not None else o.low or 0) + 0.5
        value = min(value, o.below - 0.01) if o.below is not None else value
        return repr(value), value
    return "some-text", "some-text"


def _parse(command: str, args: list[str]) -> dict:
    """The option values the real command line parses (no command runs)."""
    _, values, _ = parse([command, *args])
    return values


def test_every_config_field_is_an_option_with_help():
    """No config field escapes the command line (a new field needs its help, which makes it an option)."""
    assert all(f.description for cls in C.SECTIONS.values() for f in cls.model_fields.values())
    assert {"--depth", "--seq-len", "--no-diagnostics", "--record-every", "--attention-stats"} <= {
        x for o in FIELDS for x in (o.flag, f"--no-{o.flag[2:]}" if o.kind is bool else o.flag)}


@pytest.mark.parametrize("o", [o for o in FIELDS if _should_accept(o)], ids=lambda o: o.flag)
def test_each_command_that_should_accept_an_option_does(o):
    text, value = _sample(o)
    for command in TRAINING_COMMANDS:
        same_flag = [x for x in command_options(command) if Field(*x).flag == o.flag]
        if command in _should_accept(o):
            args = [o.flag] if o.kind is bool else [o.flag, text]
            got = _parse(command, args)[o.dest]
            assert got == (True if o.kind is bool else value), (command, o.flag)
            if o.kind is bool:
                assert _parse(command, [f"--no-{o.flag[2:]}"])[o.dest] is False
        elif not same_flag:  # e.g. train's --seed: run-ablation and map take --seeds instead
            with pytest.raises(UserError, match=f"No such option: {o.flag}"):
                _parse(command, [o.flag] if o.kind is bool else [o.flag, text])


@pytest.mark.parametrize("command", TRAINING_COMMANDS + ("summary",))
def test_help_lists_every_option_of_the_command(command, capsys):
    assert main([command, "--help"]) == 0
    help_text = capsys.readouterr().out
    for o in map(lambda p: Field(*p), command_options(command)):
        assert re.search(rf"(^|\s){re.escape(o.flag)}\b", help_text), (command, o.flag)


def test_the_option_table_in_docs_cli_md_is_generated_from_the_options():
    """docs/cli.md's table equals the generated one (regenerate: python -m flt_diag.cli.table)."""
    block = CLI_DOC.split("<!-- options:start -->")[1].split("<!-- options:end -->")[0].strip()
    assert block == options_markdown()


def _flags(command) -> set[str]:
    """Every flag the real command line accepts, in `command` and the commands below it."""
    flags = {f for p in command.params for f in [*p.opts, *getattr(p, "secondary_opts", [])] if f.startswith("--")}
    for sub in getattr(command, "commands", {}).values():
        flags |= _flags(sub)
    return flags


def test_every_flag_the_readme_and_docs_cli_md_name_exists():
    """A flag in the README or docs/cli.md that no command accepts is a broken promise."""
    import typer
    known = _flags(typer.main.get_command(build_app())) | {"--help"}  # click adds --help to every command
    assert {"--loops", "--no-diagnostics", "--install-completion", "--format"} <= known
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])(?![\w-])", README + CLI_DOC))
    # pytest's and pip's own flags in the install/test section are not flt-diag's
    foreign = {"--cov", "--upgrade", "--index-url", "--extra-index-url", "--runslow", "--durations", "--nproc_per_node",
               "--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--standalone",
               "--wrap", "--array", "--gres", "--ntasks", "--cpus-per-task", "--time"}
    # benchmarks/bench.py's own flags (the README quotes its commands), read from its argparse definitions
    bench = (Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py").read_text()
    foreign |= set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', bench))
    assert {"--flops", "--sweep", "--toy"} <= foreign
    assert named - known - foreign == set()


def _help_of(command: str, flag: str, capsys) -> str:
    """The help text `command --help` prints for `flag` (its lines joined, the panel's borders removed)."""
    assert main([command, "--help"]) == 0
    lines = [line.strip("│ ") for line in capsys.readouterr().out.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(flag + " "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("--", "╰"))), len(lines))
    return re.sub(r"\s+", " ", " ".join(lines[start:end]))


def test_defaults_in_help_are_the_dataclass_defaults(capsys):
    """`--help` and docs/cli.md show the config's own default (or each preset's), never a second copy."""
    warmup = C.TrainConfig().momentum_warmup  # the dataclass, built as the trainer builds it
    assert f"[default: {warmup}]" in _help_of("train", "--momentum-warmup", capsys)
    row = next(line for line in options_markdown().splitlines() if line.startswith("| `--momentum-warmup`"))
    assert f"| {warmup} |" in row
    assert all(f"{name} {p['train']['batch_size']}" in _help_of("train", "--batch-size", capsys)
               for name, p in C.PRESETS.items())
    bs = next(o for o in FIELDS if o.flag == "--batch-size")
    row = next(line for line in options_markdown().splitlines() if line.startswith(f"| `{bs.flag}`"))
    for name, preset in C.PRESETS.items():
        assert f"{name} {preset['train']['batch_size']}" in row


def _choice_and_list_cases():
    """(command, option) for every option with choices, and every list option, of every command."""
    return [(name, o) for name in COMMANDS if name not in POSITIONALS
            for o in map(lambda p: Field(*p), command_options(name)) if o.choices or o.many]


@pytest.mark.parametrize("command, o", _choice_and_list_cases(), ids=lambda x: x if isinstance(x, str) else x.flag)
def test_every_choice_and_list_option_refuses_bad_values(tmp_path, monkeypatch, capsys, command, o):
    """Generated from the definitions: a value outside the choices, a duplicate in a list, an empty
    list item — one error line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    bad = []
    if o.choices:
        bad.append([o.flag, "bogus"])
    if o.many:
        text, _ = _sample(o)
        bad += [[o.flag, text, text], [o.flag, f"{text},"]]
    for args in bad:
        assert main([command, *args]) == 2, args
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and o.flag in err[0], (args, err)
    assert list(tmp_path.iterdir()) == []


def test_python_dash_m_is_the_console_script():
    """`python -m flt_diag` runs the same CLI (help and its exit code; a bad command's one line and 2)."""
    import subprocess
    import sys
    ok = subprocess.run([sys.executable, "-m", "flt_diag", "variants"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "flt" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "flt_diag", "no-such-command"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
