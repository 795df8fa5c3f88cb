"""Synchronous rule checks made off the main thread (a trainer's reward function on a thread pool): Math-Verify's
alarms work only in a main thread, so such a check runs in a worker process with a deadline, and one that never
finishes is undecided while the next check is answered by a fresh worker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tmas.answer_rules as answer_rules
import tmas.grading.rules as grading_rules
from tmas.answer_rules import RuleVerdict, RuleWorkerError, check_pair_bounded
from tmas.answer_rules import check_pair as real_check_pair
from tmas.grading.grades import Item
from tmas.grading.registry import grader_named
from tmas.grading.rules import RULES, RulesGrader
from tmas.problems import Problem
from tmas.rl.scoring import RolloutInput, score_rollouts

# An answer whose comparison with a number holds SymPy (and the interpreter) for minutes without Math-Verify's alarms.
TOWER = "3^{10^{8}}"
# Far beyond any check that ends: only a check that never ends runs into it.
GENEROUS_S = 120.0


def never_done(gold: str, pred: str, timeout_s: int | None, any_order: bool) -> RuleVerdict:
    """A check that never ends (in the worker process, where the test's patch sends it by name)."""
    threading.Event().wait()
    raise AssertionError("unreachable")


def stuck_on_tower(gold: str, pred: str, timeout_s: int | None, any_order: bool) -> RuleVerdict:
    """The rules, except that an answer of :data:`TOWER` never ends."""
    if pred == TOWER:
        threading.Event().wait()
    return real_check_pair(gold, pred, timeout_s, any_order)


def exits_at_once(conn: Any) -> None:
    """A worker that exits before taking a check (as one whose spawn ran an unguarded main module and failed)."""
    raise SystemExit(3)


def patch_check(monkeypatch: pytest.MonkeyPatch, check: Callable[..., RuleVerdict]) -> None:
    monkeypatch.setattr(answer_rules, "check_pair", check)
    # Where the grader called the check in its own thread.
    monkeypatch.setattr(grading_rules, "check_pair", check, raising=False)


def in_a_thread(work: Callable[[], Any]) -> Any:
    """``work()``'s result, run on a thread that is not the main one; fails where it does not end."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    thread.join(GENEROUS_S)
    assert not thread.is_alive(), "the check never ended"
    return out[0]


@pytest.fixture(autouse=True)
def no_worker() -> Iterator[None]:
    answer_rules._stop_worker()
    yield
    answer_rules._stop_worker()


def item(gold: str, answer: str) -> Item:
    problem = Problem(problem_id="p", question="Compute it.", answer=gold)
    return Item(("p", 0, 0), problem, answer, f"\\boxed{{{answer}}}")


def test_a_check_that_never_ends_is_undecided_off_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_check(monkeypatch, never_done)
    grader = RulesGrader(deadline_s=1)
    assert in_a_thread(lambda: grader.grade_one(item("5", TOWER))) is None
    verdict = in_a_thread(lambda: check_pair_bounded("5", TOWER, deadline_s=1))
    assert verdict == RuleVerdict(None, "timed out (over 1 s)")
    # The stuck worker was replaced: the next checks are answered (under a bound no real check runs into).
    monkeypatch.undo()
    grader = RulesGrader(deadline_s=GENEROUS_S)
    assert in_a_thread(lambda: grader.grade_one(item("\\frac{1}{2}", "0.5"))) is True
    assert in_a_thread(lambda: grader.grade_one(item("5", "6"))) is False


def test_the_real_tower_is_undecided_off_the_main_thread() -> None:
    # Math-Verify's alarms run in the worker's main thread: its comparison runs out of time, not the trainer.
    verdict = in_a_thread(lambda: check_pair_bounded("5", TOWER, timeout_s=1, deadline_s=GENEROUS_S))
    assert verdict.correct is None and "timed out" in verdict.detail


def test_checks_on_the_main_thread_start_no_worker() -> None:
    assert RulesGrader().grade_one(item("\\frac{1}{2}", "0.5")) is True
    assert answer_rules._worker is None


def test_a_batch_with_a_rollout_that_never_grades_scores_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_check(monkeypatch, stuck_on_tower)
    monkeypatch.setattr(grader_named(RULES), "deadline_s", 1)

    def rollout(answer: str) -> RolloutInput:
        completion = f"So the answer is \\boxed{{{answer}}}."
        return RolloutInput(task="normal", group="g", question="q", ground_truth="\\frac{1}{2}", completion=completion)

    scored = in_a_thread(lambda: score_rollouts([rollout("0.5"), rollout(TOWER), rollout("0.25"), rollout("1/2")]))
    # Undecided counts as wrong: never a reward for an answer the rules could not confirm.
    assert [(b.correct, b.reward) for b in scored] == [(True, 1.0), (False, -1.0), (False, -1.0), (True, 1.0)]


def test_a_worker_that_cannot_start_is_an_error_not_an_undecided_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every check would be undecided alike: rewards of -1 for every rollout would hide it.
    monkeypatch.setattr(answer_rules, "_serve", exits_at_once)

    def check() -> str:
        try:
            check_pair_bounded("\\frac{1}{2}", "0.5")
        except RuleWorkerError as exc:
            return str(exc)
        return "no error"

    message = in_a_thread(check)
    assert message.startswith("the rules worker process exited before taking a check (exit code 3)")
    assert answer_rules._worker is None
