"""JSON schemas for structured outputs: a pydantic reply model turned into the ``response_format`` a server
constrains its decoding to (llama-server, vLLM, SGLang and OpenAI accept OpenAI's shape).

The schema is flattened so every server's subset of JSON Schema accepts it: ``$ref``s are inlined (reply models
are never recursive), titles, defaults and descriptions are dropped, and objects get ``additionalProperties: false``.
Fields with a default stay optional, so a constrained model need not spell out every empty field; ``strict``
(OpenAI's strict mode, which demands every property be required) is set only where the schema has no optional field.
Property order is the model's field order; llama-server's grammar writes required properties first, in that order, so
reasoning fields are required and come first in each reply model.

llama-server writes a string's ``maxLength`` N as a grammar repetition of up to N characters and an array's
``maxItems`` N as a first item and up to N - 1 more, and its grammar parser refuses any repetition of 2000 or more
("failed to parse grammar"): :func:`grammar_fit` caps the bounds it is sent (:data:`LLAMA_MAX_BOUND`).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

# Keywords that say nothing about the shape of the reply, or that a server's subset may not know. Descriptions go
# too: they are the models' docstrings, written for developers, and some servers show the schema to the model.
_DROPPED = frozenset({"title", "default", "examples", "description"})
# The largest maxLength and maxItems llama-server's grammar takes (src/llama-grammar.cpp refuses a repetition of
# MAX_REPETITION_THRESHOLD = 2000 or more).
LLAMA_MAX_BOUND = 1999
_BOUNDS = ("maxLength", "maxItems")


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema, flattened for constrained decoding (see the module docstring)."""
    return copy.deepcopy(_flat(model))


def response_format(model: type[BaseModel]) -> dict[str, Any]:
    """The ``response_format`` request field (OpenAI's ``json_schema`` shape) for replies parsed by ``model``."""
    schema = json_schema(model)
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": schema, "strict": _strict(schema)}}


@lru_cache(maxsize=64)
def _flat(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema()
    defs: dict[str, Any] = raw.pop("$defs", {})
    flat: dict[str, Any] = _inline(raw, defs, ())
    return flat


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name in seen or name not in defs:
            raise ValueError(f"reply schema reference {ref!r} is recursive or unknown: keep reply models flat")
        merged = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs, (*seen, name))
    out = {key: _inline(value, defs, seen) for key, value in node.items() if key not in _DROPPED}
    if out.get("type") == "object" and "properties" in node:
        # Properties are schemas keyed by field name: a field named like a dropped keyword must stay.
        out["properties"] = {name: _inline(value, defs, seen) for name, value in node["properties"].items()}
        out["additionalProperties"] = False
    return out


def _strict(node: Any) -> bool:
    """Whether every object in the schema requires all its properties (OpenAI's strict mode accepts nothing else)."""
    if isinstance(node, list):
        return all(_strict(item) for item in node)
    if not isinstance(node, dict):
        return True
    if node.get("type") == "object" and set(node.get("required", [])) != set(node.get("properties", {})):
        return False
    return all(_strict(value) for value in node.values())


def grammar_fit(response_format: Any, most: int = LLAMA_MAX_BOUND) -> Any:
    """``response_format`` with each maxLength and maxItems of its JSON schema capped at ``most`` (a server whose
    grammar refuses larger ones: the module docstring); anything else is returned as it is."""
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return response_format
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return response_format
    return {**response_format, "json_schema": {**spec, "schema": _capped(spec["schema"], most)}}


def _capped(node: Any, most: int) -> Any:
    if isinstance(node, list):
        return [_capped(item, most) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _capped(value, most) for key, value in node.items()}
    for key in _BOUNDS:
        # Under "properties" a name is a field's, not a keyword: its value is a schema, never a number.
        if isinstance(out.get(key), int) and not isinstance(out[key], bool) and out[key] > most:
            out[key] = most
    return out
