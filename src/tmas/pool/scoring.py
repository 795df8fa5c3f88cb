"""The judge's calls for experience construction: individual scores s_{i,t} (Eq. 9) and turn objectives F_t(S)
(Eq. 17-18), each through the project's LLM client, so a build store replays them on a rebuild.

A teaching domain (education) scores a teacher's turn with appendix C.4.6's rubric (correctness, information gain,
relevance, clarity) against the question, the student's pre-test, the correct answer and the dialogue so far.

A reply that cannot be parsed (or a failed call) is retried with a new sample index (and a seed configured for
the judge changed, so a server that honours it answers anew); after ``retries`` retries
the score defaults to 0 (no credit for what could not be judged) and the reason is recorded with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from tmas.agents.output import AgentOutputError
from tmas.agents.utterance_judge import (
    JudgeScore,
    JudgeScoreReply,
    RoundView,
    RubricReply,
    TurnView,
    parse_judge_score,
    parse_rubric_score,
    teaching_score_prompt,
    turn_value_prompt,
    utterance_score_prompt,
)
from tmas.llm.model import ChatModel
from tmas.llm.sampling import retried
from tmas.llm.types import CallKey, Message
from tmas.pool.credit import Coalition
from tmas.pool.outcomes import AgentTurn, LabelledTranscript

JUDGE_ROLE = "judge"
# What a specialist outside the coalition "said" when a turn is re-run without it (Eq. 17's no-op).
NO_OP = "(silent this round: no contribution)"


@dataclass
class Judged:
    """A judge's verdict in [0, 1] and how it was reached."""

    value: float
    analysis: str = ""
    attempts: int = 0
    # Why the value is the default 0 rather than the judge's, when it is.
    defaulted: str | None = None
    call_ids: list[int] = field(default_factory=list)


def _view(turn: AgentTurn) -> TurnView:
    return TurnView(agent=turn.agent, specialty=turn.specialty, text=turn.text)


def history_before(turns: list[AgentTurn], turn: int) -> list[RoundView]:
    """H_{i,t}: the team's turns before turn ``turn``, round by round."""
    rounds: dict[int, list[TurnView]] = {}
    for t in turns:
        if t.turn < turn:
            rounds.setdefault(t.turn, []).append(_view(t))
    return [RoundView(number=n, turns=views) for n, views in sorted(rounds.items())]


class TurnJudge:
    """Asks the ``judge`` role; ``gate`` bounds the calls in flight (the client's own cap applies too)."""

    def __init__(self, llm: ChatModel, *, retries: int = 2, concurrency: int = 16) -> None:
        self.llm = llm
        self.retries = retries
        self._gate = asyncio.Semaphore(concurrency)
        # Calls sent to the endpoint, and calls answered from the store (a resumed or repeated build's).
        self.calls = 0
        self.replayed = 0

    async def _ask(
        self,
        messages: list[Message],
        key: CallKey,
        parse: Callable[..., JudgeScore] = parse_judge_score,
        reply_model: type[BaseModel] = JudgeScoreReply,
    ) -> Judged:
        judged = Judged(value=0.0)
        reasons: list[str] = []
        configured = self.llm.resolve_sampling(JUDGE_ROLE)
        for attempt in range(self.retries + 1):
            async with self._gate:
                completion = await self.llm.chat(
                    JUDGE_ROLE,
                    messages,
                    key=key.model_copy(update={"sample": attempt}),
                    sampling=retried(configured, attempt),
                    reply_model=reply_model,
                )
            if completion.replayed:
                self.replayed += 1
            else:
                self.calls += 1
            judged.attempts = attempt + 1
            if completion.call_id is not None:
                judged.call_ids.append(completion.call_id)
            if not completion.ok:
                reasons.append(f"call failed: {completion.error}")
                continue
            try:
                score = parse(completion.content, truncated=completion.truncated)
            except AgentOutputError as exc:
                reasons.append(str(exc))
                continue
            judged.value, judged.analysis = score.normalised, score.analysis
            return judged
        judged.defaulted = f"{judged.attempts} judge replies unusable ({reasons[-1]}); scored 0"
        return judged

    async def score_turn(self, case: LabelledTranscript, turns: list[AgentTurn], target: AgentTurn) -> Judged:
        """s_{i,t} (Eq. 9) of ``target``, judged against the earlier turns, the gold and the team's final answer
        (education: C.4.6's rubric against the pre-test, the correct answer and the dialogue so far)."""
        key = CallKey(problem_id=case.problem.problem_id, role=JUDGE_ROLE, iteration=target.turn)
        if case.domain.teaching:
            rubric = teaching_score_prompt(
                question=case.problem.question,
                gold=case.gold,
                view=case.teaching_view(target),
                target=_view(target),
                round_number=target.turn,
            )
            return await self._ask(rubric, key, parse_rubric_score, RubricReply)
        messages = utterance_score_prompt(
            question=case.problem.question,
            gold=case.gold,
            # A ranked list (medicine) is the team's answer whole, as its G reads it: a gold at rank 2 is no miss.
            final_answer="\n".join(f"[{i}] {name}" for i, name in enumerate(case.ranked, start=1))
            or case.transcript.final_answer,
            history=history_before(turns, target.turn),
            target=_view(target),
            round_number=target.turn,
            domain=case.transcript.domain,
        )
        return await self._ask(messages, key)

    async def turn_value(
        self, case: LabelledTranscript, turns: list[AgentTurn], turn: int, coalition: Coalition
    ) -> Judged:
        """F_t(S): turn ``turn`` re-judged with the specialists outside ``coalition`` replaced by a no-op.

        F_t of the empty coalition is 0 by definition (a round where nobody spoke makes no progress), which
        saves a call per turn and anchors Eq. 18's first marginal.
        """
        if not coalition:
            return Judged(value=0.0)
        views = [
            _view(t) if t.agent in coalition else TurnView(agent=t.agent, specialty=t.specialty, text=NO_OP)
            for t in turns
            if t.turn == turn
        ]
        messages = turn_value_prompt(
            question=case.problem.question,
            gold=case.gold,
            history=history_before(turns, turn),
            turn=RoundView(number=turn, turns=views),
            domain=case.transcript.domain,
        )
        key = CallKey(problem_id=case.problem.problem_id, role=JUDGE_ROLE, iteration=turn)
        return await self._ask(messages, key)
