"""Shared pieces of the agents' output parsers: the error a parser raises, and JSON extraction from chat text."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Item = TypeVar("Item", bound=BaseModel)

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


def parse_json_list(
    content: str, keys: tuple[str, ...], model: type[Item], *, truncated: bool, noun: str
) -> tuple[list[Item], list[str]]:
    """The valid items of the list under the first of ``keys`` in the reply's JSON object, and why others failed.

    A truncated reply, one without such a list, or a non-empty list with no valid item is unusable as a whole.
    """
    if truncated:
        raise AgentOutputError("reply truncated at max_tokens")
    data = extract_json_object(content)
    raw = next((data[key] for key in keys if key in data), None)
    if not isinstance(raw, list):
        raise AgentOutputError(f"the JSON object has no {keys[0]!r} list")
    items: list[Item] = []
    malformed: list[str] = []
    for position, item in enumerate(raw, start=1):
        try:
            items.append(model.model_validate(item))
        except ValidationError as exc:
            err = exc.errors()[0]
            malformed.append(f"{noun} {position}: {'.'.join(map(str, err['loc'])) or 'item'}: {err['msg']}")
    if raw and not items:
        raise AgentOutputError(f"none of the {len(raw)} {noun}s is valid ({malformed[0]})")
    return items, malformed
