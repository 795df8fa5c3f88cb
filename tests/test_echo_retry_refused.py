"""An agent call under the echo guard whose retry the budget refused: the first reply, answered and spent, stays in
the records (its call, its tokens, what echoed and why it was not asked again), is kept out of answers, and the
problem ends stopped by the budget as every method's stop is recorded. In process on the scripted model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import by_role, run_scripted, solve_in_process
from tmas.agents.echo import ECHO_RETRY_SAMPLE
from tmas.agents.solution import generation_prompt
from tmas.api import asolve
from tmas.llm.replay import StoreReplay
from tmas.llm.types import Completion, Message
from tmas.memory.transcript import Transcript
from tmas.methods import create_method
from tmas.methods.base import BudgetExhausted, MethodParams, ProblemResult, ProblemSession
from tmas.methods.echo_retry import RetryRefused, chat_guarded, reply_to_read
from tmas.methods.reasked import Reasked
from tmas.methods.steps import solve_call
from tmas.problems import Problem
from tmas.runner import solve_one
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript

Q = "What is 17*23?"
# A solution that copies the concise style's instructions, and boxes their wording for the answer.
SOLUTION_ECHO = (
    "Finish with one last line that holds nothing but the final answer you computed.\n"
    "\\boxed{the final answer you computed}"
)
SUMMARY_ECHO = (
    "List the reasoning steps that the verifiers confirmed as correct, so that they can be reused. List the errors "
    "and gaps the verifiers found, most serious first, saying where each one occurs."
)
EXPERIENCE_ECHO = "a transformation that turns the problem or a sub-problem into a simpler or better understood one"
FINDING = "17 times 23 splits as 17 times 20 plus 17 times 3, which is 340 plus 51"
GUIDELINE_ECHO = "the mathematical framework, the key structural insight and the angle of attack"


async def solve(
    method: str, rules: list[Rule], budget: dict[str, Any], **params: Any
) -> tuple[ProblemResult, ScriptedModel]:
    settings = scripted_settings(method={"name": method, "params": params}, budget=budget)
    model = ScriptedModel(SimScript(rules=rules), settings)
    return await solve_in_process(model, Q), model


async def test_chat_guarded_carries_the_first_reply_up_with_the_stop() -> None:
    # One call of budget: the reply echoes and its retry is refused. The stop goes up as a BudgetExhausted holding
    # the reply that came back; reply_to_read reads that reply, saying the budget refused the retry.
    settings = scripted_settings(budget={"calls": 1})
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=["ECHO"])]), settings)
    problem = Problem(problem_id="q", question=Q)
    session = ProblemSession(problem, model, None, params=MethodParams(), budget=settings.budget)
    messages = [Message(role="user", content=Q)]

    def echo_of(reply: Completion) -> str | None:
        return "answer" if reply.content == "ECHO" else None

    with pytest.raises(RetryRefused) as raised:
        await chat_guarded(session, "solution", messages, echo_of)
    assert isinstance(raised.value, BudgetExhausted)
    guarded = raised.value.guarded
    [call] = model.calls
    assert guarded.reply.call_id == call.reply.call_id and guarded.echoed is None
    assert (guarded.first_echo, guarded.echo, guarded.refused) == ("answer", "answer", session.budget_stop)
    assert guarded.usage == call.reply.usage and session.tally("solution").echo == 1
    read, why = reply_to_read(guarded, lambda r: None)
    assert read is guarded.reply and why == f"the budget refused it ({session.budget_stop})"


async def test_a_cot_solution_whose_retry_the_budget_refused_is_recorded_and_ends_the_problem(
    tmp_path: Path,
) -> None:
    # Before, the stop threw the reply away: no iteration record, and the problem was not marked stopped.
    settings = scripted_settings(method={"name": "cot", "params": {"style": "concise"}}, budget={"calls": 1})
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=[SOLUTION_ECHO])]), settings)
    result = await asolve(Q, model=model, run_dir=tmp_path / "run")
    [call] = model.calls
    assert (result.status, result.stopped_reason, result.answer) == ("failed", "budget", None)
    assert result.counters["budget_stops"] == 1
    [record] = result.iterations
    assert record.calls == 1 and record.usage == call.reply.usage and record.replies["solution"].echo == 1
    [candidate] = record.candidates
    assert candidate.call_id == call.reply.call_id and candidate.usage == call.reply.usage
    assert candidate.answer is None and record.selected is None
    assert candidate.error == "the answer echoed the prompt's instructions; the budget refused its retry"
    assert (candidate.meta.echo_retry, candidate.meta.echo) == ("answer", "answer")
    assert candidate.meta.retry_refused == "budget spent (1 calls of a budget of 1) in iteration 0"
    assert record.notes == [
        f"candidate 0: unusable: {candidate.error} ({candidate.meta.retry_refused})",
        f"stopped: {candidate.meta.retry_refused}",
    ]


async def test_a_tmas_solution_whose_retry_the_budget_refused_stays_in_the_record_out_of_the_answer() -> None:
    # n = 2, m = 1, 2 calls: both solutions go; candidate 0's echoes, and its retry is refused, as is candidate 1's
    # verification. Candidate 0 is recorded unusable, with its call and tokens; candidate 1 answers.
    echo = Rule(role="solution", pattern="", replies=[SOLUTION_ECHO], times=1)
    result, model = await solve("tmas", [echo], {"calls": 2}, n=2, m=1, iterations=2, style="concise")
    assert [c.role for c in model.calls] == ["solution", "solution"]
    echoed = next(c for c in model.calls if c.reply.content == SOLUTION_ECHO)
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    assert record.calls == 2 and record.replies["solution"].echo == 1
    refused = next(c for c in record.candidates if c.meta.retry_refused)
    assert refused.call_id == echoed.reply.call_id and refused.usage == echoed.reply.usage
    assert refused.answer is None and refused.meta.echo == "answer" and refused.score == 0.0
    assert refused.meta.verifications is None
    assert record.selection is not None and record.selection.candidate != refused.index
    assert result.counters == {"budget_stops": 1, "solution_echo": 1}
    assert f"candidate {refused.index}: unusable: {refused.error} ({refused.meta.retry_refused})" in record.notes
    stop = "stopped: budget spent (2 calls of a budget of 2) in iteration 0"
    assert record.notes[-1] == f"{stop}; 2 of 2 candidates finished"


async def test_a_tmas_solution_alone_whose_retry_the_budget_refused_leaves_a_record() -> None:
    # Before, the stop left no record at all and the problem failed with no trace of the call it paid for.
    echo = Rule(role="solution", replies=[SOLUTION_ECHO])
    result, model = await solve("tmas", [echo], {"calls": 1}, n=1, m=1, iterations=2, style="concise")
    [call] = model.calls
    assert (result.status, result.stopped_reason, result.answer) == ("failed", "budget", None)
    [record] = result.iterations
    [candidate] = record.candidates
    assert candidate.call_id == call.reply.call_id and candidate.meta.retry_refused is not None
    assert record.usage == call.reply.usage == result.usage


async def test_a_tmas_summary_whose_retry_the_budget_refused_is_built_from_the_scores_and_keeps_its_call() -> None:
    # n = 1, m = 1, 3 calls: the solution, its verification and the summary, which echoes; its retry is refused.
    echo = Rule(role="summary", replies=[SUMMARY_ECHO])
    result, model = await solve("tmas", [echo], {"calls": 3}, n=1, m=1, iterations=2)
    assert [c.role for c in model.calls] == ["solution", "verifier", "summary"]
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    [candidate] = record.candidates
    summary_call = model.calls[-1].reply
    assert candidate.meta.summary_call_id == summary_call.call_id
    assert candidate.meta.summary and SUMMARY_ECHO not in candidate.meta.summary
    assert record.replies["summary"].echo == 1 and result.counters["summary_echo"] == 1
    stop = "budget spent (3 calls of a budget of 3) in iteration 0"
    assert (
        f"candidate 0: the summary echoed the prompt's instructions; the budget refused its retry ({stop}); scores used"
        in record.notes
    )


def memory_echoes() -> list[Rule]:
    ops = [{"op": "ADD", "kind": "anchor", "content": text} for text in (EXPERIENCE_ECHO, FINDING)]
    strategy = {"rollout": 1, "strategy": GUIDELINE_ECHO, "novelty": 1, "same_as": None}
    return [
        Rule(role="experience", replies=[json.dumps({"operations": ops})]),
        Rule(role="guideline", replies=[json.dumps({"rollouts": [strategy]})]),
    ]


async def test_memory_updates_whose_retries_the_budget_refused_take_the_first_replies_less_their_echoes() -> None:
    # n = 1, m = 1: the solution, verification and summary, then both memory calls (5 calls); both echo, and both
    # retries are refused. Each bank takes its first reply without its echoing items, and says its retry was refused.
    result, model = await solve("tmas", memory_echoes(), {"calls": 5}, n=1, m=1, iterations=2)
    assert by_role(model) == {"solution": 1, "verifier": 1, "summary": 1, "experience": 1, "guideline": 1}
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    state = record.state
    stop = "budget spent (5 calls of a budget of 5) in iteration 0"
    experience, guideline = state["experience_update"], state["guideline_update"]
    assert experience["status"] == "applied" and experience["call_id"] == model.calls_of("experience")[0].reply.call_id
    assert experience["retry"] == {"status": "refused", "error": stop} and len(experience["echo_dropped"]) == 1
    assert [e["content"] for e in state["experience_bank"]["entries"]] == [FINDING]
    assert guideline["status"] == "applied" and guideline["retry"] == {"status": "refused", "error": stop}
    assert state["guideline_bank"]["strategies"] == []
    assert record.replies["experience"].echo == record.replies["guideline"].echo == 1
    assert "experience update held 1 item(s) echoing the prompt's instructions; the budget refused its retry" in (
        record.notes
    )
    assert "budget spent during the memory update: each bank took what came back of its update" in record.notes
    assert record.notes[-1] == f"stopped: {stop}"


async def test_memory_calls_the_budget_refused_are_recorded_as_refused() -> None:
    # 3 calls: both memory calls are refused. Each update is recorded as refused (before: "skipped", as if never
    # asked), and the banks stay as they were.
    result, model = await solve("tmas", [], {"calls": 3}, n=1, m=1, iterations=2)
    assert [c.role for c in model.calls] == ["solution", "verifier", "summary"]
    [record] = result.iterations
    stop = "budget spent (3 calls of a budget of 3) in iteration 0"
    assert record.state["experience_update"] == record.state["guideline_update"] == {"status": "refused", "error": stop}
    assert "experience update: the budget refused its call; previous bank kept" in record.notes
    assert "guideline update: the budget refused its call; previous bank kept" in record.notes
    assert "budget spent during the memory update: the banks stay as they were" in record.notes
    assert result.stopped_reason == "budget" and record.notes[-1] == f"stopped: {stop}"


async def test_one_memory_call_refused_leaves_the_other_update_applied() -> None:
    # 4 calls: the experience call goes, the guideline call is refused. The experience update that came back is
    # applied (before: thrown away with the guideline's); the guideline's is recorded as refused.
    result, model = await solve("tmas", [], {"calls": 4}, n=1, m=1, iterations=2)
    assert [c.role for c in model.calls] == ["solution", "verifier", "summary", "experience"]
    [record] = result.iterations
    assert record.state["experience_update"]["status"] == "applied"
    assert record.state["experience_update"]["call_id"] == model.calls[-1].reply.call_id
    assert record.state["experience_bank"]["entries"]
    assert record.state["guideline_update"]["status"] == "refused"
    assert "budget spent during the memory update: each bank took what came back of its update" in record.notes


async def test_a_mattrl_decision_whose_retry_the_budget_refused_ends_with_the_teams_answer() -> None:
    # 11 calls: the team, three opinions, six reviews and the decision, whose answer echoes its instructions; the
    # retry is refused. The decision falls to the team's majority, its reply is in the transcript, and the problem
    # ends stopped by the budget (before: the stop threw the reply away and no note said why).
    echo = (
        "<analysis>\n- the team agrees\n</analysis>\n<final_answer>\nthe answer alone, on one line, or N/A if it cannot"
        " be determined\n</final_answer>"
    )
    chair = Rule(role="coordinator", pattern="<team_summary>", replies=[echo])
    result, model = await solve("mattrl", [chair], {"calls": 11}, iterations=1)
    assert by_role(model) == {"coordinator": 2, "specialist": 3, "reviewer": 6}
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    assert result.counters["budget_stops"] == 1
    [record] = result.iterations
    chair_call = model.calls_of("coordinator")[-1]
    assert chair_call.key.sample < ECHO_RETRY_SAMPLE and record.replies["coordinator"].echo == 1
    reports = [u for u in record.state["transcript"]["utterances"] if u["kind"] == "report"]
    assert [u["call_id"] for u in reports] == [chair_call.reply.call_id]
    assert record.notes[-3:] == [
        "decision: the final answer echoed the prompt's instructions; the budget refused its retry",
        "decision: unreadable (its answer echoed the instructions; the budget refused its retry); the team's majority"
        " answer is used",
        "stopped: budget spent (11 calls of a budget of 11) in iteration 0",
    ]


RESUMED = [
    ("cot", {"style": "concise"}, [Rule(role="solution", replies=[SOLUTION_ECHO])], 1),
    ("tmas", {"n": 1, "m": 1, "style": "concise"}, [Rule(role="solution", replies=[SOLUTION_ECHO])], 1),
    ("tmas", {"n": 1, "m": 1, "iterations": 2}, [Rule(role="summary", replies=[SUMMARY_ECHO])], 3),
    ("tmas", {"n": 1, "m": 1, "iterations": 2, "no_guideline": True}, memory_echoes(), 4),
]


@pytest.mark.parametrize(("method", "params", "rules", "calls"), RESUMED)
async def test_a_problem_solved_again_from_its_store_replays_the_refused_retrys_first_reply(
    tmp_path: Path, method: str, params: dict[str, Any], rules: list[Rule], calls: int
) -> None:
    # Solved again from the run store (a resume), the problem asks nothing: every call it made, the first reply whose
    # retry the budget refused included, is replayed, and it stops where it stopped, with the same records (calls
    # made side by side: tests/test_replay_budget.py).
    settings = scripted_settings(method={"name": method, "params": params}, budget={"calls": calls})
    problem = Problem(problem_id="q", question=Q, answer="391")
    solver = create_method(method, params)
    with RunStore(tmp_path / "run") as store:
        first_model = ScriptedModel(SimScript(rules=rules), settings)
        session = ProblemSession(
            problem, StoreReplay(first_model, store), store, budget=settings.budget, params=solver.params
        )
        first = await solve_one(solver, session)
        again_model = ScriptedModel(SimScript(), settings)
        replay = StoreReplay(again_model, store)
        again = await solve_one(
            solver, ProblemSession(problem, replay, store, budget=settings.budget, params=solver.params)
        )
    assert len(first_model.calls) == calls and again_model.calls == [] and replay.replayed == calls
    assert (again.stopped_reason, again.answer) == (first.stopped_reason, first.answer)
    assert [r.model_dump() for r in again.iterations] == [r.model_dump() for r in first.iterations]


@pytest.mark.parametrize(
    ("method", "params"), [("majority", {"k": 2}), ("pacore", {"responses_per_round": 2}), ("rse", {"n": 2})]
)
async def test_a_sample_whose_retry_the_budget_refused_is_recorded_and_casts_no_vote(
    method: str, params: dict[str, Any]
) -> None:
    # Two samples go together; sample 0 echoes and its retry is refused. It is in the record, unusable, with its
    # call and tokens (before: no candidate at all); sample 1 answers.
    echo = Rule(role="solution", replies=[SOLUTION_ECHO], times=1)
    result, model = await solve(method, [echo], {"calls": 2}, style="concise", iterations=2, **params)
    assert [c.role for c in model.calls] == ["solution", "solution"]
    echoed = next(c for c in model.calls if c.reply.content == SOLUTION_ECHO)
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    refused = next(c for c in record.candidates if c.meta.retry_refused)
    assert len(record.candidates) == 2 and refused.answer is None
    assert refused.call_id == echoed.reply.call_id and refused.usage == echoed.reply.usage
    assert record.calls == 2 and record.replies["solution"].echo == 1
    assert f"candidate {refused.index}: unusable: {refused.error} ({refused.meta.retry_refused})" in record.notes
    assert (
        record.notes[-1]
        == "stopped: budget spent (2 calls of a budget of 2) in iteration 0; 2 of 2 candidates finished"
    )


async def test_an_rse_distillation_whose_retry_the_budget_refused_is_read_from_its_first_reply() -> None:
    # n = 1, 2 calls: the sample, then its distillation, which holds an item copied from its instructions and one
    # finding; its retry is refused. The finding enters the bank as after an unusable retry (before: the whole
    # distillation was counted refused, as if nothing came back), and the problem ends stopped by the budget.
    echoed = "intermediate facts the attempt establishes that you have rechecked yourself and found correct"
    steps = "Carrying out the operations of 17*23 step by step gives 391."
    reply = json.dumps({"propositions": [echoed, steps], "pitfalls": []})
    result, model = await solve("rse", [Rule(role="distiller", replies=[reply])], {"calls": 2}, n=1, iterations=2)
    assert [c.role for c in model.calls] == ["solution", "distiller"]
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    assert record.state["bank"] == {"propositions": [steps], "pitfalls": []}
    assert (record.state["distill"]["distilled"], record.state["distill"]["refused"]) == (1, 0)
    assert record.replies["distiller"].echo == 1 and record.replies["distiller"].unusable == 0
    stop = "budget spent (2 calls of a budget of 2) in iteration 0"
    assert (
        f"distillation of candidate 0: 1 item(s) echoed the instructions; the budget refused its retry ({stop});"
        " the first reply is used" in record.notes
    )
    assert not any("distillations came back before the budget stop" in note for note in record.notes)
    assert record.notes[-1] == f"stopped: {stop}; 1 of 1 candidates finished"


# Three first solutions, told apart by their opening words; the refiner or corrector writes each one again.
PATH_A, PATH_B, PATH_C = "Path A: 5.\n\n\\boxed{5}", "Path B: 7.\n\n\\boxed{7}", "Path C: 7.\n\n\\boxed{7}"
SCORE_1 = "## Analysis\nEvery step checks out.\n\n## Score\nScore: 1"


def refining(role: str, echo: bool) -> list[Rule]:
    """Iteration 0 writes 5, 7, 7; each later call writes its trajectory's solution again, except trajectory 2's,
    which echoes the prompt's instructions with ``echo``."""
    return [
        Rule(role="solution", replies=[PATH_A, PATH_B, PATH_C]),
        *([Rule(role=role, pattern="Path C", replies=[SOLUTION_ECHO])] if echo else []),
        *[
            Rule(role=role, pattern=f"Path {p}", replies=[s])
            for p, s in zip("ABC", (PATH_A, PATH_B, PATH_C), strict=True)
        ],
        Rule(role="verifier", replies=[SCORE_1]),
    ]


@pytest.mark.parametrize(
    ("method", "role", "calls"), [("self_refine", "refiner", 5), ("verify_refine", "corrector", 8)]
)
async def test_a_refinement_whose_retry_the_budget_refused_is_recorded_and_its_trajectory_holds_its_solution(
    method: str, role: str, calls: int
) -> None:
    # Iteration 1's calls go in trajectory order. With `calls`, trajectory 2's refinement is refused outright: it
    # holds its 7 of iteration 0 (held_over), and the vote is 5, 7, 7. With one call more, its refinement comes back
    # echoing and its retry is refused: the reply is in the record (call, tokens, the stop), and the trajectory still
    # holds its 7 (before: no record of the reply, and trajectory 2 out of the vote: 5 against 7, a tie 5 won).
    params = {"n": 3, "iterations": 3, "style": "concise"}
    plain, _ = await solve(method, refining(role, echo=False), {"calls": calls}, **params)
    result, model = await solve(method, refining(role, echo=True), {"calls": calls + 1}, **params)
    assert plain.iterations[1].held_over == [2] and plain.answer == "7"
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", plain.answer)
    it0, it1 = result.iterations
    echoed = next(c for c in model.calls_of(role) if c.reply.content == SOLUTION_ECHO)
    refused = it1.candidates[2]
    assert refused.call_id == echoed.reply.call_id and refused.usage == echoed.reply.usage
    assert refused.answer is None and refused.meta.retry_refused is not None and refused.meta.echo == "answer"
    assert refused.meta.carried_from == 0 and it1.held_over is None
    assert it1.replies[role].echo == 1 and it1.calls == (calls + 1) - it0.calls
    assert it1.selected == plain.iterations[1].selected == "7"
    assert it1.selection is not None and plain.iterations[1].selection is not None
    assert (it1.selection.iteration, it1.selection.candidate) == (
        plain.iterations[1].selection.iteration,
        plain.iterations[1].selection.candidate,
    )
    assert (
        "candidate 2: the budget refused its retry; the trajectory goes on from its solution of iteration 0"
        " (answer 7), which counts in its place" in it1.notes
    )


# An opinion that copies the math specialist's instructions.
OPINION_ECHO = (
    "Think step by step from your speciality and write ONE integrated, concise message: a one- or two-sentence "
    "reflection, the core reasoning, and the final answer alone inside \\boxed{}. Keep it rigorous and "
    "self-contained; no decorative tags, no step numbering."
)


async def test_a_mattrl_opinion_whose_retry_the_budget_refused_is_recorded_and_its_seat_keeps_its_attempt() -> None:
    # Team of 3, 4 calls: the team and the three opinions; S3's echoes and its retry is refused. Its reply is the
    # seat's candidate (call, tokens, the stop), the seat keeps its attempt and does not speak, and the notes say the
    # budget refused the retry (before: that it refused the opinion call, and no record of the reply).
    echo = Rule(role="specialist", pattern="You are Edge-case auditor", replies=[OPINION_ECHO])
    result, model = await solve("mattrl", [echo], {"calls": 4}, iterations=2)
    assert by_role(model) == {"coordinator": 1, "specialist": 3}
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    echoed = next(c for c in model.calls if c.reply.content == OPINION_ECHO)
    [s3] = [c for c in record.candidates if c.meta.member == "S3"]
    assert s3.call_id == echoed.reply.call_id and s3.usage == echoed.reply.usage and s3.answer is None
    assert s3.meta.retry_refused == "budget spent (4 calls of a budget of 4) in iteration 0" and s3.error
    assert len(record.candidates) == 3 and record.calls == 4 and record.replies["specialist"].echo == 1
    [said] = [u for u in Transcript.model_validate(record.state["transcript"]).utterances if u.agent == "S3"]
    assert (said.text, said.answer, said.call_id) == ("", None, echoed.reply.call_id)
    assert [m["spoke"] for m in record.state["members"] if m["id"] == "S3"] == [False]
    assert (
        f"S3: the opinion's {s3.meta.echo} echoed the instructions; the budget refused its retry; keeps its attempt"
        in record.notes
    )
    assert not any("refused its opinion call" in note for note in record.notes)
    assert record.notes[-1] == f"stopped: {s3.meta.retry_refused}; the team's majority answer is used"


async def test_an_education_plan_whose_retry_the_budget_refused_is_recorded_in_the_cut_round() -> None:
    # The pre-test, the team, round 1's three analyses and the plan (6 calls): the plan echoes its instructions and
    # its retry is refused. The round's record keeps the plan's call (an empty meeting turn: no question was put) and
    # says the budget refused its retry (before: that the planned question was refused, and no trace of its call).
    question = "Which quantity stays the same in free fall?\nA) speed\nB) acceleration\nC) height"
    problem = Problem(problem_id="q1", question=question, answer="B", metadata={"field": "Physics"})
    plan_echo = (
        "ROUND 1: plan one specific, targeted question for round 1 of the dialogue that ties directly to the"
        " student's reasoning"
    )
    echo = Rule(role="coordinator", pattern="for round 1 of the dialogue", replies=[plan_echo])
    result, model = await run_scripted(
        "mattrl", [echo], problem, domain="education", iterations=2, settings={"budget": {"calls": 6}}
    )
    assert len(model.calls) == 6 and model.calls[-1].reply.content == plan_echo
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "A")
    record = result.iterations[1]
    said = Transcript.model_validate(record.state["transcript"]).by_round(1)
    assert [(u.agent, u.kind) for u in said] == [
        ("S1", "opinion"),
        ("S2", "opinion"),
        ("S3", "opinion"),
        ("coordinator", "meeting"),
    ]
    assert (said[-1].text, said[-1].call_id) == ("", model.calls[-1].reply.call_id)
    assert record.calls == 4 and record.replies["coordinator"].echo == 1
    assert (
        "round 1: the planned question echoed the prompt's instructions; the budget refused its retry" in record.notes
    )
    assert record.notes[-1] == (
        "stopped: budget spent (6 calls of a budget of 6) in iteration 1; round 1 was cut by the budget (the planned"
        " question echoed the prompt's instructions; the budget refused its retry): its finished turns are kept, and"
        " the pre-test's answer stands"
    )


async def test_a_reply_whose_retry_the_budget_refused_counts_one_send_of_its_prompt() -> None:
    # One call of budget: the reply echoes and its retry is refused, so never sent: the prompt was sent once (before,
    # counted twice, as an echo asked again is). With two calls the retry goes: two sends.
    rules = [Rule(role="solution", replies=[SOLUTION_ECHO], times=1)]
    for calls, sends in ((1, 1), (2, 2)):
        settings = scripted_settings(budget={"calls": calls})
        model = ScriptedModel(SimScript(rules=rules), settings)
        problem = Problem(problem_id="q", question=Q)
        session = ProblemSession(problem, model, None, params=MethodParams(), budget=settings.budget)
        messages = generation_prompt(Q, "numeric", "concise")
        asked = Reasked()
        candidate = await solve_call(session, "solution", messages, index=0, mode="numeric", asked=asked)
        assert candidate is not None and len(model.calls) == calls
        assert asked.attempt(0, "solution", messages) == sends


# Each iteration (round) of these writes one solution: 5, 5, 7, then one that echoes the prompt's instructions.
FIVE, SEVEN = "Path A: 5.\n\n\\boxed{5}", "Path B: 7.\n\n\\boxed{7}"
CUT_ITERATION = [
    ("tmas", {"n": 1, "m": 1}, 15),
    ("rse", {"n": 1}, 6),
    ("pacore", {"responses_per_round": 1}, 3),
]


@pytest.mark.parametrize("answer_fallback", [True, False])
@pytest.mark.parametrize(("method", "params", "calls"), CUT_ITERATION)
async def test_a_cut_iteration_whose_every_reply_the_budget_refused_a_retry_keeps_the_answer_before(
    method: str, params: dict[str, Any], calls: int, answer_fallback: bool
) -> None:
    # `calls` is iterations 0-2's calls: with it, iteration 3's solution is refused outright, and the answer is the
    # one chosen after iteration 2 (7). With one call more, that solution comes back echoing and its retry is
    # refused: the reply is in iteration 3's record (call, tokens, the stop), and the answer is still iteration 2's,
    # recorded as such (before: the answer fallback over every earlier iteration, 5 where it counts all of them, or
    # no answer at all with the fallback off).
    rules = [
        Rule(role="solution", replies=[FIVE, FIVE, SEVEN, SOLUTION_ECHO]),
        Rule(role="verifier", replies=[SCORE_1]),
    ]
    params = {**params, "iterations": 4, "style": "concise", "answer_fallback": answer_fallback}
    plain, _ = await solve(method, rules, {"calls": calls}, **params)
    result, model = await solve(method, rules, {"calls": calls + 1}, **params)
    assert (plain.stopped_reason, plain.answer, plain.fallback, len(plain.iterations)) == ("budget", "7", None, 3)
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "7")
    assert result.fallback is None and result.text == plain.text
    assert result.counters.get("answer_fallback") is None
    echoed = model.calls_of("solution")[-1]
    assert echoed.reply.content == SOLUTION_ECHO and len(model.calls) == calls + 1
    cut = result.iterations[-1]
    assert cut.iteration == 3 and cut.calls == 1 and cut.usage == echoed.reply.usage
    [refused] = cut.candidates
    assert refused.call_id == echoed.reply.call_id and refused.usage == echoed.reply.usage
    assert refused.answer is None and refused.meta.retry_refused is not None
    assert f"candidate 0: unusable: {refused.error} ({refused.meta.retry_refused})" in cut.notes
    assert (
        cut.selected == "7"
        and cut.selection is not None
        and cut.selection.model_dump()
        == {
            "iteration": 2,
            "candidate": 0,
            "fallback": False,
        }
    )
    assert "answer_fallback" not in cut.state
    assert (
        "no usable candidate: every reply that came back echoed and the budget refused its retry; the answer stays"
        " the one chosen after iteration 2" in cut.notes
    )
