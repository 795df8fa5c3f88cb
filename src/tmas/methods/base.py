"""The interface every method shares, and the records it emits.

A method runs one problem for T iterations and emits one :class:`IterationRecord` per iteration with every candidate,
its extracted answer, its score and its token cost, so evaluation, budgets, reports and the viewer treat every
method the same way.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tmas.config import Sampling
from tmas.llm.client import LLMClient
from tmas.llm.types import CallKey, Completion, Message, Usage
from tmas.problems import Problem
from tmas.store.run_store import RunStore


class Candidate(BaseModel):
    index: int
    text: str
    answer: str | None = None
    # Method's own score of the candidate (TMAS: mean verifier score); None when the method has none.
    score: float | None = None
    call_id: int | None = None
    usage: Usage = Field(default_factory=Usage)
    finish_reason: str | None = None
    error: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class IterationRecord(BaseModel):
    problem_id: str
    iteration: int
    candidates: list[Candidate]
    # The answer the method would return if it stopped after this iteration.
    selected: str | None = None
    # Every call of the iteration, all roles.
    calls: int = 0
    failed_calls: int = 0
    usage: Usage = Field(default_factory=Usage)
    # Method state after the iteration (e.g. TMAS's experience and guideline banks).
    state: dict[str, Any] = Field(default_factory=dict)
    # Bad agent outputs that were handled, truncations, and other things worth knowing.
    notes: list[str] = Field(default_factory=list)


class ProblemResult(BaseModel):
    problem_id: str
    method: str
    answer: str | None = None
    text: str = ""
    status: str = "done"
    error: str | None = None
    stopped_reason: str | None = None
    iterations: list[IterationRecord] = Field(default_factory=list)
    calls: int = 0
    failed_calls: int = 0
    usage: Usage = Field(default_factory=Usage)


class MethodParams(BaseModel):
    """Base of each method's parameters; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(default=1, ge=1)
    mode: str = Field(default="numeric", pattern="^(numeric|proof)$")


class ProblemSession:
    """What a method sees of the run while it solves one problem: calls (cached and stored), iteration bookkeeping."""

    def __init__(
        self,
        problem: Problem,
        llm: LLMClient,
        store: RunStore | None,
        *,
        seed: int = 0,
        active: dict[str, int] | None = None,
    ) -> None:
        self.problem = problem
        self.llm = llm
        self.store = store
        # The run seed: methods derive their random draws and each call's sampling seed from it.
        self.seed = seed
        # Shared with the progress display: problem id -> iteration it is in.
        self._active = active
        self.iteration = 0
        self._iteration_calls = 0
        self._iteration_failed = 0
        self._iteration_usage = Usage()
        self.records: list[IterationRecord] = []

    async def chat(
        self,
        role: str,
        messages: Sequence[Message],
        *,
        sample: int = 0,
        sampling: Sampling | None = None,
    ) -> Completion:
        key = CallKey(problem_id=self.problem.problem_id, role=role, sample=sample, iteration=self.iteration)
        if self.llm.route(role).sampling.merged(sampling).seed is None:
            # A distinct, reproducible seed per call: parallel samples of one prompt differ, and a rerun with the
            # same run seed asks the same questions (servers that honour `seed`, e.g. vLLM, answer the same too).
            sampling = (sampling or Sampling()).merged(Sampling(seed=self.derive_seed("call", role, sample)))
        completion = await self.llm.chat(role, messages, key=key, sampling=sampling)
        self._iteration_calls += 1
        self._iteration_usage = self._iteration_usage + completion.usage
        if not completion.ok:
            self._iteration_failed += 1
        return completion

    def derive_seed(self, *parts: object) -> int:
        """A 31-bit seed fixed by the run seed, the problem, the current iteration and ``parts``."""
        raw = repr((self.seed, self.problem.problem_id, self.iteration, *parts)).encode()
        return int.from_bytes(hashlib.sha256(raw).digest()[:4], "big") >> 1

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        if self._active is not None:
            self._active[self.problem.problem_id] = iteration
        self._iteration_calls = 0
        self._iteration_failed = 0
        self._iteration_usage = Usage()

    def end_iteration(
        self,
        candidates: list[Candidate],
        *,
        selected: str | None,
        state: dict[str, Any] | None = None,
        notes: list[str] | None = None,
    ) -> IterationRecord:
        record = IterationRecord(
            problem_id=self.problem.problem_id,
            iteration=self.iteration,
            candidates=candidates,
            selected=selected,
            calls=self._iteration_calls,
            failed_calls=self._iteration_failed,
            usage=self._iteration_usage,
            state=state or {},
            notes=notes or [],
        )
        self.records.append(record)
        if self.store is not None:
            self.store.save_iteration(self.problem.problem_id, self.iteration, record.model_dump(mode="json"))
        return record

    def result(self, method: str, *, answer: str | None, text: str, stopped_reason: str | None = None) -> ProblemResult:
        usage = Usage()
        for record in self.records:
            usage = usage + record.usage
        return ProblemResult(
            problem_id=self.problem.problem_id,
            method=method,
            answer=answer,
            text=text,
            stopped_reason=stopped_reason,
            iterations=self.records,
            calls=sum(r.calls for r in self.records),
            failed_calls=sum(r.failed_calls for r in self.records),
            usage=usage,
        )


class Method(ABC):
    """A test-time scaling method. Subclasses set ``name`` and ``Params`` and implement :meth:`solve`."""

    name: ClassVar[str]
    Params: ClassVar[type[MethodParams]] = MethodParams

    def __init__(self, params: MethodParams) -> None:
        self.params = params

    @abstractmethod
    async def solve(self, session: ProblemSession) -> ProblemResult:
        """Solve ``session.problem``; every LLM call goes through ``session.chat``."""
