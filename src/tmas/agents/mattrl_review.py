"""MATTRL's structured peer review. Math (B.4): each specialist's attempt is reviewed by every other specialist
as JSON (analysis, verdict, validated parts, issues with type/severity/note/fix, tests, alt_hint, confidence).

Acceptance rule (B.4): an attempt is accepted only if every peer verdict is ``accept`` and no issue remains.

Medicine (A.4): each specialist's differential is reviewed by every other specialist as JSON (analysis,
agreements, disagreements, changes); there is no verdict, a specialist converges when its list stops changing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.templates import prompt
from tmas.llm.types import Message
from tmas.memory.transcript import TeamMember

Verdict = Literal["accept", "revise", "reject"]
Severity = Literal["fatal", "major", "minor"]
# B.4's issue types, then two of ours for what none of them names.
IssueType = Literal[
    "algebra_error",
    "logic_gap",
    "missing_case",
    "theorem_misuse",
    "undefined_symbol",
    "diagram_dependence",
    "computation_error",
    "other",
]

# A server closes a constrained reply's JSON only where the schema lets it. Unbounded, the embedded 0.5B model wrote
# analyses of up to 3,000 characters and one phrase of "validated" over and over until max_tokens cut the reply (65
# of 147 math reviews at 640 tokens, 25 of them after their verdict), and a cut review counts as no review. So the
# reply schemas bound what the review prompts already ask to keep short (an analysis of two to four sentences, short
# phrases, one entry per criticism); reading a reply stays unbounded.
ANALYSIS_CHARS = 600
PHRASE_CHARS = 160
NOTE_CHARS = 300
MAX_VALIDATED = 6
MAX_ISSUES = 4
# A.4's lists: a differential has ten entries, so ten points each at most.
MAX_POINTS = 10

Phrase = Annotated[str, Field(max_length=PHRASE_CHARS)]
Note = Annotated[str, Field(max_length=NOTE_CHARS)]


class Issue(BaseModel):
    type: str = "other"
    severity: Severity = "major"
    note: str
    fix: str = ""

    @field_validator("severity", mode="before")
    @classmethod
    def _severity(cls, value: Any) -> Any:
        # An unknown severity is taken as major: serious enough to need a fix, not enough to reject.
        text = str(value).strip().lower()
        return text if text in ("fatal", "major", "minor") else "major"

    @field_validator("type", "fix", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return "" if value is None else str(value)


class Review(BaseModel):
    reviewer: str = ""
    target: str = ""
    analysis: str = ""
    verdict: Verdict
    validated: list[str] = Field(default_factory=list)
    issues: list[Issue] = Field(default_factory=list)
    tests: dict[str, Any] = Field(default_factory=dict)
    alt_hint: str | None = None
    confidence: float | None = None
    # False when the reply could not be read and this review stands in for it (see parse failures in the method).
    readable: bool = True

    @field_validator("verdict", mode="before")
    @classmethod
    def _verdict(cls, value: Any) -> Any:
        return str(value).strip().lower() if value is not None else value

    @field_validator("validated", mode="before")
    @classmethod
    def _phrases(cls, value: Any) -> Any:
        if value is None:
            return []
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]

    @field_validator("tests", mode="before")
    @classmethod
    def _tests(cls, value: Any) -> Any:
        return value if isinstance(value, dict) else {}

    @field_validator("confidence", mode="before")
    @classmethod
    def _confidence(cls, value: Any) -> Any:
        try:
            return float(value)
        except (TypeError, ValueError):
            return None


class IssueReply(BaseModel):
    type: IssueType
    severity: Severity
    note: Note
    fix: Note


class CounterexampleReply(BaseModel):
    found: bool
    example: Note | None = None


class ReviewTestsReply(BaseModel):
    random_checks: int = Field(ge=0)
    counterexample: CounterexampleReply


class ReviewReply(BaseModel):
    """The reply's shape (B.4), sent as the call's JSON schema (``reply_model``): analysis first, verdict after it,
    each text and list bounded (see :data:`ANALYSIS_CHARS`). Read by :func:`parse_review` into :class:`Review`, which
    also says who reviewed whom."""

    analysis: str = Field(max_length=ANALYSIS_CHARS)
    verdict: Verdict
    validated: list[Phrase] = Field(max_length=MAX_VALIDATED)
    issues: list[IssueReply] = Field(max_length=MAX_ISSUES)
    tests: ReviewTestsReply
    alt_hint: Note | None = None
    confidence: float | None = Field(default=None, ge=0.0, le=1.0)


def unreadable_review(reviewer: str, target: str, why: str) -> Review:
    """What an unusable review counts as: ``revise`` with no issue, so it can neither accept the attempt nor
    feed it a made-up criticism."""
    return Review(
        reviewer=reviewer, target=target, analysis=f"(unreadable review: {why})", verdict="revise", readable=False
    )


def review_prompt(question: str, reviewer: TeamMember, target: TeamMember, attempt: str) -> list[Message]:
    """The B.4 review prompt; the case and attempt go in as a JSON bundle (data, not template text)."""
    bundle = json.dumps(
        {
            "problem": question,
            "author": {"specialty": target.specialty, "role": target.role},
            "attempt": attempt,
            "reviewer": {"specialty": reviewer.specialty, "role": reviewer.role},
        },
        ensure_ascii=False,
        indent=1,
    )
    return prompt("mattrl_review.j2", reviewer=reviewer, bundle=bundle)


# Entries of an issues list that say there is none.
_NO_ISSUE = frozenset({"", "none", "n/a", "na", "nil", "nothing", "no issue", "no issues", "no issues found"})


def _issue(item: Any) -> Issue | None:
    """One entry of a review's ``issues`` list as an issue; None for an entry that says nothing (empty, null, a
    number, a string saying there is none). B.4 accepts an attempt only when the list is empty, so an entry is kept
    whatever its shape: a plain string is the issue's note, and an object without a note keeps its whole text as
    the note (type ``other``, severity ``major`` where it names none, as for an unknown severity)."""
    if isinstance(item, str):
        text = " ".join(item.split())
        return Issue(note=text) if text.strip(" .!-").lower() not in _NO_ISSUE else None
    if not isinstance(item, dict) or not item:
        return None
    note = item.get("note")
    if note is None or not str(note).strip():
        item = {**item, "note": json.dumps(item, ensure_ascii=False)}
    try:
        return Issue.model_validate(item)
    except ValidationError:
        return Issue(note=json.dumps(item, ensure_ascii=False))


def parse_review(content: str, reviewer: str, target: str, *, truncated: bool = False) -> Review:
    """The review JSON, every entry of its issues list read as an issue (see :func:`_issue`). Raises
    :class:`AgentOutputError`."""
    try:
        data = extract_json_object(content)
    except AgentOutputError as exc:
        raise AgentOutputError(f"{exc} (reply truncated at max_tokens)" if truncated else str(exc)) from None
    raw_issues = data.get("issues")
    issues = [
        issue for item in (raw_issues if isinstance(raw_issues, list) else []) if (issue := _issue(item)) is not None
    ]
    try:
        return Review.model_validate({**data, "issues": issues, "reviewer": reviewer, "target": target})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise AgentOutputError(f"review {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def accepted(reviews: list[Review]) -> bool:
    """B.4: accepted only if there is at least one review, every verdict is accept and no issue remains."""
    return bool(reviews) and all(r.verdict == "accept" and not r.issues for r in reviews)


# ---- medicine (A.4): a critical peer review of another member's differential ---------------------------------


class DifferentialReview(BaseModel):
    """A.4's peer review of a differential: analysis, agreements, disagreements (none when the reviewer fully
    concurs) and the concrete changes to the ranked list it asks for."""

    reviewer: str = ""
    target: str = ""
    analysis: str = ""
    agreements: list[str] = Field(default_factory=list)
    disagreements: list[str] = Field(default_factory=list)
    changes: list[str] = Field(default_factory=list)
    readable: bool = True

    @field_validator("agreements", "disagreements", "changes", mode="before")
    @classmethod
    def _points(cls, value: Any) -> Any:
        # A.4 lets a reviewer that fully concurs write null; a lone string is one point.
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        return [" ".join(str(v).split()) for v in items if v is not None and str(v).strip()]

    @field_validator("analysis", mode="before")
    @classmethod
    def _analysis(cls, value: Any) -> Any:
        return "" if value is None else str(value)

    @property
    def concurs(self) -> bool:
        return self.readable and not self.disagreements and not self.changes


class DifferentialReviewReply(BaseModel):
    """A.4's reply shape, sent as the call's JSON schema (``reply_model``), fields in the template's order: the
    analysis first, then the points, each text and list bounded like the math review's; ``disagreements`` is null
    when the reviewer fully concurs. Read by :func:`parse_differential_review` into :class:`DifferentialReview`."""

    analysis: str = Field(max_length=ANALYSIS_CHARS)
    agreements: list[Note] = Field(max_length=MAX_POINTS)
    disagreements: list[Note] | None = Field(max_length=MAX_POINTS)
    changes: list[Note] = Field(max_length=MAX_POINTS)


def differential_review_prompt(question: str, reviewer: TeamMember, target: TeamMember, attempt: str) -> list[Message]:
    """A.4's peer review prompt; the record and the differential go in as a JSON bundle (data, not template text)."""
    bundle = json.dumps(
        {
            "patient_record": question,
            "author": {"specialty": target.specialty, "role": target.role},
            "differential": attempt,
            "reviewer": {"specialty": reviewer.specialty, "role": reviewer.role},
        },
        ensure_ascii=False,
        indent=1,
    )
    return prompt("mattrl_med_review.j2", reviewer=reviewer, target=target, bundle=bundle)


def parse_differential_review(
    content: str, reviewer: str, target: str, *, truncated: bool = False
) -> DifferentialReview:
    """The review JSON; raises :class:`AgentOutputError` when there is none or it has neither analysis nor points."""
    try:
        data = extract_json_object(content)
    except AgentOutputError as exc:
        raise AgentOutputError(f"{exc} (reply truncated at max_tokens)" if truncated else str(exc)) from None
    if not any(k in data for k in ("analysis", "agreements", "disagreements", "changes")):
        raise AgentOutputError("review JSON has none of analysis, agreements, disagreements, changes")
    try:
        return DifferentialReview.model_validate({**data, "reviewer": reviewer, "target": target, "readable": True})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise AgentOutputError(f"review {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def unreadable_differential_review(reviewer: str, target: str, why: str) -> DifferentialReview:
    """What an unusable review counts as: no agreement and no criticism (nothing to share)."""
    return DifferentialReview(reviewer=reviewer, target=target, analysis=f"(unreadable review: {why})", readable=False)
