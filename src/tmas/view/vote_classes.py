"""Answers grouped by value for the viewer's majority votes (MV, MV@k), as ``tmas report`` groups them: by the
grading rules' equivalence (Math-Verify, ``tmas.answer_rules.RuleEquivalence``) where it is installed, so
``\\frac{\\sqrt{2}}{2}`` and ``\\frac{1}{\\sqrt{2}}`` are one vote in both.

Each pair of answers is checked once per run (the caller keeps what was found); Math-Verify's workers start only
where a pair not checked before is met, so a run whose answers are plain numbers never starts them, and a live run's
page rebuilt after each iteration checks only its new answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tmas.answer_classes import EquivalenceCheck
from tmas.answer_rules import RuleEquivalence, math_verify_installed
from tmas.grading.grades import GradeConfig
from tmas.reports.metrics import answer_classes_of
from tmas.store.records import ProblemResult

T = TypeVar("T")

# Pairs of answers (in sorted order) -> whether they are equal.
Checked = dict[tuple[str, str], bool]


def vote_classes(results: list[ProblemResult], checked: Checked | None = None) -> dict[str, dict[str, str]] | None:
    """Per problem, each candidate answer -> the key of its class (:func:`tmas.reports.metrics.answer_classes_of`);
    None without Math-Verify (votes then group by spelling and exact numbers, as the report's do). ``checked``: the
    pairs checked so far (kept by the caller between calls), added to."""
    if not math_verify_installed():
        return None
    return _run(_classes(results, {} if checked is None else checked))


class _Remembered:
    """An equivalence that asks ``inner`` only of pairs not in ``checked``."""

    def __init__(self, inner: EquivalenceCheck, checked: Checked) -> None:
        self.inner = inner
        self.checked = checked

    async def equivalent(self, first: str, second: str) -> bool:
        pair = (first, second) if first <= second else (second, first)
        if pair not in self.checked:
            self.checked[pair] = await self.inner.equivalent(first, second)
        return self.checked[pair]


async def _classes(results: list[ProblemResult], checked: Checked) -> dict[str, dict[str, str]]:
    config = GradeConfig()  # the workers and the time bound tmas report checks with by default
    equivalence = RuleEquivalence(workers=config.workers, timeout_s=config.rule_timeout_s)
    try:
        return await answer_classes_of(results, _Remembered(equivalence, checked))
    finally:
        await equivalence.aclose()


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``coroutine`` run to its end from synchronous code: here (a page's worker thread has no event loop), or in a
    thread of its own where the caller's thread runs one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
