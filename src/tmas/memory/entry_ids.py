"""A bank entry's id as an agent writes it back. The experience and guideline prompts show each entry as "[E3] ..." or
"- [G2] ...", and a model copies the id with its brackets, or in lower case, as often as bare: all of them name the
entry, so an operation or a verdict on it is not refused as naming none."""

from __future__ import annotations

from typing import Any


def entry_id(value: Any) -> Any:
    """``value`` as a bank id: surrounding spaces and one pair of square brackets left out, in upper case (the banks
    number their entries "E1", "G1"); an integer as its digits; anything else unchanged, for validation to refuse."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip()
    return text.upper()
