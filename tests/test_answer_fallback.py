"""Refinement never loses an answer: an answerless refinement is asked again with a reminder of
the required output, and when the last iteration holds no answer the earlier verified answer is returned, recorded
as a fallback; the parameters turn both off (Algorithm 1's line 22 exactly). The methods run in process on the scripted
model, and one whole run for what it sends and stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import scripted_settings
from scripted_runs import solve_in_process
from tmas.agents.templates import render
from tmas.api import asolve
from tmas.grading.run_results import load_results
from tmas.llm.types import Message
from tmas.methods.base import Candidate, Fallback, ProblemResult
from tmas.methods.selection import select_answered
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript

Q = "What is 17*23?"
REMINDER = render("answer_reminder.j2")
# Once seen from the embedded model: a refinement that only judges the attempts, with no solution and no answer.
VERDICT = "The solution is correct."
# What the reminder asks for; the pattern matches only the follow-up turn.
ANSWERED = "17*23 = 17*20 + 17*3 = 340 + 51 = 391.\n\n\\boxed{391}"
REMINDED = r"states no final answer"


def stored_result(run_dir: Path) -> ProblemResult:
    with RunStore(run_dir, create=False) as store:
        (record,) = load_results(store)
    return record


async def solve(method: str, rules: list[Rule], **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    model = ScriptedModel(SimScript(rules=rules), scripted_settings(method={"name": method, "params": params}))
    return await solve_in_process(model, Q), model


async def solve_tmas(rules: list[Rule], **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    return await solve("tmas", rules, **{"n": 2, "m": 1, "iterations": 2, "epsilon": 0.0, **params})


def solution_prompts(model: ScriptedModel, role: str = "solution") -> list[list[Message]]:
    """The messages of each call of ``role``, in call order."""
    return [call.messages for call in model.calls_of(role)]


async def test_refinements_without_an_answer_return_the_earlier_verified_answer(tmp_path: Path) -> None:
    # Iteration 0 answers 391 (the default replies, full verifier scores); every refinement, and every reply to the
    # reminder, is the bare verdict. A whole run, in process.
    params = {"n": 2, "m": 1, "iterations": 2, "epsilon": 0.0}
    script = SimScript(rules=[Rule(role="solution", pattern="<rollouts>", replies=[VERDICT])])
    model = ScriptedModel(script, scripted_settings(method={"name": "tmas", "params": params}))
    result = await asolve(Q, model=model, run_dir=tmp_path / "run")
    assert result.status == "done" and result.answer == "391"
    # The best-scored first candidate (the verifier may give one of them 0.5; ties: the lower index).
    scores = [c.score or 0.0 for c in result.iterations[0].candidates]
    assert result.fallback == Fallback(
        iteration=0,
        candidate=scores.index(max(scores)),
        answer="391",
        reason="no answered candidate in the last iteration",
    )
    # Recorded: in the stored result, in the last iteration's state, answer and notes, and in the counters.
    record = stored_result(tmp_path / "run")
    assert record.fallback == result.fallback and record.answer == "391"
    last = result.iterations[1]
    assert last.selected == "391" and Fallback.model_validate(last.state["answer_fallback"]) == result.fallback
    assert [c.answer for c in last.candidates] == [None, None]
    assert any("answer from iteration 0" in note for note in last.notes)
    assert result.counters["answer_fallback"] == 1 and result.counters["solution_reminded"] == 2
    # As sent: 2 first samples, 2 refinements, 2 reminders; each reminder is the refinement prompt, the answerless
    # reply as the assistant turn, then the reminder.
    bodies = [call.body for call in model.calls_of("solution")]
    assert len(bodies) == 6
    reminders = [b["messages"] for b in bodies if b["messages"][-1]["content"] == REMINDER]
    assert len(reminders) == 2
    for messages in reminders:
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
        assert "<rollouts>" in messages[1]["content"] and messages[2]["content"] == VERDICT
    reminded = last.candidates[0].meta.reminder
    assert reminded.answered is False and reminded.first_reply == VERDICT
    assert isinstance(reminded.first_call_id, int) and reminded.first_call_id != last.candidates[0].call_id


async def test_a_refinement_answering_after_the_reminder_is_the_candidate() -> None:
    result, _ = await solve_tmas(
        [
            Rule(role="solution", pattern=REMINDED, replies=[ANSWERED]),
            Rule(role="solution", pattern="<rollouts>", replies=[VERDICT]),
        ]
    )
    last = result.iterations[1]
    assert [c.answer for c in last.candidates] == ["391", "391"]
    assert all(c.meta.reminder.answered is True for c in last.candidates)
    assert all(c.text == ANSWERED for c in last.candidates)
    # Verified like any other answer (an answerless candidate scores 0), and no fallback was needed.
    assert all((c.score or 0.0) > 0 for c in last.candidates)
    assert result.answer == "391" and result.fallback is None and "answer_fallback" not in last.state
    # The candidate's cost is both calls'.
    first = last.candidates[0]
    assert first.usage.completion_tokens > 0 and first.call_id != first.meta.reminder.first_call_id


# Instruction text as a small model copies it: of the refinement prompt, and of the reminder itself.
REFINE_ECHO = (
    "Study each previous attempt together with its verification summary: pin down what went wrong, what was left "
    "incomplete and what, if anything, was sound."
)
REMINDER_ECHO = "Reply again with a complete solution to the problem, not a comment on earlier attempts: work it out."


async def test_an_echo_is_asked_again_first_then_an_answerless_retry_is_reminded() -> None:
    """The echo check comes first (its retry under another sample), the reminder after it, of the retry's reply."""
    rules = [
        Rule(role="solution", pattern=REMINDED, replies=[ANSWERED]),
        Rule(role="solution", pattern="<rollouts>", replies=[REFINE_ECHO], times=1),
        Rule(role="solution", pattern="<rollouts>", replies=[VERDICT]),
    ]
    result, model = await solve_tmas(rules)
    last = result.iterations[1]
    assert [c.answer for c in last.candidates] == ["391", "391"]
    assert all(c.meta.reminder.answered is True for c in last.candidates)
    assert last.replies["solution"].echo == 1 and result.counters["solution_echo"] == 1
    # 2 first samples, 2 refinements, 1 echo retry, 2 reminders; every reminder sends back the honest verdict.
    prompts = solution_prompts(model)
    assert len(prompts) == 7
    reminders = [m for m in prompts if m[-1].content == REMINDER]
    assert [m[2].content for m in reminders] == [VERDICT, VERDICT]


async def test_a_reply_to_the_reminder_that_echoes_it_never_becomes_the_candidate() -> None:
    rules = [
        Rule(role="solution", pattern=REMINDED, replies=[REMINDER_ECHO]),
        Rule(role="solution", pattern="<rollouts>", replies=[VERDICT]),
    ]
    result, _ = await solve_tmas(rules)
    last = result.iterations[1]
    # Each candidate keeps its honest, answerless first reply; the answer comes from iteration 0.
    assert [(c.answer, c.text) for c in last.candidates] == [(None, VERDICT), (None, VERDICT)]
    assert all(c.meta.reminder.echo == "solution text" for c in last.candidates)
    assert all(c.call_id == c.meta.reminder.first_call_id for c in last.candidates)
    assert last.replies["solution"].echo == 2 and result.counters["solution_echo"] == 2
    assert result.answer == "391" and result.fallback is not None


async def test_a_baselines_reminder_reply_that_echoes_is_not_voted() -> None:
    rules = [
        Rule(role="refiner", pattern=REMINDED, replies=[REMINDER_ECHO]),
        Rule(role="refiner", replies=[VERDICT]),
    ]
    result, model = await solve("self_refine", rules, n=1, iterations=2)
    [refined] = result.iterations[1].candidates
    assert (refined.answer, refined.text, refined.meta.reminder.echo) == (None, VERDICT, "solution text")
    assert refined.meta.reminder.answered is None and result.iterations[1].replies["refiner"].echo == 1
    assert len(model.calls_of("refiner")) == 2 and result.answer == "391"


async def test_both_off_is_algorithm_1_line_22() -> None:
    rules = [Rule(role="solution", pattern="<rollouts>", replies=[VERDICT])]
    result, model = await solve_tmas(rules, answer_reminder=False, answer_fallback=False)
    # R_T holds no answer and line 22 reads R_T alone: no answer, and no reminder was asked for.
    assert result.answer is None and result.fallback is None
    assert len(solution_prompts(model)) == 4
    assert all(m[-1].content != REMINDER for m in solution_prompts(model))


async def test_the_first_iteration_is_not_reminded_and_no_answer_anywhere_stays_none() -> None:
    result, model = await solve_tmas([Rule(role="solution", replies=[VERDICT])])
    # Iteration 0 (the generation prompt) is not reminded; iteration 1's two refinements are.
    assert len(solution_prompts(model)) == 2 + 2 + 2
    assert result.answer is None and result.fallback is None


def test_fallback_selection_by_hand() -> None:
    def cand(i: int, answer: str | None, score: float) -> Candidate:
        return Candidate(index=i, text="", answer=answer, score=score)

    it0 = [cand(0, "12", 0.5), cand(1, "13", 0.0)]
    it1 = [cand(0, "12", 0.0), cand(1, "14", 1.0)]
    it2 = [cand(0, None, 1.0), cand(1, None, 0.0)]
    chosen, info = select_answered([it0, it1, it2], "last", "numeric")
    # The best answered earlier candidate: "14" (score 1.0) in iteration 1.
    assert chosen is it1[1] and info is not None and (info.iteration, info.candidate) == (1, 1)
    # Equal scores: the newest iteration's answer.
    tie = [[cand(0, "12", 0.5)], [cand(0, "15", 0.5)], [cand(0, None, 0.0)]]
    chosen, info = select_answered(tie, "last", "numeric")
    assert chosen is tie[1][0] and info is not None and info.iteration == 1
    # Off, or an answered last iteration, or proof mode: no fallback.
    assert select_answered([it0, it1, it2], "last", "numeric", fallback=False) == (it2[0], None)
    assert select_answered([it0, it1], "last", "numeric") == (it1[1], None)
    assert select_answered([it0, it2], "last", "proof")[1] is None
    # Nothing answered anywhere: the rule's own choice, no fallback.
    assert select_answered([it2], "last", "numeric") == (it2[0], None)


async def test_self_refine_and_verify_refine_keep_the_answer() -> None:
    for method, role in (("self_refine", "refiner"), ("verify_refine", "corrector")):
        result, model = await solve(method, [Rule(role=role, replies=[VERDICT])], n=2, iterations=3)
        # Each refinement was reminded once; none answered.
        assert len(solution_prompts(model, role)) == 2 * 2 * 2, method
        # The trajectories went on from their answered solutions: iteration 2 refined the first sample again.
        last_refinements = solution_prompts(model, role)[-4:]
        assert all("\\boxed{391}" in m[1].content for m in last_refinements), method
        # Each trajectory still holds its answered first solution, which votes in the last iteration: no fallback.
        assert result.answer == "391" and result.fallback is None, method
        last = result.iterations[2]
        assert all(c.meta.kept_previous and c.meta.carried_from == 0 for c in last.candidates), method
        assert last.selection is not None and last.selection.iteration == 0 and not last.selection.fallback, method
