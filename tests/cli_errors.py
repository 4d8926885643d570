"""What a refused command leaves on stderr: exactly one line, `error: ...`, and nothing else (no traceback, no
usage box). The one check the command-line tests share; `from cli_errors import one_error_line`."""
from __future__ import annotations


def one_error_line(capsys, prefix: str | None = "error: ", *, blank_lines: bool = True,
                   stdout_without: tuple[str, ...] = ()) -> str:
    """Read (and so consume) pytest's captured stdout and stderr; return stderr's one line.

    AssertionError unless stderr holds exactly one non-blank line, starting with `prefix` (None: any start),
    with no "Traceback" on stderr and no usage box ("╭", typer's panel) on either stream. `blank_lines=False`
    refuses blank lines on stderr too: the one line must be all that stderr holds. `stdout_without`: texts stdout
    must not hold (read here: the streams are consumed, so a caller cannot look at stdout after this call).
    """
    out, err = capsys.readouterr()
    lines = err.splitlines()
    if blank_lines:
        lines = [line for line in lines if line.strip()]
    assert len(lines) == 1, lines
    assert prefix is None or lines[0].startswith(prefix), lines
    assert "Traceback" not in err and "╭" not in out + err, (out, err)  # no traceback, no usage box
    assert not [t for t in stdout_without if t in out], out
    return lines[0]
