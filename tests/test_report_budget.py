"""The report puts each run's budget beside what its problems spent (as the budget counts), and its cost table says
which tokens each per-problem column counts. Runs made in process on the scripted model, figures worked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.config import Sampling
from tmas.grading.grades import GradeConfig
from tmas.llm.types import CallKey, ChatRequest, Completion, Usage, user
from tmas.problems import Problem
from tmas.reports.budget_table import budget_spend
from tmas.reports.report import build_report
from tmas.store.records import ProblemResult
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript

pytest.importorskip("matplotlib")

# Every reply: 100 prompt and 30 completion tokens.
THIRTY = SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=100, completion_tokens=30))])


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading``, as cells."""
    lines = markdown[markdown.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    return table


def two_problems(tmp_path: Path) -> Path:
    """A JSONL of two multiplication problems."""
    problems = tmp_path / "p.jsonl"
    rows = [{"problem_id": f"p{i}", "question": f"What is {i + 3}*7?", "answer": str((i + 3) * 7)} for i in range(2)]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return problems


async def test_the_report_shows_budget_and_spend_side_by_side(tmp_path: Path) -> None:
    problems = two_problems(tmp_path)
    # Majority vote, one sample an iteration, 50 iterations; 100 completion tokens a problem: calls at 0, 30, 60 and
    # 90 go (each alone: max_tokens 256 passes what is left), the fifth, at 120, is refused. 120 spent, 4 calls.
    one_a_time = {"name": "majority", "params": {"k": 1, "iterations": 50}}
    budgeted = scripted_settings(method=one_a_time, budget={"tokens": 100})
    await scripted_run(ScriptedModel(THIRTY, budgeted), tmp_path / "budgeted", problems)
    # The same by prompt + completion, 300 a problem: 130 a call, so calls at 0 and 130 go, the third at 260 goes
    # too (260 < 300), and 390 stops it: 390 spent, 3 calls.
    total = scripted_settings(method=one_a_time, budget={"tokens": 300, "count": "total"})
    await scripted_run(ScriptedModel(THIRTY, total), tmp_path / "total", problems)
    # Two iterations of one sample under the same 100: 60 spent, the iterations end first; 60% of the budget.
    short = scripted_settings(method={"name": "majority", "params": {"k": 1, "iterations": 2}}, budget={"tokens": 100})
    await scripted_run(ScriptedModel(THIRTY, short), tmp_path / "short", problems)
    free = scripted_settings(method={"name": "cot", "params": {}})
    await scripted_run(ScriptedModel(THIRTY, free), tmp_path / "free", problems)

    runs = [tmp_path / "budgeted", tmp_path / "total", tmp_path / "short", tmp_path / "free"]
    await build_report(runs, tmp_path / "report", GradeConfig(mode="rules"), None)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert table_rows(markdown, "Budget and spend per problem") == [
        [
            "majority [sim-model] (iterations=50) <budgeted>",
            "100 completion tokens",
            "120 completion tokens",
            "120 completion tokens",
            "2 of 2",
            "0 of 2",
        ],
        [
            "majority [sim-model] (iterations=50) <total>",
            "300 prompt + completion tokens",
            "390 prompt + completion tokens",
            "390 prompt + completion tokens",
            "2 of 2",
            "0 of 2",
        ],
        [
            "majority [sim-model] (iterations=2) <short>",
            "100 completion tokens",
            "60 completion tokens",
            "60 completion tokens",
            "0 of 2",
            "2 of 2 (60%)",
        ],
    ]
    assert (
        "Not at the budget: majority [sim-model] (iterations=2) <short>. Problems that ended under the budget"
        in markdown
    )
    cost = table_rows(markdown, "### Cost")
    header = markdown[markdown.index("### Cost") :].splitlines()
    assert any("Completion tokens/problem | Prompt + completion tokens/problem" in line for line in header[:6])
    # cot: one call a problem, 30 completion and 130 prompt + completion tokens.
    assert [row[8:10] for row in cost if row[0].startswith("cot")] == [["30", "130"]]
    assert (
        "Completion tokens/problem is what the frontier, the equal-budget table and the budget table count" in markdown
    )


async def test_a_run_stopped_early_costs_per_problem_it_started(tmp_path: Path) -> None:
    problems = two_problems(tmp_path)
    run = tmp_path / "cot"
    await scripted_run(ScriptedModel(THIRTY, scripted_settings(method={"name": "cot", "params": {}})), run, problems)
    # Two more problems in the run that it never started (as when a long run is stopped and reported).
    with RunStore(run) as store:
        store.add_problems(
            [Problem(problem_id=f"later{i}", question=f"What is {i}+1?", answer=str(i + 1)) for i in (1, 2)]
        )

    await build_report([run], tmp_path / "report", GradeConfig(mode="rules"), None)
    markdown = (tmp_path / "report" / "report.md").read_text()
    # 2 calls of 30 completion and 130 prompt + completion tokens over the 2 problems started, not the 4 it holds.
    assert [row[8:10] for row in table_rows(markdown, "### Cost")] == [["30", "130"]]


async def test_the_cost_table_counts_the_judge_calls_apart(tmp_path: Path) -> None:
    problems = two_problems(tmp_path)
    run = tmp_path / "cot"
    await scripted_run(ScriptedModel(THIRTY, scripted_settings(method={"name": "cot", "params": {}})), run, problems)
    # What grading by a judge leaves in the run: its calls, one of them failed after its retries.
    judged = [(40, 5, None), (30, 0, "gave up after 3 attempts: timeout")]
    with RunStore(run) as store:
        for sample, (prompt, completion, error) in enumerate(judged):
            request = ChatRequest(model="judge-model", messages=[user("Is 21 equal to 21?")], sampling=Sampling())
            key = CallKey(problem_id="p0", role="judge", sample=sample)
            usage = Usage(prompt_tokens=prompt, completion_tokens=completion)
            call = Completion(key=key, request_hash=request.request_hash(key), usage=usage, error=error)
            store.record_call(call, request)

    await build_report([run], tmp_path / "report", GradeConfig(mode="rules"), None)
    markdown = (tmp_path / "report" / "report.md").read_text()
    [row] = table_rows(markdown, "### Cost")
    # The method's 2 calls of 100 + 30 tokens; the judge's 2 calls and their 40 + 5 + 30 tokens apart.
    assert (row[1], row[4], row[6], row[10], row[11]) == ("2", "200", "60", "2", "75")
    # The judge's failed call is the judge's, not one of the run's (its Failed column says 0): named apart.
    assert row[2] == row[3] == "0" and "- judge calls failed: 1 (unknown 1)" in markdown
    assert "- calls failed:" not in markdown


def test_under_the_budget_counts_a_pooled_problems_draws_and_a_call_budget() -> None:
    def result(pid: str, completion: int, calls: int, drawn: int = 0, stopped: str | None = None) -> ProblemResult:
        usage = Usage(completion_tokens=completion)
        return ProblemResult(
            problem_id=pid, method="majority", calls=calls, usage=usage, budget_drawn=drawn, stopped_reason=stopped
        )

    # A pooled 100: p1 settled at 40 (40%), p2 drew 50 and ended at 120 of its 150 (80%), p3 was stopped by it.
    pooled = {"budget": {"tokens": 100, "pool": True}}
    spend = budget_spend(pooled, [result("p1", 40, 2), result("p2", 120, 5, 50), result("p3", 130, 6, 30, "budget")])
    assert spend is not None and spend.under == [0.4, 0.8] and spend.stopped == 1
    # A budget of 4 calls: p1 ended after 1 call (25%), p2 sent its 4 without being stopped: at the budget.
    spend = budget_spend({"budget": {"calls": 4}}, [result("p1", 10, 1), result("p2", 40, 4)])
    assert spend is not None and spend.under == [0.25]
