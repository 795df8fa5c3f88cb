"""The method parameters the commands that take ``--param`` list at the end of their ``--help``: every method's
parameters with their defaults, read from the methods' parameter models, then the rules that carry a description
(stopping and confidence: what each does and the work it comes from)."""

from __future__ import annotations

import json
from typing import Any

from tmas.methods import METHODS


def _shown(value: Any) -> str:
    """A default as ``--param`` reads it (JSON), strings bare."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def method_parameters_help() -> str:
    """Paragraphs for a command's epilog (rich separates paragraphs at blank lines)."""
    parts = ["Method parameters (--param KEY=VALUE), with their defaults:"]
    described: dict[tuple[str, str], list[str]] = {}
    for name, cls in METHODS.items():
        fields = cls.Params.model_fields
        defaults = ", ".join(
            f"{key}={_shown(field.get_default(call_default_factory=True))}" for key, field in fields.items()
        )
        parts.append(f"{name}: {defaults}")
        for key, field in fields.items():
            if field.description:
                described.setdefault((key, field.description), []).append(name)
    parts.append("Stopping and confidence rules:")
    parts += [f"{key} ({', '.join(methods)}): {text}" for (key, text), methods in described.items()]
    return "\n\n".join(parts)
