"""What an iteration did to a memory bank: each entry added, refined, updated, kept or deleted.

Banks are compared by entry id (ids are never reused, so the same id is the same entry across iterations).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

ChangeKind = Literal["added", "refined", "updated", "kept", "deleted"]


class BankChange(BaseModel):
    id: str
    change: ChangeKind
    text: str
    # The text before a refinement.
    before: str | None = None
    # The rest of the entry (kind, subtype, attempts, scores, ...), for display.
    details: dict[str, Any] = {}


# The bank keys of a TMAS iteration record's state: (list field, text field of an entry).
BANKS = {"experience_bank": ("entries", "content"), "guideline_bank": ("strategies", "description")}


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


def bank_diffs(previous: dict[str, Any] | None, state: dict[str, Any]) -> dict[str, list[BankChange]]:
    """Per bank present in ``state``: its changes since ``previous`` (the prior iteration's state; None: empty)."""
    out = {}
    for bank, (list_key, text_key) in BANKS.items():
        if not isinstance(state.get(bank), dict):
            continue
        before = (previous or {}).get(bank) or {}
        out[bank] = diff_entries(list(before.get(list_key, [])), list(state[bank].get(list_key, [])), text_key)
    return out
