"""What holds of every registered method's run, in process on the scripted model with the method's own example
parameters: each call is a request of its own with a key of its own (so a resumed run can replay each), the
iteration records account for every call and token, every call carries its problem, and the run seed alone sets what
is sampled."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from scripted_runs import run_scripted
from test_reliability import TEMPLATE_QUESTIONS
from tmas.methods import METHODS
from tmas.methods.base import ProblemResult
from tmas.problems import Problem
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript

# Every reply reports 100 prompt and 30 completion tokens, so the records' sums are checked against the calls.
THIRTY = SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=100, completion_tokens=30))])
ALL = sorted(METHODS)


async def run(
    method: str, seed: int = 0, question: str | Problem = "What is 17*23?"
) -> tuple[ProblemResult, ScriptedModel]:
    params = METHODS[method].example_params
    if params is None:
        pytest.skip(f"{method} declares no example_params")
    return await run_scripted(method, question=question, script=THIRTY, settings={"seed": seed}, **params)


@pytest.mark.parametrize("method", ALL)
async def test_every_call_of_a_run_is_a_request_of_its_own(method: str) -> None:
    result, model = await run(method)
    hashes = [c.reply.request_hash for c in model.calls]
    assert result.status == "done" and len(hashes) > 0
    assert len(set(hashes)) == len(hashes)


@pytest.mark.parametrize("method", ALL)
async def test_every_call_of_a_run_has_a_key_of_its_own(method: str) -> None:
    # A key identifies a call (the same request with the same sample index is the same call): two calls of one
    # role in one iteration and chain never share a sample index.
    _, model = await run(method)
    keys = Counter(c.key for c in model.calls)
    assert [key for key, n in keys.items() if n > 1] == []


@pytest.mark.parametrize("method", ALL)
async def test_the_iteration_records_account_for_every_call_and_token(method: str) -> None:
    result, model = await run(method)
    assert result.calls == len(model.calls) == sum(r.calls for r in result.iterations)
    # Each call is counted in the record of the iteration its key names.
    assert Counter(c.key.iteration for c in model.calls) == {r.iteration: r.calls for r in result.iterations}
    assert result.usage.completion_tokens == 30 * len(model.calls)
    assert sum(r.usage.completion_tokens for r in result.iterations) == result.usage.completion_tokens
    assert sum(r.usage.prompt_tokens for r in result.iterations) == 100 * len(model.calls)


@pytest.mark.parametrize("method", ALL)
async def test_every_call_carries_its_problem(method: str) -> None:
    problem = Problem(problem_id="p-17", question="What is 17*23?")
    result, model = await run(method, question=problem)
    assert result.problem_id == "p-17" and {c.key.problem_id for c in model.calls} == {"p-17"}
    assert all(r.problem_id == "p-17" for r in result.iterations)


@pytest.mark.parametrize("method", ALL)
async def test_the_run_seed_alone_sets_what_is_sampled(method: str) -> None:
    def asked(model: ScriptedModel) -> list[tuple[str, Any, int | None, list[str]]]:
        return [(c.role, c.key, c.sampling.seed, [m.content for m in c.messages]) for c in model.calls]

    _, first = await run(method)
    _, again = await run(method)
    assert asked(first) == asked(again)
    # Another run seed gives every call another sampling seed (the calls themselves may differ after the first).
    _, other = await run(method, seed=7)
    seeds = {c.sampling.seed for c in first.calls}
    assert None not in seeds and not seeds & {c.sampling.seed for c in other.calls}


@pytest.mark.parametrize("method", ALL)
async def test_every_method_shows_a_question_with_template_syntax_verbatim(method: str) -> None:
    # Template syntax in a question is data (tests/test_reliability.py runs TMAS on them through the command line).
    for question in TEMPLATE_QUESTIONS:
        result, model = await run(method, question=question)
        assert result.status == "done", (question, result.error)
        # The first call of every method is asked the problem, character for character.
        first = "\n".join(m.content for m in model.calls[0].messages)
        assert question in first, question
        # No prompt holds a rendered piece of it ("What is 42?" for "What is {{ 6 * 7 }}?", a loop's "looploop").
        texts = [m.content for c in model.calls for m in c.messages]
        assert not any("What is 42?" in t or "looploop" in t for t in texts)
