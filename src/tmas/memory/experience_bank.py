"""The experience bank E_t (paper section 3.2, eq. 4): low-level, verifier-backed signals for later refinements.

Entries are Verified Anchors (non-trivial, reusable results the verifiers confirmed, in four sub-types) and
Error-Avoidance Heuristics (mistakes the verifiers caught). The experience agent edits the bank with ADD / KEEP /
REFINE / DELETE operations; :func:`apply_experience_ops` applies them purely, then drops near-duplicates (word-set
Jaccard similarity, the same values stated: tmas.memory.similarity) and enforces the size cap. Entries an update
does not mention are kept: a lazy update can never silently empty the bank, only an explicit DELETE removes an entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tmas.memory.entry_ids import entry_id
from tmas.memory.similarity import near_duplicate

EntryKind = Literal["anchor", "heuristic"]
# Verified Anchor sub-types. Only "structural reduction" survives verbatim in the paper's prompt fragments; the other
# three are our reading of its case study (Table 11: verified values, a structural rule such as a recurrence).
AnchorSubtype = Literal["structural_reduction", "intermediate_result", "structural_rule", "boundary_case"]
ANCHOR_SUBTYPES: tuple[str, ...] = ("structural_reduction", "intermediate_result", "structural_rule", "boundary_case")
OpName = Literal["ADD", "KEEP", "REFINE", "DELETE"]

DEFAULT_DEDUP_THRESHOLD = 0.7
DEFAULT_MAX_ENTRIES = 35
# The longest entry an update may write: five times what the reply's schema asks for where the server enforces it
# (tmas.agents.experience.ENTRY_CHARS). A server that does not leaves the length to the model; an entry of thousands
# of characters is a runaway (one sentence repeated) that would ride in every later prompt showing the bank.
MAX_CONTENT_CHARS = 2000


class ExperienceEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    kind: EntryKind
    subtype: AnchorSubtype | None = None
    content: str
    # Iteration that added the entry, and the last one that refined it.
    added_at: int = 0
    updated_at: int = 0


class ExperienceBank(BaseModel):
    entries: list[ExperienceEntry] = Field(default_factory=list)
    # Ids are never reused, so an operation on "E3" always means the same entry.
    next_id: int = 1

    def get(self, entry_id: str) -> ExperienceEntry | None:
        return next((e for e in self.entries if e.id == entry_id), None)

    @property
    def anchors(self) -> list[ExperienceEntry]:
        return [e for e in self.entries if e.kind == "anchor"]

    @property
    def heuristics(self) -> list[ExperienceEntry]:
        return [e for e in self.entries if e.kind == "heuristic"]

    def __len__(self) -> int:
        return len(self.entries)


def _kind(value: Any) -> Any:
    """Accept the spellings a model tends to use for the two categories."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace("-", " ").replace("_", " ")
    if "anchor" in text:
        return "anchor"
    if "heuristic" in text or "avoid" in text or "error" in text:
        return "heuristic"
    return value


def _subtype(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace("-", "_").replace(" ", "_")
    return text if text in ANCHOR_SUBTYPES else None


class ExperienceOp(BaseModel):
    """One operation of an experience update, as the agent writes it (see ``experience.j2``)."""

    model_config = ConfigDict(extra="ignore")

    op: OpName
    id: str | None = None
    kind: EntryKind | None = None
    subtype: AnchorSubtype | None = None
    content: str | None = None
    # REFINE only: other entries the refined one subsumes (they are removed).
    merges: list[str] = Field(default_factory=list)

    @field_validator("op", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, value: Any) -> Any:
        return _kind(value)

    @field_validator("subtype", mode="before")
    @classmethod
    def _subtype(cls, value: Any) -> Any:
        return _subtype(value)

    @field_validator("id", mode="before")
    @classmethod
    def _id(cls, value: Any) -> Any:
        return entry_id(value)

    @field_validator("merges", mode="before")
    @classmethod
    def _merges(cls, value: Any) -> Any:
        # Written as null (or empty) where it does not apply (every field spelt out), or as one id without a list.
        if value is None or (isinstance(value, str) and not value.strip()):
            return []
        if isinstance(value, str | int) and not isinstance(value, bool):
            value = [value]
        return [entry_id(item) for item in value] if isinstance(value, list) else value

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return value.strip() or None if isinstance(value, str) else value


class ExperienceReport(BaseModel):
    """What an update did, entry ids per operation, and every operation that was refused (with why)."""

    added: list[str] = Field(default_factory=list)
    kept: list[str] = Field(default_factory=list)
    refined: list[str] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)
    deduplicated: list[str] = Field(default_factory=list)
    rejected: list[str] = Field(default_factory=list)


def apply_experience_ops(
    bank: ExperienceBank,
    ops: list[ExperienceOp],
    *,
    iteration: int,
    dedup_threshold: float = DEFAULT_DEDUP_THRESHOLD,
    max_entries: int | None = DEFAULT_MAX_ENTRIES,
    max_content_chars: int = MAX_CONTENT_CHARS,
) -> tuple[ExperienceBank, ExperienceReport]:
    """E_t from E_{t-1} and the agent's operations; ``bank`` itself is not changed.

    Order: operations on existing entries (DELETE, REFINE with its merges, KEEP) against E_{t-1}, then ADDs in the
    order given; then near-duplicates (Jaccard >= ``dedup_threshold`` with an earlier entry of the same kind, stating
    the same values) are dropped, the earlier entry winning; then ADDs beyond ``max_entries`` (None: no limit) are
    refused. An ADD or REFINE whose content is longer than ``max_content_chars`` is refused (a refused REFINE leaves
    its entry as it was).
    """
    report = ExperienceReport()
    claims = _claims(bank, ops, report, max_content_chars)
    entries = _edited(bank, claims, iteration)
    # Unmentioned entries stay (KEEP is the default), so they count as kept too.
    report.kept.extend(e.id for e in bank.entries if e.id not in claims.touched)
    new_ids = [f"E{bank.next_id + i}" for i in range(len(claims.additions))]
    entries += [_new_entry(entry_id, op, iteration) for entry_id, op in zip(new_ids, claims.additions, strict=True)]
    kept = _deduplicated(entries, dedup_threshold, report)
    while max_entries is not None and len(kept) > max_entries and kept[-1].id in new_ids:
        dropped = kept.pop()
        report.rejected.append(f"ADD {dropped.id}: the bank is full ({max_entries} entries)")
    final_ids = {e.id for e in kept}
    report.added = [i for i in new_ids if i in final_ids]
    # An entry kept by the update but dropped as the near-duplicate of one refined into its words is no longer kept.
    report.kept = [i for i in report.kept if i in final_ids]
    return ExperienceBank(entries=kept, next_id=bank.next_id + len(new_ids)), report


@dataclass
class _Claims:
    """An update's operations sorted against E_{t-1}: which operation claimed each existing entry, the
    refinements by entry, the entries removed (deleted or merged), and the valid ADDs in order."""

    touched: dict[str, str] = field(default_factory=dict)
    refinements: dict[str, ExperienceOp] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    additions: list[ExperienceOp] = field(default_factory=list)


def _claims(bank: ExperienceBank, ops: list[ExperienceOp], report: ExperienceReport, max_chars: int) -> _Claims:
    """Each operation checked and sorted (refused ones in ``report.rejected``, with why); one operation per entry."""
    existing = {e.id for e in bank.entries}
    out = _Claims()

    def claim(entry_id: str, op: ExperienceOp) -> bool:
        if entry_id not in existing:
            report.rejected.append(f"{op.op} {entry_id}: no such entry")
            return False
        if entry_id in out.touched:
            report.rejected.append(f"{op.op} {entry_id}: entry already claimed by {out.touched[entry_id]}")
            return False
        out.touched[entry_id] = op.op
        return True

    for op in ops:
        if op.content is not None and op.op in ("ADD", "REFINE") and len(op.content) > max_chars:
            named = f" {op.id}" if op.op == "REFINE" and op.id else ""
            report.rejected.append(
                f"{op.op}{named}: content of {len(op.content)} characters, over the {max_chars} an entry may hold"
            )
            continue
        if op.op == "ADD":
            if op.content is None or op.kind is None:
                report.rejected.append("ADD: needs both 'kind' and 'content'")
            else:
                out.additions.append(op)
            continue
        if op.id is None:
            report.rejected.append(f"{op.op}: needs the 'id' of an existing entry")
            continue
        if op.op == "REFINE" and op.content is None:
            report.rejected.append(f"REFINE {op.id}: needs the new 'content'")
            continue
        if not claim(op.id, op):
            continue
        if op.op == "DELETE":
            out.removed.add(op.id)
            report.deleted.append(op.id)
        elif op.op == "KEEP":
            report.kept.append(op.id)
        else:
            out.refinements[op.id] = op
            report.refined.append(op.id)
            for merged in op.merges:
                if merged != op.id and claim(merged, op):
                    out.removed.add(merged)
                    report.deleted.append(merged)
    return out


def _edited(bank: ExperienceBank, claims: _Claims, iteration: int) -> list[ExperienceEntry]:
    """E_{t-1} without the removed entries, each refined one rewritten (its kind and sub-type where given)."""
    entries: list[ExperienceEntry] = []
    for entry in bank.entries:
        if entry.id in claims.removed:
            continue
        refine = claims.refinements.get(entry.id)
        if refine is not None and refine.content is not None:
            kind = refine.kind or entry.kind
            subtype = (refine.subtype or entry.subtype) if kind == "anchor" else None
            entry = entry.model_copy(
                update={"content": refine.content, "kind": kind, "subtype": subtype, "updated_at": iteration}
            )
        entries.append(entry)
    return entries


def _new_entry(entry_id: str, op: ExperienceOp, iteration: int) -> ExperienceEntry:
    """The entry an ADD makes (checked to have its kind and content)."""
    assert op.kind is not None and op.content is not None
    subtype = op.subtype if op.kind == "anchor" else None
    return ExperienceEntry(
        id=entry_id, kind=op.kind, subtype=subtype, content=op.content, added_at=iteration, updated_at=iteration
    )


def _deduplicated(entries: list[ExperienceEntry], threshold: float, report: ExperienceReport) -> list[ExperienceEntry]:
    """``entries`` without the near-duplicates of an earlier entry of the same kind (noted in the report)."""
    kept: list[ExperienceEntry] = []
    for entry in entries:
        twin = next(
            (k for k in kept if k.kind == entry.kind and near_duplicate(k.content, entry.content, threshold)), None
        )
        if twin is None:
            kept.append(entry)
        else:
            report.deduplicated.append(f"{entry.id} (near-duplicate of {twin.id})")
    return kept
