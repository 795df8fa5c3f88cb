"""The guideline agent A_guide (paper eq. 5): G_t = A_guide(Q, R_t, G_{t-1}), one strategy verdict per rollout.

The reply must hold a JSON object with a ``rollouts`` list of ``{rollout, strategy, novelty, same_as}`` items
(novelty 1 new, 0 already logged, -1 undeterminable; a 0 whose ``same_as`` is "R2" shares the strategy of rollout 2 of
the same iteration, so the distinct strategies of one iteration enter the bank once). Truncated, empty or listless
replies, or a non-empty list with no valid item, are invalid updates (the caller keeps G_{t-1}); single malformed
items are dropped and reported.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tmas.agents.echo import EchoGuard
from tmas.agents.output import AgentOutputError, parse_json_list
from tmas.agents.rollouts import RolloutView
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.llm.types import Message
from tmas.memory.guideline_bank import GuidelineBank, StrategyClassification


class RolloutVerdict(BaseModel):
    """One item of the reply as the server is asked to write it: the strategy is described before it is judged."""

    rollout: int = Field(ge=1)
    strategy: str
    novelty: Literal[1, 0, -1]
    same_as: str | None = None


class GuidelineReply(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``); read by :func:`parse_guideline_update`."""

    rollouts: list[RolloutVerdict]


class GuidelineUpdate(BaseModel):
    items: list[StrategyClassification]
    malformed: list[str] = Field(default_factory=list)

    def without_echoes(self, guard: EchoGuard) -> tuple[GuidelineUpdate, list[str]]:
        """The update without the verdicts whose strategy echoes the prompt's instructions."""
        kept: list[StrategyClassification] = []
        dropped: list[str] = []
        for item in self.items:
            if guard.echoes_text(item.strategy):
                dropped.append(f"rollout {item.rollout}: strategy echoes the instructions: {item.strategy!r:.120}")
            else:
                kept.append(item)
        return self.model_copy(update={"items": kept}), dropped


def guideline_prompt(question: str, rollouts: list[RolloutView], bank: GuidelineBank) -> list[Message]:
    return prompt("tmas_guideline.j2", system_name=MATH_SYSTEM, question=question, rollouts=rollouts, bank=bank)


def parse_guideline_update(content: str, *, truncated: bool = False) -> GuidelineUpdate:
    items, malformed = parse_json_list(
        content, ("rollouts", "classifications"), StrategyClassification, truncated=truncated, noun="item"
    )
    if not items:
        raise AgentOutputError("empty 'rollouts' list")
    return GuidelineUpdate(items=items, malformed=malformed)
