"""The experience agent A_exp (paper eq. 4): E_t = A_exp(Q, R_t, E_{t-1}) as ADD / KEEP / REFINE / DELETE operations.

The reply must hold a JSON object with an ``operations`` list (``ops`` accepted). A truncated or empty reply, one
without such a list, or a non-empty list of which no operation is valid is an invalid update: the caller keeps
E_{t-1}. Single malformed operations in an otherwise valid update are dropped and reported.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import BaseModel, Field, create_model

from tmas.agents.echo import EchoGuard
from tmas.agents.output import parse_json_list
from tmas.agents.rollouts import RolloutView
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank, ExperienceOp

# An entry is one finding, not an essay. Under a schema the server must close the JSON, so the schema bounds each
# entry and the number of operations to what the role's max_tokens holds: unbounded, the embedded 0.5B model repeated
# one sentence inside "content" until the cut, and a cut update is no update (4 of 4 on the first run measured).
ENTRY_CHARS = 400
# One operation under the schema: an entry of ENTRY_CHARS (about 100 tokens), its keys and the indentation a model
# writes (measured on the embedded model: about 150 tokens a full operation).
TOKENS_PER_OPERATION = 170
# With no max_tokens known: a whole bank's worth (the prompt asks for 20 to 35 entries).
MAX_OPERATIONS = 40


class BoundedExperienceOp(ExperienceOp):
    """An operation as the schema asks the server for it: the same fields, the content bounded."""

    content: str | None = Field(default=None, max_length=ENTRY_CHARS)


class ExperienceReply(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``) where the server constrains decoding."""

    operations: list[BoundedExperienceOp] = Field(max_length=MAX_OPERATIONS)


@lru_cache(maxsize=32)
def experience_reply_model(max_tokens: int | None) -> type[ExperienceReply]:
    """:class:`ExperienceReply` with at most as many operations as ``max_tokens`` holds (at least one)."""
    if max_tokens is None:
        return ExperienceReply
    operations = max(1, min(MAX_OPERATIONS, max_tokens // TOKENS_PER_OPERATION))
    return create_model(
        "ExperienceReply",
        __base__=ExperienceReply,
        operations=(list[BoundedExperienceOp], Field(max_length=operations)),
    )


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
    question: str, rollouts: list[RolloutView], bank: ExperienceBank, max_entries: int | None
) -> list[Message]:
    """The experience agent's prompt; ``max_entries`` is the bank's cap, stated where there is one."""
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
