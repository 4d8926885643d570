"""The `flt-diag` command line: typer commands whose options are read straight from the pydantic fields that
flt_diag.cli.options assigns to each command (`parameter`; how, and how list options are parsed: docs/DESIGN.md
§7, "Options"). Errors a user can cause print one line (`error: ...`)
and exit with status 2; Ctrl-C exits with 130. `main(argv) -> int` is the entry point (`flt-diag`, and
`python -m flt_diag`: flt_diag/__main__.py, the one __main__).
"""
from __future__ import annotations

import functools
import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Callable, List, Optional, cast

import typer
import typer.rich_utils
from pydantic import ValidationError
from rich.markup import escape
from typer.core import TyperCommand

from flt_diag.cli.commands import COMMANDS, cmd_plot
from flt_diag.cli.options import (POSITIONALS, SECTION_TITLES, Param, UserError, command_args, command_options,
                                  default_text)
from flt_diag.results.figure_names import FIGURE_NAMES
from flt_diag.config.option_fields import default, dest, dotted, flag, form, one_line

DESCRIPTION = "Train looped-transformer variants, record why they collapse, and plot it."
METAVARS = {int: "N", float: "X", str: "TEXT", Path: "PATH"}


def _is_value(arg: str) -> bool:
    """Whether an argument after a list option is one of its values (a negative number is one)."""
    if not arg.startswith("-"):
        return True
    try:
        float(arg)
        return True
    except ValueError:
        return False


def spread_lists(args: list[str], many: set[str]) -> list[str]:
    """`--loops 3 6,9` -> `--loops 3 --loops 6 --loops 9` for the flags in `many` (also `--loops=3,6`);
    everything after `--` is left as it is."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg == "--":
            return out + args[i - 1:]
        flag, eq, value = arg.partition("=")
        if flag not in many or not arg.startswith("--"):
            out.append(arg)
            continue
        values = [value] if eq else []
        while not eq and i < len(args) and _is_value(args[i]):
            values.append(args[i])
            i += 1
        if not values:  # click says that the flag needs a value
            out.append(arg)
        for text in values:
            if any(not item.strip() for item in text.split(",")):
                raise UserError(f"{flag}: empty value in {text!r}")
            out += [x for item in text.split(",") for x in (flag, item.strip())]
    return out


class ListCommand(TyperCommand):
    """A typer command whose list options take several values after one flag (`spread_lists`)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        many = {name for p in self.params if getattr(p, "multiple", False) for name in p.opts}
        return super().parse_args(ctx, spread_lists(list(args), many))


# ------------------------------------------------------------------ typer options from pydantic fields

def _path(text) -> Path:
    """A path given on the command line; an empty one is refused (Path("") is the current folder: `--to ""` would
    write into it)."""
    if not str(text):
        raise typer.BadParameter("an empty path; give the name of a file or folder")
    return Path(text)


def parameter(p: Param) -> inspect.Parameter:
    """The typer option (or argument) of one field: `--x/--no-x` for a config switch, a plain flag for a
    command's own switch, a list for a list field; None (not given) where the config or the command decides.
    Typer reads a command's options from its function's signature only, so this is where a field becomes one."""
    section, name, info = p
    f, help = form(info), cast(str, info.description)  # (every option has its help: opt)
    kind = List[f.kind] if f.many else f.kind  # type: ignore[name-defined]  # (a field's type, as typer reads it)
    parser = _path if f.kind is Path else None
    if flag(name, info) == "":
        argument = typer.Argument(help=escape(help), metavar=name.upper() + ("..." if f.many else ""), parser=parser,
                                  show_default=False)
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, argument])
    switch, named = f.kind is bool and section == "cli", f.choices is None or all(c in help for c in f.choices)
    help += default_text(*p) + ("" if named else  # (not named: choices given)
                                f" Choices: {', '.join(map(str, f.choices))}.")  # type: ignore[arg-type]
    option = typer.Option(flag(name, info) + (f"/--no-{flag(name, info)[2:]}" if f.kind is bool and not switch else ""),
                          help=escape(help), rich_help_panel=SECTION_TITLES[section], show_default=False,
                          metavar=None if f.kind is bool else ("NAME" if f.choices else METAVARS[f.kind]) + "..." * f.many,
                          parser=parser, autocompletion=(lambda incomplete: [  # (choices given)
                              c for c in f.choices if c.startswith(incomplete)])  # type: ignore[union-attr]
                          if f.choices else None)
    given = inspect.Parameter.empty if not f.optional and default(info) is None else False if switch else None
    return inspect.Parameter(dest(name, info), inspect.Parameter.KEYWORD_ONLY, default=given,
                             annotation=Annotated[bool if switch else Optional[kind], option])


def add_command(app: typer.Typer, name: str, func: Callable, params: list[Param], help: str | None = None,
                command: str | None = None, **fixed) -> None:
    """Register `name` on `app`: parsing it returns (func, option values with `fixed` added (fields of its
    options model that are no option, such as plot's figure), the command's name)."""
    def collect(**values):
        return func, {**values, **fixed}, command or name

    collect.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # (typer reads it)
        list(map(parameter, params)))
    help = help or cast(str, inspect.getdoc(func)).split("\n\n")[0].replace("\n", " ")
    app.command(name, cls=ListCommand, help=escape(help))(collect)


def _plot_app() -> typer.Typer:
    """`flt-diag plot FIGURE PATH`: one command per figure, and `all`."""
    plot = typer.Typer(help=inspect.getdoc(cmd_plot), rich_markup_mode="rich")

    @plot.callback(invoke_without_command=True)
    def needs_a_figure(ctx: typer.Context):
        if ctx.invoked_subcommand is None:
            raise UserError(f"plot needs a figure: {', '.join([*FIGURE_NAMES, 'all'])} (flt-diag plot --help)")

    for name, (_, help) in [*FIGURE_NAMES.items(), ("all", ("", "Every figure that has data."))]:
        add_command(plot, name, cmd_plot, POSITIONALS["plot"] + command_options("plot"), help=help, command="plot",
                    figure=name)
    return plot


def build_app() -> typer.Typer:
    app = typer.Typer(name="flt-diag", help=DESCRIPTION, rich_markup_mode="rich", pretty_exceptions_enable=False)
    for name, func in COMMANDS.items():
        if name != "plot":
            add_command(app, name, func, POSITIONALS.get(name, []) + command_options(name))
    app.add_typer(_plot_app(), name="plot")
    return app


@functools.cache
def _command():
    """The click command of the app, built once per process. Help is drawn at least 100 columns wide
    (TERMINAL_WIDTH overrides): at 80, typer's tables cut long flags such as --no-checkpoint-loops short."""
    if not os.environ.get("TERMINAL_WIDTH"):
        typer.rich_utils.MAX_WIDTH = max(shutil.get_terminal_size((100, 24)).columns, 100)
    return typer.main.get_command(build_app())


# ------------------------------------------------------------------ entry point

def parse(argv: list[str]):
    """(command function, option values, command name) of a command line, or an exit status where typer
    answered it itself (--help, --install-completion); a usage error is one UserError line."""
    try:
        return _command().main(list(argv), prog_name="flt-diag", standalone_mode=False)
    except typer.TyperException as e:  # click's usage errors and bad values
        message = e.format_message() if hasattr(e, "format_message") else str(e) or type(e).__name__
        raise UserError("; ".join(line.strip() for line in message.splitlines() if line.strip())) from None


def run(argv: list[str]) -> int:
    from flt_diag.cli import snapshot_exec
    snapshot_exec.command_line[:] = argv  # (what a command re-run from its code snapshot repeats)
    parsed = parse(argv)
    if isinstance(parsed, int) or parsed is None:
        return parsed or 0
    func, values, command = parsed
    return func(command_args(command, values))


def main(argv: list[str] | None = None) -> int:
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # shell completion
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        if "flt_diag.cli.console" in sys.modules:  # (a command that drew a progress bar imported it)
            sys.modules["flt_diag.cli.console"].progress_bar.close()
        print("interrupted; finished work is kept (re-run the same command to resume)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (UserError, ValueError, FileNotFoundError, PermissionError) as e:  # (StorageError, DataError: ValueErrors)
        if os.environ.get("FLT_DIAG_DEBUG"):
            raise
        print(f"error: {one_line(e, dotted) if isinstance(e, ValidationError) else e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a path that is a file, ...: files in flight were removed (atomic_path)
        if os.environ.get("FLT_DIAG_DEBUG"):
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or type(e).__name__}{where}", file=sys.stderr)
        return 2
