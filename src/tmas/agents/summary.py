"""The summary agent A_sum (paper eq. 3): the M verifications of one candidate folded into s_{t,i}.

A reply with the three sections (Validated Steps, Remaining Flaws, Verdict) is parsed into lists; a non-empty reply
without them is kept whole (``structured`` False). An empty or failed reply is replaced by
:func:`summary_from_scores`, built from the verifier scores alone, so the rollout still carries its evidence.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from tmas.agents.output import AgentOutputError
from tmas.agents.rollouts import score_text
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.agents.verification import Verification
from tmas.llm.types import Message

_HEADING = re.compile(r"^#{1,6}\s*(validated steps|remaining flaws|verdict)\s*:?\s*$", re.I | re.M)


class Summary(BaseModel):
    text: str
    validated: list[str] = Field(default_factory=list)
    flaws: list[str] = Field(default_factory=list)
    verdict: str = ""
    structured: bool = False


class VerificationView(BaseModel):
    feedback: str
    score_text: str


# The paper's summaries are short; the word limit shrinks with a small max_tokens so that the summary ends within it
# (a 0.5B model asked for 200 words under a 220-token cap was cut every time, losing its verdict).
SUMMARY_WORDS = 200
WORDS_PER_TOKEN = 0.55


def summary_words(max_tokens: int | None) -> int:
    """The word limit the summary prompt states: 200, or what ``max_tokens`` holds with room to close."""
    if max_tokens is None:
        return SUMMARY_WORDS
    return max(40, min(SUMMARY_WORDS, int(max_tokens * WORDS_PER_TOKEN) // 10 * 10))


def summary_prompt(
    question: str, solution: str, verifications: list[Verification], *, max_tokens: int | None = None
) -> list[Message]:
    views = [
        VerificationView(feedback=v.feedback, score_text="unreadable" if v.score is None else score_text(v.score))
        for v in verifications
    ]
    return prompt(
        "tmas_summary.j2",
        system_name=MATH_SYSTEM,
        question=question,
        solution=solution,
        verifications=views,
        max_words=summary_words(max_tokens),
    )


def _bullets(block: str) -> list[str]:
    items = [line.strip().lstrip("-*•").strip() for line in block.splitlines()]
    return [item for item in items if item and item.lower().rstrip(".") not in ("none", "none found")]


def parse_summary(content: str, *, truncated: bool = False) -> Summary:
    text = content.strip()
    if not text:
        raise AgentOutputError("empty summary")
    sections: dict[str, str] = {}
    headings = list(_HEADING.finditer(text))
    for i, match in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        sections[match.group(1).lower()] = text[match.end() : end].strip()
    structured = "validated steps" in sections and "remaining flaws" in sections and not truncated
    return Summary(
        text=text,
        validated=_bullets(sections.get("validated steps", "")),
        flaws=_bullets(sections.get("remaining flaws", "")),
        verdict=sections.get("verdict", "").strip(),
        structured=structured,
    )


def summary_from_scores(verifications: list[Verification], reason: str) -> Summary:
    scores = ", ".join("unreadable" if v.score is None else score_text(v.score) for v in verifications) or "none"
    text = f"(No summary: {reason}.) Verifier scores: {scores}. Treat every step of this attempt as unconfirmed."
    return Summary(text=text, verdict=text)
