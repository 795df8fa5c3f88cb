"""The guideline agent A_guide (paper eq. 5): G_t = A_guide(Q, R_t, G_{t-1}), one strategy verdict per rollout.

The reply must hold a JSON object with a ``rollouts`` list of ``{rollout, strategy, novelty, same_as}`` items
(novelty 1 new, 0 already logged, -1 undeterminable). Truncated, empty or listless replies, or a non-empty list with
no valid item, are invalid updates (the caller keeps G_{t-1}); single malformed items are dropped and reported.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError

from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.rollouts import RolloutView
from tmas.agents.templates import prompt
from tmas.llm.types import Message
from tmas.memory.guideline_bank import GuidelineBank, StrategyClassification


class GuidelineUpdate(BaseModel):
    items: list[StrategyClassification]
    malformed: list[str] = Field(default_factory=list)


def guideline_prompt(question: str, rollouts: list[RolloutView], bank: GuidelineBank) -> list[Message]:
    return prompt("tmas_guideline.j2", question=question, rollouts=rollouts, bank=bank)


def parse_guideline_update(content: str, *, truncated: bool = False) -> GuidelineUpdate:
    if truncated:
        raise AgentOutputError("reply truncated at max_tokens")
    data = extract_json_object(content)
    raw = data.get("rollouts", data.get("classifications"))
    if not isinstance(raw, list):
        raise AgentOutputError("the JSON object has no 'rollouts' list")
    items: list[StrategyClassification] = []
    malformed: list[str] = []
    for position, item in enumerate(raw, start=1):
        try:
            items.append(StrategyClassification.model_validate(item))
        except ValidationError as exc:
            err = exc.errors()[0]
            malformed.append(f"item {position}: {'.'.join(map(str, err['loc'])) or 'item'}: {err['msg']}")
    if raw and not items:
        raise AgentOutputError(f"none of the {len(raw)} items is valid ({malformed[0]})")
    if not items:
        raise AgentOutputError("empty 'rollouts' list")
    return GuidelineUpdate(items=items, malformed=malformed)
