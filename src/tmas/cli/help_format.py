"""``--help`` as it should read: a flag takes no value, so its line shows no type (Typer shows ``<bool>`` beside every
flag, ``--help`` included, as if it took one); and a command's line in its group's list reads as one sentence (Typer
keeps the line breaks of the docstring's first paragraph there, cutting it where the source wraps)."""

from __future__ import annotations

import inspect
from typing import Any

import typer


def command_of(app: typer.Typer) -> Any:
    """``app``'s command with every flag's type hidden in its help and each subcommand's first paragraph on one line
    in its group's list, subcommands included."""
    command = typer.main.get_command(app)
    _plain_flags(command)
    return command


def _plain_flags(command: Any) -> None:
    for param in command.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    # The help option is made on demand (and kept): make it now, as a flag like the others.
    help_option = command.get_help_option(typer.Context(command))
    if help_option is not None:
        help_option.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        if sub.short_help is None and sub.help:
            sub.short_help = " ".join(inspect.cleandoc(sub.help).split("\n\n")[0].split())
        _plain_flags(sub)
