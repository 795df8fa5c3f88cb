"""MATTRL's summarizer (paper 003, Eq. 14 and appendix A.6): a kept turn, its context and its reward distilled into
ACTION / EXPERIENCE entries, each general (any case of the domain) or case-specific.

Output: strict JSON ``{"entries": [{"action": ..., "experience": ..., "scope": "general"|"case"}]}``; entries that
fail validation are dropped and reported, a reply with no valid entry is unusable.

Education uses appendix C.4.7's summarizer instead: each entry also has a ``class``, GUIDANCE (handling a teaching
situation or a student error) or STRATEGY (carrying out a teaching approach), and its scope is general or
subject-specific (stored as ``case``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, ValidationInfo, field_validator

from tmas.agents.output import parse_json_list
from tmas.agents.templates import prompt
from tmas.agents.utterance_judge import RoundView, TeachingView, TurnView
from tmas.llm.types import Message

MAX_ENTRIES = 3
# The longest ACTION and EXPERIENCE an entry may have (the prompt asks for a short key and one or two sentences). A
# runaway (one sentence repeated until the JSON closes) would ride in the hints of every specialist it is retrieved
# for, K entries at a time: such an entry is dropped and reported like any other invalid one.
ACTION_CHARS = 1000
EXPERIENCE_CHARS = 2000


class DistilledEntry(BaseModel):
    action: str = Field(min_length=1)
    experience: str = Field(min_length=1)
    scope: Literal["general", "case"] = "general"

    @field_validator("action", "experience")
    @classmethod
    def _stripped(cls, value: str, info: ValidationInfo) -> str:
        value = " ".join(value.split())
        if not value:
            raise ValueError("empty text")
        limit = ACTION_CHARS if info.field_name == "action" else EXPERIENCE_CHARS
        if len(value) > limit:
            raise ValueError(f"{len(value)} characters, over the {limit} it may hold")
        return value

    @field_validator("scope", mode="before")
    @classmethod
    def _scope_words(cls, value: object) -> object:
        # "case-specific" and "specific" are what summarizers write when they mean a case entry.
        # Education's summarizer says "subject" for a subject-specific entry (C.4.7).
        specific = ("case-specific", "specific", "case_specific", "subject", "subject-specific", "subject_specific")
        if isinstance(value, str) and value.strip().lower() in specific:
            return "case"
        return value.strip().lower() if isinstance(value, str) else value


class SummarizerReply(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``)."""

    entries: list[DistilledEntry] = Field(max_length=MAX_ENTRIES)


class TeachingEntry(DistilledEntry):
    """C.4.7's entry: a class (GUIDANCE or STRATEGY), the key (``action``) and the experience."""

    category: Literal["GUIDANCE", "STRATEGY"] = Field(validation_alias=AliasChoices("class", "category"))

    @field_validator("category", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.strip().upper() if isinstance(value, str) else value


class TeachingEntryReply(BaseModel):
    """One C.4.7 entry as the education summarizer's schema forces it, fields in the template's order."""

    category: Literal["GUIDANCE", "STRATEGY"] = Field(alias="class")
    action: str
    experience: str
    scope: Literal["general", "subject"]


class TeachingSummarizerReply(BaseModel):
    """The education summarizer's reply shape, sent as the call's JSON schema (``reply_model``); read by
    :func:`parse_teaching_summarizer`."""

    entries: list[TeachingEntryReply] = Field(max_length=MAX_ENTRIES)


def teaching_summarizer_prompt(
    *,
    question: str,
    gold: str,
    outcome: float,
    view: TeachingView,
    target: TurnView,
    round_number: int,
    reward: float,
    judge_analysis: str,
) -> list[Message]:
    return prompt(
        "mattrl_edu_summarizer.j2",
        question=question,
        gold=gold,
        outcome="correct" if outcome >= 1.0 else "wrong",
        target=target,
        round_number=round_number,
        reward=f"{reward:.3f}",
        judge_analysis=judge_analysis or "(none)",
        max_entries=MAX_ENTRIES,
        **view.variables(),
    )


def parse_teaching_summarizer(content: str, *, truncated: bool = False) -> tuple[list[TeachingEntry], list[str]]:
    """The valid C.4.7 entries (at most :data:`MAX_ENTRIES`) and why any others were dropped."""
    entries, malformed = parse_json_list(
        content, ("entries", "experiences"), TeachingEntry, truncated=truncated, noun="entry"
    )
    return entries[:MAX_ENTRIES], malformed


def summarizer_prompt(
    *,
    question: str,
    gold: str,
    outcome: float,
    history: list[RoundView],
    target: TurnView,
    round_number: int,
    reward: float,
    judge_analysis: str,
    domain: str = "math",
) -> list[Message]:
    return prompt(
        "mattrl_summarizer.j2",
        domain=domain,
        question=question,
        gold=gold,
        outcome=_outcome_text(outcome),
        history=history,
        target=target,
        round_number=round_number,
        reward=f"{reward:.3f}",
        judge_analysis=judge_analysis or "(none)",
        max_entries=MAX_ENTRIES,
    )


def _outcome_text(outcome: float) -> str:
    if outcome >= 1.0:
        return "correct"
    if outcome <= 0.0:
        return "wrong"
    return f"partly correct (outcome score {outcome:.2f} of 1)"


def parse_summarizer(content: str, *, truncated: bool = False) -> tuple[list[DistilledEntry], list[str]]:
    """The valid entries (at most :data:`MAX_ENTRIES`) and why any others were dropped."""
    entries, malformed = parse_json_list(
        content, ("entries", "experiences"), DistilledEntry, truncated=truncated, noun="entry"
    )
    return entries[:MAX_ENTRIES], malformed
