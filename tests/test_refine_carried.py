"""A Self-Refine or Verify-Refine trajectory whose refinement gave no answer holds its earlier answered solution:
that solution, not the answerless reply, is its vote in the iteration (the method's answer), its rollout in Pass@1
and MV@k, and the record says so (``meta.carried_from``), in the full record and in its summary. The methods run in
process on the scripted model; the metrics and the selection on records made by hand."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import solve_in_process
from stored_records import as_results
from tmas.grading.grades import SELECTED, Grades
from tmas.methods.base import Candidate, CandidateMeta, ProblemResult
from tmas.methods.selection import held, select_answered
from tmas.reports.metrics import compute_metrics
from tmas.reports.selection_table import selection_table
from tmas.reports.where_lost import where_lost
from tmas.store.records import IterationRecord
from tmas.store.summaries import summarize_result
from tmas.testing import Rule, ScriptedModel, SimScript

Q = "What is 17*23?"
# Three first solutions, told apart by their opening words, each refined into itself except B.
A, B, C = "Path A: 5.\n\n\\boxed{5}", "Path B: 7.\n\n\\boxed{7}", "Path C: 7.\n\n\\boxed{7}"
VERDICT = "The solution is correct."


async def solve(method: str, role: str, first: list[Rule], **params: Any) -> ProblemResult:
    rules = [
        *first,
        Rule(role=role, pattern="Path A", replies=[A]),
        Rule(role=role, pattern="Path B", replies=[VERDICT]),
        Rule(role=role, pattern="Path C", replies=[C]),
        # Verify-Refine: every verification scores 1 (a solution without an answer counts 0 whatever it says).
        Rule(role="verifier", replies=["## Analysis\nEvery step checks out.\n\n## Score\nScore: 1"]),
    ]
    settings = scripted_settings(method={"name": method, "params": {"n": 3, "iterations": 2, **params}})
    return await solve_in_process(ScriptedModel(SimScript(rules=rules), settings), Q)


@pytest.mark.parametrize(("method", "role"), [("self_refine", "refiner"), ("verify_refine", "corrector")])
async def test_the_carried_solution_votes_in_the_last_iteration(method: str, role: str) -> None:
    # Iteration 0: 5, 7, 7 (answer 7). Iteration 1: trajectory 0 writes 5 again, trajectory 1's refinement (and its
    # reminder) has no answer, trajectory 2 writes 7. The trajectories hold 5, 7 (carried from iteration 0), 7: the
    # answer is 7. Counting the new replies alone gave 5 against 7, a tie the earlier holder (5) won.
    result = await solve(method, role, [Rule(role="solution", replies=[A, B, C])])
    it0, it1 = result.iterations
    assert [c.answer for c in it0.candidates] == ["5", "7", "7"]
    assert [c.answer for c in it1.candidates] == ["5", None, "7"]
    assert [c.meta.carried_from for c in it1.candidates] == [None, 0, None]
    assert it1.candidates[1].meta.kept_previous is True
    if method == "verify_refine":
        # Every answered solution scores 1, the answerless correction 0: best_score ties the held 5, 7, 7 and
        # the majority among them is 7.
        assert [c.score for c in it1.candidates] == [1.0, 0.0, 1.0]
        # The iteration's mean score is that of the solutions held (1, 1 carried, 1), not of the replies (2 / 3).
        assert it0.state["mean_score"] == 1.0 and it1.state["mean_score"] == 1.0
    assert result.answer == "7" and result.fallback is None
    assert it1.selected == "7"
    # The chosen solution is the carried one, where it was written: iteration 0, candidate 1.
    assert it1.selection is not None and (it1.selection.iteration, it1.selection.candidate) == (0, 1)
    assert not it1.selection.fallback
    assert any("solution of iteration 0 (answer 7), which counts in its place" in n for n in it1.notes)


@pytest.mark.parametrize(("method", "role"), [("self_refine", "refiner"), ("verify_refine", "corrector")])
async def test_a_failed_first_solution_is_solved_again_and_counts(method: str, role: str) -> None:
    # Iteration 0: trajectory 0's call fails (refused, not retried), 1 and 2 answer 7. Iteration 1: trajectory 0 is
    # solved afresh (5), 1 carries its 7, 2 writes 7. Nothing carries a failed solution: trajectory 0 holds its new
    # one, and the vote is 5, 7, 7.
    first = [
        Rule(role="solution", times=1, error_status=400, error_message="bad request"),
        Rule(role="solution", replies=[B, C, A]),
    ]
    result = await solve(method, role, first)
    it0, it1 = result.iterations
    assert it0.candidates[0].error is not None and [c.answer for c in it0.candidates] == [None, "7", "7"]
    refined = "refine" if method == "self_refine" else "correct"
    assert [c.meta.prompt for c in it1.candidates] == ["generate", refined, refined]
    assert [c.answer for c in it1.candidates] == ["5", None, "7"]
    assert [c.meta.carried_from for c in it1.candidates] == [None, 0, None]
    assert [c.answer for c in held([it0.candidates, it1.candidates], 1)] == ["5", "7", "7"]
    assert result.answer == "7"


def _cand(i: int, answer: str | None, carried_from: int | None = None) -> Candidate:
    meta = CandidateMeta(kept_previous=True if carried_from is not None else None, carried_from=carried_from)
    return Candidate(index=i, answer=answer, meta=meta)


def test_held_and_the_latest_fallback_read_carried_solutions() -> None:
    it0 = [_cand(0, "5"), _cand(1, "7"), _cand(2, "7")]
    # Iteration 1: only trajectory 0 wrote an answer; 1 and 2 carry their 7s.
    it1 = [_cand(0, "5"), _cand(1, None, 0), _cand(2, None, 0)]
    assert held([it0, it1], 1) == [it1[0], it0[1], it0[2]]
    chosen, fell_back = select_answered([it0, it1], "last", "numeric", "vote")
    assert chosen is it0[1] and fell_back is None
    # Iteration 2: every call failed. The latest earlier round's held answers are 5, 7, 7: 7 (its new replies alone
    # would have given 5).
    it2 = [Candidate(index=i, error="boom") for i in range(3)]
    chosen, fell_back = select_answered([it0, it1, it2], "last", "numeric", "vote", fallback_from="latest")
    assert chosen is it0[1]
    assert fell_back is not None and (fell_back.iteration, fell_back.candidate, fell_back.answer) == (0, 1, "7")
    # "all" counts every solution once, where it was written: 5 twice, 7 twice; the newest first holder (5) wins.
    chosen, _ = select_answered([it0, it1], "all", "numeric", "vote")
    assert chosen is it1[0]
    # A record stored before carried_from reads as its own candidates.
    old = [_cand(0, "5"), Candidate(index=1, meta=CandidateMeta(kept_previous=True)), _cand(2, "7")]
    assert held([it0, old], 1) == old


def _record(iteration: int, candidates: list[dict[str, Any]], selected: str) -> dict[str, Any]:
    return {"iteration": iteration, "candidates": candidates, "selected": selected, "calls": 3}


def test_pass_at_1_and_the_vote_count_the_carried_solution() -> None:
    # Gold 7. Iteration 0: 5, 7, 7. Iteration 1: 5, no answer carrying iteration 0's 7, 7.
    it1 = [
        {"index": 0, "answer": "5"},
        {"index": 1, "answer": None, "meta": {"kept_previous": True, "carried_from": 0}},
        {"index": 2, "answer": "7"},
    ]
    results = [
        {
            "problem_id": "p",
            "iterations": [
                _record(0, [{"index": i, "answer": a} for i, a in enumerate(["5", "7", "7"])], "7"),
                _record(1, it1, "7"),
            ],
        }
    ]
    grades = Grades(runs=1)
    for rec in results[0]["iterations"]:
        for c in rec["candidates"]:
            grades.verdicts[("p", rec["iteration"], c["index"])] = [c["answer"] == "7"]
        grades.verdicts[("p", rec["iteration"], SELECTED)] = [True]
    loaded = as_results(results)
    for stored in (loaded, [ProblemResult.model_validate(summarize_result(r)) for r in loaded]):
        it0m, it1m = compute_metrics(stored, grades).iterations
        assert it0m.pass1 == pytest.approx(2 / 3) and it0m.mv == 1.0
        # Held at iteration 1: 5, 7 (graded at iteration 0, candidate 1), 7 -> 2/3; the vote 7 of 5, 7, 7 is right.
        # The replies alone gave 1/3 and a 1-1 tie (0.5).
        assert it1m.pass1 == pytest.approx(2 / 3) and it1m.mv == 1.0


def test_the_summary_keeps_carried_from_alone_of_the_meta() -> None:
    c = Candidate(index=1, text="t", meta=CandidateMeta(kept_previous=True, carried_from=0, prompt="refine"))
    record = IterationRecord(problem_id="p", iteration=1, candidates=[c])
    result = ProblemResult(problem_id="p", method="self_refine", iterations=[record])
    summary = summarize_result(result)
    assert summary["iterations"][0]["candidates"][0]["meta"] == {"carried_from": 0}
    back = ProblemResult.model_validate(summary)
    assert back.iterations[0].candidates[0].meta == CandidateMeta(carried_from=0)


def _graded(result: ProblemResult, gold: str) -> Grades:
    """One judge run grading every candidate and every selected answer of ``result`` by its answer alone."""
    grades = Grades(runs=1)
    for rec in result.iterations:
        for c in rec.candidates:
            grades.verdicts[(result.problem_id, rec.iteration, c.index)] = [c.answer == gold]
        grades.verdicts[(result.problem_id, rec.iteration, SELECTED)] = [rec.selected == gold]
    return grades


async def test_where_lost_finds_a_carried_right_solution_in_the_last_iteration() -> None:
    # Verify-Refine (Self-Refine declares no selection rule). Gold 7. Iteration 0: 5, 7, 5. Iteration 1: 5, trajectory
    # 1 without an answer (carrying its 7, score 1), 5. The trajectories hold 5, 7, 5, all scored 1, and best_score's
    # tie goes to the majority, 5: a right solution was among those the rule chose from, and it passed it over. The
    # new replies alone (5, none, 5) read as if refinement had lost it (only earlier).
    result = await solve("verify_refine", "corrector", [Rule(role="solution", replies=[A, B, A])])
    assert [c.answer for c in result.iterations[-1].candidates] == ["5", None, "5"]
    assert result.answer == "5"
    lost = where_lost("verify_refine", [result], _graded(result, "7"), {}).selection
    assert lost is not None
    assert (lost.returned_right, lost.in_last, lost.only_earlier, lost.never_right) == (0, ["question"], [], [])


def test_held_fills_the_trajectories_a_budget_stop_refused_from_the_iteration_before() -> None:
    it0 = [_cand(0, "5"), _cand(1, "7"), _cand(2, "7")]
    # Iteration 1: trajectory 1 wrote no answer and carries its 7 of iteration 0; trajectory 2 wrote 9.
    it1 = [_cand(0, "5"), _cand(1, None, 0), _cand(2, "9")]
    # Iteration 2, cut by the budget: only trajectory 2's refinement came back; 0 and 1 hold what they held at 1.
    it2 = [_cand(2, "5")]
    assert held([it0, it1, it2], 2, [None, None, [0, 1]]) == [it1[0], it0[1], it2[0]]
    # Without held_over (TMAS, or a record stored before it existed), the iteration reads as its candidates alone.
    assert held([it0, it1, it2], 2) == held([it0, it1, it2], 2, [None, None, None]) == [it2[0]]
    # The vote: 5, 7, 7 of iteration 0 and a cut iteration 1 whose trajectory 0 alone came back with 5: 7, as the
    # trajectories hold it (5 where its one refinement alone voted). The fallback reads them too.
    cut = [_cand(0, "5")]
    chosen, fell_back = select_answered([it0, cut], "last", "numeric", "vote", held_over=[None, [1, 2]])
    assert chosen is it0[1] and fell_back is None
    assert select_answered([it0, cut], "last", "numeric", "vote")[0] is cut[0]
    failed = [Candidate(index=0, error="boom")]
    chosen, fell_back = select_answered([it0, failed], "last", "numeric", "vote", held_over=[None, [1, 2]])
    assert chosen is it0[1] and fell_back is None


def test_the_report_replays_the_cut_iterations_vote_and_pass_at_1_counts_the_calls_that_came_back() -> None:
    # Gold 7. Iteration 0: 5, 7, 7. Iteration 1, cut by the budget: trajectory 0's 5 came back, 1 and 2 were refused.
    results = [
        {
            "problem_id": "p",
            "status": "done",
            "iterations": [
                _record(0, [{"index": i, "answer": a} for i, a in enumerate(["5", "7", "7"])], "7"),
                {**_record(1, [{"index": 0, "answer": "5"}], "7"), "held_over": [1, 2]},
            ],
        }
    ]
    loaded = as_results(results, "self_refine")
    grades = _graded(loaded[0], "7")
    for stored in (loaded, [ProblemResult.model_validate(summarize_result(r)) for r in loaded]):
        assert stored[0].iterations[1].held_over == [1, 2]
        table = selection_table(stored, grades, "numeric")
        # The vote over the held solutions 5, 7, 7 is right, as the run's was; the refinement alone would vote 5.
        assert table.accuracy[("vote", "last")] == [1.0, 1.0]
        # Pass@1 at iteration 1 counts the one call that came back (5: wrong); the held 7s were rollouts of iteration 0.
        it0m, it1m = compute_metrics(stored, grades).iterations
        assert it0m.pass1 == pytest.approx(2 / 3) and it1m.pass1 == 0.0


def test_where_lost_finds_a_right_solution_a_refused_trajectory_holds_in_the_cut_last_iteration() -> None:
    # Verify-Refine, gold 7. p: iteration 0 writes 5, 7, 5; iteration 1 writes 5, no answer (trajectory 1 carries its 7
    # of iteration 0), 5; iteration 2, cut by the budget: trajectory 0's 5 came back, 1 and 2 were refused. The
    # trajectories hold 5, 7 (written at iteration 0), 5 (written at iteration 1) there, as the run voted (5): the rule
    # passed the right 7 over in the last iteration. Read as Pass@1 reads it (the one 5 that came back), refinement
    # would seem to have lost it. q: iteration 0 writes 7, 5; iteration 1 writes 5 and its trajectory 1 is refused,
    # holding its 5: no right solution is held there, so refinement lost the 7 (only earlier).
    carried = {"index": 1, "answer": None, "meta": {"kept_previous": True, "carried_from": 0}}
    results = [
        {
            "problem_id": "p",
            "status": "done",
            "iterations": [
                _record(0, [{"index": i, "answer": a} for i, a in enumerate(["5", "7", "5"])], "5"),
                _record(1, [{"index": 0, "answer": "5"}, carried, {"index": 2, "answer": "5"}], "5"),
                {**_record(2, [{"index": 0, "answer": "5"}], "5"), "held_over": [1, 2]},
            ],
        },
        {
            "problem_id": "q",
            "status": "done",
            "iterations": [
                _record(0, [{"index": 0, "answer": "7"}, {"index": 1, "answer": "5"}], "5"),
                {**_record(1, [{"index": 0, "answer": "5"}], "5"), "held_over": [1]},
            ],
        },
    ]
    loaded = as_results(results, "verify_refine")
    grades = _graded(loaded[0], "7")
    grades.verdicts.update(_graded(loaded[1], "7").verdicts)
    for stored in (loaded, [ProblemResult.model_validate(summarize_result(r)) for r in loaded]):
        lost = where_lost("verify_refine", stored, grades, {}).selection
        assert lost is not None
        assert (lost.returned_right, lost.in_last, lost.only_earlier, lost.never_right) == (0, ["p"], ["q"], [])
