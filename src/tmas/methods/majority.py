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
  stopped run drew are the first ones a fixed run draws (same requests, same seeds). Under a configured seed, sample
  ``i`` of iteration ``t`` goes with seed + t·k + i: every sample of the prompt its own, as MV@(k(t+1)) draws them;
- ``online_stop`` (DeepConf's online mode: methods/online_stop.py): the problem's first ``warmup`` samples run to
  their end and set a confidence threshold; each later sample streams under a watch and is stopped once its running
  group confidence falls below it, and does not vote. The samples are drawn in batches that never mix warm-up and
  watched samples (the first batch ends where the warm-up does); each iteration's ``state["online_stop"]`` and the
  result count the samples stopped and the completion tokens that saved.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from tmas.agents.solution import generation_prompt
from tmas.config import Sampling
from tmas.llm.types import Message
from tmas.methods.base import (
    Candidate,
    CandidateMeta,
    Method,
    MethodParams,
    ProblemResult,
    ProblemSession,
    gather_all,
)
from tmas.methods.call_count import CallCount, asked_again, count_calls
from tmas.methods.confidence_params import note_missing_confidence
from tmas.methods.online_stop import (
    ONLINE_STOP_NOTICE,
    WARMUP,
    WATCHED,
    OnlineStop,
    OnlineStopParams,
    OnlineStopRecord,
)
from tmas.methods.selection import ConfidenceRule, select
from tmas.methods.state import MethodState
from tmas.methods.steps import budget_note, finish, notes_for, solve_call
from tmas.methods.stopping import BETA_THRESHOLD, VoteStop, beta_vote_stop, fewest_votes_to_stop
from tmas.methods.style_params import StyledParams
from tmas.methods.traits import Traits

# The reason a decided vote gives as the problem's ``stopped_reason``.
VOTE_DECIDED = "vote decided (Beta stopping criterion)"


class MajorityParams(StyledParams, OnlineStopParams):
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
    proof_refused: ClassVar[str | None] = (
        "a majority vote counts equal final answers and no two proofs are counted equal, so it would return"
        " the first of its k proofs: mode=proof does not apply to it; cot writes one proof, verify_refine and"
        " tmas choose among proofs by verifier score"
    )


class VoteStopRecord(BaseModel):
    """What an iteration's record says of the stopping rule (``stop = "beta"``): the samples drawn of k, the
    criterion's reading (the leader's and the runner-up's votes, the probability the leader stays ahead), whether it
    stopped the problem, and why the iteration ended, in words."""

    rule: Literal["beta"] = "beta"
    drawn: int
    k: int
    leading: int
    runner_up: int
    probability: float
    stopped: bool
    reason: str


class MajorityState(MethodState):
    """An iteration's vote: the samples drawn so far, the ten leading answers' votes (by answer class), and where
    set, the Beta stop's record and online stopping's."""

    samples: int = 0
    votes: dict[str, int] = Field(default_factory=dict)
    stop: VoteStopRecord | None = None
    online_stop: OnlineStopRecord | None = None


class MajorityVote(Method[MajorityParams]):
    name: ClassVar[str] = "majority"
    traits: ClassVar[Traits] = Traits(frontier="votes", samples="k")
    example_params: ClassVar[dict[str, Any] | None] = {"k": 2}
    # The setting the TMAS paper ran this baseline with (4.1, A.3).
    paper_settings: ClassVar[dict[str, Any]] = {"k": 64, "iterations": 1}
    Params: ClassVar[type[MethodParams]] = MajorityParams
    State: ClassVar[type[MethodState]] = MajorityState
    embedded_defaults: ClassVar[dict[str, Any]] = {"k": 4, "style": "concise"}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        return ["MV@64"]

    def calls_per_problem(self) -> CallCount:
        """k x T solution calls (MV@k is k samples; each further iteration draws k more). With ``stop = "beta"``
        that is the most; the fewest is the first round end at which enough agreeing samples can decide the vote
        (4 at the 0.95 threshold, so one round of 4), the problem stopping there (with ``online_stop`` a round also
        ends where the warm-up does). ``online_stop`` leaves the calls as they are and makes their tokens a range:
        at the fewest, every sample after the ``warmup`` ones is stopped as soon as it can be, once
        ``confidence_window`` tokens arrived."""
        p = self.params
        most = p.k * p.iterations
        again = asked_again({"solution": most})
        samples, count = most, count_calls({"solution": most}, again=again)
        if p.stop == "beta":
            warmup = p.warmup if p.online_stop else 0
            samples = fewest_samples(p.k, p.iterations, p.round_size, fewest_votes_to_stop(p.stop_threshold), warmup)
            if samples < most:
                note = f"stop=beta: from {samples} samples (a decided vote) to k x T (Adaptive-Consistency)"
                count = count_calls(
                    {"solution": most}, note, upper={"solution": most}, fewest={"solution": samples}, again=again
                )
        if p.online_stop and samples > p.warmup:
            count.stoppable, count.stoppable_tokens = {"solution": samples - p.warmup}, p.confidence_window
            note = (
                f"online_stop: the samples after the first {p.warmup} may stop once {p.confidence_window} tokens"
                " arrived (DeepConf)"
            )
            count.note = "; ".join(filter(None, [count.note, note]))
        return count

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p, mode = self.params, self.params.mode
        messages = generation_prompt(session.problem.question, mode, p.style_of("solution"))
        pool: list[Candidate] = []
        decided: VoteStop | None = None
        online = OnlineStop.of(p) if p.online_stop else None
        for t in range(p.iterations):
            session.begin_iteration(t)
            candidates, drawn, decided = await self._draw(session, messages, pool, online)
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
            state = MajorityState(samples=len(pool), votes=dict(Counter(keys).most_common(10)))
            if p.stop == "beta":
                reading = decided or beta_vote_stop(keys, p.stop_threshold)
                state.stop = self._stop_record(session, drawn, reading, decided=decided is not None)
                if decided is not None:
                    notes.append(f"stopped: {state.stop.reason}")
            if online is not None:
                state.online_stop = online.record(candidates)
            session.end_iteration(candidates, chosen=chosen, state=state, notes=notes)
            if session.budget_stop or decided is not None:
                break
        chosen = select(pool, mode, p.select, await session.answer_classes(pool), p.confidence_vote())
        result = finish(session, self.name, chosen, stopped=session.budget_stop is not None)
        if decided is not None and result.stopped_reason is None:
            result.stopped_reason = VOTE_DECIDED
        if online is not None:
            stopped = [c for c in pool if c.meta.stopped_early]
            result.stopped_traces = len(stopped)
            result.stopped_tokens_saved = sum(online.saved(c) for c in stopped)
        return result

    async def _draw(
        self, session: ProblemSession, messages: list[Message], earlier: list[Candidate], online: OnlineStop | None
    ) -> tuple[list[Candidate], int, VoteStop | None]:
        """This iteration's samples: all k at once, or (``stop = "beta"``) rounds until the vote over ``earlier``
        and them is decided; with ``online``, a batch ends where the warm-up does, and the samples after it are
        watched. Returns the candidates, how many samples were drawn (those the budget refused are not), and the
        decision that stopped them."""
        p = self.params
        sampling = p.confidence_sampling(p.select)
        window = p.confidence_window if sampling is not None else None
        size = p.k if p.stop == "fixed" else p.round_size
        candidates: list[Candidate] = []
        asked = 0
        while asked < p.k:
            warming = online.warmup_left() if online is not None else 0
            indices = range(asked, min(asked + size, p.k, asked + (warming or p.k)))
            got = await gather_all(
                self._sample(session, messages, i, sampling, window, online, warming=warming > 0) for i in indices
            )
            asked = indices.stop
            finished = [c for c in got if c is not None]
            candidates += finished
            if online is not None and warming:
                if online.warmed(finished):
                    session.notice("online_stop", ONLINE_STOP_NOTICE)
                elif (short := online.short_warmup()) is not None:
                    session.notice("online_stop_window", short)
            if session.budget_stop:
                break
            if p.stop == "fixed":
                continue
            classes = await session.answer_classes([*earlier, *candidates])
            keys = [classes[c.answer] for c in (*earlier, *candidates) if c.answer and c.error is None]
            decision = beta_vote_stop(keys, p.stop_threshold)
            if decision.stop:
                return candidates, len(candidates), decision
        return candidates, len(candidates), None

    def _sample(
        self,
        session: ProblemSession,
        messages: list[Message],
        index: int,
        sampling: Sampling | None,
        window: int | None,
        online: OnlineStop | None,
        *,
        warming: bool,
    ) -> Awaitable[Candidate | None]:
        """Sample ``index``: a warm-up sample of online stopping runs to its end, a later one is watched (where the
        warm-up set a threshold)."""
        watch = online.watch() if online is not None and not warming else None
        kind = WARMUP if warming else WATCHED if watch is not None else None
        return solve_call(
            session,
            "solution",
            messages,
            index=index,
            mode=self.params.mode,
            sampling=sampling,
            # The iteration's samples continue the earlier ones' numbering for a configured seed (the same prompt).
            draw=session.iteration * self.params.k + index,
            confidence_window=window,
            watch=watch,
            meta=CandidateMeta(online_stop=kind),
        )

    def _stop_record(self, session: ProblemSession, drawn: int, decision: VoteStop, *, decided: bool) -> VoteStopRecord:
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
        return VoteStopRecord(
            drawn=drawn,
            k=p.k,
            leading=decision.leading,
            runner_up=decision.runner_up,
            probability=decision.probability,
            stopped=decided,
            reason=reason,
        )


def fewest_samples(k: int, iterations: int, round_size: int, votes: int, warmup: int = 0) -> int:
    """The fewest samples after which the Beta stop can end a problem: the first round end (rounds of
    ``round_size`` within each iteration's k, a round also ending where the ``warmup`` samples do) with at least
    ``votes`` samples drawn; k x T when none."""
    drawn = 0
    for _ in range(iterations):
        asked = 0
        while asked < k:
            warming = max(0, warmup - drawn)
            end = min(asked + round_size, k, asked + (warming or k))
            drawn, asked = drawn + end - asked, end
            if drawn >= votes:
                return drawn
    return k * iterations
