"""Self-Refine (Madaan et al. 2023; TMAS paper 4.1 and A.3): N solutions in parallel, each refined, iteration after
iteration, on its own previous attempt only. No trajectory ever sees another one.

Iteration 0 samples TMAS's plain generation prompt (as every method here does); each later iteration sends
trajectory i's previous solution back to the model (role ``refiner``), which reviews it and writes an improved one.
The paper's feedback and refine steps are one call here (a "## Feedback" section, then the solution under a
"## Solution" heading, whose answer alone is read: ``parse_refinement``): see docs/baselines.md. A trajectory whose
last call failed or wrote no text (noted in the record) starts afresh from the generation prompt. A prompt a
trajectory sends again (the generation prompt afresh, a held solution to refine again) goes with a new seed where one
is configured (``tmas.methods.reasked``). A refinement
without an answer never silently replaces an answered solution (``answer_reminder``, ``answer_fallback``): the
trajectory holds that solution on, and it votes in the iteration in place of the reply (``meta.carried_from``).
A budget stop that cuts an iteration short keeps the refinements that came back; a trajectory whose refinement it
refused holds its solution of the iteration before, and votes with it there (``IterationRecord.held_over``), so the
few refinements that came back do not outvote the trajectories the stop left standing. A refinement that echoed its
instructions, whose retry the budget refused, is recorded (unusable, ``meta.retry_refused``), and its trajectory holds
its solution on as well, voting with it in the reply's place (``meta.carried_from``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from tmas.agents.baselines import parse_refinement, self_refine_prompt
from tmas.agents.solution import generation_prompt, parse_section
from tmas.methods.base import (
    Candidate,
    CandidateMeta,
    Iterations,
    Method,
    MethodParams,
    ProblemResult,
    ProblemSession,
    gather_all,
)
from tmas.methods.call_count import CallCount, Instead, asked_again, count_calls
from tmas.methods.reasked import Reasked
from tmas.methods.state import FallbackState, MethodState
from tmas.methods.steps import (
    Chosen,
    carry,
    close_iteration,
    finish,
    hold,
    holds_previous,
    keeps_previous,
    notes_for,
    solve_call,
)
from tmas.methods.style_params import StyledParams
from tmas.methods.traits import Traits


class SelfRefineParams(StyledParams):
    style_roles: ClassVar[tuple[str, ...]] = ("solution", "refiner")
    iterations: Iterations = 20
    # Parallel trajectories (paper: 8).
    n: int = Field(default=8, ge=1, le=256)
    # Beyond the paper: a refinement with no extractable answer is asked once more with a reminder of the
    # required output; one still without an answer does not replace its trajectory's answered solution, and when the
    # last iteration has no answer, the latest earlier answer is returned, recorded as a fallback.
    answer_reminder: bool = True
    answer_fallback: bool = True


class SelfRefine(Method[SelfRefineParams]):
    name: ClassVar[str] = "self_refine"
    traits: ClassVar[Traits] = Traits(roles=("solution", "refiner"))
    example_params: ClassVar[dict[str, Any] | None] = {"n": 1, "iterations": 2}
    # The setting the TMAS paper ran this baseline with (4.1, A.3).
    paper_settings: ClassVar[dict[str, Any]] = {"n": 8}
    Params: ClassVar[type[MethodParams]] = SelfRefineParams
    # An iteration records the answer fallback it took, if any.
    State: ClassVar[type[MethodState]] = FallbackState
    embedded_defaults: ClassVar[dict[str, Any]] = {"n": 2, "iterations": 2, "style": "concise"}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        return ["Self-Refine"]

    def calls_per_problem(self) -> CallCount:
        """N solution calls in iteration 0, N refiner calls in each of the T - 1 later ones: N x T; each may be asked
        again once (an echo), a refinement (``answer_reminder``) once more. A trajectory whose last call failed or
        wrote no text sends a solution call (asked again once at most) in place of its refinement."""
        p = self.params
        roles = {"solution": p.n, "refiner": p.n * (p.iterations - 1)}
        reminded = {"refiner": roles["refiner"]} if p.answer_reminder else {}
        # A refinement is asked at most twice (an echo), three times with the reminder; a solution call twice.
        refining = 3 if p.answer_reminder else 2
        afresh = Instead(roles["refiner"], {"refiner": refining}, {"solution": 2})
        return count_calls(roles, again=asked_again(roles, reminded), instead=[afresh])

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p, mode, q = self.params, self.params.mode, session.problem.question
        # Trajectory i's latest solution; None before the first or after a failed call.
        latest: list[Candidate | None] = [None] * p.n
        # The iteration each latest solution was written in.
        written = [0] * p.n
        asked = Reasked()
        chosen = Chosen()
        for t in range(p.iterations):
            session.begin_iteration(t)

            async def step(i: int) -> Candidate | None:
                prev = latest[i]
                # A failed call, or a reply with no text (cut while it reasoned), leaves no attempt to improve.
                if prev is None or prev.error is not None or not prev.text.strip():
                    role, messages = "solution", generation_prompt(q, mode, p.style_of("solution"))
                    meta, remind, parse = CandidateMeta(prompt="generate"), False, parse_section
                else:
                    role, messages = "refiner", self_refine_prompt(q, mode, prev.text, p.style_of("refiner"))
                    meta, remind, parse = CandidateMeta(prompt="refine"), p.answer_reminder, parse_refinement
                # A prompt this trajectory sent before (started afresh, or a held solution refined again) goes with
                # a new seed where one is configured: the same one would draw the same unusable reply.
                return await solve_call(
                    session,
                    role,
                    messages,
                    index=i,
                    mode=mode,
                    meta=meta,
                    remind=remind,
                    parse=parse,
                    asked=asked,
                )

            stepped = await gather_all(step(i) for i in range(p.n))
            candidates = [c for c in stepped if c is not None]
            if not candidates:
                break
            # A trajectory whose refinement the budget refused holds its solution on, and votes with it.
            refused = [i for i, c in enumerate(stepped) if c is None and latest[i] is not None]
            notes = notes_for(candidates, mode) + [
                f"candidate {c.index}: no solution text; not sent to the refiner"
                for c in candidates
                if c.error is None and not c.text.strip()
            ]
            for c in candidates:
                previous = latest[c.index]
                if previous is not None and holds_previous(c, previous):
                    notes.append(hold(c, previous, written[c.index]))
                elif p.answer_fallback and previous is not None and keeps_previous(c, previous, mode):
                    notes.append(carry(c, previous, written[c.index]))
                else:
                    latest[c.index], written[c.index] = c, t
            # The majority of the solutions the trajectories hold (a carried one in place of the answerless reply, a
            # held-over one where the budget refused the refinement); without an answer there, of the latest earlier
            # round that has one.
            chosen = await close_iteration(
                session,
                candidates,
                FallbackState(),
                notes,
                planned=p.n,
                mode=mode,
                fallback=p.answer_fallback,
                fallback_from="latest",
                held_over=refused,
            )
            if session.budget_stop:
                break
        stopped = session.budget_stop is not None
        return finish(session, self.name, chosen.candidate, stopped=stopped, fallback=chosen.fallback)
