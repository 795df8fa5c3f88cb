"""RSE (TMAS paper 4.1 and A.3): each iteration's trajectories are distilled, without the reference answer, into an
experience bank of verified propositions and critical pitfalls, which the next iteration's samples see.

Per iteration t: N samples of the RSE solve prompt with the bank E_{t-1} injected (the plain problem while it is
empty); then each successful trajectory is distilled on its own (role ``distiller``, N calls in parallel) into
propositions and pitfalls; new items join the bank unless their embedding (role ``embedding``) has cosine similarity
>= ``dedup_threshold`` with an item of the same kind already there or added before them (``embedder``: the
``embedding`` role's endpoint, or ``local``, all-MiniLM-L6-v2 in process, for servers that serve no embeddings). The
bank keeps the newest ``bank_max`` items of each kind. The last iteration is not distilled: no later sample would read
the result.

The distiller sees the problem and one attempt (a trajectory with no text, cut while it reasoned, is not distilled);
the method never reads ``problem.answer``. When the embedding
endpoint fails, duplicates are judged by word-set Jaccard similarity instead, and the record says so.

The answer is the majority vote of the last iteration's samples. Beyond the paper (``answer_fallback``, default on):
when the last iteration holds no answered sample (numeric mode: none boxed an answer, or every call failed), the
answer is the vote over the samples of every earlier iteration, recorded as a fallback (the result's ``fallback``,
the iteration's ``state.answer_fallback`` and a note), as TMAS's (methods/selection.py, ``fallback_from = "all"``):
each iteration samples the problem afresh, none rewrites an earlier sample, so every earlier answer is a vote.
A prompt a sample index sends again (the prompt of the iteration before, where the distillations left the bank as it
was; a solution distilled again after an unreadable distillation) goes with a new seed where one is configured
(``tmas.methods.reasked``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from tmas.agents.baselines import (
    Distillation,
    distill_prompt,
    distillation_reply_model,
    parse_distillation,
    rse_solve_prompt,
)
from tmas.agents.echo import EchoGuard
from tmas.agents.output import AgentOutputError
from tmas.agents.solution import generation_prompt
from tmas.errors import LLMError
from tmas.llm.types import Completion, Message
from tmas.memory.embedders import LOCAL, LocalEmbedder
from tmas.memory.similarity import jaccard
from tmas.methods.base import (
    BudgetExhausted,
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
from tmas.methods.echo_retry import RetryRefused, chat_guarded, reply_to_read
from tmas.methods.reasked import Reasked
from tmas.methods.state import FallbackState, MethodState
from tmas.methods.steps import Chosen, close_iteration, finish, notes_for, solve_call
from tmas.methods.style_params import StyledParams
from tmas.methods.traits import Traits

KINDS = ("propositions", "pitfalls")


class RSEParams(StyledParams):
    # Runs from before the answer fallback existed answered from the last iteration alone.
    before_added: ClassVar[dict[str, Any]] = {"answer_fallback": False}
    iterations: Iterations = 20
    n: int = Field(default=8, ge=1, le=256)
    # Cosine similarity at or above which a new item is a duplicate (the RSE setting, about 0.85).
    dedup_threshold: float = Field(default=0.85, gt=0.0, le=1.0)
    # Where the vectors come from: the ``embedding`` role's /v1/embeddings, or all-MiniLM-L6-v2 in process.
    embedder: Literal["endpoint", "local"] = "endpoint"
    # Items of each kind one distillation may add, and the bank's cap per kind (oldest dropped first).
    items_per_trajectory: int = Field(default=4, ge=1, le=32)
    bank_max: int = Field(default=40, ge=1)
    # Beyond the paper: a last iteration without an answer answers with the vote of the earlier iterations' samples.
    answer_fallback: bool = True


class ExperienceBank(BaseModel):
    """RSE's bank: the verified propositions and the critical pitfalls distilled so far."""

    propositions: list[str] = Field(default_factory=list)
    pitfalls: list[str] = Field(default_factory=list)

    def items(self, kind: str) -> list[str]:
        return self.propositions if kind == "propositions" else self.pitfalls


class Distilled(BaseModel):
    """What an iteration's distillation did: the trajectories distilled, the items added, those dropped as
    duplicates (judged by ``similarity``: embeddings, or word-set Jaccard where they failed) and as the oldest past
    the cap, and how many trajectories' distillations a budget stop refused (0 in runs stored before it was
    counted)."""

    distilled: int
    added: int
    duplicates: int
    dropped_old: int
    similarity: str
    refused: int = 0


class RSEState(FallbackState):
    """The bank an iteration's samples saw, its distillation (none in the last iteration, or where the budget
    stopped it), the bank after it, and its answer fallback, if any."""

    bank_in: ExperienceBank = Field(default_factory=ExperienceBank)
    distill: Distilled | None = None
    bank: ExperienceBank = Field(default_factory=ExperienceBank)


@dataclass
class Merge:
    added: int = 0
    duplicates: int = 0
    dropped_old: int = 0
    similarity: str = "embedding"
    notes: list[str] = field(default_factory=list)


class RSE(Method[RSEParams]):
    name: ClassVar[str] = "rse"
    traits: ClassVar[Traits] = Traits(roles=("solution", "distiller", "embedding"))
    example_params: ClassVar[dict[str, Any] | None] = {"n": 1, "iterations": 2}
    # The setting the TMAS paper ran this baseline with (4.1, A.3).
    paper_settings: ClassVar[dict[str, Any]] = {"n": 8}
    Params: ClassVar[type[MethodParams]] = RSEParams
    State: ClassVar[type[MethodState]] = RSEState
    embedded_defaults: ClassVar[dict[str, Any]] = {"n": 2, "iterations": 2, "style": "concise"}

    def __init__(self, params: MethodParams) -> None:
        super().__init__(params)
        self._local: LocalEmbedder | None = None
        if self.params.embedder == LOCAL:
            from tmas.memory.minilm import package_model_dir

            package_model_dir()  # a missing weights package is a clear error before the first call
            self._local = LocalEmbedder()

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        return ["RSE"]

    def calls_per_problem(self) -> CallCount:
        """N x T solution calls and N x (T - 1) distiller calls (the last iteration is not distilled); its embedding
        requests are not chat calls."""
        p = self.params
        roles = {"solution": p.n * p.iterations, "distiller": p.n * (p.iterations - 1)}
        return count_calls(roles, again=asked_again(roles))

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p, q, mode = self.params, session.problem.question, self.params.mode
        bank = ExperienceBank()
        # The prompts each sample index sent (solution and distiller): one sent again goes with a new seed where one
        # is configured (a bank the distillations left as it was, a solution distilled again after an unreadable reply).
        asked = Reasked()
        chosen = Chosen()
        for t in range(p.iterations):
            session.begin_iteration(t)
            style = p.style_of("solution")
            if bank.propositions or bank.pitfalls:
                prompt, kind = rse_solve_prompt(q, mode, bank.propositions, bank.pitfalls, style), "with_bank"
            else:  # no experience yet: the first sample every method shares
                prompt, kind = generation_prompt(q, mode, style), "generate"
            drawn = await gather_all(self._sample(session, prompt, i, kind, asked) for i in range(p.n))
            candidates = [c for c in drawn if c is not None]
            if not candidates:
                break
            notes = notes_for(candidates, mode)
            state = RSEState(bank_in=bank.model_copy(deep=True))
            if not session.budget_stop and t < p.iterations - 1:
                bank, state.distill = await self._distill(session, candidates, bank, notes, asked)
            state.bank = bank.model_copy(deep=True)
            # The vote of this iteration's samples; without an answer here, of every earlier iteration's.
            chosen = await close_iteration(
                session, candidates, state, notes, planned=p.n, mode=mode, fallback=p.answer_fallback, previous=chosen
            )
            if session.budget_stop:
                break
        stopped = session.budget_stop is not None
        return finish(session, self.name, chosen.candidate, stopped=stopped, fallback=chosen.fallback)

    async def _sample(
        self, session: ProblemSession, prompt: list[Message], i: int, kind: str, asked: Reasked
    ) -> Candidate | None:
        """Sample i of an iteration, under a new seed where one is configured and sample i sent ``prompt`` before."""
        meta = CandidateMeta(prompt=kind)
        return await solve_call(session, "solution", prompt, index=i, mode=self.params.mode, meta=meta, asked=asked)

    async def _distill(
        self,
        session: ProblemSession,
        candidates: list[Candidate],
        bank: ExperienceBank,
        notes: list[str],
        asked: Reasked,
    ) -> tuple[ExperienceBank, Distilled]:
        """Distil every successful trajectory (in parallel) and merge what they found into a new bank."""
        p, q = self.params, session.problem.question

        shape = distillation_reply_model(session.max_tokens("distiller"), p.items_per_trajectory)

        def parse(r: Completion) -> Distillation:
            return parse_distillation(r.content, max_items=p.items_per_trajectory, truncated=r.truncated)

        def unreadable(r: Completion) -> str | None:
            if not r.ok:
                return f"call failed: {r.error}"
            try:
                parse(r)
            except AgentOutputError as exc:
                return str(exc)
            return None

        refused: list[int] = []  # the trajectories whose distillation the budget refused

        async def one(c: Candidate) -> Distillation | None:
            messages = distill_prompt(q, c.text, p.items_per_trajectory)
            guard = EchoGuard.of(messages)

            def echo_of(r: Completion) -> str | None:
                try:
                    dropped = parse(r).without_echoes(guard)[1]
                except AgentOutputError:
                    return None
                return f"{len(dropped)} item(s)" if dropped else None

            attempt = asked.attempt(c.index, "distiller", messages)
            try:
                guarded = await chat_guarded(
                    session, "distiller", messages, echo_of, sample=c.index, reply_model=shape, attempt=attempt
                )
            except RetryRefused as stop:
                # The first reply came back and was spent: read without its echoing items, as after an unusable
                # retry; the stop ends the problem after this iteration.
                guarded = stop.guarded
            except BudgetExhausted:
                refused.append(c.index)
                return None
            asked.add(c.index, "distiller", messages, 1 if guarded.echoed is None else 2)
            if guarded.refused is not None:
                notes.append(
                    f"distillation of candidate {c.index}: {guarded.first_echo} echoed the instructions; the budget"
                    f" refused its retry ({guarded.refused}); the first reply is used"
                )
            elif guarded.first_echo is not None:
                notes.append(
                    f"distillation of candidate {c.index}: {guarded.first_echo} echoed the instructions; asked again"
                )
            # A retry that failed or does not parse leaves the first reply, read without its echoing items below.
            reply, why = reply_to_read(guarded, unreadable)
            if why is not None and guarded.refused is None:
                if guarded.reply.ok:
                    session.tally("distiller").unusable += 1
                notes.append(f"distillation of candidate {c.index}: retry unusable ({why}); the first reply is used")
            if not reply.ok:
                notes.append(f"distillation of candidate {c.index} failed: {reply.error}")
                return None
            try:
                distilled, dropped = parse(reply).without_echoes(guard)
            except AgentOutputError as exc:
                session.tally("distiller").unusable += 1
                notes.append(f"distillation of candidate {c.index} unusable: {exc}")
                return None
            if dropped:
                notes.append(f"distillation of candidate {c.index}: dropped {'; '.join(dropped)[:300]}")
            return distilled

        # A trajectory with no text (cut while it reasoned) leaves no attempt to distil.
        attempts = [c for c in candidates if c.error is None and c.text.strip()]
        notes += [
            f"candidate {c.index}: no solution text; not distilled"
            for c in candidates
            if c.error is None and not c.text.strip()
        ]
        found = [d for d in await gather_all(one(c) for c in attempts) if d is not None]
        if refused:
            notes.append(
                f"{len(attempts) - len(refused)} of {len(attempts)} distillations came back before the budget stop;"
                " the bank takes theirs"
            )
        merge = Merge()
        new = bank.model_copy(deep=True)
        for kind in KINDS:
            proposed = [item for d in found for item in getattr(d, kind)]
            await self._merge(session, new.items(kind), proposed, merge)
        notes += merge.notes
        info = Distilled(
            distilled=len(found),
            added=merge.added,
            duplicates=merge.duplicates,
            dropped_old=merge.dropped_old,
            similarity=merge.similarity,
            refused=len(refused),
        )
        return new, info

    async def _merge(self, session: ProblemSession, items: list[str], proposed: list[str], merge: Merge) -> None:
        """Append each proposed item unless it is a near-duplicate of one already kept; then cap the list."""
        if not proposed:
            return
        p = self.params
        vectors: list[list[float]] | None = None
        if merge.similarity == "embedding":
            try:
                texts = [*items, *proposed]
                vectors = await (self._local(texts) if self._local is not None else session.embed(texts))
            except LLMError as exc:
                merge.similarity = "jaccard"
                merge.notes.append(
                    f"embeddings unavailable ({exc}); duplicates judged by word-set Jaccard"
                    " (-p embedder=local judges them by all-MiniLM-L6-v2 in process)"
                )
        before = len(items)
        kept_vectors = vectors[:before] if vectors is not None else []
        for j, item in enumerate(proposed):
            if vectors is not None:
                vec = vectors[before + j]
                duplicate = any(_cosine(vec, other) >= p.dedup_threshold for other in kept_vectors)
            else:
                duplicate = any(jaccard(item, other) >= p.dedup_threshold for other in items)
            if duplicate:
                merge.duplicates += 1
                continue
            items.append(item)
            if vectors is not None:
                kept_vectors.append(vec)
            merge.added += 1
        if len(items) > p.bank_max:
            merge.dropped_old += len(items) - p.bank_max
            del items[: len(items) - p.bank_max]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=False))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
