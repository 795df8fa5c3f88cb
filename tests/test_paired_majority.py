"""A method against majority vote at the nearest completion-token budget (tmas.reports.paired), worked by hand, and
the per-problem values it reads from a run's frontier (tmas.reports.frontier)."""

from __future__ import annotations

import pytest

from stored_records import as_results
from tmas.grading.grades import SELECTED, Grades
from tmas.reports.frontier import mv_by_problem, returned_by_problem
from tmas.reports.paired import nearest_majority, paired

METHOD = {"a": (1.0, 100.0), "b": (0.0, 200.0), "c": (1.0, 300.0)}
MV = {
    1: {"a": (1.0, 100.0), "b": (0.0, 100.0), "c": (0.0, 100.0)},
    2: {"a": (0.5, 200.0), "b": (0.0, 210.0), "c": (1.0, 220.0)},
    4: {"a": (1.0, 400.0), "b": (1.0, 420.0), "c": (1.0, 440.0)},
}


def test_the_nearest_budget_and_the_paired_difference_worked_by_hand() -> None:
    # The method spends 200 a problem; MV@1 100, MV@2 210, MV@4 420: MV@2 is nearest. Differences 0.5, 0, 0: mean
    # 1/6; their sd is sqrt(((1/3)^2 + 2 (1/6)^2) / 2) = sqrt(1/12), over sqrt(3) problems: 1/6.
    pair = nearest_majority(METHOD, MV)
    assert pair is not None
    assert (pair.k, pair.problems) == (2, 3)
    assert (pair.tokens, pair.majority_tokens) == (200.0, 210.0)
    assert pair.accuracy == pytest.approx(2 / 3) and pair.majority_accuracy == pytest.approx(0.5)
    assert pair.difference == pytest.approx(1 / 6)
    assert pair.stderr == pytest.approx(1 / 6)


def test_only_problems_both_answered_are_paired() -> None:
    pair = paired({"a": (1.0, 10.0), "z": (1.0, 10.0)}, MV[4], 4)
    assert pair is not None and pair.problems == 1 and pair.difference == 0.0 and pair.stderr == 0.0
    assert paired({"z": (1.0, 10.0)}, MV[4], 4) is None
    assert nearest_majority({"z": (1.0, 10.0)}, MV) is None


def test_a_method_halfway_between_two_budgets_is_paired_with_the_smaller_k() -> None:
    # 150 tokens a problem: MV@1 (100) and MV@2 (200) are equally near, and the smaller k is taken.
    majority = {1: {"a": (0.0, 100.0)}, 2: {"a": (1.0, 200.0)}}
    pair = nearest_majority({"a": (1.0, 150.0)}, majority)
    assert pair is not None and (pair.k, pair.majority_tokens, pair.difference) == (1, 100.0, 1.0)


def test_a_runs_per_problem_values() -> None:
    # Majority vote: problem p has samples answering 5, 5, 7 (5 right), q samples 1 and none. MV@2 of p: of the three
    # pairs, {5, 5} and both {5, 7} pairs win with 5 half the time: (1 + 0.5 + 0.5) / 3 = 2/3; q's pair votes 1.
    def candidate(index: int, answer: str | None, tokens: int) -> dict[str, object]:
        return {"index": index, "answer": answer, "usage": {"completion_tokens": tokens}}

    results = as_results(
        [
            {
                "problem_id": "p",
                "status": "done",
                "iterations": [
                    {
                        "iteration": 0,
                        "candidates": [candidate(0, "5", 10), candidate(1, "5", 20), candidate(2, "7", 30)],
                        "usage": {"completion_tokens": 60},
                    }
                ],
            },
            {
                "problem_id": "q",
                "status": "done",
                "iterations": [
                    {
                        "iteration": 0,
                        "candidates": [candidate(0, "1", 40), candidate(1, None, 60)],
                        "usage": {"completion_tokens": 100},
                    }
                ],
            },
        ],
        method="majority",
    )
    grades = Grades(runs=1)
    grades.verdicts.update(
        {
            ("p", 0, 0): [True],
            ("p", 0, 1): [True],
            ("p", 0, 2): [False],
            ("q", 0, 0): [False],
            ("p", 0, SELECTED): [True],
            ("q", 0, SELECTED): [False],
        }
    )
    at2 = mv_by_problem(results, grades, 2)
    assert at2["p"] == (pytest.approx(2 / 3), 40.0) and at2["q"] == (0.0, 100.0)
    # MV@3 of p: 5 has two votes, at 3 x 20 tokens. q finished with two samples: at k = 3 it keeps its vote over both
    # (1: wrong), at their 100 tokens.
    assert mv_by_problem(results, grades, 3) == {"p": (1.0, 60.0), "q": (0.0, 100.0)}
    assert returned_by_problem(results, grades) == {"p": (1.0, 60.0), "q": (0.0, 100.0)}


def test_the_answer_a_run_returned_is_paired_at_every_token_it_spent() -> None:
    # a ran It0 (600 completion tokens, right) and its budget stopped it inside It1: 1000 spent in all. b ran It0 and
    # It1 at 300 each (wrong, then right). Each returned answer stands at all its problem spent (metrics.spent_through
    # over every iteration, the cut one included, as MV@k counts a problem): a 1000, b 600; mean 800, not the
    # (600 + 600) / 2 = 600 of a's finished iterations alone.
    def record(t: int, tokens: int) -> dict[str, object]:
        return {
            "iteration": t,
            "selected": "1",
            "candidates": [{"index": 0, "answer": "1", "usage": {"completion_tokens": tokens}}],
            "usage": {"completion_tokens": tokens},
        }

    results = as_results(
        [
            {
                "problem_id": "a",
                "status": "done",
                "stopped_reason": "budget",
                "usage": {"completion_tokens": 1000},
                "iterations": [record(0, 600)],
            },
            {"problem_id": "b", "status": "done", "iterations": [record(0, 300), record(1, 300)]},
        ]
    )
    verdicts = {("a", 0, 0): True, ("b", 0, 0): False, ("b", 1, 0): True}
    grades = Grades(runs=1)
    for (pid, t, index), ok in verdicts.items():
        grades.verdicts[(pid, t, index)] = [ok]
        grades.verdicts[(pid, t, SELECTED)] = [ok]
    returned = returned_by_problem(results, grades)
    assert returned == {"a": (1.0, 1000.0), "b": (1.0, 600.0)}
    # Paired with the MV@k nearest its 800 a problem: MV@2 (800), not MV@1 (600).
    majority = {1: {"a": (1.0, 600.0), "b": (0.0, 600.0)}, 2: {"a": (1.0, 800.0), "b": (0.5, 800.0)}}
    pair = nearest_majority(returned, majority)
    assert pair is not None and (pair.k, pair.tokens, pair.difference) == (2, 800.0, 0.25)
    # The frontier's It0 point still reads a's answer after It0 at what It0 cost (600), b's at its 300.
    assert returned_by_problem(results, grades, 0) == {"a": (1.0, 600.0), "b": (0.0, 300.0)}
