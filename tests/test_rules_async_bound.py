"""The asyncio rules grader (tmas eval, tmas report, the votes of a run) bounds each check in a worker process: a
check that never ends is undecided and its worker killed and replaced, the other checks go on, and neither leaving the
grader nor cancelling it waits on a stuck worker."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from pathlib import Path

import pytest

import tmas.answer_rules as answer_rules
from conftest import eventually
from tmas.answer_rules import RuleChecker, RuleVerdict
from tmas.answer_rules import check_pair as real_check_pair

pytest.importorskip("math_verify")

# The answer the patched check never finishes on (the real rules give up on it by Math-Verify's alarms).
TOWER = "3^{10^{8}}"
# Far beyond any check that ends: only a grader held by a stuck worker runs into it.
GENEROUS_S = 120.0
# A stuck check's bound: long enough for a real check in a freshly started worker.
DEADLINE_S = 3


def stuck_on_tower(gold: str, pred: str, timeout_s: int | None, any_order: bool) -> RuleVerdict:
    """The rules, except that an answer of :data:`TOWER` never ends (in the worker, where the patch sends it by
    name); the reference names a file it creates first, so the test knows the worker took the check."""
    if pred == TOWER:
        Path(gold).touch()
        threading.Event().wait()
    return real_check_pair(gold, pred, timeout_s, any_order)


def marked(paths: list[str]) -> bool:
    """Whether every check of ``paths`` was taken by a worker."""
    return all(Path(path).exists() for path in paths)


async def test_a_check_that_never_ends_is_undecided_and_the_others_are_answered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(answer_rules, "check_pair", stuck_on_tower)
    stuck = [str(tmp_path / "a"), str(tmp_path / "b")]
    before = set(multiprocessing.active_children())
    async with asyncio.timeout(GENEROUS_S):
        async with RuleChecker(workers=2, timeout_s=1, deadline_s=DEADLINE_S) as checker:
            # A check in progress beside a stuck one is answered.
            first = await asyncio.gather(checker.check(stuck[0], TOWER), checker.check("\\frac{1}{2}", "0.5"))
            assert list(first) == [
                RuleVerdict(None, f"timed out (over {DEADLINE_S} s)"),
                real_check_pair("\\frac{1}{2}", "0.5"),
            ]
            # Two stuck checks held both workers: the checks after them are answered by fresh ones.
            both = await asyncio.gather(checker.check(stuck[1], TOWER), checker.check(stuck[0] + "c", TOWER))
            assert [v.correct for v in both] == [None, None]
            assert (await checker.check("5", "6")).correct is False
            assert (await checker.check("x+1", "1+x")).correct is True
    assert marked(stuck[:2])  # the stuck checks ran, in workers
    assert set(multiprocessing.active_children()) <= before


async def test_a_cancelled_grading_leaves_no_worker_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(answer_rules, "check_pair", stuck_on_tower)
    stuck = [str(tmp_path / "a"), str(tmp_path / "b")]
    before = set(multiprocessing.active_children())

    async def grade() -> None:
        async with RuleChecker(workers=2, timeout_s=1, deadline_s=GENEROUS_S) as checker:
            await asyncio.gather(*(checker.check(path, TOWER) for path in stuck))

    async with asyncio.timeout(GENEROUS_S):
        grading = asyncio.ensure_future(grade())
        await eventually(lambda: marked(stuck), tries=int(GENEROUS_S / 0.025))  # both workers are in their checks
        grading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await grading
    assert set(multiprocessing.active_children()) <= before
