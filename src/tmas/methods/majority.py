"""Majority vote, MV@k (self-consistency; the TMAS paper's MV@64 baseline): k independent samples of the plain
solution prompt, and the most frequent answer wins, answers counted by value (``0.5`` and ``\\frac{1}{2}`` are one
answer: tmas.answer_classes); ties: the answer that came first.

Beyond the paper:

- with ``iterations`` > 1 each iteration draws k more samples and the vote runs over all samples drawn so far
  (MV@k(t+1)), so majority vote gets an accuracy-against-tokens curve like the iterative methods;
- ``select = "confidence_vote"`` / ``"filtered_vote"`` weigh or filter the votes by each sample's confidence
  (DeepConf, Fu et al. 2025: methods/selection.py, methods/confidence_params.py);
- ``stop = "beta"`` (Adaptive-Consistency, Aggarwal et al. 2023: methods/stopping.py) draws the samples in rounds of
  ``round_size`` and stops once the leading answer cannot be overtaken by the runner-up with probability
  ``stop_threshold``, never past k samples an iteration; a stop ends the problem. Each iteration's record says how
  many samples it drew and why it stopped (``state["stop"]``). The samples keep their indices, so the samples a
  stopped run drew are the first ones a fixed run draws (same requests, same seeds).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar, Literal

from pydantic import Field

from tmas.agents.solution import generation_prompt
from tmas.llm.types import Message
from tmas.methods.base import Candidate, Method, MethodParams, ProblemResult, ProblemSession, gather_all
from tmas.methods.candidates import budget_note, finish, notes_for, solve_call
from tmas.methods.confidence_params import ConfidenceParams, note_missing_confidence
from tmas.methods.selection import ConfidenceRule, select
from tmas.methods.stopping import BETA_THRESHOLD, VoteStop, beta_vote_stop
from tmas.methods.styled import StyledParams

# The reason a decided vote gives as the problem's ``stopped_reason``.
VOTE_DECIDED = "vote decided (Beta stopping criterion)"


class MajorityParams(StyledParams, ConfidenceParams):
    # Samples per iteration (paper: 64).
    k: int = Field(default=64, ge=1, le=1024)
    select: Literal["vote"] | ConfidenceRule = Field(
        default="vote",
        description="vote (plurality), confidence_vote or filtered_vote (DeepConf, Fu et al. 2025)",
    )
    stop: Literal["fixed", "beta"] = Field(
        default="fixed",
        description="fixed: k samples; beta: rounds until the leader cannot be overtaken with probability"
        " stop_threshold (Adaptive-Consistency, Aggarwal et al. 2023)",
    )
    stop_threshold: float = Field(
        default=BETA_THRESHOLD, gt=0.0, lt=1.0, description="stop=beta: P(leader stays ahead)"
    )
    round_size: int = Field(default=4, ge=1, le=1024, description="stop=beta: samples drawn together before a check")


class MajorityVote(Method[MajorityParams]):
    name: ClassVar[str] = "majority"
    Params: ClassVar[type[MethodParams]] = MajorityParams
    embedded_defaults: ClassVar[dict[str, Any]] = {"k": 4, "style": "concise"}

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p, mode = self.params, self.params.mode
        messages = generation_prompt(session.problem.question, mode, p.style_of("solution"))
        pool: list[Candidate] = []
        decided: VoteStop | None = None
        for t in range(p.iterations):
            session.begin_iteration(t)
            candidates, drawn, decided = await self._draw(session, messages, pool)
            if not candidates:
                break  # the budget refused every sample of this iteration: nothing to record
            pool += candidates
            classes = await session.answer_classes(pool)
            chosen = select(pool, mode, p.select, classes, p.confidence_vote())
            notes = notes_for(candidates, mode)
            if p.asks_confidence(p.select):
                note_missing_confidence(session, candidates, notes)
            if session.budget_stop:
                notes += budget_note(session, len(candidates), p.k)
            keys = [classes[c.answer] for c in pool if c.answer and c.error is None]
            state: dict[str, Any] = {"samples": len(pool), "votes": dict(Counter(keys).most_common(10))}
            if p.stop == "beta":
                reading = decided or beta_vote_stop(keys, p.stop_threshold)
                state["stop"] = self._stop_record(session, drawn, reading, decided=decided is not None)
                if decided is not None:
                    notes.append(f"stopped: {state['stop']['reason']}")
            session.end_iteration(candidates, selected=chosen.answer if chosen else None, state=state, notes=notes)
            if session.budget_stop or decided is not None:
                break
        chosen = select(pool, mode, p.select, await session.answer_classes(pool), p.confidence_vote())
        result = finish(session, self.name, chosen, stopped=session.budget_stop is not None)
        if decided is not None and result.stopped_reason is None:
            result.stopped_reason = VOTE_DECIDED
        return result

    async def _draw(
        self, session: ProblemSession, messages: list[Message], earlier: list[Candidate]
    ) -> tuple[list[Candidate], int, VoteStop | None]:
        """This iteration's samples: all k at once, or (``stop = "beta"``) rounds until the vote over ``earlier``
        and them is decided. Returns the candidates, how many samples were drawn (those the budget refused are not),
        and the decision that stopped them."""
        p, mode = self.params, self.params.mode
        sampling = p.confidence_sampling(p.select)
        window = p.confidence_window if sampling is not None else None
        size = p.k if p.stop == "fixed" else p.round_size
        candidates: list[Candidate] = []
        asked = 0
        while asked < p.k:
            indices = range(asked, min(asked + size, p.k))
            got = await gather_all(
                solve_call(
                    session, "solution", messages, index=i, mode=mode, sampling=sampling, confidence_window=window
                )
                for i in indices
            )
            asked = indices.stop
            candidates += [c for c in got if c is not None]
            if session.budget_stop or p.stop == "fixed":
                break
            classes = await session.answer_classes([*earlier, *candidates])
            keys = [classes[c.answer] for c in (*earlier, *candidates) if c.answer and c.error is None]
            decision = beta_vote_stop(keys, p.stop_threshold)
            if decision.stop:
                return candidates, len(candidates), decision
        return candidates, len(candidates), None

    def _stop_record(self, session: ProblemSession, drawn: int, decision: VoteStop, *, decided: bool) -> dict[str, Any]:
        """What the iteration record says of the stopping rule: samples drawn, the criterion's reading, and why the
        iteration ended (``decided``: the criterion stopped it; a budget stop is no decision, whatever the reading)."""
        p = self.params
        if decided:
            reason = (
                f"after {drawn} of {p.k} samples: the leader's {decision.leading} votes against the runner-up's"
                f" {decision.runner_up} stay ahead with probability {decision.probability:.3f} >= {p.stop_threshold:g}"
            )
        elif session.budget_stop:
            reason = f"the budget stopped sampling after {drawn} of {p.k} samples"
        else:
            reason = f"all {p.k} samples drawn (probability {decision.probability:.3f} < {p.stop_threshold:g})"
        return {
            "rule": "beta",
            "drawn": drawn,
            "k": p.k,
            "leading": decision.leading,
            "runner_up": decision.runner_up,
            "probability": decision.probability,
            "stopped": decided,
            "reason": reason,
        }
