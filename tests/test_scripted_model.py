"""Methods, a MATTRL stage, the judge and the turn judge on the in-process scripted model (no HTTP): their logic, and
what they asked the model for, through the ChatModel protocol alone; and the scripted model answering a request as
the simulated server does (the body the HTTP client would send, a reply model's schema where it would send one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings, settings_for
from mattrl_runs import hand_worked_transcript
from tmas.agents.utterance_judge import JudgeScoreReply
from tmas.api import asolve
from tmas.config import Sampling, Settings
from tmas.grading.judge import JudgeReplyFormat, judge_once
from tmas.llm.client import LLMClient
from tmas.llm.model import ChatModel, QuotaSpent
from tmas.llm.replay import StoreReplay
from tmas.llm.types import ChatRequest, TokenLogprob, user
from tmas.llm.watch import UNWATCHED_NOTICE
from tmas.methods import create_method
from tmas.methods.base import MethodParams, ProblemResult, ProblemSession
from tmas.methods.mattrl import MATTRL, MATTRLParams
from tmas.methods.online_stop import ConfidenceWatch
from tmas.pool.outcomes import LabelledTranscript
from tmas.pool.scoring import TurnJudge
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

Q = Problem(problem_id="p1", question="What is 17*23?", answer="391")
SETTINGS = Settings.model_validate({"sampling": {"temperature": 0.7, "max_tokens": 256}})


async def solve(model: ScriptedModel, method: str, **params: Any) -> ProblemResult:
    solver = create_method(method, params)
    return await solver.solve(ProblemSession(Q, model, None, seed=3, params=solver.params))


def test_both_implementations_satisfy_the_protocol() -> None:
    # mypy checks these assignments; at run time they show the seam is the protocol, not the class.
    scripted: ChatModel = ScriptedModel(settings=SETTINGS)
    http: ChatModel = LLMClient(Settings.model_validate({"endpoint": {"base_url": "http://127.0.0.1:9"}}))
    assert scripted.model_name("solution") == "default" and http.model_name("solution") == "default"


async def test_tmas_runs_algorithm_1_in_process() -> None:
    model = ScriptedModel(settings=SETTINGS)
    n, m, t = 2, 2, 2
    result = await solve(model, "tmas", n=n, m=m, iterations=t)
    assert result.status == "done" and result.answer == "391"
    roles = [call.role for call in model.calls]
    # The last iteration computes no summaries or memory updates (nothing reads them: skip_final_memory).
    assert {r: roles.count(r) for r in set(roles)} == {
        "solution": n * t,
        "verifier": n * m * t,
        "summary": n * (t - 1),
        "experience": t - 1,
        "guideline": t - 1,
    }
    # Iteration 1's exploit or explore prompts carry what iteration 0 left in the banks.
    second = [c for c in model.calls_of("solution") if c.key.iteration == 1]
    marks = ("<rollouts>", "<attempted_strategies>")
    assert second and all(any(mark in c.messages[-1].content for mark in marks) for c in second)
    # Every call carried its own derived seed over the run's sampling.
    seeds = [c.sampling.seed for c in model.calls]
    assert None not in seeds and len(set(seeds)) > 1
    assert {c.sampling.temperature for c in model.calls} == {0.7}


async def test_tmas_preset_sampling_reaches_each_role_in_process() -> None:
    model = ScriptedModel(settings=Settings())  # no sampling set by anyone: the preset fills it
    await solve(model, "tmas", preset="local", iterations=1)
    assert {c.sampling.temperature for c in model.calls_of("solution")} == {0.3}
    assert {c.sampling.max_tokens for c in model.calls_of("verifier")} == {400}


async def test_majority_vote_counts_the_scripted_answers() -> None:
    replies = ["So \\boxed{391}.", "So \\boxed{390}.", "So \\boxed{391}.", "So \\boxed{12}."]
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=replies)]), SETTINGS)
    result = await solve(model, "majority", k=4)
    assert result.answer == "391"
    assert len(model.calls_of("solution")) == 4
    assert len({c.sampling.seed for c in model.calls}) == 4  # four distinct samples of one prompt


async def test_verify_refine_corrects_a_wrong_solution_in_process() -> None:
    wrong = "Multiplying gives 17*23 = 390.\n\nTherefore, the final answer is \\boxed{390}."
    verdict = "## Analysis\nThe product is wrong: 17*23 is 391.\n\n## Score\nScore: 0"
    model = ScriptedModel(
        SimScript(
            rules=[
                Rule(role="solution", replies=[wrong]),
                Rule(role="verifier", replies=[verdict], times=2),
            ]
        ),
        SETTINGS,
    )
    result = await solve(model, "verify_refine", n=1, m=2, iterations=2)
    [corrector] = model.calls_of("corrector")
    # The corrector sees its own solution and the verifier's finding, then answers right (default responder).
    assert "390" in corrector.messages[-1].content and "17*23 is 391" in corrector.messages[-1].content
    assert result.answer == "391"
    assert [c.score for c in result.iterations[0].candidates] == [0.0]


async def test_mattrl_team_formation_repairs_nothing_on_a_good_reply_and_falls_back_on_bad_ones() -> None:
    method = MATTRL(MATTRLParams(retries=1))
    good = ScriptedModel(settings=SETTINGS)
    notes: list[str] = []
    team = await method._form_team(ProblemSession(Q, good, None, params=method.params), notes)
    assert [m.specialty for m in team] == ["Arithmetic strategist", "Computation checker", "Edge-case auditor"]
    assert notes == [] and good.calls[0].reply_model is not None  # the team's schema goes with the call

    bad = ScriptedModel(SimScript(rules=[Rule(role="coordinator", replies=["no team here"])]), SETTINGS)
    notes = []
    team = await method._form_team(ProblemSession(Q, bad, None, params=method.params), notes)
    assert len(bad.calls) == 2  # the first try and one retry
    assert notes[-1] == "team formation: no usable team from the coordinator; the default team is used"
    assert len(team) == MATTRLParams().team_size


async def test_the_answer_judge_retries_an_unreadable_reply_in_process() -> None:
    model = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=["not json"], times=1)]), SETTINGS)
    verdict = await judge_once(model, problem_id="p1", problem=Q.question, reference="391", student="391.0", run=0)
    assert verdict.correct is True and verdict.attempts == 2
    assert [c.reply_model for c in model.calls] == [JudgeReplyFormat, JudgeReplyFormat]
    assert [c.key.sample for c in model.calls] == [0, 1]


async def test_store_replay_wraps_any_model(tmp_path: Path) -> None:
    # The run store's replay is a wrapper (tmas.llm.replay): around the scripted model, a second solve of the same
    # problem with the same seed is answered from the store alone, with the same result.
    with RunStore(tmp_path / "run") as store:
        method = create_method("tmas", {"n": 2, "m": 1, "iterations": 2})
        first_model = ScriptedModel(settings=SETTINGS)
        first = await method.solve(
            ProblemSession(Q, StoreReplay(first_model, store), store, seed=3, params=method.params)
        )
        again_model = ScriptedModel(settings=SETTINGS)
        replay = StoreReplay(again_model, store)
        again = await method.solve(ProblemSession(Q, replay, store, seed=3, params=method.params))
        assert again_model.calls == [] and replay.replayed == len(first_model.calls) == len(list(store.calls()))
        # The chains end through the wrapper, replayed or sent.
        assert again_model.ended_chains == first_model.ended_chains and len(first_model.ended_chains) == 4
        assert again.answer == first.answer == "391"
        assert [c.text for r in again.iterations for c in r.candidates] == [
            c.text for r in first.iterations for c in r.candidates
        ]
        # Each stored call keeps its sources (SETTINGS is built in Python, so a value equal to the built-in one
        # reads as the built-in one: see tmas.llm.sampling).
        call = next(store.calls())
        assert call.call_id is not None
        assert store.call_sampling_sources(call.call_id) == {
            "temperature": "built-in",
            "max_tokens": "config",
            "seed": "derived seed",
        }


async def test_experience_turn_scoring_retries_an_unreadable_judge_reply_in_process() -> None:
    case = LabelledTranscript("run", Q, hand_worked_transcript(), outcome=1.0)
    turns = case.turns()
    replies = ["no score here", json.dumps({"analysis": "It moved the team to the right product.", "score": 4})]
    model = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=replies)]), SETTINGS)
    judged = await TurnJudge(model).score_turn(case, turns, turns[0])
    assert judged.value == 4 / 5 and judged.attempts == 2 and judged.defaulted is None  # Eq. 9: s = score / 5
    assert [c.key.sample for c in model.calls] == [0, 1]
    assert all(c.reply_model is JudgeScoreReply and turns[0].text in c.messages[-1].content for c in model.calls)


async def test_a_watch_is_never_begun_in_process_and_the_session_says_so_once() -> None:
    # The scripted model answers whole, as an unstreamed call: the watch sees nothing and stops nothing.
    session = ProblemSession(Q, ScriptedModel(settings=SETTINGS), None, params=MethodParams())
    watch = ConfidenceWatch(threshold=2.0, window=4)
    for sample in range(2):
        reply = await session.chat("solution", [user(Q.question)], sample=sample, watch=watch)
        assert reply.ok and reply.stopped_early is None and "\\boxed{391}" in reply.content
    assert not watch.began and session.notices == {"unwatched": UNWATCHED_NOTICE}


async def test_logprobs_come_where_asked_and_calls_are_numbered_in_process() -> None:
    payload = [{"token": "Score", "logprob": -0.5, "top_logprobs": [{"token": "Score", "logprob": -0.5}]}]
    rules = [Rule(role="verifier", replies=["Score: 2"], logprobs=payload)]
    model = ScriptedModel(SimScript(rules=rules), SETTINGS)
    asked = Sampling(extra_body={"logprobs": True, "top_logprobs": 2})
    scripted = await model.chat("verifier", [user("Grade it.")], sampling=asked)
    certain = await model.chat("solution", [user(Q.question)], sampling=asked)
    plain = await model.chat("solution", [user(Q.question)])
    # The rule's payload, else every content token certain with itself as the one alternative; none unasked.
    assert scripted.logprobs == [TokenLogprob.model_validate(p) for p in payload]
    assert certain.logprobs is not None and "".join(t.token for t in certain.logprobs) == certain.content
    assert all(t.logprob == 0.0 and [a.token for a in t.top_logprobs] == [t.token] for t in certain.logprobs)
    assert plain.logprobs is None
    assert [scripted.call_id, certain.call_id, plain.call_id] == [1, 2, 3]
    # A script whose server ignores the request sends none.
    silent = ScriptedModel(SimScript(logprobs=False), SETTINGS)
    assert (await silent.chat("solution", [user(Q.question)], sampling=asked)).logprobs is None
    vectors = await model.embed(["one text", "another"])
    assert model.embedded == [["one text", "another"]] and len(vectors) == 2


async def test_a_run_answers_alike_in_process_and_on_the_simulated_server(tmp_path: Path) -> None:
    # The default verifier's random scores come from a hash of the request body: in process the body is the one the
    # HTTP client sends (a reply model's schema included), so every call gets the same reply either way.
    params = {"n": 3, "m": 2, "iterations": 2}
    with SimServer(SimScript()) as sim:
        on_wire = await asolve(Q.question, settings_for(sim, method={"name": "tmas", "params": params}))
        sent = sorted(json.dumps(delivered(r.body), sort_keys=True) for r in sim.requests if r.endpoint == "chat")
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "tmas", "params": params}))
    in_process = await asolve(Q.question, model=model)
    assert sorted(json.dumps(call.body, sort_keys=True) for call in model.calls) == sent
    assert any("response_format" in call.body for call in model.calls_of("verifier"))

    def scores(result: ProblemResult) -> list[list[float | None]]:
        return [[c.score for c in record.candidates] for record in result.iterations]

    assert scores(in_process) == scores(on_wire) and in_process.answer == on_wire.answer


def delivered(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` less how it was delivered (streamed or not): what a reply depends on."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


async def test_a_reply_models_schema_is_sent_where_the_http_client_sends_it() -> None:
    def verifier_formats() -> list[bool]:
        return ["response_format" in call.body for call in model.calls_of("verifier")]

    params = {"n": 1, "m": 1, "iterations": 1}
    # auto: not before the endpoint's first reply has shown where it puts reasoning, then with every reply model.
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "tmas", "params": params}))
    await solve(model, "tmas", **params)
    first = model.calls[0]
    assert first.reply_model is None and verifier_formats() == [True]
    # off: never; json_schema: always; auto against a model that thinks inside its reply: never.
    for mode, script, sent in (
        ("off", SimScript(), False),
        ("json_schema", SimScript(), True),
        ("auto", SimScript(rules=[Rule(replies=["<think>17*23</think>\\boxed{391}"])]), False),
    ):
        model = ScriptedModel(script, scripted_settings(endpoint__structured_output=mode))
        reply = await model.chat("verifier", [user("Grade it.")], reply_model=JudgeScoreReply)
        again = await model.chat("verifier", [user("Grade it again.")], reply_model=JudgeScoreReply)
        assert reply.ok and ["response_format" in c.body for c in model.calls] == [mode == "json_schema", sent], mode
        assert again.ok


async def test_a_roles_own_endpoint_fields_decide_its_schema() -> None:
    # The default endpoint sends schemas always; the verifier's own endpoint sends none, and the judge's ("auto", on
    # an address of its own) learns from its own first reply: the default endpoint's replies teach it nothing.
    judge = {"base_url": "http://judge.invalid/v1", "structured_output": "auto"}
    roles = {"verifier": {"structured_output": "off"}, "judge": judge}
    model = ScriptedModel(SimScript(), scripted_settings(endpoint__structured_output="json_schema", roles=roles))
    for role in ("solution", "verifier", "judge", "judge"):
        await model.chat(role, [user("Grade it.")], reply_model=JudgeScoreReply)
    assert ["response_format" in call.body for call in model.calls] == [True, False, False, True]


QUOTA = {
    "error": {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}


async def test_a_rules_error_status_fails_the_call_in_process_as_the_http_client_sees_it() -> None:
    # A rule with error_status and no fault: the simulator refuses the request with that status (and error_body);
    # in process the call fails alike, with the cause and message the HTTP client reads from that refusal.
    for status, cause in ((400, "http_400"), (503, "http_503")):
        script = SimScript(persona="vllm", rules=[Rule(error_status=status, error_message="Engine refused it.")])
        with SimServer(script) as sim:
            async with LLMClient(settings_for(sim)) as llm:
                on_wire = await llm.chat("solution", [user(Q.question)])
        in_process = await ScriptedModel(script, SETTINGS).chat("solution", [user(Q.question)])
        assert not on_wire.ok and not in_process.ok and in_process.content == ""
        assert in_process.error_cause == on_wire.error_cause == cause
        assert in_process.error == f"HTTP {status}: Engine refused it."
        assert on_wire.error is not None and on_wire.error.endswith(": Engine refused it.")
    # OpenAI's 429 for a spent quota (its body verbatim): the client ends the run, in process too.
    quota = SimScript(persona="openai", rules=[Rule(role="solution", error_status=429, error_body=QUOTA)])
    with SimServer(quota) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            with pytest.raises(QuotaSpent, match="quota is spent"):
                await llm.chat("solution", [user(Q.question)])
    with pytest.raises(QuotaSpent, match="refused role 'solution': HTTP 429: You exceeded your current quota"):
        await ScriptedModel(quota, SETTINGS).chat("solution", [user(Q.question)])


async def test_a_failed_call_in_process_names_its_call_request_and_model() -> None:
    # A fault that replaces the reply and a refusal by status fail alike: the call's key, the hash of its request, its
    # number among the calls and the model asked, with nothing generated.
    for rule, error, cause in (
        (Rule(fault="http_500"), "scripted http_500", "http_500"),
        (Rule(error_status=400, error_message="Engine refused it."), "HTTP 400: Engine refused it.", "http_400"),
    ):
        model = ScriptedModel(SimScript(rules=[rule]), SETTINGS)
        await model.chat("verifier", [user("first")])
        failed = await model.chat("solution", [user(Q.question)])
        call = model.calls[-1]
        assert (failed.error, failed.error_cause, failed.call_id) == (error, cause, 2)
        assert failed.key == call.key and failed.model == "default" and failed.content == ""
        sent = ChatRequest.build("default", [user(Q.question)], model.resolve_sampling("solution"))
        assert failed.request_hash == sent.request_hash(call.key)
        assert failed.usage.completion_tokens == 0
