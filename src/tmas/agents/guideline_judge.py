"""The guideline judge of TMAS's RL training (paper eq. 9, appendix D.2): is a rollout's strategy new?

It sees the problem, the guideline bank the rollout was conditioned on and the rollout, and answers with a JSON object
``{identified_strategy, novelty, same_as}`` where novelty is 1 (new), 0 (already attempted) or -1 (cannot tell).
An empty, truncated or unreadable reply raises :class:`AgentOutputError`; the reward counts it as known.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.templates import prompt
from tmas.llm.types import Message
from tmas.memory.guideline_bank import Strategy, StrategyNovelty


class StrategyView(BaseModel):
    """A guideline-bank entry as the judge sees it (training data carries only id and description)."""

    id: str
    description: str


class NoveltyReply(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``): the strategy named before the verdict."""

    identified_strategy: str
    novelty: Literal[1, 0, -1]
    same_as: str | None = None


class NoveltyVerdict(StrategyNovelty):
    identified_strategy: str = ""


def judge_prompt(question: str, strategies: list[StrategyView] | list[Strategy], solution: str) -> list[Message]:
    return prompt("rl_guideline_judge.j2", question=question, strategies=strategies, solution=solution)


def parse_novelty(content: str, *, truncated: bool = False) -> NoveltyVerdict:
    if truncated:
        raise AgentOutputError("reply truncated at max_tokens")
    data: dict[str, Any] = extract_json_object(content)
    if "novelty" not in data and "classification" in data:
        data["novelty"] = data["classification"]
    try:
        return NoveltyVerdict.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise AgentOutputError(f"{'.'.join(map(str, err['loc'])) or 'verdict'}: {err['msg']}") from None
