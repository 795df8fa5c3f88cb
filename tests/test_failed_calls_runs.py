"""A failed call in a whole run, in process on the scripted model (a scripted fault ends a call as the HTTP client
ends it after its retries): it costs its candidate only, that trajectory starts afresh, and a problem fails only when
no candidate of its last iteration succeeded; a model gone mid-run ends it, and its resume asks only the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import GoneModel, by_role, run_scripted, scripted_run
from tmas.methods.base import ProblemResult
from tmas.problems import Problem
from tmas.runner import Unreachable, prepare_run, run_problems
from tmas.testing import Rule, ScriptedModel, SimScript

# The first solution call fails; every later one answers.
FIRST_FAILS = Rule(role="solution", fault="http_500", times=1)
ALL_FAIL = Rule(role="solution", fault="http_500")


@pytest.mark.parametrize(
    ("method", "params", "calls"),
    [
        # 3 samples, one failed: the vote is over 2.
        ("majority", {"k": 3}, {"solution": 3}),
        # Trajectory 0 failed, so iteration 1 samples it afresh; trajectory 1 is refined.
        ("self_refine", {"n": 2, "iterations": 2}, {"solution": 3, "refiner": 1}),
        # Likewise, and the failed solution is never verified: 1 + 2 verifications.
        ("verify_refine", {"n": 2, "m": 1, "iterations": 2}, {"solution": 3, "corrector": 1, "verifier": 3}),
        # The failed sample is not distilled.
        ("rse", {"n": 2, "iterations": 2}, {"solution": 4, "distiller": 1}),
        # Round 1 sees the one message round 0 has.
        ("pacore", {"responses_per_round": 2, "iterations": 2}, {"solution": 4, "synthesis": 1}),
        # The failed candidate is neither verified nor summarised: 1 + 2 verifications, 1 summary (the last
        # iteration has none).
        (
            "tmas",
            {"n": 2, "m": 1, "iterations": 2},
            {"solution": 4, "verifier": 3, "summary": 1, "experience": 1, "guideline": 1},
        ),
    ],
)
async def test_a_failed_call_costs_its_candidate_only(
    method: str, params: dict[str, Any], calls: dict[str, int]
) -> None:
    result, model = await run_scripted(method, [FIRST_FAILS], **params)
    assert result.status == "done" and result.answer == "391"
    assert by_role(model) == calls and result.calls == sum(calls.values())
    first = result.iterations[0]
    assert result.failed_calls == first.failed_calls == 1
    assert [c.index for c in first.candidates if c.error] == [0]
    assert first.candidates[0].error == "scripted http_500" and first.candidates[0].answer is None
    assert any(
        note.startswith("candidate 0: ") and note.endswith("call failed: scripted http_500") for note in first.notes
    )


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("cot", {}),
        ("majority", {"k": 3}),
        ("self_refine", {"n": 2, "iterations": 2}),
        ("verify_refine", {"n": 2, "m": 1, "iterations": 2}),
        ("rse", {"n": 2, "iterations": 2}),
        ("tmas", {"n": 2, "m": 1, "iterations": 2}),
    ],
)
async def test_a_problem_whose_every_solution_call_fails_fails(method: str, params: dict[str, Any]) -> None:
    result, model = await run_scripted(method, [ALL_FAIL], **params)
    assert result.status == "failed" and result.answer is None
    assert result.error == "no candidate of the last iteration succeeded: scripted http_500"
    # Nothing but solutions is asked: there is nothing to verify, refine, distil or summarise.
    assert set(by_role(model)) == {"solution"} and result.failed_calls == len(model.calls)


async def test_pacore_with_no_message_to_synthesise_samples_plainly() -> None:
    # Both rounds fail whole: the synthesis has no message to read, so it is asked the plain first prompt.
    result, model = await run_scripted("pacore", [ALL_FAIL], responses_per_round=2, iterations=2)
    assert by_role(model) == {"solution": 4, "synthesis": 1} and result.answer == "391"
    [synthesis] = model.calls_of("synthesis")
    assert synthesis.messages == model.calls_of("solution")[0].messages
    assert result.iterations[-1].candidates[0].meta.prompt == "generate"


async def test_a_model_gone_mid_run_ends_it_and_a_resume_asks_only_the_rest(tmp_path: Path) -> None:
    # One problem at a time; the model goes away once the first is finished: the run ends, naming the resume.
    problems = [Problem(problem_id=f"q{i}", question=f"What is {i + 2}*7?", answer=str((i + 2) * 7)) for i in range(3)]
    settings = scripted_settings(concurrency=1, method={"name": "majority", "params": {"k": 2}})
    model = GoneModel(SimScript(), settings)
    store, settings, todo = prepare_run(tmp_path / "run", settings, problems, resume=False, own_model=True)

    def gone(_: ProblemResult) -> None:
        model.gone = True

    with store, pytest.raises(Unreachable, match="continue with 'tmas run --resume"):
        await run_problems(settings, todo, store, on_result=gone, model=model)
    assert {call.key.problem_id for call in model.calls} == {"q0"}
    again = ScriptedModel(SimScript(), settings)
    summary = await scripted_run(again, tmp_path / "run")
    assert (summary.done, summary.skipped) == (3, 1)
    assert sorted({call.key.problem_id for call in again.calls}) == ["q1", "q2"] and len(again.calls) == 4
