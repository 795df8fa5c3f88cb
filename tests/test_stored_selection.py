"""The candidate a method returned is stored with each iteration's record (``IterationRecord.selection``), and the
report's table of selection rules reads the run's own rule from it instead of choosing again."""

from __future__ import annotations

from typing import Any

from scripted_runs import run_scripted
from stored_records import as_results
from tmas.grading.grades import SELECTED, Grades
from tmas.methods.base import ProblemResult, Selection
from tmas.reports.selection_table import selection_table
from tmas.testing import Rule


def boxed(answer: str) -> str:
    return f"Working it out by hand.\n\n\\boxed{{{answer}}}"


def chosen(result: ProblemResult) -> list[tuple[str | None, str | None]]:
    """Per record: the stored selection's answer (found by its iteration and index) beside the record's answer."""
    out = []
    for record in result.iterations:
        where = record.selection
        if where is None:
            out.append((None, record.selected))
            continue
        [source] = [r for r in result.iterations if r.iteration == where.iteration]
        candidate = next((c for c in source.candidates if c.index == where.candidate), None)
        out.append((candidate.answer if candidate else "missing", record.selected))
    return out


async def test_each_method_that_returns_a_candidate_stores_which_one() -> None:
    for method, params in (
        ("cot", {}),
        ("majority", {"k": 3}),
        ("self_refine", {"n": 2, "iterations": 2}),
        ("verify_refine", {"n": 2, "m": 1, "iterations": 2}),
        ("pacore", {"responses_per_round": 2, "iterations": 1}),
        ("rse", {"n": 2, "iterations": 2}),
        ("tmas", {"n": 2, "m": 1, "iterations": 2}),
    ):
        result, _ = await run_scripted(method, **params)
        assert result.answer == "391", method
        assert all(s is not None for s in (r.selection for r in result.iterations)), method
        assert all(stored == returned for stored, returned in chosen(result)), method


async def test_a_vote_over_every_iteration_stores_the_earlier_holder() -> None:
    # Majority vote, k = 2: iteration 0 draws 7 and 9 (7 wins the tie, drawn first); iteration 1 draws 9 and 7, and
    # the vote over all four is still 7: iteration 0's first sample.
    rules = [Rule(role="solution", replies=[boxed("7"), boxed("9"), boxed("9"), boxed("7")])]
    result, _ = await run_scripted("majority", rules, k=2, iterations=2)
    assert [r.selection for r in result.iterations] == [Selection(iteration=0, candidate=0)] * 2


async def test_a_fallback_is_stored_as_one() -> None:
    # PaCoRe's round votes 9 (candidates 1 and 2); the synthesis boxes nothing: the answer falls back to the round's.
    rules = [
        Rule(role="solution", replies=[boxed("7"), boxed("9"), boxed("9")]),
        Rule(role="synthesis", replies=["The solution is correct."]),
    ]
    result, _ = await run_scripted("pacore", rules, responses_per_round=3, iterations=1)
    assert [r.selection for r in result.iterations] == [
        Selection(iteration=0, candidate=1),
        Selection(iteration=0, candidate=1, fallback=True),
    ]


async def test_a_decision_that_is_no_candidate_stores_none() -> None:
    result, _ = await run_scripted("mattrl", iterations=1, team_size=2)
    assert result.answer == "391" and result.iterations and all(r.selection is None for r in result.iterations)


def two_candidates(selection: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One problem, one iteration: candidate 0 answers 7 (score 1.0, right), candidate 1 answers 5 (score 0, wrong);
    the run returned ``selection``'s candidate (its selected answer 5 where the record stores none)."""
    candidates = [{"index": 0, "answer": "7", "score": 1.0}, {"index": 1, "answer": "5", "score": 0.0}]
    record: dict[str, Any] = {"iteration": 0, "selected": "5", "candidates": candidates}
    if selection is not None:
        record["selection"] = selection
    return [{"problem_id": "p", "status": "done", "iterations": [record]}]


GRADES = Grades(runs=1, verdicts={("p", 0, 0): [True], ("p", 0, 1): [False], ("p", 0, SELECTED): [False]})


def test_the_report_reads_the_runs_own_rule_from_what_the_run_chose() -> None:
    # best_score over the last candidates would choose candidate 0 (right); the run chose candidate 1 (wrong).
    stored = as_results(two_candidates({"iteration": 0, "candidate": 1}), "verify_refine")
    own = selection_table(stored, GRADES, "numeric", own=("best_score", "last"))
    assert own.own == ("best_score", "last") and own.accuracy[("best_score", "last")] == [0.0]
    # Every other rule is replayed on the stored candidates: best score and the weighted vote choose candidate 0.
    assert own.accuracy[("score_weighted_vote", "last")] == [1.0]
    replayed = selection_table(stored, GRADES, "numeric")
    assert replayed.own is None and replayed.accuracy[("best_score", "last")] == [1.0]


def test_a_record_stored_before_selections_reports_its_returned_answer() -> None:
    older = as_results(two_candidates(None), "verify_refine")
    table = selection_table(older, GRADES, "numeric", own=("best_score", "last"))
    assert table.accuracy[("best_score", "last")] == [0.0]  # the returned 5, graded wrong
