"""A call that failed and was asked again (a resume asks each failed call once more) is the run's history: it counts as
a call and for the tokens the server generated for it, and as no failure of the run. The run's summary, ``tmas
report`` (its cost table and its failures line), the viewer's runs page and run page give one set of figures."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.config import Sampling
from tmas.grading.grades import GradeConfig
from tmas.llm.types import CallKey, ChatRequest, Completion, Usage, user
from tmas.planning.estimate import rates_from_role_costs
from tmas.problems import Problem
from tmas.reports.report import build_report
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript
from tmas.view.app import view_app
from web_helpers import AppThread, get, run_ref_for

# Every answered solution call reports 10 prompt and 5 completion tokens.
USAGE = ScriptedUsage(prompt_tokens=10, completion_tokens=5)
ANSWER = Rule(role="solution", replies=["Seven twice: \\boxed{14}"], usage=USAGE)


def _numbers(html: str) -> list[str]:
    return re.findall(r">(\d+)<", html)


async def test_a_failed_call_asked_again_on_resume_is_counted_alike_everywhere(tmp_path: Path) -> None:
    # Majority vote of 3 on one problem. The first run's first sample fails (the server generated nothing); the
    # resume asks it again and it answers. Worked by hand: 4 calls (3 answered, 1 failed attempt), none failed in
    # the finished run, 1 failed then asked again; 3 x 10 = 30 prompt and 3 x 5 = 15 completion tokens.
    run_dir = tmp_path / "run"
    settings = scripted_settings(method__name="majority", method__params={"k": 3})
    first = ScriptedModel(SimScript(rules=[Rule(role="solution", fault="http_500", times=1), ANSWER]), settings)
    problem = Problem(problem_id="q", question="What is 2*7?", answer="14")
    before = await scripted_run(first, run_dir, [problem])
    assert (before.failed_calls, before.asked_again_calls, before.problems_with_failed_calls) == (1, 0, 1)
    again = ScriptedModel(SimScript(rules=[ANSWER]), settings)
    summary = await scripted_run(again, run_dir)
    assert (summary.calls, summary.replayed_calls) == (1, 2)
    assert (summary.failed_calls, summary.failed_calls_by_cause) == (0, {})
    assert (summary.asked_again_calls, summary.asked_again_by_cause) == (1, {"http_500": 1})
    assert (summary.prompt_tokens, summary.completion_tokens, summary.problems_with_failed_calls) == (30, 15, 0)

    written = await build_report([run_dir], tmp_path / "report", GradeConfig(mode="rules"), None)
    markdown = written["markdown"].read_text()
    header = (
        "| Method | Calls | Failed | Failed, then asked again | Prompt tokens | Cached prompt | Completion tokens |"
    )
    assert header in markdown
    # 45 prompt + completion tokens over the one problem.
    assert "| majority [sim-model] | 4 | 0 | 1 | 30 | 0.0% (0) | 15 | 0 | 15 | 45 | 0 | 0 |" in markdown
    assert "calls failed, then asked again: 1 (http_500 1)" in markdown
    assert "calls failed:" not in markdown

    ref = run_ref_for([run_dir], run_dir)
    assert ref is not None
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        index, run_page = get(f"{viewer.url}/"), get(f"{viewer.url}/run/{ref.key}")
        problem_page = get(f"{viewer.url}/run/{ref.key}/problem?id=q")
        iteration_page = get(f"{viewer.url}/run/{ref.key}/iteration?id=q&t=0")
    assert index[0] == run_page[0] == problem_page[0] == iteration_page[0] == 200
    row = index[1].decode().split(f'href="/run/{ref.key}"', 1)[1].split("</tr>", 1)[0]
    assert re.findall(r'<td class="num">(\d+)</td>', row)[-2:] == ["4", "45"]
    costs = run_page[1].decode().split('id="costs"', 1)[1].split("</table>", 1)[0]
    assert "failed, then asked again" in costs
    solution = costs.split("<td>solution</td>", 1)[1].split("</tr>", 1)[0]
    total = costs.split("<th>all</th>", 1)[1].split("</tr>", 1)[0]
    assert _numbers(solution) == _numbers(total) == ["4", "0", "1", "30", "15"]
    # The problem's row (1 iteration, 4 calls, 45 tokens) and its page say what it spent, as the tables above.
    problems = run_page[1].decode().split('id="problems"', 1)[1].split("</table>", 1)[0]
    row = problems.split('class="problem-link"', 1)[1].split("</tr>", 1)[0]
    assert re.findall(r'<td class="num">(\d+)</td>', row) == ["1", "4", "45"]
    spent = problem_page[1].decode().split('id="spent">', 1)[1].split("</span>", 1)[0]
    assert spent == "4 calls (1 failed, then asked again) · 45 prompt + completion tokens"
    # The iteration's page lists its 4 calls, the failed one marked, and counts it among them, as the report's
    # per-iteration table does (the record holds the 3 of the pass that finished the iteration).
    page = iteration_page[1].decode()
    rows = page.split('id="calls"', 1)[1].split("</table>", 1)[0].split("<tr>")[2:]
    [failed] = [r for r in rows if "scripted http_500" in r]
    assert len(rows) == 4 and "(then asked again on resume)" in failed
    assert sum("then asked again" in r for r in rows) == 1
    assert "1 call above failed and was asked again: it counts in this iteration's 4 calls and their tokens" in page
    assert '<span id="iteration-spend">4 calls · 30 prompt + 15 completion tokens</span>' in page


def _call(prompt: str, iteration: int, usage: Usage, error: str | None = None) -> tuple[Completion, ChatRequest]:
    request = ChatRequest(model="m", messages=[user(prompt)], sampling=Sampling())
    key = CallKey(problem_id="q", iteration=iteration, role="solution")
    completion = Completion(
        key=key,
        request_hash=request.request_hash(key),
        usage=usage,
        error=error,
        error_cause=None if error is None else "drop",
    )
    return completion, request


def test_a_failed_attempt_counts_its_tokens_and_only_the_last_failure_of_a_request_is_the_runs(tmp_path: Path) -> None:
    # Stored in this order: "a" fails (its stream cut after 3 completion tokens) and is answered when asked again;
    # "b" fails twice (1 completion token each), its second failure is the run's; "c" at iteration 1 fails once,
    # and the same request at iteration 0 (answered) is another call, not an asking again of it.
    with RunStore(tmp_path) as store:
        store.record_call(*_call("a", 0, Usage(prompt_tokens=7, completion_tokens=3), "cut"))
        store.record_call(*_call("a", 0, Usage(prompt_tokens=7, completion_tokens=5)))
        store.record_call(*_call("b", 0, Usage(prompt_tokens=2, completion_tokens=1), "cut"))
        store.record_call(*_call("b", 0, Usage(prompt_tokens=2, completion_tokens=1), "cut"))
        store.record_call(*_call("c", 1, Usage(prompt_tokens=4), "cut"))
        store.record_call(*_call("c", 0, Usage(prompt_tokens=4, completion_tokens=6)))
        counts, roles, causes = store.call_counts(), store.role_costs(), store.call_causes()
    # 6 calls: 2 failed and never asked again (b's second, c's at iteration 1), 2 failed then asked again (a's
    # first, b's first). Tokens of every one: 7+7+2+2+4+4 = 26 prompt, 3+5+1+1+0+6 = 16 completion.
    assert (counts["calls"], counts["failed"], counts["asked_again"]) == (6, 2, 2)
    assert (counts["prompt_tokens"], counts["completion_tokens"]) == (26, 16)
    solution = roles["solution"]
    assert (solution["calls"], solution["failed"], solution["asked_again"]) == (6, 2, 2)
    assert (causes["failed"], causes["asked_again"]) == ({"drop": 2}, {"drop": 2})
    # A pilot's rates are per answered call: 2 of the 6 (26 prompt, 16 completion tokens over them).
    rates = rates_from_role_costs([roles])
    assert (rates.prompt["solution"], rates.completion["solution"]) == (13.0, 8.0)


async def test_a_call_a_resume_asked_afresh_after_a_failure_it_asked_again_is_no_failure_of_the_run(
    tmp_path: Path,
) -> None:
    # TMAS, 2 solutions verified once each, 2 iterations. The first run's first verification fails, and so does the
    # summary of that failed verification. The resume asks the verification again; answered, it changes the summary's
    # prompt, so the summary is asked afresh (a new request) and the old failure is left behind: the finished run
    # holds no failed call (its result says 0), and the two failures are the run's history.
    run_dir = tmp_path / "run"
    settings = scripted_settings(method__name="tmas", method__params={"n": 2, "m": 1, "iterations": 2})
    faults = [Rule(role="verifier", fault="http_500", times=1), Rule(role="summary", fault="http_500", times=1)]
    problem = Problem(problem_id="q", question="What is 17*23?", answer="391")
    before = await scripted_run(ScriptedModel(SimScript(rules=faults), settings), run_dir, [problem])
    assert (before.failed_calls, before.asked_again_calls, before.problems_with_failed_calls) == (2, 0, 1)
    summary = await scripted_run(ScriptedModel(SimScript(), settings), run_dir)
    with RunStore(run_dir, create=False) as store:
        result = store.result("q")
        roles = store.role_costs()
    assert result is not None and result.failed_calls == 0
    assert (summary.failed_calls, summary.asked_again_calls, summary.problems_with_failed_calls) == (0, 2, 0)
    assert (summary.failed_calls_by_cause, summary.asked_again_by_cause) == ({}, {"http_500": 2})
    assert {role: (c["failed"], c["asked_again"]) for role, c in roles.items() if c["failed"] or c["asked_again"]} == {
        "verifier": (0, 1),
        "summary": (0, 1),
    }
