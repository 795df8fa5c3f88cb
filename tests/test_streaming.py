"""Streamed chat calls against the simulated server: what goes on the wire per `stream` mode,
timeout_s as the longest wait between chunks (a long reply that keeps coming arrives whole), deadline_s over a whole
call, stalled and cut streams retried with nothing partial kept, reasoning, usage and logprobs assembled from the
deltas, and the fallback of `stream = "auto"` on a server that cannot stream, recorded once per endpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from conftest import eventually, settings_for
from tmas.config import Sampling, Settings, load_settings
from tmas.llm.client import LLMClient
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.types import CallKey, Completion, TokenLogprob, user
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedUsage, SimScript, SimServer
from tmas.testing.responders import count_tokens

QUESTION = [user("What is 17*23?")]
# 20 simulator tokens: with 0.05 s per token a reply of 1 s whose deltas come 0.05 s apart.
LONG = "The product of seventeen and twenty three is worked out below , step by step , and the result is 391 ."
SLOW = SimScript(rules=[Rule(replies=[LONG])], latency_per_token_s=0.05)


async def one_call(settings: Settings, store: RunStore | None = None, **kwargs: Any) -> Completion:
    async with open_model(settings, store) as llm:
        return await llm.chat("solution", QUESTION, **kwargs)


# ------------------------------------------------------------------------------------------------ the request
@pytest.mark.parametrize("mode", ["auto", "on", "off"])
async def test_streamed_requests_ask_for_usage_and_read_the_same_reply(sim: SimServer, mode: str) -> None:
    sim.set_script(SimScript(seed=3))
    reply = await one_call(settings_for(sim, endpoint__stream=mode))
    [body] = sim.chat_bodies()
    if mode == "off":
        assert "stream" not in body and "stream_options" not in body
    else:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert reply.ok and reply.attempts == 1 and reply.finish_reason == "stop"
    assert "\\boxed{391}" in reply.content
    assert not reply.usage.estimated and reply.usage.completion_tokens > 0


async def test_stream_options_set_in_extra_body_go_with_the_ones_the_client_asks_for(sim: SimServer) -> None:
    # A user's stream_options (vLLM's and SGLang's continuous_usage_stats: the usage so far on every chunk) reach the
    # server beside include_usage, rather than being replaced by it.
    sim.set_script(SimScript(seed=3, persona="vllm"))
    extra = {"stream_options": {"continuous_usage_stats": True}}
    reply = await one_call(settings_for(sim, sampling__extra_body=extra))
    [body] = sim.chat_bodies()
    assert body["stream"] is True
    assert body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert reply.ok and "\\boxed{391}" in reply.content
    assert reply.usage.completion_tokens == sim.stats().completion_tokens and not reply.usage.estimated


# ------------------------------------------------------------------------------------------------ timeouts
@pytest.mark.slow
async def test_a_reply_longer_than_timeout_s_arrives_whole_while_its_chunks_keep_coming(sim: SimServer) -> None:
    # Streamed, each delta comes well inside timeout_s and the whole reply arrives at once.
    sim.set_script(SLOW)
    reply = await one_call(settings_for(sim, endpoint__timeout_s=0.4))
    assert reply.ok, reply.error
    assert reply.content == LONG and reply.attempts == 1 and reply.retry_causes == []
    assert sim.stats().total_requests == 1


async def test_unstreamed_a_reply_longer_than_timeout_s_is_waited_for_while_its_server_progresses(
    sim: SimServer,
) -> None:
    # Unstreamed, the reply is silent until whole: past timeout_s its replica is asked, and it answers /health and
    # generates, so the call waits on, sent once.
    sim.set_script(SLOW)
    reply = await one_call(settings_for(sim, endpoint__stream="off", endpoint__timeout_s=0.4, retry__max_attempts=2))
    assert reply.ok and reply.content == LONG and reply.attempts == 1, reply.error
    assert sim.stats().total_requests == 1


async def test_deadline_s_fails_a_slow_call_without_retrying_it(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SLOW)
    with RunStore(tmp_path) as store:
        reply = await one_call(settings_for(sim, endpoint__timeout_s=0.4, endpoint__deadline_s=0.3), store)
        [stored] = store.calls()
    assert not reply.ok and reply.error_cause == "deadline" and reply.attempts == 1
    assert reply.error is not None and "deadline_s = 0.3s" in reply.error
    assert stored.error_cause == "deadline" and stored.content == ""
    assert sim.stats().total_requests == 1


async def test_a_stalled_stream_is_retried_and_the_retry_used(sim: SimServer, tmp_path: Path) -> None:
    # The stream pauses and its server makes no progress meanwhile (its counters stand still): past timeout_s the
    # replica is asked, and once it showed no progress for progress_timeout_s the call goes again.
    sim.set_script(SimScript(rules=[Rule(fault="freeze", times=1)], hang_s=5))
    with RunStore(tmp_path) as store:
        settings = settings_for(sim, endpoint__timeout_s=0.3, endpoint__progress_timeout_s=0.6)
        reply = await one_call(settings, store)
        [stored] = store.calls()
    assert reply.ok and reply.retry_causes == ["stall"] and reply.attempts == 2
    assert "\\boxed{391}" in reply.content and stored.content == reply.content
    assert sim.stats().total_requests == 2 and sim.stats().faults == {"freeze": 1}


async def test_a_cut_stream_is_retried_and_nothing_partial_is_kept(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(replies=[LONG], fault="cut", times=1), Rule(replies=[LONG])]))
    with RunStore(tmp_path) as store:
        reply = await one_call(settings_for(sim), store)
        stored = list(store.calls())
    assert reply.ok and reply.retry_causes == ["cut"] and reply.content == LONG
    assert [(c.content, c.error) for c in stored] == [(LONG, None)]
    assert sim.stats().total_requests == 2


async def test_a_call_whose_every_stream_is_cut_fails_and_stores_no_text(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(replies=[LONG], fault="cut")]))
    with RunStore(tmp_path) as store:
        reply = await one_call(settings_for(sim, retry__max_attempts=2), store)
        [stored] = store.calls()
    assert not reply.ok and reply.error_cause == "cut" and reply.retry_causes == ["cut"]
    assert reply.content == stored.content == "" and stored.error_cause == "cut"
    with RunStore(tmp_path) as store:
        assert store.call_causes() == {"failed": {"cut": 1}, "asked_again": {}, "retried": {"cut": 1}}


async def test_an_error_event_in_the_stream_is_a_retried_failure_with_the_servers_message(sim: SimServer) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="stream_error")]))
    reply = await one_call(settings_for(sim, retry__max_attempts=2))
    assert not reply.ok and reply.error_cause == "stream_error" and reply.retry_causes == ["stream_error"]
    assert reply.error is not None and "Simulated error mid-generation." in reply.error
    assert reply.content == ""


@pytest.mark.parametrize("stream", ["on", "off"])
async def test_sglangs_full_queue_in_an_open_stream_counts_as_its_503(
    sim: SimServer, tmp_path: Path, stream: str
) -> None:
    # SGLang with --max-queued-requests aborts a request its full queue cannot take with 503 "The request queue is
    # full."; a streamed request meets it as the first event of an HTTP 200 stream. One call holds the only turn
    # (a rule's latency), none may wait: the other call meets the full queue on each attempt.
    holding = Rule(pattern="hold the turn", replies=["held"], latency_s=60)
    sim.set_script(SimScript(persona="sglang", max_running=1, max_queued=0, rules=[holding, Rule(replies=["ok"])]))
    settings = settings_for(sim, endpoint__stream=stream, retry__max_attempts=2)
    with RunStore(tmp_path) as store:
        async with open_model(settings, store) as llm:
            holder = asyncio.ensure_future(llm.chat("solution", [user("hold the turn")]))
            await eventually(lambda: sim.stats().running == 1)
            reply = await llm.chat("solution", QUESTION)
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
        causes = store.call_causes()
    assert sim.stats().faults == {"queue_full": 2}
    assert not reply.ok and reply.error_cause == "http_503" and reply.retry_causes == ["http_503"]
    assert reply.error is not None and "The request queue is full." in reply.error
    assert causes == {"failed": {"http_503": 1}, "asked_again": {}, "retried": {"http_503": 1}}


@pytest.mark.parametrize(
    ("fault", "causes"), [("stall", []), ("cut", ["disconnected"]), ("stream_error", ["http_500"])]
)
async def test_stream_faults_on_an_unstreamed_request_hang_or_drop(
    sim: SimServer, fault: str, causes: list[str]
) -> None:
    # A hang past timeout_s on a server that answers /health is waited out, as a queued request is; a drop or an
    # error is sent again.
    sim.set_script(SimScript(rules=[Rule(fault=fault, times=1)], hang_s=1))  # type: ignore[arg-type]
    reply = await one_call(settings_for(sim, endpoint__stream="off", endpoint__timeout_s=0.3))
    assert reply.ok and reply.retry_causes == causes


# ------------------------------------------------------------------------------------------------ cancellation
class _CancelAtEnd:
    """A watch that cancels ``caller`` when the task reading the reply ends: the cancel lands in the very turn of the
    event loop in which the reply comes whole (Ctrl-C, or a ``tmas serve`` client gone, while a call finishes)."""

    def __init__(self) -> None:
        self.caller: asyncio.Future[Completion] | None = None
        self.began = False
        self._armed = False

    def begin(self) -> None:
        self.began = True

    def observe(self, tokens: Any) -> None:
        if not self._armed and self.caller is not None:
            caller = self.caller
            reader = asyncio.current_task()
            assert reader is not None
            reader.add_done_callback(lambda _: caller.cancel())
            self._armed = True


async def test_a_call_cancelled_just_as_its_stream_ends_stays_cancelled(sim: SimServer, tmp_path: Path) -> None:
    # The reply came whole, but the caller was cancelled first: the call is cancelled (nothing goes on with its reply
    # after a Ctrl-C), and the store keeps no reply its caller never received, only what it cost (a failed call, never
    # replayed: its tokens as the stream's usage chunk reported them).
    sim.set_script(SimScript(rules=[Rule(replies=[LONG])]))
    watch = _CancelAtEnd()
    asked = Sampling(extra_body={"logprobs": True, "top_logprobs": 2})
    with RunStore(tmp_path / "run") as store:
        async with open_model(settings_for(sim, endpoint__stream="on"), store) as llm:
            caller = asyncio.ensure_future(llm.chat("solution", QUESTION, sampling=asked, watch=watch))
            watch.caller = caller
            with pytest.raises(asyncio.CancelledError):
                await caller
        stored = [(c.error_cause, c.content, c.usage.completion_tokens) for c in store.calls()]
    served = sim.stats()
    assert watch.began and stored == [("cancelled", "", served.completion_tokens)] and served.completion_tokens > 0
    assert served.total_requests == 1


# ------------------------------------------------------------------------------------------------ assembly
async def test_reasoning_deltas_end_in_reasoning_not_content(sim: SimServer) -> None:
    sim.set_script(SimScript(rules=[Rule(replies=["So \\boxed{391}."], reasoning="17*23 = 340 + 51 = 391")]))
    reply = await one_call(settings_for(sim))
    assert reply.reasoning == "17*23 = 340 + 51 = 391"
    assert reply.content == "So \\boxed{391}."
    assert reply.usage.reasoning_tokens > 0


@pytest.mark.parametrize("cached_in", ["usage", "timings"])
async def test_usage_comes_from_the_final_chunk(sim: SimServer, cached_in: str) -> None:
    usage = ScriptedUsage(prompt_tokens=40, completion_tokens=9, cached_tokens=32, cached_in=cached_in)  # type: ignore[arg-type]
    sim.set_script(SimScript(rules=[Rule(usage=usage)]))
    reply = await one_call(settings_for(sim))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.cached_prompt_tokens) == (40, 9, 32)
    assert not reply.usage.estimated


async def test_usage_is_estimated_where_the_stream_has_none(sim: SimServer) -> None:
    sim.set_script(SimScript(usage=False))
    reply = await one_call(settings_for(sim))
    assert reply.ok and reply.usage.estimated
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


async def test_logprobs_are_assembled_from_the_deltas(sim: SimServer) -> None:
    payload = [{"token": t, "logprob": -0.1 * i, "top_logprobs": []} for i, t in enumerate(["Score", ":", " 4"])]
    sim.set_script(SimScript(rules=[Rule(replies=["Score: 4"], logprobs=payload)], latency_per_token_s=0.001))
    asked = Sampling(max_tokens=8, extra_body={"logprobs": True, "top_logprobs": 2})
    reply = await one_call(settings_for(sim), sampling=asked)
    assert sim.chat_bodies()[0]["stream"] is True
    assert reply.logprobs == [TokenLogprob.model_validate(item) for item in payload]


# ------------------------------------------------------------------------------------------------ auto fallback
async def _twice(
    sim: SimServer, mode: str, store: RunStore | None
) -> tuple[Completion, Completion, dict[str, dict[str, str]]]:
    stats = ClientStats()
    async with open_model(settings_for(sim, endpoint__stream=mode), store, stats=stats) as llm:
        first = await llm.chat("solution", QUESTION)
        second = await llm.chat("solution", QUESTION, key=CallKey(role="solution", sample=1))
        return first, second, stats.downgrades.get("stream", {})


async def test_auto_falls_back_once_on_a_server_that_refuses_to_stream(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(stream="refuse"))
    with RunStore(tmp_path) as store:
        first, second, fallbacks = await _twice(sim, "auto", store)
        assert first.ok and second.ok and "\\boxed{391}" in first.content
        # Refused once, the same call again at once unstreamed, and none streamed to that server again.
        assert [b.get("stream", False) for b in sim.chat_bodies()] == [True, False, False]
        assert first.retry_causes == ["stream"] and first.attempts == 1 and second.retry_causes == []
        assert list(fallbacks) == [sim.base_url] and "stream" in fallbacks[sim.base_url]["sim-model"]
        recorded = store.downgrades("stream")
        assert list(recorded) == [sim.base_url] and recorded[sim.base_url]["sim-model"]["role"] == "solution"
        # A resumed run finds the refusal again, but the record stays one per endpoint and model.
        await _twice(sim, "auto", store)
        assert [list(models) for models in store.downgrades("stream").values()] == [["sim-model"]]


async def test_auto_uses_the_whole_reply_of_a_server_that_ignores_stream(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(stream="ignore"))
    with RunStore(tmp_path) as store:
        first, second, fallbacks = await _twice(sim, "auto", store)
        assert first.ok and second.ok and first.retry_causes == []
        assert [b.get("stream", False) for b in sim.chat_bodies()] == [True, False]
        assert list(fallbacks) == [sim.base_url] and list(store.downgrades("stream")) == [sim.base_url]


async def test_on_fails_the_call_a_server_refuses_to_stream(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(stream="refuse"))
    with RunStore(tmp_path) as store:
        first, _, fallbacks = await _twice(sim, "on", store)
        assert not first.ok and first.error_cause == "stream" and first.attempts == 1
        assert first.error is not None and first.error.startswith("server refused streaming (stream = 'on'): HTTP 400")
        assert [b.get("stream") for b in sim.chat_bodies()] == [True, True]
        assert fallbacks == {} and store.downgrades("stream") == {}


# ------------------------------------------------------------------------------------------------ configuration
def test_stream_timeout_and_deadline_per_endpoint_role_and_environment(tmp_path: Path) -> None:
    default = Settings().endpoint
    assert (default.stream, default.timeout_s, default.deadline_s) == ("auto", 600.0, None)
    config = tmp_path / "tmas.toml"
    config.write_text('[endpoint]\nbase_url = "http://h/v1"\n[roles.judge]\nstream = "off"\ndeadline_s = 90\n')
    env = {"TMAS_STREAM": "on", "TMAS_TIMEOUT_S": "120", "TMAS_DEADLINE_S": "7200"}
    settings = load_settings(config, environ=env)
    assert (settings.endpoint.stream, settings.endpoint.timeout_s, settings.endpoint.deadline_s) == ("on", 120, 7200)
    judge = LLMClient(settings).route("judge").endpoint
    assert (judge.stream, judge.timeout_s, judge.deadline_s) == ("off", 120, 90)


# ------------------------------------------------------------------------------------------------ thinking lengths
@pytest.mark.slow
@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_a_thinking_length_reply_streams_whole_with_its_reasoning_apart(persona: str) -> None:
    # A thinking model's reply: 30,000 tokens of reasoning, then the answer, streamed in the shapes vLLM and SGLang
    # send (vLLM's `reasoning`, SGLang's `reasoning_content`); one delta per token under a per-token latency too
    # small to slow the test, so the client assembles 30,000 events.
    thought = "step " * 30_000
    script = SimScript(
        persona=persona, rules=[Rule(replies=["So \\boxed{391}."], reasoning=thought)], latency_per_token_s=1e-9
    )
    async with SimServer(script) as sim:
        reply = await one_call(settings_for(sim, endpoint__timeout_s=5.0, sampling__max_tokens=40_000))
    assert reply.ok, reply.error
    assert reply.content == "So \\boxed{391}." and reply.reasoning == thought.strip()
    # The server's own usage (the usage chunk), not a count of ours: 30,000 + the answer's 7 simulator tokens.
    assert reply.usage.completion_tokens == 30_000 + count_tokens(reply.content)
    assert reply.usage.reasoning_tokens == 30_000 and not reply.usage.estimated


# ------------------------------------------------------------------------------------------------ error lines
async def test_an_older_llama_server_s_error_line_is_its_context_refusal_not_a_cut_stream() -> None:
    # llama-server builds before server-http.cpp open a stream before its task runs: a prompt over n_ctx is refused
    # inside it, on an SSE line of the field "error" (then data: [DONE]). That refusal, with its numbers, is final: the
    # prompt alone fills the window, so nothing is sent again.
    script = SimScript(persona="llama-server", context_length=50, sse_error_field=True)
    async with SimServer(script) as sim:
        async with LLMClient(settings_for(sim, endpoint__stream="on", endpoint__context_length=100_000)) as llm:
            reply = await llm.chat("solution", [user("word " * 400)])
        bodies = sim.chat_bodies()
    assert reply.error_cause == "context" and not reply.retry_causes, reply.error
    assert "exceeds the available context size (50 tokens)" in (reply.error or "")
    assert len(bodies) == 1 and bodies[0]["stream"] is True
