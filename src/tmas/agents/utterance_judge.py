"""MATTRL's judge for experience construction (paper 003, Eq. 9 and appendix B.6): an integer score 0-5, normalised
to s = score / 5 in [0, 1].

Two questions are asked with the same output format (strict JSON ``{"analysis": ..., "score": 0-5}``):
- how much one specialist's turn helped the team towards the correct answer (the individual score s_{i,t});
- how far one turn of the discussion, with some specialists' contributions replaced by a no-op, moves the team
  towards the correct answer (the turn objective F_t of Eq. 17-18).

Education scores a teacher's utterance with appendix C.4.6's rubric instead: correctness, information gain,
relevance and clarity, each 0-5, combined here (not by the judge) as 0.30 / 0.25 / 0.25 / 0.20 and rounded to the
nearest integer, as C.4.6 states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.templates import prompt
from tmas.llm.types import Message

MAX_SCORE = 5


class JudgeScore(BaseModel):
    score: int = Field(ge=0, le=MAX_SCORE)
    analysis: str = ""

    @property
    def normalised(self) -> float:
        """Eq. 9's s in [0, 1] (appendix B.6: score / 5)."""
        return self.score / MAX_SCORE


class JudgeScoreReply(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``): the analysis is written before the score."""

    analysis: str
    score: int = Field(ge=0, le=MAX_SCORE)


class TurnView(BaseModel):
    """One specialist's turn as the judge reads it: every utterance the specialist made in that round."""

    agent: str
    specialty: str = ""
    text: str


class RoundView(BaseModel):
    number: int
    turns: list[TurnView]


def utterance_score_prompt(
    *,
    question: str,
    gold: str,
    final_answer: str | None,
    history: list[RoundView],
    target: TurnView,
    round_number: int,
    domain: str = "math",
) -> list[Message]:
    return prompt(
        "mattrl_utterance_judge.j2",
        domain=domain,
        question=question,
        gold=gold,
        final_answer=final_answer or "(none)",
        history=history,
        target=target,
        round_number=round_number,
    )


# C.4.6's criteria and weights, in the order the rubric lists them.
RUBRIC = (
    ("correctness_score", 0.30),
    ("information_gain_score", 0.25),
    ("relevance_score", 0.25),
    ("clarity_score", 0.20),
)


class RubricReply(BaseModel):
    """C.4.6's reply shape, sent as the call's JSON schema (``reply_model``): the four criterion scores in the
    rubric's order, then the analysis, as the template describes them. Read by :func:`parse_rubric_score`."""

    correctness_score: int = Field(ge=0, le=MAX_SCORE)
    information_gain_score: int = Field(ge=0, le=MAX_SCORE)
    relevance_score: int = Field(ge=0, le=MAX_SCORE)
    clarity_score: int = Field(ge=0, le=MAX_SCORE)
    analysis: str


@dataclass(frozen=True)
class DialogueTurn:
    teacher: str
    student: str


class TeachingView(BaseModel):
    """What the education judge and summarizer see of a teaching session besides the target utterance."""

    subject: str = ""
    difficulty: str = ""
    pre_answer: str | None = None
    pre_reasoning: str = ""
    # (teacher question, student reply) of the rounds before the target's.
    dialogue: list[tuple[str, str]] = Field(default_factory=list)
    role: str = ""

    def variables(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "difficulty": self.difficulty,
            "pre_answer": self.pre_answer,
            "pre_reasoning": self.pre_reasoning,
            "dialogue": [DialogueTurn(t, s) for t, s in self.dialogue],
            "role": self.role or "teacher",
        }


def teaching_score_prompt(
    *, question: str, gold: str, view: TeachingView, target: TurnView, round_number: int
) -> list[Message]:
    """C.4.6: the rubric judge of one teacher utterance."""
    return prompt(
        "mattrl_edu_judge.j2",
        question=question,
        gold=gold,
        target=target,
        round_number=round_number,
        **view.variables(),
    )


def parse_rubric_score(content: str, *, truncated: bool = False) -> JudgeScore:
    """C.4.6's four criterion scores combined into the global 0-5 score (weighted sum, rounded half up); raises
    :class:`AgentOutputError` when a criterion is missing or outside 0-5."""
    if truncated:
        raise AgentOutputError("judge reply truncated at max_tokens")
    data = extract_json_object(content)
    parts: list[str] = []
    total = 0.0
    for key, weight in RUBRIC:
        raw = data.get(key)
        if isinstance(raw, str):
            try:
                raw = float(raw.strip())
            except ValueError:
                raise AgentOutputError(f"judge {key} {raw!r} is not a number") from None
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise AgentOutputError(f"judge JSON has no numeric {key!r}")
        if not 0 <= raw <= MAX_SCORE:
            raise AgentOutputError(f"judge {key} {raw} outside 0-{MAX_SCORE}")
        total += weight * raw
        parts.append(f"{key.removesuffix('_score').replace('_', ' ')} {raw:g}")
    analysis = str(data.get("analysis", "")).strip()
    score = min(MAX_SCORE, nearest_score(total))
    return JudgeScore(score=score, analysis=f"{analysis} ({'; '.join(parts)}; weighted {total:.2f})".strip())


def nearest_score(value: float) -> int:
    """``value`` rounded to the nearest integer, halves up (2.5 -> 3, 3.5 -> 4), as C.4.6's "Round to nearest
    integer" reads, not Python's round-half-to-even (2.5 -> 2). The tolerance keeps a weighted sum that floating
    point stores a hair under a half rounding up."""
    return math.floor(value + 0.5 + 1e-9)


def turn_value_prompt(
    *, question: str, gold: str, history: list[RoundView], turn: RoundView, domain: str = "math"
) -> list[Message]:
    return prompt("mattrl_turn_value.j2", question=question, gold=gold, history=history, turn=turn, domain=domain)


def parse_judge_score(content: str, *, truncated: bool = False) -> JudgeScore:
    """The score of a judge reply; raises :class:`AgentOutputError` saying why when there is none."""
    if truncated:
        raise AgentOutputError("judge reply truncated at max_tokens")
    data = extract_json_object(content)
    raw = data.get("score")
    # Judges write "4", 4 or 4.0 alike. Appendix B.6 asks for an integer 0-5; a fractional one is read as the nearest
    # integer, halves up, as C.4.6 rounds its weighted sum (B.6 itself has no weighted sum to round).
    if isinstance(raw, str):
        try:
            raw = float(raw.strip())
        except ValueError:
            raise AgentOutputError(f"judge score {raw!r} is not a number") from None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise AgentOutputError("judge JSON has no numeric 'score'")
    try:
        return JudgeScore(score=nearest_score(raw), analysis=str(data.get("analysis", "")))
    except ValidationError:
        raise AgentOutputError(f"judge score {raw} outside 0-{MAX_SCORE}") from None
