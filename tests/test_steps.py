"""The solution step every method shares (methods/steps.py) on the scripted model: the candidate it makes of a reply,
the anomalies it reports, and that TMAS and a baseline make the same candidate of the same reply."""

from __future__ import annotations

from typing import Any

from conftest import scripted_settings
from scripted_runs import solve_in_process
from tmas.agents.solution import generation_prompt, parse_solution
from tmas.config import Budget
from tmas.methods.base import Candidate, CandidateMeta, MethodParams, ProblemSession
from tmas.methods.steps import notes_for, solution_anomalies, solve_call
from tmas.problems import Problem
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript

Q = "What is 17*23?"
ANSWERED = "17*23 = 340 + 51 = 391.\n\n\\boxed{391}"
STATED = "17*23 = 340 + 51 = 391.\nThe answer is 391."
# A refinement that judges the attempt and gives no answer.
VERDICT = "The solution is correct."
REMINDED = r"states no final answer"
PROMPT = generation_prompt(Q, "numeric")


def session_on(rules: list[Rule], budget: Budget | None = None) -> tuple[ProblemSession, ScriptedModel]:
    model = ScriptedModel(SimScript(rules=rules))
    session = ProblemSession(
        Problem(problem_id="p", question=Q), model, None, params=MethodParams(), seed=5, budget=budget
    )
    return session, model


def kinds(c: Candidate, mode: str = "numeric") -> list[str | None]:
    return [kind for kind, _ in solution_anomalies(c, mode)]


async def test_both_parsers_give_the_same_candidate_of_a_plain_reply() -> None:
    made: list[Candidate] = []
    for parse in ({}, {"parse": parse_solution}):
        session, _ = session_on([Rule(role="solution", replies=[STATED])])
        c = await solve_call(session, "solution", PROMPT, index=0, mode="numeric", **parse)
        assert c is not None
        made.append(c)
        assert session.tally("solution").stated == 1 and session.tally("solution").unusable == 0
    baseline, tmas = made
    assert baseline == tmas
    assert (tmas.text, tmas.answer, tmas.error, tmas.meta) == (STATED, "391", None, CandidateMeta(extraction="stated"))
    assert solution_anomalies(tmas, "numeric") == []


async def test_the_readers_differ_only_in_numeric_mode_where_feedback_precedes_the_solution() -> None:
    reply = f"Feedback: the carry was lost.\n\n## Solution\n{ANSWERED}"
    baseline = await solve_call(session_on([Rule(role="r", replies=[reply])])[0], "r", PROMPT, index=0, mode="numeric")
    session, _ = session_on([Rule(role="r", replies=[reply])])
    tmas = await solve_call(session, "r", PROMPT, index=0, mode="numeric", parse=parse_solution)
    assert baseline is not None and tmas is not None
    assert baseline.text == ANSWERED and tmas.text == reply.strip() and baseline.answer == tmas.answer == "391"
    # Proof mode: both read the solution under the heading.
    made = [
        await solve_call(session_on([Rule(role="r", replies=[reply])])[0], "r", PROMPT, index=0, mode="proof", **p)
        for p in ({}, {"parse": parse_solution})
    ]
    assert made[0] == made[1] and made[0] is not None and made[0].text == ANSWERED


async def test_tmas_and_a_baseline_make_the_same_candidate_of_the_same_first_reply() -> None:
    rules = [Rule(role="solution", replies=[STATED])]
    results = []
    for method, params in (("cot", {}), ("tmas", {"n": 1, "m": 1, "iterations": 1})):
        model = ScriptedModel(SimScript(rules=rules), scripted_settings(method={"name": method, "params": params}))
        results.append(await solve_in_process(model, Q))
    [cot], [tmas] = (r.iterations[0].candidates for r in results)
    same = ("index", "text", "answer", "finish_reason", "error", "usage", "confidence")
    assert {k: getattr(cot, k) for k in same} == {k: getattr(tmas, k) for k in same}
    assert cot.meta.extraction == tmas.meta.extraction == "stated"
    assert results[0].iterations[0].replies["solution"] == results[1].iterations[0].replies["solution"]


async def test_an_answerless_reply_is_reminded_under_its_own_sample_and_the_answer_taken() -> None:
    rules = [Rule(role="r", pattern=REMINDED, replies=[ANSWERED]), Rule(role="r", replies=[VERDICT])]
    session, model = session_on(rules)
    c = await solve_call(
        session, "r", PROMPT, index=1, sample=7, mode="numeric", remind=True, meta=CandidateMeta(prompt="x")
    )
    assert c is not None and c.answer == "391" and c.error is None
    first, retry = model.calls_of("r")
    assert first.sampling.seed == retry.sampling.seed  # the same sample index: one seed, replayed on resume
    assert c.call_id != c.meta.reminder.first_call_id and c.meta.reminder.answered is True
    assert c.meta.prompt == "x" and c.meta.extraction == "boxed"
    assert session.tally("r").unusable == 1  # the first reply; the retry's is boxed
    assert kinds(c) == ["solution_reminded"]
    assert notes_for([c], "numeric") == [
        "candidate 1: first reply had no answer; asked again with a reminder of the required output: answered"
    ]


async def test_without_remind_an_answerless_reply_is_noted_and_not_asked_again() -> None:
    session, model = session_on([Rule(role="r", replies=[VERDICT])])
    c = await solve_call(session, "r", PROMPT, index=0, mode="numeric")
    assert c is not None and c.answer is None and len(model.calls) == 1
    assert solution_anomalies(c, "numeric") == [("solution_no_answer", "candidate 0: no extractable answer")]


async def test_an_answer_echoing_twice_is_an_error_with_both_echo_kinds() -> None:
    echo = "\\boxed{the final answer you computed}"
    session, model = session_on([Rule(role="r", replies=[echo])])
    # The concise prompt shows the answer format this reply copies.
    c = await solve_call(session, "r", generation_prompt(Q, "numeric", "concise"), index=0, mode="numeric")
    assert c is not None and c.answer is None and c.meta.echo == c.meta.echo_retry == "answer"
    assert c.error == "the answer echoed the prompt's instructions (asked twice)"
    assert len(model.calls) == 2 and session.tally("r").echo == 2
    assert kinds(c) == ["solution_echo", "solution_echo"]


async def test_a_candidate_holds_the_usage_of_every_call_spent_on_it() -> None:
    # The first reply echoes the concise prompt's answer format (300 tokens), the retry gives no answer (200), the
    # reminder answers (50): the candidate spent 550 completion tokens over three calls, as the session counted.
    echo = "\\boxed{the final answer you computed}"
    rules = [
        Rule(
            role="r", pattern=REMINDED, replies=[ANSWERED], usage=ScriptedUsage(prompt_tokens=40, completion_tokens=50)
        ),
        Rule(role="r", replies=[echo], times=1, usage=ScriptedUsage(prompt_tokens=10, completion_tokens=300)),
        Rule(role="r", replies=[VERDICT], usage=ScriptedUsage(prompt_tokens=10, completion_tokens=200)),
    ]
    session, model = session_on(rules)
    prompt = generation_prompt(Q, "numeric", "concise")
    c = await solve_call(session, "r", prompt, index=0, mode="numeric", remind=True)
    assert c is not None and c.answer == "391" and c.meta.echo_retry == "answer" and len(model.calls) == 3
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (60, 550)
    assert c.usage == session.spent_usage
    # Echoing twice: the unusable candidate holds both calls.
    session, model = session_on(
        [Rule(role="r", replies=[echo], usage=ScriptedUsage(prompt_tokens=10, completion_tokens=300))]
    )
    c = await solve_call(session, "r", prompt, index=0, mode="numeric")
    assert c is not None and c.error is not None and len(model.calls) == 2
    assert c.usage.completion_tokens == 600 and c.usage == session.spent_usage


async def test_failure_truncation_and_a_missing_heading_are_reported() -> None:
    session, _ = session_on([Rule(role="r", replies=["A proof without its heading."], finish_reason="length")])
    c = await solve_call(session, "r", PROMPT, index=2, mode="proof")
    assert c is not None and c.meta == CandidateMeta(no_solution_heading=True, truncated=True)
    assert solution_anomalies(c, "proof") == [
        (None, "candidate 2: no '## Solution' heading; the whole reply is taken as the solution"),
        ("solution_truncated", "candidate 2: truncated at max_tokens"),
    ]
    failed = Candidate(index=3, text="", error="HTTP 500")
    assert solution_anomalies(failed, "numeric") == [("solution_failed", "candidate 3: call failed: HTTP 500")]


def test_a_reminder_that_failed_or_echoed_is_counted_as_such() -> None:
    def reminded(**outcome: Any) -> Candidate:
        return Candidate(index=0, text=VERDICT, meta={"reminder": {"first_call_id": 1, **outcome}})

    assert kinds(reminded(error="HTTP 500")) == ["solution_reminder_failed", "solution_no_answer"]
    assert kinds(reminded(echo="solution text")) == ["solution_echo", "solution_no_answer"]
    assert kinds(reminded(answered=False)) == ["solution_reminded", "solution_no_answer"]


async def test_a_call_the_budget_refuses_is_none() -> None:
    session, model = session_on([Rule(role="r", replies=[ANSWERED])], Budget(calls=1))
    assert await solve_call(session, "r", PROMPT, index=0, mode="numeric") is not None
    assert await solve_call(session, "r", PROMPT, index=1, mode="numeric") is None
    assert len(model.calls) == 1 and session.budget_stop is not None
