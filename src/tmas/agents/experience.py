"""The experience agent A_exp (paper eq. 4): E_t = A_exp(Q, R_t, E_{t-1}) as ADD / KEEP / REFINE / DELETE operations.

The reply must hold a JSON object with an ``operations`` list (``ops`` accepted). A truncated or empty reply, one
without such a list, or a non-empty list of which no operation is valid is an invalid update: the caller keeps
E_{t-1}. Single malformed operations in an otherwise valid update are dropped and reported.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError

from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.rollouts import RolloutView
from tmas.agents.templates import prompt
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank, ExperienceOp


class ExperienceUpdate(BaseModel):
    operations: list[ExperienceOp]
    # Operations that could not be read, with why.
    malformed: list[str] = Field(default_factory=list)


def experience_prompt(
    question: str, rollouts: list[RolloutView], bank: ExperienceBank, max_entries: int
) -> list[Message]:
    return prompt("tmas_experience.j2", question=question, rollouts=rollouts, bank=bank, max_entries=max_entries)


def parse_experience_update(content: str, *, truncated: bool = False) -> ExperienceUpdate:
    if truncated:
        raise AgentOutputError("reply truncated at max_tokens")
    data = extract_json_object(content)
    raw = data.get("operations", data.get("ops"))
    if not isinstance(raw, list):
        raise AgentOutputError("the JSON object has no 'operations' list")
    ops: list[ExperienceOp] = []
    malformed: list[str] = []
    for position, item in enumerate(raw, start=1):
        try:
            ops.append(ExperienceOp.model_validate(item))
        except ValidationError as exc:
            err = exc.errors()[0]
            malformed.append(f"operation {position}: {'.'.join(map(str, err['loc'])) or 'item'}: {err['msg']}")
    if raw and not ops:
        raise AgentOutputError(f"none of the {len(raw)} operations is valid ({malformed[0]})")
    return ExperienceUpdate(operations=ops, malformed=malformed)
