"""The experience agent A_exp (paper eq. 4): E_t = A_exp(Q, R_t, E_{t-1}) as ADD / KEEP / REFINE / DELETE operations.

The reply must hold a JSON object with an ``operations`` list (``ops`` accepted). A truncated or empty reply, one
without such a list, or a non-empty list of which no operation is valid is an invalid update: the caller keeps
E_{t-1}. Single malformed operations in an otherwise valid update are dropped and reported.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tmas.agents.echo import EchoGuard
from tmas.agents.output import parse_json_list
from tmas.agents.rollouts import RolloutView
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank, ExperienceOp


class ExperienceReply(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``) where the server constrains decoding."""

    operations: list[ExperienceOp]


class ExperienceUpdate(BaseModel):
    operations: list[ExperienceOp]
    # Operations that could not be read, with why.
    malformed: list[str] = Field(default_factory=list)

    def without_echoes(self, guard: EchoGuard) -> tuple[ExperienceUpdate, list[str]]:
        """The update without the ADD / REFINE operations whose content echoes the prompt's instructions."""
        kept: list[ExperienceOp] = []
        dropped: list[str] = []
        for position, op in enumerate(self.operations, start=1):
            if guard.echoes_text(op.content):
                dropped.append(f"operation {position} ({op.op}): content echoes the instructions: {op.content!r:.120}")
            else:
                kept.append(op)
        return self.model_copy(update={"operations": kept}), dropped


def experience_prompt(
    question: str, rollouts: list[RolloutView], bank: ExperienceBank, max_entries: int
) -> list[Message]:
    return prompt(
        "tmas_experience.j2",
        system_name=MATH_SYSTEM,
        question=question,
        rollouts=rollouts,
        bank=bank,
        max_entries=max_entries,
    )


def parse_experience_update(content: str, *, truncated: bool = False) -> ExperienceUpdate:
    ops, malformed = parse_json_list(
        content, ("operations", "ops"), ExperienceOp, truncated=truncated, noun="operation"
    )
    return ExperienceUpdate(operations=ops, malformed=malformed)
