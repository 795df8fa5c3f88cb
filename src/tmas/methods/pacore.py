"""PaCoRe, parallel coordinated reasoning (TMAS paper 4.1 and A.3; ``num_responses_per_round`` = 8 there).

Round 0 samples ``responses_per_round`` responses to TMAS's plain generation prompt. Every later round samples as
many again, each conditioned on the compact messages of *all* successful responses of the previous round: their
final conclusions (the end of the final content, reasoning left out), not their whole reasoning; a response with no
final content (cut while it reasoned) gives none. With ``synthesis``
a last round (iteration T, role ``synthesis``) writes ``synthesis_responses`` final solutions from the last round's
messages; the answer is theirs (majority among them).

Beyond the paper (``answer_fallback``, default on): when the last round, the synthesis included, holds no answered
response (numeric mode: none boxed an answer, or every call failed), the answer is the majority of the latest
earlier round that has one, recorded as a fallback (the result's ``fallback``, the round's ``state.answer_fallback``
and a note), as Self-Refine's (methods/selection.py, ``fallback_from = "latest"``): each round is written from the
one before it, so an older round must not outvote a newer one. Off, a synthesis without an answer leaves the problem
without one.

Each round is one iteration record; the synthesis round is one more, so T rounds give T + 1 records. A prompt a
response sends again (the plain prompt after a round with no successful response) goes with a new seed where one is
configured (``tmas.methods.reasked``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field

from tmas.agents.baselines import compact_message, pacore_round_prompt, pacore_synthesis_prompt
from tmas.agents.solution import generation_prompt
from tmas.llm.types import Message
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
from tmas.methods.call_count import CallCount, asked_again, count_calls
from tmas.methods.reasked import Reasked
from tmas.methods.state import FallbackState, MethodState
from tmas.methods.steps import Chosen, close_iteration, finish, notes_for, solve_call
from tmas.methods.style_params import StyledParams
from tmas.methods.traits import Traits


class PaCoReParams(StyledParams):
    style_roles: ClassVar[tuple[str, ...]] = ("solution", "synthesis")
    # Runs from before the answer fallback existed answered from the last round alone.
    before_added: ClassVar[dict[str, Any]] = {"answer_fallback": False}
    iterations: Iterations = 20
    # Parallel responses per round (paper: num_responses_per_round = 8).
    responses_per_round: int = Field(default=8, ge=1, le=256)
    # A final synthesis round after the T parallel rounds.
    synthesis: bool = True
    synthesis_responses: int = Field(default=1, ge=1, le=64)
    # Longest compact message, in characters (cut from the start: the conclusion is at the end). None: the whole
    # final content, as PaCoRe's official implementation passes it (the paper's setting).
    message_chars: int | None = Field(default=1500, ge=100)
    # Beyond the paper: a last round without an answer answers with the latest earlier round that has one.
    answer_fallback: bool = True


class PaCoReState(FallbackState):
    """A round's record: which round (its index, or the synthesis), how many compact messages it was given, and its
    answer fallback, if any."""

    round: int | Literal["synthesis"] = 0
    messages_in: int = 0


class PaCoRe(Method[PaCoReParams]):
    name: ClassVar[str] = "pacore"
    traits: ClassVar[Traits] = Traits(roles=("solution", "synthesis"))
    example_params: ClassVar[dict[str, Any] | None] = {"responses_per_round": 1, "iterations": 1}
    # The setting the TMAS paper ran this baseline with (4.1, A.3).
    paper_settings: ClassVar[dict[str, Any]] = {"responses_per_round": 8, "message_chars": None}
    Params: ClassVar[type[MethodParams]] = PaCoReParams
    State: ClassVar[type[MethodState]] = PaCoReState
    embedded_defaults: ClassVar[dict[str, Any]] = {"responses_per_round": 2, "iterations": 2, "style": "concise"}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        return ["PaCoRe"]

    def calls_per_problem(self) -> CallCount:
        """R x T solution calls (R responses per round), plus the synthesis round's S calls when ``synthesis``."""
        p = self.params
        roles = {"solution": p.responses_per_round * p.iterations, "synthesis": p.synthesis_responses * p.synthesis}
        return count_calls(roles, again=asked_again(roles))

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p, q, mode = self.params, session.problem.question, self.params.mode
        messages: list[str] = []  # the compact messages of the previous round
        asked = Reasked()
        chosen = Chosen()
        rounds = p.iterations + (1 if p.synthesis else 0)
        for t in range(rounds):
            session.begin_iteration(t)
            synthesis = p.synthesis and t == p.iterations
            if synthesis:
                role, count, kind = "synthesis", p.synthesis_responses, "synthesis"
                style = p.style_of(role)
                prompt: list[Message] = pacore_synthesis_prompt(q, mode, messages, style) if messages else []
                if not prompt:  # nothing to synthesise from: a plain sample is the honest substitute
                    prompt, kind = generation_prompt(q, mode, style), "generate"
            else:
                role, count = "solution", p.responses_per_round
                kind, style = ("round" if messages else "generate"), p.style_of(role)
                prompt = (
                    pacore_round_prompt(q, mode, messages, style) if messages else generation_prompt(q, mode, style)
                )
            drawn = await gather_all(self._respond(session, role, prompt, i, kind, asked) for i in range(count))
            candidates = [c for c in drawn if c is not None]
            if not candidates:
                break
            notes = notes_for(candidates, mode)
            if kind == "generate" and t > 0:
                notes.append("no response of the previous round wrote a conclusion: sampled without messages")
            # The majority of this round; without an answer here, of the latest earlier round that has one.
            chosen = await close_iteration(
                session,
                candidates,
                PaCoReState(round="synthesis" if synthesis else t, messages_in=len(messages)),
                notes,
                planned=count,
                mode=mode,
                fallback=p.answer_fallback,
                fallback_from="latest",
                previous=chosen,
            )
            if session.budget_stop:
                break
            # A response with no final content (cut while it reasoned) has no conclusion to pass on.
            compact = (compact_message(c.text, p.message_chars) for c in candidates if c.error is None)
            messages = [m for m in compact if m]
        stopped = session.budget_stop is not None
        return finish(session, self.name, chosen.candidate, stopped=stopped, fallback=chosen.fallback)

    async def _respond(
        self, session: ProblemSession, role: str, prompt: list[Message], i: int, kind: str, asked: Reasked
    ) -> Candidate | None:
        """Response i of a round. A prompt response i sent before (the plain prompt again after a round with no
        successful response) goes with a new seed where one is configured: the same one would draw the same reply."""
        meta = CandidateMeta(prompt=kind)
        return await solve_call(session, role, prompt, index=i, mode=self.params.mode, meta=meta, asked=asked)
