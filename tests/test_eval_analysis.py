"""The paper's analyses on hand-made records: B.4 score dynamics, B.3 unique guidelines, C trace, stopping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stored_records import as_results, as_stored
from tmas.config import Budget
from tmas.grading.grades import Grades
from tmas.reports.analysis import (
    experience_trace,
    score_dynamics,
    stopping_summary,
    stopping_tradeoff,
    unique_guidelines,
)
from tmas.reports.budget_table import BudgetSpend
from tmas.reports.metrics import compute_metrics
from tmas.reports.report import RunEvaluation, _stopping_comparisons, without_stopping
from tmas.store.records import BUDGET_STOP

pytest.importorskip("scipy")


def _result(pid: str, scores: list[list[float]], correct: list[list[bool]], **extra: Any) -> dict[str, Any]:
    iterations = []
    for t, (row, ok) in enumerate(zip(scores, correct, strict=True)):
        cands = [
            {"index": i, "answer": "1" if c else "2", "score": s} for i, (s, c) in enumerate(zip(row, ok, strict=True))
        ]
        iterations.append({"iteration": t, "candidates": cands, "selected": None, "state": extra.get("state", {})})
    return {"problem_id": pid, "iterations": iterations, **{k: v for k, v in extra.items() if k != "state"}}


def _grades(results: list[dict[str, Any]]) -> Grades:
    grades = Grades(runs=1)
    for r in results:
        for rec in r["iterations"]:
            for c in rec["candidates"]:
                grades.verdicts[(r["problem_id"], rec["iteration"], c["index"])] = [c["answer"] == "1"]
    return grades


def test_score_dynamics_groups_and_test() -> None:
    results = [
        _result("e1", [[0.6, 0.8], [0.7, 0.7]], [[False, True], [False, False]]),
        _result("e2", [[0.5, 0.5], [0.6, 0.6]], [[False, False], [True, True]]),
        _result("n1", [[0.9, 0.9], [1.0, 0.8]], [[False, False], [False, False]]),
        _result("n2", [[0.8, 1.0], [0.9, 0.9]], [[False, False], [False, False]]),
    ]
    d = score_dynamics(as_results(results), _grades(results))
    assert d.available and d.ever_correct == ["e1", "e2"] and d.never_correct == ["n1", "n2"]
    # Per-problem means: e1 0.7, e2 0.55, n1 0.9, n2 0.9.
    assert d.ever_mean == pytest.approx(0.625) and d.never_mean == pytest.approx(0.9)
    assert d.delta == pytest.approx(0.275)
    assert d.ever_by_iteration == pytest.approx([0.6, 0.65])
    assert d.u_statistic == pytest.approx(4.0) and d.p_value is not None and 0 < d.p_value <= 1


def test_score_dynamics_reads_the_verifiers_scores_not_the_selection_rule() -> None:
    # B.4 compares the verification scores of ever- and never-correct problems. A candidate's stored score is the
    # method's selection score: 0 by rule for a failed call or an answerless reply, and 0 for an unreadable
    # verification. The analysis reads what the verifiers gave instead.
    def verified(index: int, answer: str | None, scores: list[float | None], score: float) -> dict[str, Any]:
        meta = {"verifications": [{"score": s} for s in scores]}
        return {"index": index, "answer": answer, "score": score, "meta": meta}

    never = [
        verified(0, "2", [1.0, 1.0], 1.0),  # verifiers 1.0, 1.0 -> 1.0
        verified(1, None, [1.0, 0.5], 0.0),  # answerless, scored 0 by rule; verifiers 1.0, 0.5 -> 0.75
        verified(2, "2", [0.5, None], 0.25),  # one verification unreadable (0 in the selection score) -> 0.5
        {"index": 3, "answer": None, "score": 0.0, "error": "timeout"},  # never verified: no verification score
        {"index": 4, "answer": None, "score": 0.0, "meta": {"unverified": True}},  # empty reply: not verified
    ]
    ever = [verified(0, "1", [0.5, 0.0], 0.25)]  # right, verifiers 0.5, 0.0 -> 0.25
    results = [
        {"problem_id": "n1", "iterations": [{"iteration": 0, "candidates": never, "selected": None}]},
        {"problem_id": "e1", "iterations": [{"iteration": 0, "candidates": ever, "selected": None}]},
    ]
    d = score_dynamics(as_results(results), _grades(results))
    assert d.ever_correct == ["e1"] and d.never_correct == ["n1"]
    # n1: (1.0 + 0.75 + 0.5) / 3 = 0.75 over the three verified candidates (the stored scores would give
    # (1.0 + 0 + 0.25 + 0 + 0) / 5 = 0.25). e1: 0.25. Delta(wrong - correct) = 0.75 - 0.25 = 0.5.
    assert d.per_problem == pytest.approx({"n1": 0.75, "e1": 0.25})
    assert d.never_by_iteration == pytest.approx([0.75]) and d.ever_by_iteration == pytest.approx([0.25])
    assert d.delta == pytest.approx(0.5)


def test_score_dynamics_without_scores_says_so() -> None:
    results = [_result("a", [[0.5]], [[True]])]
    results[0]["iterations"][0]["candidates"][0]["score"] = None
    assert not score_dynamics(as_results(results), _grades(results)).available


def test_unique_guidelines_and_trace_read_the_tmas_banks() -> None:
    def strategy(sid: str, text: str) -> dict[str, Any]:
        return {"id": sid, "description": text, "first_iteration": 0, "last_iteration": 1}

    def entry(eid: str, text: str) -> dict[str, Any]:
        return {"id": eid, "kind": "heuristic", "content": text}

    # As TMAS stores them (TMASState): banks keep their ids when the agent rewords an entry.
    bank_0 = {
        "guideline_bank": {"strategies": [strategy("G1", "direct")]},
        "experience_bank": {"entries": [entry("E1", "tile 2x1 both ways")]},
    }
    bank_1 = {
        "guideline_bank": {"strategies": [strategy("G1", "direct, reworded"), strategy("G2", "DP")]},
        "experience_bank": {"entries": [entry("E1", "tile 2x1 both ways"), entry("E2", "T(2)=3")]},
    }
    result = _result("p", [[0.5, 0.5], [0.5, 0.5]], [[False, False], [True, False]])
    result["iterations"][0]["state"], result["iterations"][1]["state"] = bank_0, bank_1
    diversity = unique_guidelines(as_results([result]), {"name": "tmas", "params": {"epsilon": 0.2}})
    assert diversity.available and diversity.per_problem == {"p": 2} and diversity.epsilon == 0.2
    trace = experience_trace(as_stored(result), _grades([result]))
    assert trace.available
    assert [(r.correct, r.new_entries) for r in trace.rows] == [(0, ["tile 2x1 both ways"]), (1, ["T(2)=3"])]
    assert not unique_guidelines(as_results([_result("q", [[0.1]], [[True]])]), None).available


def test_stopping_tradeoff_against_a_full_run() -> None:
    full = [_result("a", [[0, 0], [0, 0]], [[False, False], [True, True]])]
    stopped = [_result("a", [[0, 0]], [[False, False]], stopped_reason="agreement")]
    for runs in (full, stopped):
        for rec in runs[0]["iterations"]:
            rec["usage"] = {"prompt_tokens": 50, "completion_tokens": 50}
    summary = stopping_summary(as_results(stopped))
    assert summary.stopped == 1 and summary.reasons == {"agreement": 1} and summary.mean_stop_iteration == 0
    stopped_metrics = compute_metrics(as_results(stopped), _grades(stopped))
    stopping_tradeoff(summary, stopped_metrics, compute_metrics(as_results(full), _grades(full)))
    assert summary.tokens_saved == 100 and summary.tokens_saved_share == pytest.approx(0.5)
    assert summary.pass1_lost == pytest.approx(1.0)
    # Per problem: a stopped run of two such problems saves as much against the same full run (it spent 200 in all,
    # as much as the full run's one problem, and 100 a problem).
    twice = [stopped[0], {**stopped[0], "problem_id": "b"}]
    stopping_tradeoff(
        summary, compute_metrics(as_results(twice), _grades(twice)), compute_metrics(as_results(full), _grades(full))
    )
    assert summary.tokens_saved == 100 and summary.tokens_saved_share == pytest.approx(0.5)
    assert summary.compared == 1


def test_stopping_tradeoff_stands_on_the_problems_both_runs_finished() -> None:
    # The full run: a right at It1 (Pass@1 1), b still mid-way after It0 (no final state). The stopping run: a
    # stopped wrong at It0 (0), b finished right at It1 (1). Over a alone: 1 lost and 100 tokens saved of 200; over
    # both runs' last rows it would read 1 - 1/2 = 1/2 lost.
    full = [
        _result("a", [[0, 0], [0, 0]], [[False, False], [True, True]]),
        _result("b", [[0, 0]], [[True, True]], status="running"),
    ]
    stopped = [
        _result("a", [[0, 0]], [[False, False]], stopped_reason="agreement"),
        _result("b", [[0, 0], [0, 0]], [[False, False], [True, True]]),
    ]
    for runs in (full, stopped):
        for r in runs:
            for rec in r["iterations"]:
                rec["usage"] = {"prompt_tokens": 50, "completion_tokens": 50}
    summary = stopping_summary(as_results(stopped))
    stopping_tradeoff(
        summary,
        compute_metrics(as_results(stopped), _grades(stopped)),
        compute_metrics(as_results(full), _grades(full)),
    )
    assert summary.compared == 1
    assert summary.pass1_lost == pytest.approx(1.0)
    assert summary.tokens_saved == 100 and summary.tokens_saved_share == pytest.approx(0.5)


def test_a_stopping_run_is_compared_with_a_full_run_of_its_other_parameters() -> None:
    stopping = {"k": 16, "stop": "beta", "stop_threshold": 0.95, "round_size": 4, "online_stop": True, "warmup": 8}
    assert without_stopping(stopping) == {"k": 16}
    tmas = {"n": 8, "early_stop": True, "early_stop_patience": 2, "early_stop_score": 0.9, "iterations": 4}
    assert without_stopping(tmas) == {"n": 8, "iterations": 4}


def test_problems_a_budget_stopped_are_no_adaptive_stops() -> None:
    # a: the vote decided after It0 (3 calls); b: the budget stopped it after It0 (5 calls); c ran both iterations.
    results = [
        _result("a", [[0, 0]], [[True, True]], stopped_reason="vote decided", calls=3),
        _result("b", [[0, 0]], [[True, False]], stopped_reason=BUDGET_STOP, calls=5),
        _result("c", [[0, 0], [0, 0]], [[True, True], [True, True]], calls=4),
    ]
    summary = stopping_summary(as_results(results))
    assert (summary.stopped, summary.reasons, summary.mean_calls) == (1, {"vote decided": 1}, 3.0)
    # A run that only a budget stopped stopped nothing early.
    assert not stopping_summary(as_results(results[1:])).any


def test_a_run_a_budget_stopped_is_no_full_run_to_compare_a_stopping_run_with() -> None:
    stopped = [_result("a", [[0, 0]], [[False, False]], stopped_reason="vote decided")]
    cut = [_result("a", [[0, 0]], [[False, False]], stopped_reason=BUDGET_STOP)]
    full = [_result("a", [[0, 0], [0, 0]], [[False, False], [True, True]])]
    for runs in (stopped, cut, full):
        for rec in runs[0]["iterations"]:
            rec["usage"] = {"prompt_tokens": 50, "completion_tokens": 50}

    def evaluation(label: str, results: list[dict[str, Any]], budget_stops: int) -> RunEvaluation:
        params = {"k": 2, "stop": "beta"} if label == "stopping" else {"k": 2}
        spend = BudgetSpend(Budget(calls=4), [100], [2], budget_stops, []) if budget_stops else None
        return RunEvaluation(
            run_dir=Path(label),
            label=label,
            benchmark="b",
            method="majority",
            params=params,
            model=None,
            problems=1,
            done=1,
            failed=0,
            metrics=compute_metrics(as_results(results), _grades(results)),
            grades=None,
            stopping=stopping_summary(as_results(results)),
            budget=spend,
        )

    stopping = evaluation("stopping", stopped, 0)
    _stopping_comparisons([stopping, evaluation("cut", cut, 1)])
    assert stopping.stopping is not None and stopping.stopping.compared is None
    _stopping_comparisons([stopping, evaluation("cut", cut, 1), evaluation("full", full, 0)])
    assert stopping.stopping.compared == 1 and stopping.stopping.tokens_saved == 100
