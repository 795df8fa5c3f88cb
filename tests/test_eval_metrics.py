"""Pass@1 (paper A.2), MV@k and per-iteration accounting on small hand-made records."""

from __future__ import annotations

from typing import Any

import pytest

from stored_records import as_results
from tmas.answers import normalize_answer
from tmas.grading.grades import SELECTED, Grades
from tmas.reports.metrics import compute_metrics, majority_answer, pass_at_1


def test_pass_at_1_by_hand() -> None:
    # Two problems, two judge runs. Run 0: p1 2/4 correct, p2 1/2 -> (0.5 + 0.5) / 2 = 0.5.
    # Run 1: p1 3/4, p2 0/2 -> (0.75 + 0) / 2 = 0.375. Pass@1 = (0.5 + 0.375) / 2 = 0.4375.
    labels = {
        "p1": [[True, True, False, False], [True, True, True, False]],
        "p2": [[True, False], [False, False]],
    }
    assert pass_at_1(labels) == pytest.approx(0.4375)
    # Per problem shares, not pooled rollouts: pooling would give (2+1)/6 = 0.5 in run 0 too, but not in run 1.
    assert pass_at_1({"p1": [[True, False, False, False]], "p2": [[True, True]]}) == pytest.approx(0.625)
    assert pass_at_1({"p": [[]]}) == 0.0
    assert pass_at_1({}) == 0.0


def test_majority_answer_groups_spellings_and_breaks_ties_early() -> None:
    assert majority_answer(["3", "\\frac{1}{2}", "$\\dfrac{1}{2}$", None]) == 1
    assert majority_answer(["a", "b"]) == 0
    assert majority_answer([None, None]) is None
    assert normalize_answer(" \\text{12} . ") == "12"


def _record(iteration: int, answers: list[str | None], selected: str | None, tokens: int) -> dict[str, Any]:
    return {
        "iteration": iteration,
        "candidates": [{"index": i, "answer": a, "text": a or ""} for i, a in enumerate(answers)],
        "selected": selected,
        "calls": len(answers),
        "usage": {"prompt_tokens": tokens, "completion_tokens": tokens},
    }


def test_compute_metrics_per_iteration() -> None:
    results = [
        {"problem_id": "a", "iterations": [_record(0, ["1", "2", "2"], "2", 10), _record(1, ["1", "1", "1"], "1", 20)]},
        # b stopped after iteration 0: its candidates carry forward, at no further cost.
        {"problem_id": "b", "stopped_reason": "converged", "iterations": [_record(0, ["5", "5"], "5", 5)]},
        {"problem_id": "c", "status": "failed", "iterations": []},
    ]
    gold = {"a": "1", "b": "5"}
    grades = Grades(runs=2)
    for r in results:
        for rec in r["iterations"]:
            pid, it = r["problem_id"], rec["iteration"]
            for c in rec["candidates"]:
                ok = c["answer"] == gold[pid]
                # Judge run 1 disagrees on a's candidate 0 at iteration 0.
                second = not ok if (pid, it, c["index"]) == ("a", 0, 0) else ok
                grades.verdicts[(pid, it, c["index"])] = [ok, second]
            grades.verdicts[(pid, it, SELECTED)] = [rec["selected"] == gold[pid]] * 2
    metrics = compute_metrics(as_results(results), grades)
    it0, it1 = metrics.iterations
    # It0 run 0: a 1/3, b 1, c 0 -> 4/9; run 1: a 0/3, b 1, c 0 -> 1/3. Mean 7/18.
    assert it0.pass1 == pytest.approx(7 / 18)
    assert it0.pass1_runs == pytest.approx([4 / 9, 1 / 3])
    # MV: a votes "2" (wrong), b "5" (right), c nothing -> 1/3. Selected likewise.
    assert it0.mv == pytest.approx(1 / 3) and it0.selected == pytest.approx(1 / 3)
    # It1: a 3/3, b carried 2/2, c 0 -> 2/3 in both runs.
    assert it1.pass1 == pytest.approx(2 / 3) and it1.mv == pytest.approx(2 / 3)
    assert (it0.calls, it1.calls) == (5, 3)
    assert (it0.tokens, it1.tokens, it1.cumulative_tokens) == (30, 40, 70)
    assert it1.tokens_per_problem == pytest.approx(70 / 3)


def test_mv_at_k_uses_the_first_k_candidates() -> None:
    results = [{"problem_id": "a", "iterations": [_record(0, ["1", "2", "2"], "2", 1)]}]
    grades = Grades(runs=1)
    for i, ok in enumerate([True, False, False]):
        grades.verdicts[("a", 0, i)] = [ok]
    assert compute_metrics(as_results(results), grades, mv_k=1).iterations[0].mv == 1.0
    assert compute_metrics(as_results(results), grades, mv_k=3).iterations[0].mv == 0.0


def test_an_iteration_only_unlabeled_problems_reached_has_no_accuracy(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from tmas.reports.plots import plot_pass1

    # p (labeled) is mid-way after It0, right; u (unlabeled) reached It1.
    def record(t: int) -> dict[str, Any]:
        return {"iteration": t, "selected": "1", "candidates": [{"index": 0, "answer": "1"}]}

    results = [
        {"problem_id": "p", "status": "running", "iterations": [record(0)]},
        {"problem_id": "u", "iterations": [record(0), record(1)]},
    ]
    grades = Grades(runs=1, verdicts={("p", 0, 0): [True], ("p", 0, SELECTED): [True]}, unlabeled=["u"])
    metrics = compute_metrics(as_results(results), grades)
    assert [(m.iteration, m.problems) for m in metrics.iterations] == [(0, 1), (1, 0)]
    # The plot draws It0 alone (It1's 0 would read as every answer wrong).
    [series] = plot_pass1([("run", metrics)], "t", tmp_path / "p.png")
    assert (series.x, series.y) == ([0], [100.0])


def test_the_tokens_per_problem_count_every_problem_labeled_or_not() -> None:
    # a (labeled, right) and u (no reference answer) each spend 10 prompt + 10 completion tokens in It0: the cost
    # counts both, 40 tokens, 40 / 2 = 20 a problem; the accuracy counts a alone.
    results = [
        {"problem_id": "a", "iterations": [_record(0, ["1"], "1", 10)]},
        {"problem_id": "u", "iterations": [_record(0, ["2"], "2", 10)]},
    ]
    grades = Grades(runs=1, verdicts={("a", 0, 0): [True], ("a", 0, SELECTED): [True]}, unlabeled=["u"])
    [it0] = compute_metrics(as_results(results), grades).iterations
    assert (it0.tokens, it0.tokens_per_problem) == (40, 20.0)
    assert (it0.problems, it0.selected, it0.pass1) == (1, 1.0, 1.0)
