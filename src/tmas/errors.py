"""Errors a user sees as one line. The CLI maps each to an exit code."""


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
