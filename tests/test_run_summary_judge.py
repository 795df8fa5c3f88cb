"""A run's summary counts the method's calls: a judge that graded the run wrote its calls into the same store, and a
resume of the run after that grading says the same calls, tokens and failures as the run did before it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.grading.grades import GradeConfig
from tmas.grading.runs import grade_run
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript
from tmas.view.app import view_app
from web_helpers import AppThread, get, run_ref_for

PROBLEMS = [
    Problem(problem_id="a", question="What is 2*7?", answer="14"),
    Problem(problem_id="b", question="What is 3*7?", answer="21"),
]


def _judge() -> ScriptedModel:
    """A judge whose first call fails (asked again: three calls over the two answers, one failed) and whose replies
    are cut at max_tokens, each reporting 300 prompt tokens (250 cached), 50 completion tokens (7 of them thinking)."""
    verdict = json.dumps({"reasoning": "Both answers denote the same value.", "equivalent": True})
    usage = ScriptedUsage(prompt_tokens=300, completion_tokens=50, reasoning_tokens=7, cached_tokens=250)
    rules = [
        Rule(role="judge", fault="http_500", times=1),
        Rule(role="judge", replies=[verdict], finish_reason="length", usage=usage),
    ]
    return ScriptedModel(SimScript(rules=rules), scripted_settings())


async def test_a_resume_after_a_judge_graded_the_run_sums_the_methods_calls_alone(tmp_path: Path) -> None:
    # Each of the two problems is one cot call of 100 prompt tokens (40 cached) and 20 completion tokens (5 thinking).
    usage = ScriptedUsage(prompt_tokens=100, completion_tokens=20, reasoning_tokens=5, cached_tokens=40)
    solution = Rule(role="solution", replies=["Seven times it: \\boxed{14}"], usage=usage)
    model = ScriptedModel(SimScript(rules=[solution]), scripted_settings(method__name="cot"))
    run_dir = tmp_path / "run"
    first = await scripted_run(model, run_dir, PROBLEMS)
    with RunStore(run_dir, create=False) as store:
        await grade_run(store, GradeConfig(mode="judge", judge_runs=1), model=_judge())
        judge = store.role_costs()["judge"]
    # The judge's calls are in the run's store: three, one failed, two of 300 + 50 tokens.
    assert (judge["calls"], judge["failed"], judge["prompt_tokens"], judge["completion_tokens"]) == (3, 1, 600, 100)

    resumed = await scripted_run(model, run_dir)
    method = {
        "calls": 0,
        "replayed_calls": 0,
        "failed_calls": 0,
        "prompt_tokens": 200,
        "completion_tokens": 40,
        "reasoning_tokens": 10,
        "truncated_calls": 0,
        "truncated_by_role": {},
        "warnings": [],
        "failed_calls_by_cause": {},
        "retries_by_cause": {},
        "cached_prompt_tokens": 80,
        "cached_prompt_share": 0.4,
    }
    # Before, the resume's summary held the judge's calls too: 800 prompt tokens, 140 completion, 1 failed call
    # (http_500), 2 truncated with a warning on the judge's replies, 580 cached.
    assert {k: v for k, v in resumed.to_dict().items() if k in method} == method
    assert {k: v for k, v in first.to_dict().items() if k in method} == {**method, "calls": 2}


async def test_the_viewer_counts_the_methods_calls_and_shows_the_judges_apart(tmp_path: Path) -> None:
    usage = ScriptedUsage(prompt_tokens=100, completion_tokens=20)
    solution = Rule(role="solution", replies=["Seven times it: \\boxed{14}"], usage=usage)
    model = ScriptedModel(SimScript(rules=[solution]), scripted_settings(method__name="cot"))
    run_dir = tmp_path / "run"
    await scripted_run(model, run_dir, PROBLEMS)
    with RunStore(run_dir, create=False) as store:
        await grade_run(store, GradeConfig(mode="judge", judge_runs=1), model=_judge())
    ref = run_ref_for([run_dir], run_dir)
    assert ref is not None
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        index, run_page = get(f"{viewer.url}/"), get(f"{viewer.url}/run/{ref.key}")
    assert index[0] == run_page[0] == 200
    # The runs page: the method's 2 calls of 120 tokens each, not the judge's 3 (2 of 350 tokens) beside them.
    row = index[1].decode().split(f'href="/run/{ref.key}"', 1)[1].split("</tr>", 1)[0]
    assert re.findall(r'<td class="num">(\d+)</td>', row)[-2:] == ["2", "240"]
    # The run page: the judge's own row, and the method's total below without it.
    costs = run_page[1].decode().split('id="costs"', 1)[1].split("</table>", 1)[0]
    judge = costs.split("<td>judge</td>", 1)[1].split("</tr>", 1)[0]
    total = costs.split("<th>all but the judge</th>", 1)[1].split("</tr>", 1)[0]
    assert re.findall(r">(\d+)<", judge) == ["3", "1", "0", "600", "100"]
    assert re.findall(r">(\d+)<", total) == ["2", "0", "0", "200", "40"]
