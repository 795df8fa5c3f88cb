"""Command-line shortcuts for method parameters, declared by the parameter itself.

A method's parameter model marks a field with ``json_schema_extra=cli_flag("--no-experience", "...")``; the commands
that take ``--param`` then accept that flag as a shortcut for ``--param no_experience=true`` (a bool parameter: a
switch) or ``--param domain=VALUE`` (any other: a flag with a value), with that help text. The CLI reads the flags
from the registry (:func:`tmas.methods.method_flags`), so a method of another package brings its own flags and the
CLI names no method's parameter.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# The key of a field's json_schema_extra that holds its shortcut.
CLI_FLAG_KEY = "cli_flag"


def cli_flag(flag: str, help: str) -> dict[str, Any]:
    """A field's ``json_schema_extra`` declaring ``flag`` (``--name``) as the command-line shortcut for the field."""
    if not flag.startswith("--") or not flag[2:].replace("-", "").isalnum():
        raise ValueError(f"{flag!r} is not a long command-line flag (--name)")
    return {CLI_FLAG_KEY: {"flag": flag, "help": help}}


class ParamFlag(BaseModel):
    """One parameter's shortcut: the flag, the parameter it sets, its help, and whether it is a switch (a bool
    parameter, which the flag alone sets true)."""

    model_config = ConfigDict(frozen=True)

    flag: str
    param: str
    help: str
    switch: bool


def param_flags(params: type[BaseModel]) -> list[ParamFlag]:
    """The shortcuts a parameter model's fields declare, in field order."""
    out = []
    for name, field in params.model_fields.items():
        extra = field.json_schema_extra
        declared = extra.get(CLI_FLAG_KEY) if isinstance(extra, dict) else None
        if isinstance(declared, dict):
            flag, text = str(declared["flag"]), str(declared["help"])
            out.append(ParamFlag(flag=flag, param=name, help=text, switch=field.annotation is bool))
    return out
