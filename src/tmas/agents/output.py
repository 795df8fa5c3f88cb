"""Shared pieces of the agents' output parsers: the error a parser raises, and JSON extraction from chat text."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tmas.llm.types import Completion

Item = TypeVar("Item", bound=BaseModel)

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)```", re.S)


class AgentOutputError(ValueError):
    """An agent's reply that cannot be used (empty, truncated, unparseable). The message says why, in one line."""


def finished_lines(reply: Completion) -> str:
    """What a reply says in lines it finished: one cut at max_tokens without its last line, which the cut went
    through (an answer "39" of "391", a name "Pompe dis"); any other reply whole."""
    if not reply.truncated:
        return reply.content
    head, newline, _ = reply.content.rpartition("\n")
    return head + newline


# Any tag: where a block that was opened and never closed ends.
_ANY_TAG = re.compile(r"</?[a-z_][a-z0-9_]*>", re.I)


def tagged_block(text: str, name: str) -> str | None:
    """What a reply writes in its ``<name>...</name>`` block, stripped: the last such block that holds anything, since
    a reply may name its tags in its prose ("the answer goes inside <final_answer></final_answer>"), before or after
    the block it fills. Where no closed block holds anything, a block opened after the last closed one and never
    closed (a reply cut at its token limit, or one that goes on to its next tag): what follows its opening, up to the
    next tag. "" where the reply has the tag and the block holds nothing; None without the tag."""
    closed = list(re.finditer(rf"<{name}>(.*?)</{name}>", text, re.S | re.I))
    filled = [value for match in closed if (value := match.group(1).strip())]
    if filled:
        return filled[-1]
    opened = re.split(rf"<{name}>", text[closed[-1].end() :] if closed else text, flags=re.I)
    if len(opened) >= 2:
        return _ANY_TAG.split(opened[-1], maxsplit=1)[0].strip()
    return "" if closed else None


# A model writing LaTeX inside a JSON string writes one backslash. "\frac", "\binom", "\times", "\neq" and
# "\rightarrow" then begin with valid JSON escapes (form feed, backspace, tab, newline, carriage return) and decode into
# control characters in the middle of the mathematics ("\times" as a tab and "imes"): 131 of 862 JSON replies of the
# embedded 0.5B model. Read back: a backspace or form feed always (no reply means one), and a tab, newline or
# carriage return where the letters after it end a common command's name. Other commands ("\sum", "\cdot") are
# invalid escapes: where the text parses only with them, their backslash is taken literally.
_LATEX_CONTROL = re.compile(
    "\x08|\x0c"
    "|\t(?=(?:imes|ext[a-z]*|heta|au|o|frac|binom|riangle|ilde|op)(?![A-Za-z]))"
    "|\n(?=(?:eq|eg|ot|otin|abla|leq|geq)(?![A-Za-z]))"
    "|\r(?=(?:ight[a-z]*|ho|angle|floor|ceil)(?![A-Za-z]))"
)
_ESCAPE_OF = {"\x08": "\\b", "\x0c": "\\f", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
# A JSON escape, or a backslash that begins none.
_BACKSLASH = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})?')


def latex_restored(value: Any) -> Any:
    """``value`` (decoded JSON) with the LaTeX commands its escapes turned into control characters written back."""
    if isinstance(value, str):
        return _LATEX_CONTROL.sub(lambda m: _ESCAPE_OF[m.group()], value)
    if isinstance(value, list):
        return [latex_restored(item) for item in value]
    if isinstance(value, dict):
        return {key: latex_restored(item) for key, item in value.items()}
    return value


def literal_backslashes(text: str) -> str:
    """``text`` with each backslash that begins no JSON escape doubled (taken literally)."""
    return _BACKSLASH.sub(lambda m: m.group() if len(m.group()) > 1 else "\\\\", text)


# A JSON string, or a comma that only a closing bracket or brace follows (JSON allows none there).
_STRING_OR_TRAILING_COMMA = re.compile(r'("(?:\\.|[^"\\])*")|,(?=\s*[\]}])', re.S)


def without_trailing_commas(text: str) -> str:
    """``text`` without the commas that stand before a closing bracket or brace outside a JSON string."""
    return _STRING_OR_TRAILING_COMMA.sub(lambda m: m.group(1) or "", text)


def loads_reply(text: str) -> Any:
    """``json.loads`` of a model's JSON, its LaTeX written back (:func:`latex_restored`); raises ``ValueError``.

    A line break or tab inside a string is read as written: JSON asks for them escaped, but a model writing a long
    string without a schema breaks it over lines as prose, and the object means the same. So is a list or object
    with a comma after its last item."""
    text = without_trailing_commas(text)
    try:
        value = json.loads(text, strict=False)
    except ValueError:
        value = json.loads(literal_backslashes(text), strict=False)
    return latex_restored(value)


def extract_json_object(text: str) -> dict[str, Any]:
    """The JSON object in a reply: the last fenced block that parses, else the last bare ``{...}`` that does (taking
    a backslash that begins no escape literally where nothing parses without, and with no comma after a last item:
    :func:`loads_reply`); its LaTeX written back."""
    if not text.strip():
        raise AgentOutputError("empty reply")
    for block in reversed(_FENCE.findall(text)):
        try:
            value = loads_reply(block)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    # Without its trailing commas first: an object with one does not parse, and one nested in it would be taken.
    text = without_trailing_commas(text)
    found = _last_object(text)
    if found is None and "\\" in text:
        found = _last_object(literal_backslashes(text))
    if found is None:
        raise AgentOutputError("no valid JSON object in the reply")
    restored: dict[str, Any] = latex_restored(found)
    return restored


def _last_object(text: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder(strict=False)
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
