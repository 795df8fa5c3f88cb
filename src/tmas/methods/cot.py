"""Chain of thought: one solver call, the floor every other method is compared against.

Its one sample is the first sample of every method (TMAS's generation prompt, same system message and output
layout), so a comparison with CoT measures what a method adds after that sample, not a difference of prompts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tmas.agents.solution import generation_prompt
from tmas.methods.base import Method, MethodParams, ProblemResult, ProblemSession
from tmas.methods.call_count import CallCount, asked_again, count_calls
from tmas.methods.steps import finish, notes_for, solve_call
from tmas.methods.style_params import StyledParams
from tmas.methods.traits import Traits


class CoTParams(StyledParams):
    pass


class CoT(Method[CoTParams]):
    name: ClassVar[str] = "cot"
    traits: ClassVar[Traits] = Traits(one_chain=True, iterates=False)
    example_params: ClassVar[dict[str, Any] | None] = {}
    Params: ClassVar[type[MethodParams]] = CoTParams
    embedded_defaults: ClassVar[dict[str, Any]] = {"style": "concise"}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        return ["Single Agent"]

    def calls_per_problem(self) -> CallCount:
        """One solution call."""
        return count_calls({"solution": 1}, again=asked_again({"solution": 1}))

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p = self.params
        messages = generation_prompt(session.problem.question, p.mode, p.style_of("solution"))
        session.begin_iteration(0)
        candidate = await solve_call(session, "solution", messages, index=0, mode=p.mode)
        if candidate is None:  # a budget too small for even one call
            return finish(session, self.name, None, stopped=True)
        chosen = candidate if candidate.error is None else None
        session.end_iteration([candidate], chosen=chosen, notes=notes_for([candidate], p.mode))
        # A reply that echoed, whose retry the budget refused, is the record's candidate: the problem ends stopped.
        return finish(session, self.name, chosen, stopped=session.budget_stop is not None)
