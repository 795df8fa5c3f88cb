"""MATTRL's judge for experience construction (paper 003, Eq. 9 and appendix B.6): an integer score 0-5, normalised
to s = score / 5 in [0, 1].

Two questions are asked with the same output format (strict JSON ``{"analysis": ..., "score": 0-5}``):
- how much one specialist's turn helped the team towards the correct answer (the individual score s_{i,t});
- how far one turn of the discussion, with some specialists' contributions replaced by a no-op, moves the team
  towards the correct answer (the turn objective F_t of Eq. 17-18).
"""

from __future__ import annotations

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
    # Judges write "4", 4 or 4.0 alike; a fractional score is rounded as appendix B.6 rounds its weighted sum.
    if isinstance(raw, str):
        try:
            raw = float(raw.strip())
        except ValueError:
            raise AgentOutputError(f"judge score {raw!r} is not a number") from None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise AgentOutputError("judge JSON has no numeric 'score'")
    try:
        return JudgeScore(score=round(raw), analysis=str(data.get("analysis", "")))
    except ValidationError:
        raise AgentOutputError(f"judge score {raw} outside 0-{MAX_SCORE}") from None
