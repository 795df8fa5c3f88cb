"""Shared pieces of the agents' output parsers: the error a parser raises, and JSON extraction from chat text."""

from __future__ import annotations

import json
import re
from typing import Any

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)```", re.S)


class AgentOutputError(ValueError):
    """An agent's reply that cannot be used (empty, truncated, unparseable). The message says why, in one line."""


def extract_json_object(text: str) -> dict[str, Any]:
    """The JSON object in a reply: the last fenced block that parses, else the last bare ``{...}`` that does."""
    if not text.strip():
        raise AgentOutputError("empty reply")
    for block in reversed(_FENCE.findall(text)):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    decoder = json.JSONDecoder()
    found: dict[str, Any] | None = None
    position = text.find("{")
    while position != -1:
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            position = text.find("{", position + 1)
            continue
        if isinstance(value, dict):
            found = value
            position = text.find("{", end)
        else:
            position = text.find("{", position + 1)
    if found is None:
        raise AgentOutputError("no valid JSON object in the reply")
    return found
