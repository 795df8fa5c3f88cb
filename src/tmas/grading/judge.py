"""The LLM-as-judge of the paper (appendix A.2): is the student's final answer equivalent to the reference?

The judge answers JSON ``{"reasoning": ..., "equivalent": true|false}``. A reply that is not such JSON is undecided:
it is asked again (a fresh sample) up to ``retries`` times, and the last undecided outcome is recorded as such.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError, field_validator

from tmas.agents.templates import prompt
from tmas.config import Sampling
from tmas.llm.model import ChatModel
from tmas.llm.types import CallKey, Usage

JUDGE_ROLE = "judge"
# What the judge sees of a candidate with no extracted answer: the end of its text, where a final result would be.
STUDENT_TAIL_CHARS = 2000
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.I)


class JudgeReply(BaseModel):
    reasoning: str = ""
    equivalent: bool

    @field_validator("equivalent", mode="before")
    @classmethod
    def _lenient_bool(cls, value: object) -> object:
        # Models sometimes quote booleans; anything else stays invalid.
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value


class JudgeReplyFormat(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``): the reasoning before the verdict (a
    constrained model writes required properties first, in order)."""

    reasoning: str
    equivalent: bool


def parse_judge_reply(text: str) -> JudgeReply | None:
    """The verdict in a judge reply, or None when it holds no valid JSON verdict."""
    cleaned = _FENCE.sub("", text.strip())
    candidates = [cleaned]
    # A model may wrap the object in prose: also try the outermost {...} span.
    start, end = cleaned.find("{"), cleaned.rfind("}")
    if 0 <= start < end:
        candidates.append(cleaned[start : end + 1])
    for raw in candidates:
        try:
            data = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(data, dict) or not isinstance(data.get("equivalent"), bool | str):
            continue
        try:
            return JudgeReply.model_validate(data)
        except ValidationError:
            continue
    return None


@dataclass(frozen=True)
class JudgeVerdict:
    correct: bool | None
    detail: str
    attempts: int
    usage: Usage


def _seed(*parts: object) -> int:
    # Distinct seeds make the R runs independent samples, reproducible on servers that honour `seed`.
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "big") >> 1


async def judge_once(
    llm: ChatModel,
    *,
    problem_id: str,
    problem: str,
    reference: str,
    student: str,
    run: int,
    retries: int = 2,
) -> JudgeVerdict:
    """Judge run ``run`` for one (reference, student) pair; invalid replies are retried ``retries`` times."""
    messages = prompt(
        "judge_user.j2",
        system_name="judge_system.j2",
        problem=problem,
        reference=reference,
        student=student[-STUDENT_TAIL_CHARS:],
    )
    usage = Usage()
    detail = ""
    for attempt in range(retries + 1):
        # The sample index keeps each run and retry a distinct call in the store's cache.
        key = CallKey(problem_id=problem_id, role=JUDGE_ROLE, sample=run * (retries + 1) + attempt)
        sampling = Sampling(seed=_seed(problem_id, student, run, attempt))
        reply = await llm.chat(JUDGE_ROLE, messages, key=key, sampling=sampling, reply_model=JudgeReplyFormat)
        usage = usage + reply.usage
        if not reply.ok:
            detail = f"judge call failed: {reply.error}"
            continue
        parsed = parse_judge_reply(reply.content)
        if parsed is not None:
            return JudgeVerdict(parsed.equivalent, parsed.reasoning[:500], attempt + 1, usage)
        detail = f"judge reply is not valid JSON: {reply.content[:200]!r}"
    return JudgeVerdict(None, detail, retries + 1, usage)


def majority(verdicts: list[bool | None]) -> bool | None:
    """The majority of decided verdicts over judge runs (None on a tie or when none decided)."""
    yes = sum(v is True for v in verdicts)
    no = sum(v is False for v in verdicts)
    if yes == no:
        return None
    return yes > no
