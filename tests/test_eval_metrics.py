"""Pass@1 (paper A.2), MV@k and per-iteration accounting on small hand-made records."""

from __future__ import annotations

from typing import Any

import pytest

from stored_records import as_results
from tmas.answer_classes import value_key
from tmas.answers import normalize_answer
from tmas.grading.grades import SELECTED, Grades
from tmas.reports.metrics import compute_metrics, pass_at_1, pass_at_1_stderr, vote_share
from tmas.store.records import Candidate


def test_pass_at_1_by_hand() -> None:
    # Two problems, two judge runs. Run 0: p1 2/4 correct, p2 1/2 -> (0.5 + 0.5) / 2 = 0.5.
    # Run 1: p1 3/4, p2 0/2 -> (0.75 + 0) / 2 = 0.375. Pass@1 = (0.5 + 0.375) / 2 = 0.4375.
    labels = {
        "p1": [[True, True, False, False], [True, True, True, False]],
        "p2": [[True, False], [False, False]],
    }
    assert pass_at_1(labels) == pytest.approx(0.4375)
    # Its standard error across problems: p_1 = (0.5 + 0.75) / 2 = 0.625 and p_2 = (0.5 + 0) / 2 = 0.25 (each
    # problem's share averaged over the judge runs), mean 0.4375; deviations +-0.1875, sample variance
    # 2 * 0.1875^2 / (2 - 1), so s = 0.1875 * sqrt(2) and SE = s / sqrt(2) = 0.1875.
    assert pass_at_1_stderr(labels) == pytest.approx(0.1875)
    # Per problem shares, not pooled rollouts: pooling would give (2+1)/6 = 0.5 in run 0 too, but not in run 1.
    assert pass_at_1({"p1": [[True, False, False, False]], "p2": [[True, True]]}) == pytest.approx(0.625)
    assert pass_at_1({"p": [[]]}) == 0.0
    assert pass_at_1({}) == 0.0


def test_the_vote_groups_spellings_and_splits_ties_evenly() -> None:
    # 1/2 in two spellings outvotes 3; a sample without an answer has no vote.
    votes = [("3", 0.0), (value_key("\\frac{1}{2}"), 1.0), (value_key("$\\dfrac{1}{2}$"), 1.0), (None, 0.0)]
    assert vote_share(votes) == 1.0
    assert vote_share([("a", 1.0), ("b", 0.0)]) == 0.5
    assert vote_share([(None, 0.0), (None, 0.0)]) is None
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


def test_the_tokens_per_problem_count_the_problems_that_reached_the_iteration() -> None:
    # a finished two iterations (10 + 10 tokens at It0, 20 + 20 at It1); b is still mid-way, through It0 alone
    # (5 + 5). Mean cumulative tokens per problem: It0 (20 + 10) / 2 = 15; It1 stands on a alone, as its Pass@1
    # does: (20 + 40) / 1 = 60. Before, b's It0 tokens and b itself counted at It1: (20 + 40 + 10) / 2 = 35.
    results = as_results(
        [
            {"problem_id": "a", "iterations": [_record(0, ["1"], "1", 10), _record(1, ["1"], "1", 20)]},
            {"problem_id": "b", "status": "running", "iterations": [_record(0, ["2"], "2", 5)]},
        ]
    )
    assert results[1].in_progress
    grades = Grades(runs=1)
    for pid, its in (("a", (0, 1)), ("b", (0,))):
        for it in its:
            grades.verdicts[(pid, it, 0)] = grades.verdicts[(pid, it, SELECTED)] = [True]
    it0, it1 = compute_metrics(results, grades).iterations
    assert (it0.problems, it0.tokens_per_problem) == (2, 15.0)
    assert (it1.problems, it1.tokens_per_problem) == (1, 60.0)
    # The iteration's own cost and the cumulative count stay every call made.
    assert (it1.tokens, it1.cumulative_tokens) == (40, 70)


def _majority(records: dict[str, list[list[str | None]]], gold: dict[str, str]) -> tuple[list[Any], Grades]:
    """Majority-vote results (one record per iteration, its samples' answers; every sample 10 completion tokens), the
    first sample returned, graded by ``gold``."""
    results = [
        {"problem_id": pid, "iterations": [_record(t, answers, answers[0], 10) for t, answers in enumerate(its)]}
        for pid, its in records.items()
    ]
    grades = Grades(runs=1)
    for r in results:
        for rec in r["iterations"]:
            pid, it = r["problem_id"], rec["iteration"]
            for c in rec["candidates"]:
                grades.verdicts[(pid, it, c["index"])] = [c["answer"] == gold[pid]]
            grades.verdicts[(pid, it, SELECTED)] = [rec["selected"] == gold[pid]]
    return as_results(results, "majority"), grades


def test_mv_at_all_splits_ties_evenly_as_the_frontier_does() -> None:
    from tmas.reports.frontier import mv_frontier

    # Samples A (right) and B (wrong): a tie, split evenly -> MV@all 1/2, the frontier's MV@2. The method returns the
    # earlier sample, A: Selected 1.
    results, grades = _majority({"p": [["A", "B"]]}, {"p": "A"})
    [it0] = compute_metrics(results, grades).iterations
    assert (it0.mv, it0.selected) == (0.5, 1.0)
    assert [(p.label, p.accuracy) for p in mv_frontier(results, grades)][-1] == ("MV@2", 0.5)
    # A three-way tie A, B, C with a sample without an answer: 1/3; a clear majority stays whole.
    results, grades = _majority({"p": [["B", None, "A", "C"]], "q": [["1", "2", "1"]]}, {"p": "A", "q": "1"})
    [it0] = compute_metrics(results, grades).iterations
    assert it0.mv == pytest.approx((1 / 3 + 1) / 2)


def test_pooled_mv_at_all_votes_over_every_sample_drawn_so_far() -> None:
    from tmas.reports.frontier import mv_frontier

    # p: It0 draws 5, 5 (right), It1 6, 7. Over all four samples 5 wins: 1. Over It1's alone, 6 and 7 tie: 0.
    # q: It0 8 (right), 9; It1 8, 10. Pooled: 8, 9, 8, 10 -> 8 wins: 1. It1's alone: 8 and 10 tie: 1/2.
    # r stopped after It0 (its vote decided): 3 (right) stands at It1, pooled or not.
    results, grades = _majority(
        {"p": [["5", "5"], ["6", "7"]], "q": [["8", "9"], ["8", "10"]], "r": [["3"]]}, {"p": "5", "q": "8", "r": "3"}
    )
    pooled = compute_metrics(results, grades, pooled=True)
    assert [m.mv for m in pooled.iterations] == pytest.approx([(1 + 0.5 + 1) / 3, 1.0])
    assert [m.mv for m in compute_metrics(results, grades).iterations] == pytest.approx([(1 + 0.5 + 1) / 3, 1.5 / 3])
    # The last iteration's pooled MV@all is the frontier's MV@k at every sample.
    assert mv_frontier(results, grades)[-1].label == "MV@4"
    assert mv_frontier(results, grades)[-1].accuracy == pytest.approx(pooled.iterations[-1].mv)
    # The first k samples drawn, across iterations: MV@3 of p is 5, 5, 6 -> 1; of q 8, 9, 8 -> 1.
    assert compute_metrics(results, grades, pooled=True, mv_k=3).iterations[1].mv == pytest.approx(1.0)


def test_pass1_standard_error_across_problems_by_hand() -> None:
    # Two judge runs. p1: 1 of 2 right in both -> 1/2. p2: 2 of 2, then 1 of 2 -> 3/4. p3: none -> 0.
    # Mean 5/12; deviations 1/12, 4/12, -5/12; sum of squares 42/144; / (n - 1) = 21/144; sd = sqrt(21)/12;
    # standard error sd / sqrt(3) = sqrt(7)/12.
    results = [{"problem_id": p, "iterations": [_record(0, ["x", "y"], "x", 1)]} for p in ("p1", "p2", "p3")]
    grades = Grades(runs=2)
    for pid, first, second in (("p1", [1, 0], [1, 0]), ("p2", [1, 1], [1, 0]), ("p3", [0, 0], [0, 0])):
        for i in range(2):
            grades.verdicts[(pid, 0, i)] = [bool(first[i]), bool(second[i])]
    [it0] = compute_metrics(as_results(results), grades).iterations
    assert it0.pass1 == pytest.approx(5 / 12)
    assert it0.pass1_stderr == pytest.approx(7**0.5 / 12)
    # One problem: no spread to estimate, 0 (as the frontier's band).
    [one] = compute_metrics(as_results(results[:1]), grades).iterations
    assert one.pass1_stderr == 0.0


def test_a_final_state_reads_the_solutions_its_trajectories_hold_as_pass1_does() -> None:
    # Self-Refine, one trajectory: It0 writes 5 (right); It1's refinement has no answer and its trajectory goes on
    # from It0's solution (carried_from 0). Pass@1 at It1 reads that solution: 1. The final state the stopping
    # comparison reads ("Pass@1 lost") is the same 1; read from It1's own answerless reply it was 0.
    carried = {"index": 0, "answer": None, "meta": {"carried_from": 0}}
    results = [
        {
            "problem_id": "a",
            "iterations": [
                _record(0, ["5"], "5", 10),
                {**_record(1, [None], "5", 10), "candidates": [carried]},
            ],
        }
    ]
    grades = Grades(runs=2)
    grades.verdicts[("a", 0, 0)] = [True, True]
    grades.verdicts[("a", 1, 0)] = [False, False]
    metrics = compute_metrics(as_results(results, "self_refine"), grades)
    assert [m.pass1 for m in metrics.iterations] == [1.0, 1.0]
    assert metrics.finals["a"].pass1 == 1.0


def test_samples_stopped_online_are_no_rollouts_of_pass1() -> None:
    # Majority vote with online stopping: p1 holds 391 (right), 390 and a sample stopped while it streamed; p2 holds 7
    # (right) and a stopped sample. Stopped samples were discarded before any answer: Pass@1 is over the others,
    # p1 1/2 and p2 1/1, so (1/2 + 1) / 2 = 3/4 (counting them wrong gave (1/3 + 1/2) / 2 = 5/12). Its standard
    # error: deviations -1/4 and +1/4, sample variance 2/16, sd sqrt(2)/4, over sqrt(2): 1/4.
    stop = "group confidence 1.750 of the last 4 tokens fell below the threshold 2.000 after 8 tokens"
    stopped = {
        "answer": None,
        "text": "Seventeen times",
        "error": f"stopped early: {stop}",
        "finish_reason": "confidence_stop",
        "meta": {"stopped_early": stop, "online_stop": "watched"},
    }
    results, grades = _majority({"p1": [["391", "390", None]], "p2": [["7", None]]}, {"p1": "391", "p2": "7"})
    for result, index in ((results[0], 2), (results[1], 1)):
        result.iterations[0].candidates[index] = Candidate.model_validate({"index": index, **stopped})
    metrics = compute_metrics(results, grades, pooled=True)
    [it0] = metrics.iterations
    assert it0.pass1 == pytest.approx(3 / 4) and it0.pass1_runs == pytest.approx([3 / 4])
    assert it0.pass1_stderr == pytest.approx(1 / 4)
    # A stopped sample has no vote either: p1's 391 and 390 tie (1/2), p2's 7 wins.
    assert it0.mv == pytest.approx(3 / 4)
    # The final state the stopping comparison reads ("Pass@1 lost") counts the same rollouts.
    assert {pid: final.pass1 for pid, final in metrics.finals.items()} == {"p1": 0.5, "p2": 1.0}


def test_a_problem_that_ended_counts_every_token_it_spent_past_its_last_iteration() -> None:
    # a: a budget stopped it inside It1: It0's record holds 10 prompt + 10 completion tokens, the problem spent
    # 30 + 50 in all (It1's cut calls are in its usage, in no record). b ran It0 and It1 at 10 + 10 each. f failed
    # before any iteration after calls of 4 + 6 tokens. Cumulative tokens per problem (prompt + completion):
    # It0: (20 + 20 + 10) / 3 = 50/3 (f has ended: everything it spent); It1: a's It0 answer stands, at everything
    # it spent: (80 + 40 + 10) / 3 = 130/3, as the frontier counts a stopped problem's tokens. Before, a counted
    # 20 and f 0 at every iteration: It1 (20 + 40 + 0) / 3 = 20.
    results = as_results(
        [
            {
                "problem_id": "a",
                "stopped_reason": "budget",
                "usage": {"prompt_tokens": 30, "completion_tokens": 50},
                "iterations": [_record(0, ["1"], "1", 10)],
            },
            {"problem_id": "b", "iterations": [_record(0, ["2"], "2", 10), _record(1, ["2"], "2", 10)]},
            {"problem_id": "f", "status": "failed", "usage": {"prompt_tokens": 4, "completion_tokens": 6}},
        ]
    )
    grades = Grades(runs=1)
    for pid, its in (("a", (0,)), ("b", (0, 1))):
        for it in its:
            grades.verdicts[(pid, it, 0)] = grades.verdicts[(pid, it, SELECTED)] = [True]
    grades.verdicts[("f", 0, SELECTED)] = [False]
    metrics = compute_metrics(results, grades)
    assert [m.tokens_per_problem for m in metrics.iterations] == pytest.approx([50 / 3, 130 / 3])
    # The iterations' own cost stays what their records hold.
    assert [m.tokens for m in metrics.iterations] == [40, 20]
    # Final states (the stopping comparison's "tokens saved"): what each problem spent in all.
    assert {pid: s.tokens for pid, s in metrics.finals.items()} == {"a": 80, "b": 40, "f": 10}
