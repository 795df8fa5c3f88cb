"""What an iteration did to a memory bank: each entry added, refined, updated, kept or deleted.

Banks are compared by entry id (ids are never reused, so the same id is the same entry across iterations).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from tmas.methods.state import BankState

ChangeKind = Literal["added", "refined", "updated", "kept", "deleted"]


class BankChange(BaseModel):
    id: str
    change: ChangeKind
    text: str
    # The text before a refinement.
    before: str | None = None
    # The rest of the entry (kind, subtype, attempts, scores, ...), for display.
    details: dict[str, Any] = {}


def diff_entries(before: list[dict[str, Any]], after: list[dict[str, Any]], text_key: str) -> list[BankChange]:
    """The entries of ``after`` in order (added, refined: text changed, updated: other fields changed, kept),
    then the entries of ``before`` that are gone (deleted)."""
    old = {str(e["id"]): e for e in before}
    changes = []
    for entry in after:
        entry_id = str(entry["id"])
        details = _details(entry, text_key)
        text = str(entry.get(text_key, ""))
        prior = old.get(entry_id)
        if prior is None:
            changes.append(BankChange(id=entry_id, change="added", text=text, details=details))
        elif str(prior.get(text_key, "")) != text:
            changes.append(
                BankChange(id=entry_id, change="refined", text=text, before=str(prior.get(text_key)), details=details)
            )
        elif prior != entry:
            changes.append(BankChange(id=entry_id, change="updated", text=text, details=details))
        else:
            changes.append(BankChange(id=entry_id, change="kept", text=text, details=details))
    seen = {str(e["id"]) for e in after}
    for entry_id, entry in old.items():
        if entry_id not in seen:
            details = _details(entry, text_key)
            changes.append(
                BankChange(id=entry_id, change="deleted", text=str(entry.get(text_key, "")), details=details)
            )
    return changes


def _details(entry: dict[str, Any], text_key: str) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in ("id", text_key) and v is not None}


def bank_diffs(previous: Mapping[str, Any] | None, state: Mapping[str, Any]) -> dict[str, list[BankChange]]:
    """Per bank the state keeps (a method whose ``State`` is a ``BankState``): its changes since ``previous`` (the
    prior iteration's state; None: empty banks). Both states are read through ``BankState``; a state it cannot
    read (not written by a method that keeps banks) shows no changes rather than failing the page."""
    try:
        after, before = BankState.model_validate(state), BankState.model_validate(previous or {})
    except ValidationError:
        return {}
    out = {}
    kept = after.model_fields_set
    if "experience_bank" in kept:
        out["experience_bank"] = diff_entries(
            _dumped(before.experience_bank.entries), _dumped(after.experience_bank.entries), "content"
        )
    if "guideline_bank" in kept:
        out["guideline_bank"] = diff_entries(
            _dumped(before.guideline_bank.strategies), _dumped(after.guideline_bank.strategies), "description"
        )
    return out


def _dumped(entries: Sequence[BaseModel]) -> list[dict[str, Any]]:
    return [e.model_dump(mode="json") for e in entries]
