"""Frontier, MV@k subset expectation, equal-budget table, selection-rule table and ROC area on hand-made records,
every expected value worked by hand in the comments."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from stored_records import as_results
from tmas.grading.grades import SELECTED, Grades
from tmas.reports.frontier import equal_budget, iteration_frontier, mv_at_k, mv_frontier
from tmas.reports.metrics import compute_metrics
from tmas.reports.report import _separation_text
from tmas.reports.roc import confidence_separation, roc_area, score_separation
from tmas.reports.selection_table import selection_table


def test_mv_at_k_by_enumeration_of_subsets() -> None:
    # Four samples: A, A (right), B, C (wrong).
    # MV@1: 2 of 4 draws are A -> 1/2.
    # MV@2: C(4,2) = 6 pairs: {A,A} right; {A,B} x2 and {A,C} x2 are ties, each split 1/2; {B,C} a tie of two wrong
    #       answers -> (1 + 4 * 0.5) / 6 = 1/2.
    # MV@3: 4 triples: {A,A,B}, {A,A,C} right; {A,B,C} x2 a three-way tie, 1/3 each -> (2 + 2/3) / 4 = 2/3.
    # MV@4: A has two votes -> 1.
    groups = [(2, 1.0), (1, 0.0), (1, 0.0)]
    assert [mv_at_k(groups, 0, k) for k in (1, 2, 3, 4)] == pytest.approx([0.5, 0.5, 2 / 3, 1.0])
    # One right answer and two answerless samples: MV@1 = 1/3; MV@2: {A,-} x2 right, {-,-} nothing -> 2/3; MV@3 = 1.
    assert [mv_at_k([(1, 1.0)], 2, k) for k in (1, 2, 3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    with pytest.raises(ValueError, match="MV@5"):
        mv_at_k(groups, 0, 5)


def test_mv_at_k_matches_brute_force_on_random_sets() -> None:
    rng = random.Random(7)
    correct = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.0}
    for _ in range(25):
        samples = [rng.choice([None, "a", "b", "c", "d"]) for _ in range(rng.randint(1, 9))]
        groups = [(samples.count(x), correct[x]) for x in "abcd" if samples.count(x)]
        for k in range(1, len(samples) + 1):
            total = 0.0
            subsets = list(itertools.combinations(samples, k))
            for subset in subsets:
                votes = {x: subset.count(x) for x in subset if x is not None}
                if votes:
                    top = [x for x in votes if votes[x] == max(votes.values())]
                    total += sum(correct[x] for x in top) / len(top)
            assert mv_at_k(groups, samples.count(None), k) == pytest.approx(total / len(subsets))


def _cands(answers: list[str | None], tokens: list[int], scores: list[float | None] | None = None) -> list[Any]:
    scores = scores or [None] * len(answers)
    return [
        {"index": i, "answer": a, "text": a or "", "score": s, "usage": {"completion_tokens": t}}
        for i, (a, t, s) in enumerate(zip(answers, tokens, scores, strict=True))
    ]


def _grade(results: list[dict[str, Any]], gold: dict[str, str]) -> Grades:
    grades = Grades(runs=1)
    for r in results:
        pid = r["problem_id"]
        for rec in r["iterations"]:
            for c in rec["candidates"]:
                grades.verdicts[(pid, rec["iteration"], c["index"])] = [c["answer"] == gold[pid]]
            grades.verdicts[(pid, rec["iteration"], SELECTED)] = [rec["selected"] == gold[pid]]
    return grades


def test_mv_frontier_from_stored_samples() -> None:
    results = [
        # a: answers 1, 1, 2, 3 (gold 1) at 100..400 completion tokens: 250 per sample.
        {
            "problem_id": "a",
            "iterations": [
                {"iteration": 0, "selected": "1", "candidates": _cands(["1", "1", "2", "3"], [100, 200, 300, 400])}
            ],
        },
        # b: answers 5, none, 5, 6 (gold 6), two iterations of two samples at 50 tokens each.
        {
            "problem_id": "b",
            "iterations": [
                {"iteration": 0, "selected": "5", "candidates": _cands(["5", None], [50, 50])},
                {"iteration": 1, "selected": "5", "candidates": _cands(["5", "6"], [50, 50])},
            ],
        },
    ]
    grades = _grade(results, {"a": "1", "b": "6"})
    points = mv_frontier(as_results(results), grades)
    assert [p.label for p in points] == ["MV@1", "MV@2", "MV@4"]
    # a: MV@1 1/2, MV@2 1/2 (as in the enumeration test), MV@4 1.
    # b: MV@1 1/4. MV@2 over 6 pairs: {5,5} {5,-} {5,-} wrong, {5,6} x2 ties (1/2 each), {-,6} right -> 2/6 = 1/3.
    #    MV@4: 5 has two votes, 6 one -> 0.
    assert [p.accuracy for p in points] == pytest.approx([(0.5 + 0.25) / 2, (0.5 + 1 / 3) / 2, 0.5])
    # x: k samples' expected tokens, averaged over problems: (250k + 50k) / 2 = 150k.
    assert [p.tokens for p in points] == pytest.approx([150, 300, 600])
    # Standard error of two values: |x - y| / 2.
    assert [p.stderr for p in points] == pytest.approx([0.125, (0.5 - 1 / 3) / 2, 0.5])
    assert [p.problems for p in points] == [2, 2, 2]


def test_the_mv_frontier_ends_at_every_sample_and_a_budget_holds_a_point_exactly_at_it() -> None:
    # Three samples 4, 4, 5 (gold 4) at 100 tokens each. MV@1: 2/3. MV@2: {4,4} right, {4,5} twice a tie (1/2 each)
    # -> (1 + 1/2 + 1/2) / 3 = 2/3. MV@3 (every sample, though 3 is no power of two): 4 has two votes -> 1.
    results = [
        {
            "problem_id": "a",
            "iterations": [{"iteration": 0, "selected": "4", "candidates": _cands(["4", "4", "5"], [100] * 3)}],
        }
    ]
    points = mv_frontier(as_results(results), _grade(results, {"a": "4"}))
    assert [(p.label, p.tokens) for p in points] == [("MV@1", 100.0), ("MV@2", 200.0), ("MV@3", 300.0)]
    assert [p.accuracy for p in points] == pytest.approx([2 / 3, 2 / 3, 1.0])
    # A budget of 300 holds MV@3 (at 300 exactly); one of 299 does not.
    table = equal_budget(points, (299, 300))
    assert [p.accuracy if p else None for p in table] == pytest.approx([2 / 3, 1.0])


def test_an_empty_answer_is_no_vote_in_the_frontier_as_in_mv_at_all() -> None:
    # Samples "", "" and 7 (gold 7) at 100 tokens each: an empty answer is no vote (as majority vote counts votes),
    # so 7 is the only answer voted for. MV@1: 1/3. MV@2 over 3 pairs: {"",""} nothing, {"",7} twice 7 -> 2/3.
    # MV@3: 7 -> 1, as MV@all says. Grouping "" as an answer gave it two votes to 7's one: 0 at MV@3, and
    # MV@2 = 1/3 (two ties of "" and 7, half each).
    results = [
        {
            "problem_id": "a",
            "iterations": [{"iteration": 0, "selected": "7", "candidates": _cands(["", "", "7"], [100] * 3)}],
        }
    ]
    stored, grades = as_results(results, "majority"), _grade(results, {"a": "7"})
    points = mv_frontier(stored, grades)
    assert [p.accuracy for p in points] == pytest.approx([1 / 3, 2 / 3, 1.0])
    [it0] = compute_metrics(stored, grades, pooled=True).iterations
    assert it0.mv == points[-1].accuracy == 1.0


def test_a_sample_stopped_online_is_none_of_the_samples_mv_at_k_draws_from() -> None:
    # Majority vote with online stopping: a sample stopped while it streamed (40 tokens), then 8, 7, 7 (gold 7) that
    # ran to their end at 100 tokens each. The stopped sample is no rollout (Pass@1 2/3, over the three) and none of
    # the samples drawn: K = 3. MV@1 2/3; MV@2 over 3 pairs: {7,7} right, {8,7} twice a tie (1/2) -> 2/3; MV@3 1.
    # The problem spent 340 tokens, 340/3 a sample. Drawn as an answerless sample it gave K = 4 (MV@1, MV@2, MV@4)
    # and MV@1 = 2/4: a draw of it alone counted wrong.
    stop = "group confidence 1.750 of the last 4 tokens fell below the threshold 2.000 after 8 tokens"
    stopped = {
        "index": 0,
        "answer": None,
        "text": "Seventeen times",
        "error": f"stopped early: {stop}",
        "finish_reason": "confidence_stop",
        "usage": {"completion_tokens": 40},
        "meta": {"stopped_early": stop, "online_stop": "watched"},
    }
    ran = [{**c, "index": c["index"] + 1} for c in _cands(["8", "7", "7"], [100] * 3)]
    results = [{"problem_id": "a", "iterations": [{"iteration": 0, "selected": "7", "candidates": [stopped, *ran]}]}]
    stored, grades = as_results(results, "majority"), _grade(results, {"a": "7"})
    points = mv_frontier(stored, grades)
    assert [p.label for p in points] == ["MV@1", "MV@2", "MV@3"]
    assert [p.accuracy for p in points] == pytest.approx([2 / 3, 2 / 3, 1.0])
    assert [p.tokens for p in points] == pytest.approx([340 / 3, 680 / 3, 340])
    [it0] = compute_metrics(stored, grades, pooled=True).iterations
    assert (it0.pass1, it0.mv) == (pytest.approx(2 / 3), points[-1].accuracy)
    # MV over the first two samples votes over 8 and 7 (a tie, 1/2), not over the stopped one and 8 (0).
    [first_two] = compute_metrics(stored, grades, pooled=True, mv_k=2).iterations
    assert first_two.mv == 0.5


def test_a_vote_decided_early_keeps_its_answer_at_larger_k() -> None:
    # Adaptive-Consistency (stop=beta): a's vote was decided after 4 samples, all 1 (gold 1); b drew all 8: five 2s and
    # three 3s (gold 3); c is still mid-way with one sample, 9 (gold 9). 100 tokens a sample.
    # MV@4: a 1; b over C(8,4) = 70 draws: three 3s and a 2 (5 ways) win, two and two (C(3,2) C(5,2) = 30) tie,
    #       half -> 20/70 = 2/7 -> (1 + 2/7) / 2 = 9/14 at 400, on a and b (c has too few samples).
    # MV@8: b's 2 has the most votes -> 0; a keeps its vote over its 4 samples, at their 400 tokens -> 1/2 at
    #       (400 + 800) / 2 = 600, still on two problems (leaving a out would give 0 at 800, on b alone).
    results = [
        {
            "problem_id": "a",
            "status": "done",
            "stopped_reason": "vote decided (Beta stopping criterion)",
            "iterations": [{"iteration": 0, "selected": "1", "candidates": _cands(["1"] * 4, [100] * 4)}],
        },
        {
            "problem_id": "b",
            "status": "done",
            "iterations": [{"iteration": 0, "selected": "2", "candidates": _cands(list("22222333"), [100] * 8)}],
        },
        {
            "problem_id": "c",
            "status": "running",
            "iterations": [{"iteration": 0, "selected": "9", "candidates": _cands(["9"], [100])}],
        },
    ]
    points = mv_frontier(as_results(results, "majority"), _grade(results, {"a": "1", "b": "3", "c": "9"}))
    assert [(p.label, p.problems) for p in points] == [("MV@1", 3), ("MV@2", 2), ("MV@4", 2), ("MV@8", 2)]
    assert [p.accuracy for p in points[2:]] == pytest.approx([9 / 14, 0.5])
    assert [p.tokens for p in points[2:]] == pytest.approx([400, 600])


def _record(iteration: int, selected: str, completion: int, answers: list[str | None] | None = None) -> dict[str, Any]:
    answers = answers or [selected]
    return {
        "iteration": iteration,
        "selected": selected,
        "candidates": _cands(answers, [0] * len(answers)),
        "calls": 1,
        "usage": {"prompt_tokens": 10, "completion_tokens": completion, "reasoning_tokens": completion // 10},
    }


def partial_run() -> tuple[list[dict[str, Any]], Grades]:
    results = [
        # a: wrong at It0 (1000 tokens), right at It1 (+1500) and It2 (+2000).
        {
            "problem_id": "a",
            "status": "done",
            "iterations": [_record(0, "0", 1000), _record(1, "1", 1500), _record(2, "1", 2000)],
        },
        # b: stopped after It0 (600 tokens, right): its answer and cost carry forward.
        {"problem_id": "b", "status": "done", "stopped_reason": "converged", "iterations": [_record(0, "2", 600)]},
        # c: still mid-way, two iterations finished: right at It0 (800), wrong at It1 (+1000); not at It2.
        {"problem_id": "c", "status": "running", "iterations": [_record(0, "3", 800), _record(1, "9", 1000)]},
    ]
    return results, _grade(results, {"a": "1", "b": "2", "c": "3"})


def test_iteration_frontier_and_equal_budget_table() -> None:
    results, grades = partial_run()
    points = iteration_frontier(as_results(results), grades)
    assert [p.label for p in points] == ["It0", "It1", "It2"]
    # It0: a 0, b 1, c 1 -> 2/3 at (1000 + 600 + 800) / 3 = 800 tokens.
    # It1: a 1, b 1, c 0 -> 2/3 at (2500 + 600 + 1800) / 3 = 4900/3.
    # It2: c has not got there: a 1, b 1 -> 1 at (4500 + 600) / 2 = 2550, on 2 problems.
    assert [p.accuracy for p in points] == pytest.approx([2 / 3, 2 / 3, 1.0])
    assert [p.tokens for p in points] == pytest.approx([800, 4900 / 3, 2550])
    assert [p.problems for p in points] == [3, 3, 2]
    # Standard error of (0, 1, 1): stdev sqrt(1/3), over sqrt(3) -> 1/3; of (1, 1): 0.
    assert [p.stderr for p in points] == pytest.approx([1 / 3, 1 / 3, 0.0])
    table = equal_budget(points, (500, 1000, 2000, 4000))
    assert [p.accuracy if p else None for p in table] == pytest.approx([None, 2 / 3, 2 / 3, 1.0])
    assert table[3] is not None and table[3].label == "It2"
    # Metrics count the mid-way problem the same way, and split tokens by kind.
    metrics = compute_metrics(as_results(results), grades)
    assert [m.problems for m in metrics.iterations] == [3, 3, 2]
    assert [m.selected for m in metrics.iterations] == pytest.approx([2 / 3, 2 / 3, 1.0])
    assert [m.completion_tokens for m in metrics.iterations] == [2400, 2500, 2000]
    assert [m.prompt_tokens for m in metrics.iterations] == [30, 20, 10]
    assert [m.reasoning_tokens for m in metrics.iterations] == [240, 250, 200]


def test_a_failed_problem_and_a_budget_cut_iteration_count_on_the_frontiers() -> None:
    # Majority vote: p's samples 7 (right) and 8 (wrong), 100 tokens each; f failed before any sample, having spent
    # 30 tokens on calls that failed. MV@1 = MV@2 = (1/2 + 0) / 2 = 1/4, on both problems (f returned nothing: 0).
    # Tokens: p at k * 100; f at its 30 -> MV@1 (100 + 30) / 2 = 65, MV@2 (200 + 30) / 2 = 115.
    voted = [
        {
            "problem_id": "p",
            "iterations": [{"iteration": 0, "selected": "7", "candidates": _cands(["7", "8"], [100] * 2)}],
        },
        {"problem_id": "f", "status": "failed", "usage": {"completion_tokens": 30}, "iterations": []},
    ]
    grades = _grade(voted, {"p": "7", "f": "9"})
    points = mv_frontier(as_results(voted), grades)
    assert [(p.label, p.accuracy, p.tokens, p.problems) for p in points] == [
        ("MV@1", 0.25, 65.0, 2),
        ("MV@2", 0.25, 115.0, 2),
    ]
    # Iterations: a's budget stopped it inside It1, with 600 tokens in It0's record and 1000 spent in all; b ran It0
    # and It1 at 600 each. It0: (600 + 600) / 2 = 600; It1: a's It0 answer stands, at all it spent (its cut It1
    # included) -> (1000 + 1200) / 2 = 1100.
    stopped = [
        {
            "problem_id": "a",
            "status": "done",
            "usage": {"completion_tokens": 1000},
            "iterations": [_record(0, "1", 600)],
        },
        {"problem_id": "b", "status": "done", "iterations": [_record(0, "2", 600), _record(1, "2", 600)]},
    ]
    frontier = iteration_frontier(as_results(stopped), _grade(stopped, {"a": "1", "b": "2"}))
    assert [(p.label, p.tokens) for p in frontier] == [("It0", 600.0), ("It1", 1100.0)]


def test_every_selection_rule_from_stored_scores() -> None:
    # One problem, gold 7. It0: 7 (score 1), 5 (score 0). It1: 5 (0.5), 5 (0.5).
    results = [
        {
            "problem_id": "p",
            "status": "done",
            "iterations": [
                {"iteration": 0, "selected": "7", "candidates": _cands(["7", "5"], [0, 0], [1.0, 0.0])},
                {"iteration": 1, "selected": "5", "candidates": _cands(["5", "5"], [0, 0], [0.5, 0.5])},
            ],
        }
    ]
    table = selection_table(as_results(results), _grade(results, {"p": "7"}), "numeric")
    acc = table.accuracy
    assert table.iterations == [0, 1] and table.problems == [1, 1]
    # It0 (both pools alike): best score 7; vote 1:1, tie to the larger score sum: 7; weighted: 1.0 vs 0: 7.
    assert all(acc[key][0] == 1.0 for key in acc)
    # It1, last: only 5s.
    assert acc[("best_score", "last")][1] == acc[("vote", "last")][1] == 0.0
    assert acc[("score_weighted_vote", "last")][1] == 0.0
    # It1, all: the top score is It0's 7; 5 has 3 votes; sums 1.0 (7) vs 0 + 0.5 + 0.5 (5), tie to more votes: 5.
    assert acc[("best_score", "all")][1] == 1.0
    assert acc[("vote", "all")][1] == 0.0
    assert acc[("score_weighted_vote", "all")][1] == 0.0


def test_roc_area_by_hand() -> None:
    # Right 0.9, 0.5, 0.5; wrong 0.5, 0.1. Pairs: 0.9 beats both (2); each 0.5 ties 0.5 (1/2) and beats 0.1 (1):
    # (2 + 1.5 + 1.5) / 6 = 5/6.
    assert roc_area([0.9, 0.5, 0.5], [0.5, 0.1]) == pytest.approx(5 / 6)
    assert roc_area([1.0], [1.0]) == 0.5
    assert roc_area([0.2], [0.8]) == 0.0
    assert roc_area([], [0.3]) is None


def test_score_separation_of_a_run() -> None:
    results = [
        {
            "problem_id": "p",
            "status": "done",
            "iterations": [
                {"iteration": 0, "selected": "7", "candidates": _cands(["7", "5", None], [0, 0, 0], [1.0, 0.5, 0.0])},
                {"iteration": 1, "selected": "7", "candidates": _cands(["7", "4"], [0, 0], [0.5, 0.5])},
            ],
        }
    ]
    s = score_separation(as_results(results), _grade(results, {"p": "7"}))
    # Right: 1.0, 0.5; wrong: 0.5, 0.5; the answerless one is left out.
    # Pairs: 1.0 beats both (2), 0.5 ties both (1) -> 3/4.
    assert s.available and s.auc == pytest.approx(0.75)
    assert (s.right, s.wrong, s.answerless) == (2, 2, 1)
    assert s.right_mean == pytest.approx(0.75) and s.wrong_mean == pytest.approx(0.5)
    unscored = [
        {"problem_id": "p", "iterations": [{"iteration": 0, "selected": "7", "candidates": _cands(["7"], [0])}]}
    ]
    assert not score_separation(as_results(unscored), _grade(unscored, {"p": "7"})).available


def test_score_separation_leaves_out_verifications_without_a_score() -> None:
    # Scores as TMAS stores them: the mean of the verifications, one without a score counted 0.
    cands = _cands(["7", "5", "7", "4", None], [0] * 5, [0.5, 0.5, 0.0, 0.5, 0.0])
    unread, failed = {"score": None, "raw": "no verdict"}, {"score": None, "error": "HTTP 500"}
    checks = [
        [{"score": 1.0}, unread],
        [{"score": 0.5}, {"score": 0.5}],
        [failed, unread],
        [{"score": 0.0}, {"score": 1.0}],
        [{"score": 1.0}, unread],
    ]
    for c, verifications in zip(cands, checks, strict=True):
        c["meta"] = {"verifications": verifications}
    results = [{"problem_id": "p", "iterations": [{"iteration": 0, "selected": "7", "candidates": cands}]}]
    s = score_separation(as_results(results), _grade(results, {"p": "7"}))
    # Read by their readable verifications: right 1.0 (the first; the third has none and is left out) against wrong
    # 0.5 and 0.5: both pairs won, ROC area 1. Counting the unread ones as 0 gave right 0.5, 0.0 against 0.5, 0.5:
    # two ties and two losses, 1/4. Left out: 1 + 2 verifications of candidates with an answer; the answerless one
    # apart.
    assert (s.auc, s.right, s.wrong, s.right_mean, s.wrong_mean) == (1.0, 1, 2, 1.0, 0.5)
    assert (s.unread, s.answerless) == (3, 1)
    assert _separation_text(s, "scored", "score") == (
        "ROC area 1.000 over 1 right and 2 wrong scored candidates; mean score right 1.000, wrong 0.500; 1 scored "
        "candidates without an answer left out; 3 verifications without a score (failed or unreadable) left out, each "
        "candidate scored by its readable ones."
    )


def test_confidence_separation_reads_the_runs_measure() -> None:
    def conf(tail: float, mean: float) -> dict[str, Any]:
        return {"tail": tail, "mean": mean, "lowest_group": tail, "tokens": 10, "window": 4}

    cands = _cands(["7", "5", "7", None], [0, 0, 0, 0])
    for c, measured in zip(cands, [conf(3.0, 1.0), conf(1.0, 2.0), conf(2.0, 2.0), conf(9.0, 9.0)], strict=True):
        c["confidence"] = measured
    results = [{"problem_id": "p", "iterations": [{"iteration": 0, "selected": "7", "candidates": cands}]}]
    grades = _grade(results, {"p": "7"})
    # By the tail: right 3, 2 against wrong 1: every pair won, ROC area 1; the answerless one is left out.
    tail = confidence_separation(as_results(results), grades, "tail")
    assert (tail.auc, tail.right, tail.wrong, tail.answerless, tail.right_mean, tail.wrong_mean) == (
        1.0,
        2,
        1,
        1,
        2.5,
        1.0,
    )
    # By the mean: right 1, 2 against wrong 2: a loss and a tie, (0 + 0.5) / 2.
    assert confidence_separation(as_results(results), grades, "mean").auc == 0.25
    plain = [{"problem_id": "p", "iterations": [{"iteration": 0, "selected": "7", "candidates": _cands(["7"], [0])}]}]
    assert not confidence_separation(as_results(plain), _grade(plain, {"p": "7"}), "tail").available
