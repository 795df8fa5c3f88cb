"""Errors a user sees as one line. The CLI maps each to an exit code."""

from __future__ import annotations

from pydantic import ValidationError


class TmasError(Exception):
    """Base for errors with a message meant for the user."""

    exit_code = 1


class ConfigError(TmasError):
    """Malformed configuration or input file: exit code 2, nothing written."""

    exit_code = 2


class InputError(TmasError):
    """A bad problem file or question: exit code 2, nothing written."""

    exit_code = 2


class LLMError(TmasError):
    """An LLM call that failed for good (a 4xx, or retries exhausted)."""


class LocalModelError(TmasError):
    """The embedded model could not be assembled or started."""


def first_error(exc: ValueError) -> str:
    """What a file read into a pydantic model got wrong, in one line: for a validation error its first problem, the
    field it is about (a dotted path) and what is wrong (pydantic's own first line only counts its errors)."""
    if not isinstance(exc, ValidationError) or not exc.errors():
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{loc!r}: {msg}" if loc else msg
