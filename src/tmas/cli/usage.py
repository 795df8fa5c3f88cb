"""A command line the parser refuses (a value of the wrong type, an unknown option or command, a missing argument)
said as every other error is: one line, ``tmas: error: ...``, naming the ``--help`` that lists what the command
takes, in place of the framed box Typer draws."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def _parser_errors() -> ModuleType:
    """The exceptions of the Click that parses the command line: Typer's own copy where it has one (Typer 0.26 and
    later), Click itself before."""
    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:
        return importlib.import_module("click.exceptions")


_ERRORS = _parser_errors()
# Every error the parser raises (Click exits with its exit_code: 2 for a bad command line).
ParserError: type[Exception] = _ERRORS.ClickException


def error_line(exc: Any) -> str | None:
    """The one line to print for a :data:`ParserError`, or ``None`` where the error is the help itself (a group or
    command given no arguments shows its help, which Typer has printed already)."""
    if isinstance(exc, _ERRORS.NoArgsIsHelpError):
        return None
    message = " ".join(line.strip() for line in exc.format_message().splitlines() if line.strip())
    ctx = exc.ctx if isinstance(exc, _ERRORS.UsageError) else None
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        message = f"{message.removesuffix('.')} (see '{ctx.command_path} {ctx.help_option_names[0]}')"
    return f"tmas: error: {message}"
