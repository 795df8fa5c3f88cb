"""A run store that reports what it records: the proxy streams these reports to its clients as progress."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from tmas.llm.types import ChatRequest, Completion
from tmas.store.records import IterationRecord
from tmas.store.run_store import RunStore


class Progress(BaseModel):
    """One step of a request's run: a finished upstream call, or a finished iteration."""

    kind: str  # "call" or "iteration"
    iteration: int | None
    role: str | None = None
    calls: int  # upstream calls finished so far in this session (replayed ones are not calls)
    candidates: int  # solution candidates of the current iteration so far
    best_score: float | None = None  # best candidate score of the last finished iteration
    selected: str | None = None  # the answer the method would return now

    def line(self) -> str:
        """A line a chat client can show as reasoning."""
        if self.kind == "iteration":
            best = "-" if self.best_score is None else f"{self.best_score:.2f}"
            return (
                f"iteration {self.iteration} done: {self.candidates} candidates, best score {best},"
                f" leading answer {self.selected or '-'}"
            )
        plural = "" if self.candidates == 1 else "s"
        return f"iteration {self.iteration}: {self.role} call done ({self.candidates} candidate{plural} so far)"


class ObservedStore(RunStore):
    """A :class:`RunStore` that calls ``on_progress`` after each call and iteration it makes durable (and ``on_call``
    with each call)."""

    def __init__(
        self,
        run_dir: str | Path,
        on_progress: Callable[[Progress], None],
        *,
        create: bool = True,
        on_call: Callable[[Completion], None] | None = None,
    ) -> None:
        super().__init__(run_dir, create=create)
        self._on_progress = on_progress
        # Told of every call made durable here (the proxy's metrics); replayed calls are never recorded again.
        self._on_call = on_call
        self._calls = 0
        self._candidates: dict[int | None, int] = {}
        self._best: float | None = None
        self._selected: str | None = None

    def record_call(self, completion: Completion, request: ChatRequest) -> int:
        call_id = super().record_call(completion, request)
        if self._on_call is not None:
            self._on_call(completion)
        key = completion.key
        self._calls += 1
        if key.role == "solution" and completion.ok:
            self._candidates[key.iteration] = self._candidates.get(key.iteration, 0) + 1
        self._on_progress(
            Progress(
                kind="call",
                iteration=key.iteration,
                role=key.role,
                calls=self._calls,
                candidates=self._candidates.get(key.iteration, 0),
                best_score=self._best,
                selected=self._selected,
            )
        )
        return call_id

    def save_iteration(self, record: IterationRecord) -> None:
        super().save_iteration(record)
        scores = [c.score for c in record.candidates if c.score is not None]
        self._best = max(scores) if scores else None
        self._selected = record.selected
        self._on_progress(
            Progress(
                kind="iteration",
                iteration=record.iteration,
                calls=self._calls,
                candidates=len(record.candidates),
                best_score=self._best,
                selected=self._selected,
            )
        )
