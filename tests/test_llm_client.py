"""The LLM client against the simulated server over HTTP: retries, caps, routing, reasoning, usage, context."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from conftest import dead_url, settings_for
from tmas.agents.verification import parse_verification
from tmas.config import Sampling
from tmas.errors import ConfigError
from tmas.llm.client import LLMClient
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats, EndpointUnreachable
from tmas.llm.types import CallKey, user
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer

QUESTION = [user("What is 17*23?")]


@pytest.mark.parametrize("fault", ["http_500", "http_503", "http_429", "drop", "malformed"])
async def test_transient_faults_are_retried(sim: SimServer, fault: str, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(fault=fault, times=2)], hang_s=5))  # type: ignore[arg-type]
    settings = settings_for(sim)
    settings.endpoint.timeout_s = 0.5
    stats = ClientStats()
    with RunStore(tmp_path) as store:
        async with open_model(settings, store, stats=stats) as llm:
            reply = await llm.chat("solution", QUESTION)
        assert reply.ok, reply.error
        assert reply.attempts == 3
        assert "391" in reply.content
        assert stats.retries == 2
        assert sim.stats().total_requests == 3
        stored = list(store.calls())
    assert len(stored) == 1 and stored[0].error is None and stored[0].attempts == 3


@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_a_dropped_connection_is_sent_again_as_it_was_and_recorded_by_its_cause(
    sim: SimServer, stream: str, tmp_path: Path
) -> None:
    # The server reads the request and closes the connection without a status line: the request may not have
    # reached the model, so the same body goes again after the backoff (cause "disconnected", one attempt spent).
    sim.set_script(SimScript(rules=[Rule(fault="drop", times=1)]))
    settings = settings_for(sim)
    settings.endpoint.stream = stream  # type: ignore[assignment]
    stats = ClientStats()
    with RunStore(tmp_path) as store:
        async with open_model(settings, store, stats=stats) as llm:
            reply = await llm.chat("solution", QUESTION)
        [stored] = store.calls()
    assert reply.ok, reply.error
    assert "\\boxed{391}" in reply.content
    assert (reply.attempts, reply.retry_causes) == (2, ["disconnected"])
    assert (stats.retries, stats.retries_by_cause) == (1, {"disconnected": 1})
    assert (stored.attempts, stored.retry_causes, stored.error) == (2, ["disconnected"], None)
    dropped, answered = sim.chat_bodies()
    assert dropped == answered and dropped["messages"] == [{"role": "user", "content": "What is 17*23?"}]
    assert sim.stats().faults == {"drop": 1}


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_a_silent_request_is_waited_for_streamed_or_not(sim: SimServer, stream: str, tmp_path: Path) -> None:
    # The server holds the request 1.5 s before answering (a queue) and keeps answering /health. Streamed or not, the
    # silence before the reply is waited out past timeout_s: one request.
    sim.set_script(SimScript(rules=[Rule(fault="timeout", times=1)], hang_s=1.5))
    settings = settings_for(sim)
    settings.endpoint.timeout_s = 0.5
    settings.endpoint.stream = stream  # type: ignore[assignment]
    stats = ClientStats()
    async with open_model(settings, stats=stats) as llm:
        reply = await llm.chat("solution", QUESTION)
    assert reply.ok, reply.error
    assert reply.attempts == 1 and stats.retries == 0 and sim.stats().total_requests == 1
    assert reply.first_token_s is not None and reply.first_token_s >= 1.5


async def test_client_error_fails_at_once_with_server_message(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="http_400")]))
    with RunStore(tmp_path) as store:
        async with open_model(settings_for(sim), store) as llm:
            reply = await llm.chat("solution", QUESTION)
        assert not reply.ok
        assert reply.error is not None and reply.error.startswith("HTTP 400")
        assert reply.attempts == 1
        assert sim.stats().total_requests == 1
        [stored] = store.calls()
        assert stored.error == reply.error


async def test_exhausted_retries_are_recorded_as_failed(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="http_500")]))
    with RunStore(tmp_path) as store:
        async with open_model(settings_for(sim), store) as llm:
            reply = await llm.chat("solution", QUESTION)
        assert reply.error is not None and "gave up after 4 attempts" in reply.error
        assert sim.stats().total_requests == 4
        [stored] = store.calls()
        assert stored.error == reply.error
        # A failed call is never replayed: it is asked again on resume.
        assert store.lookup_call(stored.request_hash, 0, stored.key.iteration) is None


# nginx's error pages, as a proxy in front of the server sends them.
NGINX_PAGE = (
    "<html>\r\n<head><title>{status}</title></head>\r\n<body>\r\n<center><h1>{status}</h1></center>\r\n"
    "<hr><center>nginx/1.24.0</center>\r\n</body>\r\n</html>\r\n"
)


@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_a_proxys_error_pages_are_retried_and_said_in_one_line(
    sim: SimServer, tmp_path: Path, stream: str
) -> None:
    # A proxy answers 502 twice (its server restarting), then the server answers: each retry has its cause.
    page = NGINX_PAGE.format(status="502 Bad Gateway")
    sim.set_script(SimScript(rules=[Rule(error_status=502, error_page=page, times=2)]))
    settings = settings_for(sim, endpoint__stream=stream)
    async with open_model(settings) as llm:
        reply = await llm.chat("solution", QUESTION)
    assert reply.ok and "391" in reply.content
    assert (reply.attempts, reply.retry_causes, sim.stats().total_requests) == (3, ["http_502", "http_502"], 3)
    # A proxy that keeps answering 504: the call fails once its attempts are spent, its error one line naming the
    # page's title, not the page's markup.
    sim.set_script(
        SimScript(rules=[Rule(error_status=504, error_page=NGINX_PAGE.format(status="504 Gateway Time-out"))])
    )
    sim.reset()
    with RunStore(tmp_path) as store:
        async with open_model(settings, store) as llm:
            failed = await llm.chat("solution", QUESTION)
        [stored] = store.calls()
    assert failed.error is not None and stored.error == failed.error
    assert "\n" not in failed.error and "<" not in failed.error
    assert "HTTP 504" in failed.error and "504 Gateway Time-out (an HTML page" in failed.error
    assert (failed.retry_causes, sim.stats().total_requests) == (["http_504"] * 3, 4)


async def test_unreachable_endpoint_raises() -> None:
    settings = settings_for()
    with dead_url() as dead:
        settings.endpoint.base_url = [dead]
        async with LLMClient(settings) as llm:
            with pytest.raises(EndpointUnreachable, match="unreachable"):
                await llm.chat("solution", QUESTION)


@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_a_host_that_never_answers_is_unreachable(stream: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A host gone from the network refuses nothing: its packets vanish. A listening socket whose one-place queue is
    # taken plays it (the kernel drops the connections that come next). Each attempt gives up connecting after
    # CONNECT_TIMEOUT_S, not after timeout_s of silence, and the call ends the run as an unreachable endpoint.
    monkeypatch.setattr("tmas.llm.failures.CONNECT_TIMEOUT_S", 0.2)
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        gone.listen(0)
        with socket.create_connection(gone.getsockname()):
            settings = settings_for(endpoint__stream=stream, endpoint__timeout_s=30)
            settings.endpoint.base_url = [f"http://127.0.0.1:{gone.getsockname()[1]}/v1"]
            async with LLMClient(settings) as llm:
                with pytest.raises(EndpointUnreachable, match="did not answer in time"):
                    await llm.chat("solution", QUESTION)


async def test_global_cap_holds_under_500_concurrent_calls(sim: SimServer) -> None:
    sim.set_script(SimScript(latency_s=0.02))
    settings = settings_for(sim, concurrency=16)
    async with LLMClient(settings) as llm:
        replies = await asyncio.gather(
            *(llm.chat("solution", QUESTION, key=CallKey(role="solution", sample=i)) for i in range(500))
        )
    assert all(r.ok for r in replies)
    stats = sim.stats()
    assert stats.completed == 500
    assert stats.max_in_flight == 16


async def test_per_endpoint_cap_and_replica_spreading(sim: SimServer, sim2: SimServer) -> None:
    for s in (sim, sim2):
        s.set_script(SimScript(latency_s=0.02))
    settings = settings_for(sim, sim2, endpoint__max_in_flight=3)
    async with LLMClient(settings) as llm:
        await asyncio.gather(
            *(llm.chat("solution", QUESTION, key=CallKey(role="solution", sample=i)) for i in range(60))
        )
    a, b = sim.stats(), sim2.stats()
    assert a.max_in_flight == 3 and b.max_in_flight == 3
    assert a.completed + b.completed == 60
    assert 20 <= a.completed <= 40


async def test_roles_route_to_their_own_endpoint_and_sampling(sim: SimServer, sim2: SimServer) -> None:
    settings = settings_for(
        sim, roles={"verifier": {"base_url": sim2.base_url, "model": "judge-model", "sampling": {"temperature": 0.1}}}
    )
    async with LLMClient(settings) as llm:
        await llm.chat("solution", QUESTION)
        await llm.chat("verifier", QUESTION)
        await llm.chat("summary", QUESTION)
    assert sim.stats().by_role == {"solution": 1, "summary": 1}
    assert sim2.stats().by_role == {"verifier": 1}
    [verifier_call] = sim2.requests
    assert verifier_call.body["model"] == "judge-model"
    assert verifier_call.body["temperature"] == 0.1
    # Unset fields of the role keep the defaults.
    assert verifier_call.body["max_tokens"] == 256
    assert {r.body["temperature"] for r in sim.requests} == {0.7}


async def test_sampling_parameters_and_extra_body_pass_through(sim: SimServer) -> None:
    settings = settings_for(sim)
    override = Sampling(top_p=0.9, seed=7, stop=["###"], extra_body={"top_k": 20, "min_p": 0.05})
    async with LLMClient(settings) as llm:
        await llm.chat("solution", QUESTION, sampling=override)
    [request] = sim.requests
    body = request.body
    assert (body["top_p"], body["seed"], body["stop"], body["top_k"], body["min_p"]) == (0.9, 7, ["###"], 20, 0.05)
    assert body["temperature"] == 0.7


@pytest.mark.parametrize("script", [SimScript(reasoning=True), SimScript(think_tags=True)])
async def test_reasoning_is_split_from_final_content(sim: SimServer, script: SimScript, tmp_path: Path) -> None:
    sim.set_script(script)
    with RunStore(tmp_path) as store:
        async with open_model(settings_for(sim), store) as llm:
            reply = await llm.chat("solution", QUESTION)
        assert reply.reasoning
        assert "<think>" not in reply.content and "</think>" not in reply.content
        assert reply.reasoning not in reply.content
        assert "\\boxed{391}" in reply.content
        [stored] = store.calls()
        assert stored.reasoning == reply.reasoning and stored.content == reply.content


async def test_a_reply_cut_inside_thinking_the_template_opened_has_no_answer(sim: SimServer) -> None:
    # A model whose chat template opens the think block (DeepSeek-R1 distills, Qwen3.5), served without a reasoning
    # parser: a finished reply holds its thinking and the closing tag; one cut at max_tokens inside its thinking holds
    # no tag at all. Its thinking names a boxed value that is no answer: the cut reply's content is empty.
    thought = "Perhaps the product is \\boxed{7}, but I should multiply it out again before I commit to it."
    rule = Rule(role="solution", reasoning=thought)
    sim.set_script(SimScript(think_tags=True, think_in_prompt=True, rules=[rule]))
    async with open_model(settings_for(sim)) as llm:
        finished = await llm.chat("solution", QUESTION)
        cut_short = Sampling(max_tokens=12)
        cut = await llm.chat("solution", QUESTION, key=CallKey(role="solution", sample=1), sampling=cut_short)
    assert finished.reasoning == thought and "\\boxed{391}" in finished.content
    assert cut.truncated
    assert (cut.content, cut.reasoning) == ("", "Perhaps the product is \\boxed{7}, but I")


async def test_a_cut_reply_with_thinking_turned_off_keeps_its_answer(sim: SimServer) -> None:
    # The same model and server, thinking inside its content: a call that turns thinking off in the template
    # (chat_template_kwargs) gets the answer alone, and when max_tokens cuts it, what came is the answer, cut.
    rule = Rule(
        role="solution", replies=["The product is \\boxed{391}, found by multiplying seventeen by twenty three."]
    )
    sim.set_script(SimScript(think_tags=True, think_in_prompt=True, rules=[rule]))
    async with open_model(settings_for(sim)) as llm:
        thought = await llm.chat("solution", QUESTION)
        off = Sampling(max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        cut = await llm.chat("solution", QUESTION, key=CallKey(role="solution", sample=1), sampling=off)
    assert thought.reasoning and "\\boxed{391}" in thought.content
    assert cut.truncated and (cut.content, cut.reasoning) == ("The product is \\boxed{391}", "")
    assert cut.usage.reasoning_tokens == 0


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_a_reply_cut_inside_thinking_by_a_reasoning_parser_has_no_answer(
    sim: SimServer, persona: str, stream: str
) -> None:
    # vLLM and SGLang with a reasoning parser put a reply cut before its closing tag all in the reasoning field, its
    # content null sent whole and never a content delta streamed. The thinking's boxed value is no answer.
    thought = "Perhaps the product is \\boxed{7}, but I should multiply it out again before I commit to it."
    rule = Rule(role="solution", reasoning=thought)
    sim.set_script(SimScript(persona=persona, reasoning=True, rules=[rule]))  # type: ignore[arg-type]
    async with open_model(settings_for(sim, endpoint__stream=stream, sampling__max_tokens=12)) as llm:
        cut = await llm.chat("solution", QUESTION)
    assert cut.ok and cut.truncated and cut.finish_reason == "length"
    assert (cut.content, cut.reasoning) == ("", "Perhaps the product is \\boxed{7}, but I")
    assert cut.usage.completion_tokens == 12 and cut.usage.reasoning_tokens == 12


@pytest.mark.parametrize("tag", ["<think>", "</think>"])
async def test_a_think_tag_the_answer_writes_is_kept_where_the_thinking_came_in_its_field(
    sim: SimServer, tag: str
) -> None:
    # A verifier whose thinking the reasoning parser sent in its field, quoting a tag of the solution it checks: the
    # answer is the content whole, its score line included.
    answer = f"The solution leaves a stray {tag} tag in its text, which changes nothing.\nScore: 1"
    rule = Rule(role="verification", replies=[answer], reasoning="Check each step of the product.")
    sim.set_script(SimScript(persona="vllm", reasoning=True, rules=[rule]))
    async with open_model(settings_for(sim)) as llm:
        reply = await llm.chat("verification", QUESTION)
    assert (reply.content, reply.reasoning) == (answer, "Check each step of the product.")
    assert parse_verification(reply.content).score == 1.0


async def test_usage_from_server_and_estimated_without(sim: SimServer) -> None:
    async with LLMClient(settings_for(sim)) as llm:
        reported = await llm.chat("solution", QUESTION)
        sim.set_script(SimScript(usage=False))
        estimated = await llm.chat("solution", QUESTION, key=CallKey(role="solution", sample=1))
    stats = sim.stats()
    assert not reported.usage.estimated
    assert reported.usage.prompt_tokens + estimated.usage.prompt_tokens > 0
    assert reported.usage.completion_tokens > 0
    assert estimated.usage.estimated
    assert estimated.usage.completion_tokens > 0 and estimated.usage.prompt_tokens > 0
    assert stats.completed == 2


async def test_reasoning_tokens_are_counted(sim: SimServer) -> None:
    sim.set_script(SimScript(reasoning=True))
    async with LLMClient(settings_for(sim)) as llm:
        reply = await llm.chat("solution", QUESTION)
    assert reply.usage.reasoning_tokens > 0


async def test_max_tokens_is_lowered_to_fit_the_context_window(sim: SimServer) -> None:
    # The window comes from /v1/models (vLLM's max_model_len) and the call is shrunk instead of failing.
    sim.set_script(SimScript(context_length=200))
    settings = settings_for(sim, sampling={"max_tokens": 1000})
    async with LLMClient(settings) as llm:
        reply = await llm.chat("solution", QUESTION)
    assert reply.ok, reply.error
    [request] = sim.requests
    assert request.body["max_tokens"] < 200
    assert reply.max_tokens_sent == request.body["max_tokens"]


async def test_context_overflow_reply_is_retried_with_fewer_tokens(sim: SimServer) -> None:
    # A configured window larger than the server's: the server's 400 teaches the real one.
    sim.set_script(SimScript(context_length=200))
    settings = settings_for(sim, sampling={"max_tokens": 1000}, endpoint__context_length=100_000)
    async with LLMClient(settings) as llm:
        reply = await llm.chat("solution", QUESTION)
    assert reply.ok, reply.error
    first, second = sim.requests
    assert first.body["max_tokens"] == 1000
    assert second.body["max_tokens"] < 200


async def test_prompt_longer_than_context_fails_clearly(sim: SimServer) -> None:
    sim.set_script(SimScript(context_length=50))
    async with LLMClient(settings_for(sim)) as llm:
        reply = await llm.chat("solution", [user("word " * 400)])
    assert reply.error is not None and "context window" in reply.error


async def test_truncated_output_is_flagged(sim: SimServer) -> None:
    settings = settings_for(sim, sampling={"max_tokens": 3})
    async with LLMClient(settings) as llm:
        reply = await llm.chat("solution", QUESTION)
    assert reply.finish_reason == "length"
    assert reply.truncated


async def test_missing_api_key_variable_is_a_config_error(sim: SimServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TMAS_TEST_KEY", raising=False)
    settings = settings_for(sim, endpoint__api_key_env="TMAS_TEST_KEY")
    async with LLMClient(settings) as llm:
        with pytest.raises(ConfigError, match="TMAS_TEST_KEY"):
            await llm.chat("solution", QUESTION)


async def test_finished_calls_replay_from_the_store(sim: SimServer, tmp_path: Path) -> None:
    with RunStore(tmp_path) as store:
        async with open_model(settings_for(sim), store) as llm:
            first = await llm.chat("solution", QUESTION, key=CallKey(problem_id="p", role="solution"))
            again = await llm.chat("solution", QUESTION, key=CallKey(problem_id="p", role="solution"))
            other = await llm.chat("solution", QUESTION, key=CallKey(problem_id="p", role="solution", sample=1))
        assert sim.stats().total_requests == 2
        assert again.replayed and again.content == first.content and again.usage == first.usage
        assert not other.replayed


@pytest.mark.parametrize(("capped", "most"), [("verifier", 1), ("solution", 12)])
async def test_a_roles_own_max_in_flight_caps_that_roles_calls_only(sim: SimServer, capped: str, most: int) -> None:
    # Both roles at one URL and model; one solution call goes first. Before, the URL's cap was the first role's:
    # the verifier's own cap of 1 went unheeded, and the solution's capped the verifier's calls too.
    sim.set_script(SimScript(latency_s=0.05))
    settings = settings_for(sim, endpoint__batch_samples="off", roles={capped: {"max_in_flight": 1}})
    async with LLMClient(settings) as llm:
        assert (await llm.chat("solution", QUESTION)).ok
        sim.reset()
        replies = await asyncio.gather(
            *(llm.chat("verifier", QUESTION, key=CallKey(role="verifier", sample=i)) for i in range(12))
        )
    assert all(r.ok for r in replies)
    assert sim.stats().max_in_flight == most
