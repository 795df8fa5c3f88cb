"""Chain of thought: one solver call, the floor every other method is compared against."""

from __future__ import annotations

from typing import ClassVar

from tmas.agents.templates import prompt
from tmas.answers import extract_answer
from tmas.methods.base import Candidate, Method, MethodParams, ProblemResult, ProblemSession


class CoTParams(MethodParams):
    pass


class CoT(Method[CoTParams]):
    name: ClassVar[str] = "cot"
    Params: ClassVar[type[MethodParams]] = CoTParams

    async def solve(self, session: ProblemSession) -> ProblemResult:
        mode = self.params.mode
        messages = prompt("cot.j2", system_name="system_math.j2", question=session.problem.question, mode=mode)
        session.begin_iteration(0)
        reply = await session.chat("solution", messages)
        answer = extract_answer(reply.content) if reply.ok and mode == "numeric" else None
        notes = []
        if reply.ok and mode == "numeric" and answer is None:
            notes.append("solution has no boxed answer")
        if reply.truncated:
            notes.append("solution truncated at max_tokens")
        candidate = Candidate(
            index=0,
            text=reply.content,
            answer=answer,
            call_id=reply.call_id,
            usage=reply.usage,
            finish_reason=reply.finish_reason,
            error=reply.error,
        )
        session.end_iteration([candidate], selected=answer, notes=notes)
        result = session.result(self.name, answer=answer, text=reply.content)
        if not reply.ok:
            result.status, result.error = "failed", reply.error
        return result
