"""Every table and plot on a token axis charges a run for every completion token the server generated for it: a call
that failed and was asked again on resume spent tokens that no iteration record holds (its record is the pass that
finished it), and the run's summary, the cost table, the frontier, the equal-budget table, the per-iteration table and
the budget table count the same total. Prompt tokens of a failed attempt are not counted (none is stored)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import settings_for
from tmas.config import Budget
from tmas.grading.grades import GradeConfig, Grades
from tmas.llm.types import Usage
from tmas.problems import Problem
from tmas.reports.budget_table import budget_spend
from tmas.reports.frontier import equal_budget
from tmas.reports.metrics import Spend, compute_metrics, run_spend, spent_through
from tmas.reports.report import evaluate_run
from tmas.runner import pooled_left, prepare_run, run_problems
from tmas.store.call_stats import Spent
from tmas.store.records import IterationRecord, ProblemResult
from tmas.testing import Rule, ScriptedUsage, SimScript, SimServer

# 1,000 words of thinking: the simulator streams them as 1,000 tokens, 5,000 characters the client counts as 1,250
# completion tokens (about 4 characters a token: the server reports no usage for a stream it cut).
THOUGHT = "step " * 1000
BOXED = "So 391.\n\n\\boxed{391}"
CUT = Rule(fault="cut", fault_after_tokens=1000, reasoning=THOUGHT, replies=[BOXED], times=1)
ANSWER = Rule(replies=[BOXED], usage=ScriptedUsage(prompt_tokens=10, completion_tokens=40))


async def test_a_call_asked_again_on_resume_is_charged_in_every_token_figure_of_the_report(tmp_path: Path) -> None:
    # CoT on one problem under a budget of 4,000 completion tokens (max_tokens 2,048), the client trying each call
    # once. The first run's call is cut after 1,250 completion tokens and fails; the resume asks it again and it
    # answers with 40 (and 10 prompt tokens). Worked by hand: 2 calls, 1,250 + 40 = 1,290 completion tokens, 10
    # prompt tokens (the cut attempt's prompt is not counted). The iteration's record holds the answered call alone.
    run_dir = tmp_path / "run"
    problem = Problem(problem_id="q", question="What is 17*23?", answer="391")
    with SimServer(SimScript(persona="vllm", rules=[CUT, ANSWER])) as sim:
        settings = settings_for(
            sim, retry__max_attempts=1, sampling__max_tokens=2048, method={"name": "cot"}, budget={"tokens": 4000}
        )
        store, settings, todo = prepare_run(run_dir, settings, [problem], resume=False)
        with store:
            first = await run_problems(settings, todo, store)
        store, settings, todo = prepare_run(run_dir, settings, None, resume=True)
        with store:
            summary = await run_problems(settings, todo, store)
            [record] = store.iterations("q")
    assert (first.failed_calls, first.completion_tokens) == (1, 1250)
    assert (summary.failed_calls, summary.asked_again_calls) == (0, 1)
    assert (summary.prompt_tokens, summary.completion_tokens) == (10, 1290)
    assert (record.calls, record.usage.completion_tokens) == (1, 40)

    e = await evaluate_run(run_dir, GradeConfig(mode="rules"), None)
    assert (e.cost.calls, e.cost.usage.completion_tokens) == (2, 1290)
    # The frontier and the equal-budget table: the answer after It0, at 1,290 completion tokens (not 40), so the
    # run has no point at or under 1,000.
    [point] = e.frontier
    assert (point.label, point.tokens, point.accuracy) == ("It0", 1290.0, 1.0)
    assert equal_budget(e.frontier, (1000, 2000)) == [None, point]
    # The per-iteration table: the iteration's 2 calls and their tokens, 1,300 prompt + completion per problem.
    it0 = e.metrics.at(0)
    assert it0 is not None
    assert (it0.calls, it0.prompt_tokens, it0.completion_tokens, it0.tokens_per_problem) == (2, 10, 1290, 1300.0)
    # The budget table: what the problem spent, as the budget counts it, and its calls as a call budget counts them
    # (the failed call once, as the call asked in its place).
    assert e.budget is not None and (e.budget.tokens, e.budget.calls) == ([1290], [1])
    # The run's own section compares its final state at the same spend.
    assert e.metrics.finals["q"].tokens == 1300


def _record(iteration: int, completion: int) -> IterationRecord:
    return IterationRecord(
        problem_id="q", iteration=iteration, candidates=[], calls=1, usage=Usage(completion_tokens=completion)
    )


def _completion(usage: Usage) -> int:
    return usage.completion_tokens


@pytest.mark.parametrize(
    ("status", "through", "expected"),
    [
        # Finished, read at an iteration it reached: the calls of iterations 0 and 1 (5 + 2 + 7).
        ("done", 1, 14),
        # Finished, read past its last iteration or in all: every call, iteration 2's cut one (11) and the call of
        # no iteration (3) included.
        ("done", 4, 28),
        ("done", None, 28),
        # Still mid-way (no result yet), having finished iterations 0 and 1: the unfinished iteration 2 is not
        # counted, nor the call of no iteration, however far it is read.
        ("running", 4, 14),
        ("running", None, 14),
        ("running", 0, 7),
    ],
)
def test_a_problem_s_spend_is_its_stored_calls_by_iteration(status: str, through: int | None, expected: int) -> None:
    # The records say 5 and 6 completion tokens; the stored calls also hold, in iteration 0, a call that failed
    # and was asked again (2 tokens), and in iteration 1 one more (1).
    records = [_record(0, 5), _record(1, 6)]
    result = ProblemResult(problem_id="q", method="cot", status=status, iterations=records)
    spend: Spend = {
        "q": {
            0: Spent(2, Usage(completion_tokens=7)),
            1: Spent(2, Usage(completion_tokens=7)),
            2: Spent(1, Usage(completion_tokens=11)),
            None: Spent(1, Usage(completion_tokens=3)),
        }
    }
    assert spent_through(result, through, _completion, spend) == expected
    # Without the store's calls: the records alone.
    records_only = {1: 11, 4: 11, None: 11, 0: 5}[through]
    assert spent_through(result, through, _completion) == records_only


def test_the_per_iteration_calls_of_a_run_are_its_stored_calls_of_each_iteration() -> None:
    # Two finished problems of one iteration; the stored calls of "a" hold a failed call asked again (1 call, 9
    # tokens) that its record does not.
    results = [
        ProblemResult(problem_id=pid, method="cot", status="done", iterations=[_record(0, 4)]) for pid in ("a", "b")
    ]
    spend: Spend = {"a": {0: Spent(2, Usage(completion_tokens=13))}, "b": {0: Spent(1, Usage(completion_tokens=4))}}
    grades = Grades(runs=1)
    it0 = compute_metrics(results, grades, spend=spend).at(0)
    assert it0 is not None and (it0.calls, it0.completion_tokens) == (3, 17)
    # Without the store's calls: the records' count.
    plain = compute_metrics(results, grades).at(0)
    assert plain is not None and (plain.calls, plain.completion_tokens) == (2, 8)


@pytest.mark.parametrize("pool", [False, True])
async def test_a_problem_solved_again_on_resume_starts_its_budget_from_its_failed_calls(
    tmp_path: Path, pool: bool
) -> None:
    # Majority vote of 4 under 1,300 completion tokens (max_tokens 2,048: the samples go one at a time). The first
    # run: sample 0 is cut after 1,250 tokens and fails, samples 1 and 2 answer with 40 each (1,330), and the budget
    # refuses sample 3. The resume solves the problem again (it has a failed call) from the 1,250 its failed call
    # spent: sample 0 asked again answers (1,290), sample 1 is replayed (1,330), and the budget refuses sample 2, as
    # the first run stopped with that much spent. Counted from the resumed pass alone (40 + 40 + 40 + 40 = 160) the
    # budget let all 4 samples go, and the problem stored 1,410 completion tokens under its 1,300.
    run_dir = tmp_path / "run"
    problem = Problem(problem_id="q", question="What is 17*23?", answer="391")
    budget = {"tokens": 1300, "pool": pool}
    with SimServer(SimScript(persona="vllm", rules=[CUT, ANSWER])) as sim:
        settings = settings_for(
            sim, retry__max_attempts=1, sampling__max_tokens=2048, method={"name": "majority", "params": {"k": 4}}
        )
        settings = settings.model_copy(update={"budget": Budget.model_validate(budget)})
        store, settings, todo = prepare_run(run_dir, settings, [problem], resume=False)
        with store:
            await run_problems(settings, todo, store)
            first = store.result("q")
        store, settings, todo = prepare_run(run_dir, settings, None, resume=True)
        with store:
            await run_problems(settings, todo, store)
            result = store.result("q")
            left = pooled_left(store, settings.budget, {"q"})
            table = budget_spend(store.get_meta("settings"), [result] if result else [], run_spend(store))
    assert first is not None and (first.calls, first.usage.completion_tokens, first.stopped_reason) == (
        3,
        1330,
        "budget",
    )
    assert result is not None and result.stopped_reason == "budget"
    assert (result.calls, result.failed_calls, result.usage.completion_tokens) == (3, 0, 1330)
    assert [len(record.candidates) for record in result.iterations] == [2]
    # A pooled budget's problem left nothing for the others: it spent 30 past its share.
    assert left == (-30 if pool else 0)
    # The budget table counts every stored call: sample 2 of the first run, answered but not asked again by the
    # resume (the budget refused it first), was spent too (1,330 + 40).
    assert table is not None and (table.tokens, table.calls) == ([1370], [4])
