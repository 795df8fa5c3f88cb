"""Votes grouped as the run's methods and ``tmas report`` group them: answers of equal value are one answer.

The methods count votes by answer class (tmas.answer_classes): spelling and exact numbers first, then the grading
rules' equivalence (Math-Verify) between the few keys left. MV@k on the run and comparison pages counts votes the same
way, with the same function. Math-Verify runs in worker processes and can take a while on a big run, so the problems
that need it are grouped in a background thread: until a problem's groups are known its MV@k counts by spelling and
exact numbers (:func:`tmas.answer_classes.value_key`), its page says how many are still being grouped, and the run's
change marker moves when they are done (live pages reload). A problem whose answers need no rule check (all plain
numbers, or a single key) is grouped at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

from tmas.answer_classes import EquivalenceCheck, answer_classes, asks_check, value_key
from tmas.store.records import ProblemResult

# Per problem: answer -> the key of its class (tmas.reports.metrics.answer_classes_of).
Classes = dict[str, dict[str, str]]
Answers = tuple[str | None, ...]


def _answers(result: ProblemResult) -> Answers:
    """The answers a problem's votes group (every candidate of every iteration, as ``tmas report`` groups them)."""
    return tuple(c.answer for record in result.iterations for c in record.candidates)


def _rule_check() -> EquivalenceCheck | None:
    from tmas.answer_rules import RuleEquivalence, math_verify_installed

    return RuleEquivalence() if math_verify_installed() else None


class VoteClasses:
    """Per run directory and problem, its answers' classes, worked out in one background thread. ``check`` makes the
    equivalence check a batch of problems is grouped with (None: spelling and exact numbers alone)."""

    def __init__(self, check: Callable[[], EquivalenceCheck | None] = _rule_check) -> None:
        self._check = check
        self._lock = threading.Condition()
        self._done: dict[tuple[Path, str], tuple[Answers, dict[str, str]]] = {}
        self._queue: dict[tuple[Path, str], Answers] = {}
        self._versions: dict[Path, int] = {}
        self._worker: threading.Thread | None = None

    def classes(self, run_dir: Path, results: list[ProblemResult]) -> tuple[Classes, int]:
        """The classes of the problems whose grouping is known, and how many problems are still being grouped (they
        are queued; their MV@k meanwhile groups by :func:`value_key`)."""
        run_dir = run_dir.resolve()
        out: Classes = {}
        pending = 0
        with self._lock:
            for result in results:
                slot = (run_dir, result.problem_id)
                answers = _answers(result)
                hit = self._done.get(slot)
                if hit is not None and hit[0] == answers:
                    out[result.problem_id] = hit[1]
                elif not asks_check(answers):
                    out[result.problem_id] = {a: value_key(a) for a in answers if a is not None}
                else:
                    self._queue[slot] = answers
                    pending += 1
            if pending and self._worker is None:
                self._worker = threading.Thread(target=self._work, name="tmas-view-votes", daemon=True)
                self._worker.start()
        return out, pending

    def version(self, run_dir: Path) -> int:
        """How many of the run's groupings have been worked out: part of its change marker, so pages reload."""
        with self._lock:
            return self._versions.get(run_dir.resolve(), 0)

    def wait(self) -> None:
        """Until every queued problem is grouped."""
        with self._lock:
            self._lock.wait_for(lambda: self._worker is None)

    def _work(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._drain())
        finally:
            loop.close()
            with self._lock:  # where the drain failed: the next page asking starts another worker
                if self._worker is threading.current_thread():
                    self._worker = None
                    self._lock.notify_all()

    async def _drain(self) -> None:
        check = self._check()
        try:
            while True:
                with self._lock:
                    if not self._queue:
                        # Done, in the same hold of the lock as the last look at the queue: a problem queued later
                        # starts a new worker.
                        self._worker = None
                        self._lock.notify_all()
                        return
                    slot, answers = next(iter(self._queue.items()))
                    del self._queue[slot]
                try:
                    classes = await answer_classes(answers, check)
                except Exception:  # a broken rule check: this problem keeps its spelling-and-value groups
                    classes = {a: value_key(a) for a in answers if a is not None}
                with self._lock:
                    self._done[slot] = (answers, classes)
                    self._versions[slot[0]] = self._versions.get(slot[0], 0) + 1
        finally:
            close = getattr(check, "aclose", None)
            if close is not None:
                await close()
