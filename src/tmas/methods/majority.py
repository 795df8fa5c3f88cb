"""Majority vote, MV@k (self-consistency; the TMAS paper's MV@64 baseline): k independent samples of the plain
solution prompt, and the most frequent answer wins, answers counted by value (``0.5`` and ``\\frac{1}{2}`` are one
answer: tmas.answer_classes); ties: the answer that came first.

Beyond the paper: with ``iterations`` > 1 each iteration draws k more samples and the vote runs over all samples
drawn so far (MV@k(t+1)), so majority vote gets an accuracy-against-tokens curve like the iterative methods.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

from pydantic import Field

from tmas.agents.solution import generation_prompt
from tmas.methods.base import Candidate, Method, MethodParams, ProblemResult, ProblemSession, gather_all
from tmas.methods.candidates import budget_note, finish, notes_for, pick, solve_call
from tmas.methods.styled import StyledParams


class MajorityParams(StyledParams):
    # Samples per iteration (paper: 64).
    k: int = Field(default=64, ge=1, le=1024)


class MajorityVote(Method[MajorityParams]):
    name: ClassVar[str] = "majority"
    Params: ClassVar[type[MethodParams]] = MajorityParams
    embedded_defaults: ClassVar[dict[str, Any]] = {"k": 4, "style": "concise"}

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p, mode = self.params, self.params.mode
        messages = generation_prompt(session.problem.question, mode, p.style_of("solution"))
        pool: list[Candidate] = []
        for t in range(p.iterations):
            session.begin_iteration(t)
            drawn = await gather_all(solve_call(session, "solution", messages, index=i, mode=mode) for i in range(p.k))
            candidates = [c for c in drawn if c is not None]
            if not candidates:
                break  # the budget refused every sample of this iteration: nothing to record
            pool += candidates
            classes = await session.answer_classes(pool)
            chosen = pick(pool, mode, classes)
            notes = notes_for(candidates, mode)
            if session.budget_stop:
                notes += budget_note(session, len(candidates), p.k)
            votes = Counter(classes[c.answer] for c in pool if c.answer and c.error is None)
            session.end_iteration(
                candidates,
                selected=chosen.answer if chosen else None,
                state={"samples": len(pool), "votes": dict(votes.most_common(10))},
                notes=notes,
            )
            if session.budget_stop:
                break
        chosen = pick(pool, mode, await session.answer_classes(pool))
        return finish(session, self.name, chosen, stopped=session.budget_stop is not None)
