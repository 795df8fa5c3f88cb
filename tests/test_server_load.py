"""The client against the personas as the servers behave under load (tmas.testing, each behaviour citing the server
source it follows): queued requests waited for and sent once, a dead replica's calls killed, every context refusal
understood, the probe with the endpoint's key, n-choice streams cut or aborted, error events by status, identical
choices, and the deadline counted from sending."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import BaseModel

from conftest import _settings, eventually, settings_for
from test_failures import PERSONA_WORDINGS
from tmas.config import Sampling, Settings
from tmas.llm import refusals
from tmas.llm.client import LLMClient
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.types import CallKey, Completion, user
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer
from tmas.testing.responders import count_tokens

QUESTION = [user("What is 17*23?")]


async def _alike(llm: LLMClient, k: int, sampling: Sampling | None = None, problem: str = "p") -> list[Completion]:
    """k calls alike but for their sample index, sent together (what a method's k samples are)."""
    return list(
        await asyncio.gather(
            *(
                llm.chat(
                    "solution", QUESTION, key=CallKey(problem_id=problem, role="solution", sample=i), sampling=sampling
                )
                for i in range(k)
            )
        )
    )


# ------------------------------------------------------------------------------------------------ the queue
@pytest.mark.slow
@pytest.mark.parametrize("persona", ["vllm", "sglang", "llama-server"])
async def test_calls_queued_past_timeout_s_are_waited_for_and_sent_once(persona: str) -> None:
    # One request generates at a time, each for 0.4 s: the sixth waits 2 s, five times timeout_s, silent (vLLM sends
    # its headers, SGLang and llama-server nothing). The server answers /health, so nothing is closed or sent again.
    script = SimScript(persona=persona, max_running=1, rules=[Rule(latency_s=0.4)])  # type: ignore[arg-type]
    with SimServer(script) as sim:
        stats = ClientStats()
        settings = settings_for(sim, endpoint__timeout_s=0.4, endpoint__batch_samples="off", concurrency=16)
        async with LLMClient(settings, stats=stats) as llm:
            done = await asyncio.gather(*(llm.chat("solution", [user(f"What is {i}*7?")]) for i in range(6)))
        served = sim.stats()
    assert all(c.ok for c in done), [c.error for c in done]
    assert served.total_requests == 6 and served.aborted == 0 and served.max_waiting >= 4
    assert stats.retries == 0 and all(c.attempts == 1 for c in done)
    # The last in line waited behind five others: its first chunk came after several timeout_s of silence.
    assert max(c.first_token_s or 0.0 for c in done) >= 5 * 0.4


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_unstreamed_calls_queued_past_timeout_s_are_waited_for_and_sent_once(persona: str) -> None:
    # As above, unstreamed: a reply comes whole, so the call is silent while queued and while generated alike. The
    # server answers /health and progresses, so each call is sent once, not closed and sent to the back of the queue.
    script = SimScript(persona=persona, max_running=1, rules=[Rule(latency_s=0.4)])  # type: ignore[arg-type]
    with SimServer(script) as sim:
        stats = ClientStats()
        settings = settings_for(
            sim, endpoint__timeout_s=0.4, endpoint__stream="off", endpoint__batch_samples="off", concurrency=16
        )
        async with LLMClient(settings, stats=stats) as llm:
            done = await asyncio.gather(*(llm.chat("solution", [user(f"What is {i}*7?")]) for i in range(5)))
        served = sim.stats()
    assert all(c.ok for c in done), [c.error for c in done]
    assert served.total_requests == 5 and served.aborted == 0 and served.max_waiting >= 3
    assert stats.retries == 0 and all(c.attempts == 1 for c in done)
    assert all(not body.get("stream") for body in sim.chat_bodies("solution"))


async def _behind_a_running_call(settings: Settings) -> Completion:
    """A call sent while another runs on a one-sequence server (so it waits in the queue); the other must succeed."""
    async with LLMClient(settings) as llm:
        first = asyncio.ensure_future(llm.chat("solution", [user("What is 1*7?")]))
        await asyncio.sleep(0.1)
        queued = await llm.chat("solution", [user("What is 2*7?")])
        assert (await first).ok
    return queued


@pytest.mark.slow
@pytest.mark.parametrize("health", ["hang", "error"])
async def test_a_queued_call_on_a_replica_whose_health_fails_is_closed(health: str) -> None:
    # The replica holds the call in its queue behind a long one (whose tokens keep coming) and its /health stops
    # answering, or answers 503: after timeout_s of silence the call is closed (the server counts the abort).
    script = SimScript(persona="vllm", max_running=1, health=health, hang_s=2.0, latency_per_token_s=0.05)  # type: ignore[arg-type]
    with SimServer(script) as sim:
        settings = settings_for(sim, endpoint__timeout_s=0.3, retry__max_attempts=1, concurrency=4)
        queued = await _behind_a_running_call(settings)
        served = sim.stats()
    assert not queued.ok and queued.error_cause == "dead"
    assert "does not answer /health" in (queued.error or "")
    assert served.aborted == 1


@pytest.mark.slow
async def test_queue_timeout_s_bounds_the_wait_for_the_first_chunk() -> None:
    script = SimScript(persona="sglang", max_running=1, latency_per_token_s=0.05)
    with SimServer(script) as sim:
        settings = settings_for(sim, endpoint__timeout_s=0.2, endpoint__queue_timeout_s=0.5, retry__max_attempts=1)
        queued = await _behind_a_running_call(settings)
    assert queued.error_cause == "queue_timeout"


async def test_keep_alive_comments_are_no_first_chunk() -> None:
    # A gateway (OpenRouter: ": OPENROUTER PROCESSING") sends SSE comments while the request waits for its first
    # token. They keep the connection alive but carry no token: queue_timeout_s still bounds the wait for the first
    # event, where before the comments passed for it and the call waited until its deadline.
    asked: list[str] = []
    gone = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        try:
            while True:
                await reply.write(b": PROCESSING\n\n")
                await asyncio.sleep(0.05)
        except ConnectionError:  # the client closed the request
            gone.set()
            return reply
        except asyncio.CancelledError:
            gone.set()
            raise

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        settings = _settings(
            [f"http://127.0.0.1:{port}/v1"],
            {"endpoint__queue_timeout_s": 0.3, "endpoint__deadline_s": 5.0, "retry__max_attempts": 1},
        )
        async with LLMClient(settings) as llm:
            done = await llm.chat("solution", [user("What is 2*7?")])
        await asyncio.wait_for(gone.wait(), 5)
    finally:
        await runner.cleanup()
    assert not done.ok and done.error_cause == "queue_timeout", done.error
    assert asked == ["/v1/chat/completions"]


async def test_a_call_past_queue_timeout_s_is_sent_again_to_another_replica() -> None:
    # The second replica runs one sequence at a time and streams a long reply; a call sharing that reply's prompt
    # prefix is drawn to it and waits in its queue past queue_timeout_s: it is closed there and sent to the idle
    # replica, not to the end of the same queue again (where it would wait out every attempt).
    tokens = " ".join(["step"] * 300)
    busy_script = SimScript(
        persona="vllm", max_running=1, latency_per_token_s=0.01, rules=[Rule(pattern="long", replies=[tokens])]
    )
    prefix = "A long question, the same prefix in every call. " * 20
    with SimServer(SimScript(persona="vllm")) as idle, SimServer(busy_script) as busy:
        # Of two idle replicas the first call goes to the second.
        settings = settings_for(idle, busy, endpoint__timeout_s=0.2, endpoint__queue_timeout_s=0.5)
        async with asyncio.timeout(60), LLMClient(settings) as llm:
            long = asyncio.ensure_future(llm.chat("solution", [user(prefix + "long")]))
            await eventually(lambda: busy.stats().in_flight == 1)
            short = await llm.chat("solution", [user(prefix + "short")])
            assert (await long).endpoint == busy.base_url
    assert short.ok and short.retry_causes == ["queue_timeout"] and short.endpoint == idle.base_url, short.error
    assert [b["messages"][-1]["content"].endswith("short") for b in busy.chat_bodies()].count(True) == 1


@pytest.mark.slow
async def test_the_deadline_counts_from_sending_not_from_waiting_in_tmas(sim: SimServer) -> None:
    # One call at a time (concurrency 1), each 0.6 s at the server, deadline_s 1: the second waits 0.6 s inside tmas
    # first, which its deadline does not count.
    sim.set_script(SimScript(rules=[Rule(latency_s=0.6)]))
    settings = settings_for(sim, concurrency=1, endpoint__deadline_s=1.0, endpoint__batch_samples="off")
    async with LLMClient(settings) as llm:
        done = await asyncio.gather(*(llm.chat("solution", [user(f"What is {i}*7?")]) for i in range(2)))
    assert all(c.ok for c in done), [c.error for c in done]
    assert max(c.queued_s or 0.0 for c in done) >= 0.6


# ------------------------------------------------------------------------------------------------ context
LONG = [user("Please compute the product carefully. " * 60 + "What is 17*23?")]


@pytest.mark.parametrize(
    ("persona", "wording"),
    # llama-server and vLLM's engine refuse only a prompt that alone fills the window (below); OpenAI has no /tokenize
    # to count with.
    [(p, w) for p, w in PERSONA_WORDINGS if p not in ("llama-server", "openai") and w != "decoder_prompt"],
)
async def test_every_context_refusal_is_met_with_a_smaller_max_tokens_in_one_extra_request(
    persona: str, wording: str
) -> None:
    # The endpoint claims a window larger than the server's, so the first request goes out with max_tokens 4000 and
    # is refused; the second asks for what the server's window leaves.
    script = SimScript(persona=persona, context_length=1500, context_wording=wording)  # type: ignore[arg-type]
    with SimServer(script) as sim:
        settings = settings_for(sim, endpoint__context_length=100_000, sampling__max_tokens=4000)
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", LONG)
        bodies = sim.chat_bodies()
        served = sim.stats()
    assert reply.ok, reply.error
    assert len(bodies) == 2 and reply.retry_causes == ["context"]
    assert bodies[0]["max_tokens"] == 4000
    prompt = served.prompt_tokens
    # The second asks for the window less the prompt as the server counts it, less the template's margin.
    assert bodies[1]["max_tokens"] == 1500 - prompt - 32


# A prompt the client's estimate (4 characters a token) counts low: 13 simulator tokens in each 14 characters, 525 in
# all (13 x 40, "Compute", and the 4 of the message's template).
SYMBOLS = [user("Compute " + "(1+2)*(3-4)/5 " * 40)]
# Each wording behind a gateway with no /tokenize: (persona, wording, window). The case is vLLM's today, a
# 4000-token max_tokens on a 4100-token window; SGLang with a window under max_tokens first refuses max_tokens alone.
GATEWAY_CASES = [
    *(("vllm", w, 4100) for w in ("persona", "output_tokens", "passed", "too_large", "legacy", "generic")),
    ("vllm", "decoder_prompt", 4100),
    ("sglang", "persona", 4100),
    ("sglang", "persona", 3000),
    ("llama-server", "persona", 4100),
    ("openai", "persona", 4100),
    ("sim", "persona", 4100),
]


@pytest.mark.parametrize(("persona", "wording", "window"), GATEWAY_CASES)
async def test_a_context_refusal_behind_a_gateway_without_tokenize_is_answered_within_two_extra_requests(
    persona: str, wording: str, window: int
) -> None:
    script = SimScript(persona=persona, context_length=window, context_wording=wording, tokenize=False)  # type: ignore[arg-type]
    with SimServer(script) as sim:
        settings = settings_for(sim, endpoint__context_length=100_000, sampling__max_tokens=4000)
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", SYMBOLS)
        bodies = sim.chat_bodies()
        served = sim.stats()
    assert reply.ok, reply.error
    assert len(bodies) <= 3 and reply.retry_causes == ["context"] * (len(bodies) - 1)
    # What was answered fits the window, as the server counted it.
    assert served.prompt_tokens == 525 and served.prompt_tokens + served.completion_tokens <= window


async def test_with_the_model_s_tokenizer_a_refusal_takes_one_extra_request(tmp_path: Path) -> None:
    # Today's vLLM states only a bound of the prompt, and the gateway has no /tokenize: the model's own tokenizer
    # (here one that splits as the simulator does) counts it, and the second request asks for what is left.
    tokenizer = _simulator_tokenizer(tmp_path)
    script = SimScript(persona="vllm", context_length=4100, tokenize=False)
    with SimServer(script) as sim:
        settings = settings_for(
            sim, endpoint__context_length=100_000, endpoint__tokenizer=tokenizer, sampling__max_tokens=4000
        )
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", SYMBOLS)
        bodies = sim.chat_bodies()
        prompt = sim.stats().prompt_tokens
    assert reply.ok and len(bodies) == 2 and reply.retry_causes == ["context"]
    assert bodies[1]["max_tokens"] == 4100 - prompt - 32


async def test_sglang_counts_the_prompt_at_its_tokenize_from_the_prompt_text() -> None:
    # SGLang refuses max_tokens over its --context-length naming only the window; its /tokenize takes a prompt, not
    # messages: the client counts the texts there, adds each message's template tokens, and fits in one request more.
    with SimServer(SimScript(persona="sglang", context_length=3000)) as sim:
        settings = settings_for(sim, endpoint__context_length=100_000, sampling__max_tokens=4000)
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", SYMBOLS)
        bodies = sim.chat_bodies()
        prompt = sim.stats().prompt_tokens
    assert reply.ok and len(bodies) == 2 and reply.retry_causes == ["context"]
    assert bodies[1]["max_tokens"] == 3000 - prompt - 32


@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_vllm_s_decoder_prompt_refusal_fails_at_once_naming_both_numbers(stream: str) -> None:
    # Streamed, vLLM's engine refuses the prompt after the stream's headers went out: an error event with code 400.
    script = SimScript(persona="vllm", context_length=100, context_wording="decoder_prompt")
    with SimServer(script) as sim:
        settings = settings_for(sim, endpoint__context_length=100_000, endpoint__stream=stream)
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", SYMBOLS)
        requests = len(sim.chat_bodies())
    assert not reply.ok and reply.error_cause == "context" and requests == 1
    assert "prompt of 525 tokens does not fit the context window of 100 tokens" in (reply.error or "")


@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_sglang_s_kv_pool_refusal_fails_at_once_naming_both_numbers(stream: str) -> None:
    # The model card states a 32768-token window, but the KV cache pool holds 300 tokens: SGLang's scheduler refuses
    # the 370-token prompt against its pool, stating 294 as its bound (an error event with code 400 on a stream). No
    # smaller max_tokens helps: the call fails on its first request, naming the prompt and that bound.
    script = SimScript(persona="sglang", kv_pool_tokens=300)
    with SimServer(script) as sim:
        settings = settings_for(sim, endpoint__stream=stream, sampling__max_tokens=100)
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", LONG)
            # Later calls know the bound: a prompt it cannot hold is refused before it is sent.
            again = await llm.chat("solution", LONG, key=CallKey(problem_id="p", role="solution", sample=1))
        requests = len(sim.chat_bodies())
    assert not reply.ok and reply.error_cause == "context" and reply.attempts == 1
    assert "prompt of 370 tokens does not fit the context window of 294 tokens" in (reply.error or "")
    assert not again.ok and again.error_cause == "context"
    assert requests == 1


def _simulator_tokenizer(folder: Path) -> str:
    """A Hugging Face tokenizer.json that counts as the simulator does (a word or a punctuation mark a token)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, models, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="isolated")]
    )
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


async def test_llama_server_states_its_window_at_props_and_the_call_fits_before_it_is_sent() -> None:
    with SimServer(SimScript(persona="llama-server", context_length=1500)) as sim:
        settings = settings_for(sim, sampling__max_tokens=4000)
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", LONG)
            assert llm.context_window("solution") == 1500
        [body] = sim.chat_bodies()
    assert reply.ok and body["max_tokens"] < 1500


@pytest.mark.parametrize("persona", ["vllm", "sglang", "llama-server"])
async def test_a_prompt_the_window_cannot_hold_fails_at_once_naming_both_numbers(persona: str) -> None:
    script = SimScript(persona=persona, context_length=100)  # type: ignore[arg-type]
    with SimServer(script) as sim:
        settings = settings_for(sim, endpoint__context_length=100_000, sampling__max_tokens=10)
        async with LLMClient(settings) as llm:
            reply = await llm.chat("solution", LONG)
        requests = len(sim.chat_bodies())
    assert not reply.ok and reply.error_cause == "context" and reply.attempts == 1
    assert "does not fit the context window of 100 tokens" in (reply.error or "")
    assert requests == 1


# ------------------------------------------------------------------------------------------------ the probe
async def test_the_probe_sends_the_key_and_asks_again_until_the_replica_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A vLLM replica behind --api-key, still loading for its first /v1/models: the first round of samples waits for
    # the probe's answer, then goes as one request with n, as the second does.
    monkeypatch.setenv("SIM_KEY", "secret")
    script = SimScript(persona="vllm", api_key="secret", models_unavailable=1)
    with SimServer(script) as sim, RunStore(tmp_path) as store:
        settings = settings_for(sim, endpoint__api_key_env="SIM_KEY")
        async with open_model(settings, store) as llm:
            assert isinstance(llm.inner, LLMClient)  # type: ignore[attr-defined]
            first = await _alike(llm.inner, 3, problem="a")  # type: ignore[attr-defined]
            second = await _alike(llm.inner, 3, problem="b")  # type: ignore[attr-defined]
        served = sim.stats()
        bodies = sim.chat_bodies()
        servers = store.servers()
    assert all(c.ok for c in first + second)
    assert served.unauthorized == 0 and served.models_unavailable == 1
    assert [b.get("n") for b in bodies] == [3, 3]
    found = servers[sim.base_url]["sim-model"]
    assert found["server_kind"] == "vllm" and found["context_length"] == 32768


async def test_calls_wait_for_a_replica_still_loading_its_model() -> None:
    # llama-server answers every route but its model list 503 "Loading model" until its model is loaded, and its model
    # card without meta: the calls wait on its model card instead of spending their attempts on that refusal, and go
    # once it is loaded.
    with SimServer(SimScript(persona="llama-server", models_unavailable=2)) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            done = await llm.chat("solution", QUESTION)
        served = sim.stats()
    assert done.ok and done.attempts == 1 and not done.retry_causes, done.error
    assert (served.models_unavailable, served.refused_while_loading, served.completed) == (2, 0, 1)


@pytest.mark.parametrize(("persona", "batch"), [("llama-server", "off"), ("vllm", "auto")])
async def test_calls_go_to_a_ready_replica_while_another_loads_its_model(
    persona: str, batch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two replicas, one still loading its model (it answers every route 503, its model card 503 too (vLLM behind a
    # proxy) or without meta (llama-server)): the calls all go to the ready one at once, none waits on the loading one
    # or is refused by it (vLLM's alike calls as one request with n, once the ready replica's probe said it serves n).
    # Once it has loaded, the next calls' background poll of its model card brings it back, and calls reach it again.
    monkeypatch.setattr(refusals, "LOADING_POLL_S", 0.0)
    loading_script = SimScript(persona=persona, models_unavailable=10_000)  # type: ignore[arg-type]
    with SimServer(loading_script) as loading, SimServer(SimScript(persona=persona)) as ready:  # type: ignore[arg-type]
        settings = settings_for(loading, ready, endpoint__timeout_s=1, endpoint__batch_samples=batch, concurrency=8)
        async with asyncio.timeout(60), LLMClient(settings) as llm:
            first = await _alike(llm, 6, problem="a")
            first += await asyncio.gather(*(llm.chat("solution", [user(f"What is {i}*7?")]) for i in range(6)))
            at_ready, at_loading = ready.stats(), loading.stats()
            loading.set_script(SimScript(persona=persona))  # type: ignore[arg-type]
            later: list[Completion] = []
            for i in range(40):
                later.append(await llm.chat("solution", [user(f"What is {i}*5?")]))
                if loading.stats().completed:
                    break
                await asyncio.sleep(0.05)
    assert all(c.ok and c.attempts == 1 and not c.retry_causes for c in first + later), [c.error for c in first]
    assert {c.endpoint for c in first} == {ready.base_url}
    assert at_ready.total_requests == (1 if batch == "auto" else 6) + 6
    assert (at_loading.total_requests, at_loading.refused_while_loading) == (0, 0)
    assert loading.stats().completed == 1 and loading.stats().refused_while_loading == 0


async def test_a_call_waiting_while_every_replica_loads_goes_to_the_first_that_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both replicas loading: the call waits on one of them (its model card asked again and again). The other one
    # finishes loading first: the call goes there, and none is sent to the one still loading.
    monkeypatch.setattr(refusals, "LOADING_POLL_S", 0.01)
    script = SimScript(persona="llama-server", models_unavailable=10_000)
    with SimServer(script) as one, SimServer(script) as two:
        async with asyncio.timeout(60), LLMClient(settings_for(one, two, endpoint__timeout_s=3)) as llm:
            call = asyncio.ensure_future(llm.chat("solution", QUESTION))
            replicas = llm.route("solution").replicas
            # The call waits holding its replica's probe lock (the other's is held only while it is asked).
            await eventually(
                lambda: (
                    one.stats().models_unavailable + two.stats().models_unavailable >= 4
                    and sum(r.probe_lock.locked() for r in replicas) == 1
                )
            )
            waited, other = (one, two) if replicas[0].probe_lock.locked() else (two, one)
            other.set_script(SimScript(persona="llama-server"))
            done = await call
    assert done.ok and done.attempts == 1 and not done.retry_causes, done.error
    assert done.endpoint == other.base_url
    assert waited.stats().total_requests == waited.stats().refused_while_loading == 0


async def test_a_replica_restarted_and_loading_its_model_again_gets_no_more_calls_while_another_is_ready() -> None:
    # llama-server restarted where it served (its port open at once, loading its model): the next call, drawn to it by
    # its prompt's prefix, meets its 503 once; its model card is asked again, says it is loading, and that call and
    # the later ones go to the other replica instead of spending every attempt on that 503.
    prefix = "A long question, the same prefix in every call. " * 20
    with SimServer(SimScript(persona="llama-server")) as one, SimServer(SimScript(persona="llama-server")) as two:
        async with asyncio.timeout(60), LLMClient(settings_for(one, two)) as llm:
            first = await llm.chat("solution", [user(prefix + "0")])
            restarted, other = (one, two) if first.endpoint == one.base_url else (two, one)
            restarted.set_script(SimScript(persona="llama-server", models_unavailable=10_000))
            done = [await llm.chat("solution", [user(prefix + str(i))]) for i in range(1, 4)]
    assert all(c.ok for c in done), [c.error for c in done]
    assert [c.retry_causes for c in done] == [["http_503"], [], []]
    assert {c.endpoint for c in done} == {other.base_url}
    assert restarted.stats().refused_while_loading == 1


async def test_a_replica_loading_past_timeout_s_fails_its_calls_naming_why() -> None:
    with SimServer(SimScript(persona="llama-server", models_unavailable=10_000)) as sim:
        async with LLMClient(settings_for(sim, endpoint__timeout_s=1)) as llm:
            done = await llm.chat("solution", QUESTION)
        served = sim.stats()
    assert done.error_cause == "http_503" and "Loading model" in (done.error or "")
    # Its model card was asked for again while the wait lasted (more often than the call was sent), and the chat
    # request went only after it.
    assert served.refused_while_loading == done.attempts == 4 and served.models_unavailable > done.attempts


# ------------------------------------------------------------------------------------------------ streams
async def test_a_cut_n_stream_keeps_its_finished_choices_and_asks_only_for_the_others() -> None:
    script = SimScript(persona="vllm", rules=[Rule(fault="cut_after_finish", times=1)])
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            done = await _alike(llm, 3)
        bodies = sim.chat_bodies()
    assert all(c.ok and "391" in c.content for c in done)
    # One request for three; the first choice finished before the cut and is kept; the two others go alone.
    assert [b.get("n") for b in bodies] == [3, None, None]
    assert done[0].retry_causes == ["cut"]


async def test_a_cut_n_stream_s_running_usage_counts_every_choice() -> None:
    # With continuous_usage_stats vLLM puts on each chunk its own choice's tokens so far. Two choices of 4 tokens,
    # one delta a token, interleaved: the stream is cut after the first finished, the second having streamed 3. The
    # request cost 4 + 3 tokens (charged to the kept choice), and the second choice's retry its own 4.
    rule = Rule(replies=["a b c d"], fault="cut_after_finish", times=1)
    with SimServer(SimScript(persona="vllm", rules=[rule, Rule(replies=["a b c d"])])) as sim:
        extra = {"stream_options": {"continuous_usage_stats": True}}
        async with LLMClient(settings_for(sim, sampling__extra_body=extra)) as llm:
            done = await _alike(llm, 2)
        bodies = sim.chat_bodies()
    assert [b.get("n") for b in bodies] == [2, None]
    assert [c.usage.completion_tokens for c in done] == [7, 4]
    assert not any(c.usage.estimated for c in done)


# vLLM's detokenizer's OverflowError (a token id out of its vocabulary's range), which vLLM's serving code sends
# mid-stream with code 400 as it does every ValueError, TypeError, RuntimeError and OverflowError.
OVERFLOW = "out of range integral type conversion attempted"
# 10,000 tokens of thinking (the simulator's tokens: a word each), streamed before the fault.
THOUGHT = "step " * 10_000


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_a_400_event_naming_an_engine_fault_after_10000_tokens_is_retried_once_and_answered(persona: str) -> None:
    fault = Rule(
        fault="stream_error", error_status=400, error_message=OVERFLOW, fault_after_tokens=10_000, times=1,
        reasoning=THOUGHT,
    )  # fmt: skip
    script = SimScript(persona=persona, rules=[fault, Rule(reasoning=THOUGHT)])  # type: ignore[arg-type]
    with SimServer(script) as sim:
        stats = ClientStats()
        async with LLMClient(settings_for(sim, sampling__max_tokens=20_000), stats=stats) as llm:
            reply = await llm.chat("solution", QUESTION)
        requests = len(sim.chat_bodies())
    assert reply.ok and "\\boxed{391}" in reply.content and reply.reasoning.count("step") == 10_000
    assert reply.retry_causes == ["engine_fault"] and requests == 2
    assert stats.retries_by_cause == {"engine_fault": 1}


async def test_an_engine_fault_met_twice_in_one_call_is_final() -> None:
    fault = Rule(fault="stream_error", error_status=400, error_message=OVERFLOW, fault_after_tokens=1000, times=2)
    with SimServer(SimScript(persona="vllm", rules=[fault])) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            reply = await llm.chat("solution", QUESTION)
        requests = len(sim.chat_bodies())
    assert not reply.ok and reply.error_cause == "engine_fault" and requests == 2
    assert "a second time in this call" in (reply.error or "")


@pytest.mark.parametrize(
    ("message", "after"),
    [
        # Before any text: the request's own fault unless it names the engine.
        (None, 0),
        # After text began, one that names the request (its schema) is still the request's.
        ("Invalid JSON schema in response_format: unknown keyword", 1000),
    ],
)
async def test_a_400_event_that_is_the_request_s_own_fault_is_final(message: str | None, after: int) -> None:
    fault = Rule(fault="stream_error", error_status=400, error_message=message, fault_after_tokens=after)
    with SimServer(SimScript(persona="vllm", rules=[fault])) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            reply = await llm.chat("solution", QUESTION)
        requests = len(sim.chat_bodies())
    assert not reply.ok and reply.error_cause == "http_400" and requests == 1


@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_an_aborted_reply_is_sent_again_never_kept(stream: str, tmp_path: Path) -> None:
    script = SimScript(persona="sglang", rules=[Rule(fault="abort", times=1)])
    with SimServer(script) as sim, RunStore(tmp_path) as store:
        async with open_model(settings_for(sim, endpoint__stream=stream), store) as llm:
            reply = await llm.chat("solution", QUESTION)
        stored = list(store.calls())
    assert reply.ok and reply.finish_reason != "abort" and reply.retry_causes == ["abort"]
    assert [c.finish_reason for c in stored] == [reply.finish_reason]
    # What the server generated for the aborted reply still counts, streamed or sent whole.
    assert reply.usage.completion_tokens == sim.stats().completion_tokens


@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_an_n_reply_with_some_choices_aborted_keeps_the_finished_ones(stream: str) -> None:
    # The server aborts the request for two choices once the longer is half way: the short one had finished and is
    # kept, and only the aborted one is asked again, alone; before, both were asked again and the short one's work
    # was lost.
    short, long = "\\boxed{391}", "Let me work it out. " + "step " * 40 + "\\boxed{391}"
    rules = [Rule(replies=[short, long], fault="abort", times=1), Rule(replies=[long])]
    with SimServer(SimScript(persona="vllm", rules=rules)) as sim:
        async with LLMClient(settings_for(sim, endpoint__stream=stream)) as llm:
            done = await _alike(llm, 2)
        bodies = sim.chat_bodies()
        served = sim.stats()
    assert [b.get("n") for b in bodies] == [2, None]
    assert all(c.ok and c.finish_reason == "stop" for c in done)
    assert [c.content for c in done] == [short, long]
    assert done[0].retry_causes == ["abort"]
    # The aborted choice's tokens are charged: the calls' figures add up to what the server generated.
    assert sum(c.usage.completion_tokens for c in done) == served.completion_tokens


@pytest.mark.parametrize("fault", ["abort", "cut_after_finish"])
async def test_a_kept_choice_goes_to_its_own_sample_and_the_lost_one_goes_with_its_seed(fault: str) -> None:
    # Two samples, seeds 7 and 8, go as one request (vLLM draws choice i with seed 7 + i); choice 1 finishes, choice 0
    # is aborted or cut. Choice 1 is sample 1's; sample 0 goes again with seed 7. Before, choice 1 went to sample 0
    # and sample 1 went again with seed 8: two samples of seed 8, none of seed 7.
    short, long = "\\boxed{391}", "Let me work it out. " + "step " * 40 + "\\boxed{391}"
    rules = [Rule(replies=[long, short], fault=fault, times=1), Rule(replies=[long])]  # type: ignore[arg-type]
    with SimServer(SimScript(persona="vllm", rules=rules)) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            done = await asyncio.gather(
                *(
                    llm.chat("solution", QUESTION, key=CallKey(problem_id="p", role="solution", sample=i),
                             sampling=Sampling(seed=7 + i))
                    for i in range(2)
                )
            )  # fmt: skip
        bodies = sim.chat_bodies()
    assert [(b.get("n"), b.get("seed")) for b in bodies] == [(2, 7), (None, 7)]
    assert [c.content for c in done] == [long, short]
    assert done[1].retry_causes == ["abort" if fault == "abort" else "cut"] and done[0].retry_causes == []


async def test_identical_long_choices_at_a_temperature_above_zero_go_one_request_each() -> None:
    # SGLang with deterministic inference samples every choice with the request's seed: n alike choices.
    long_reply = "Let me multiply step by step. " * 20 + "\\boxed{391}"
    script = SimScript(persona="sglang", deterministic=True, rules=[Rule(replies=[long_reply])])
    with SimServer(script) as sim:
        stats = ClientStats()
        async with LLMClient(settings_for(sim), stats=stats) as llm:
            done = await _alike(llm, 3)
            again = await _alike(llm, 2, problem="q")
        bodies = sim.chat_bodies()
    assert all(c.ok for c in done + again)
    assert [b.get("n") for b in bodies] == [3, None, None, None, None]
    assert "identical choices" in stats.downgrades["batch_samples"][sim.base_url]["sim-model"]
    # The work the server did on the dropped choices is still counted.
    served = sim.stats()
    assert sum(c.usage.completion_tokens for c in done + again) == served.completion_tokens


# ------------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize(
    ("persona", "sent"),
    [
        ("vllm", {"top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05, "presence_penalty": 0.5}),
        ("llama-server", {"top_k": 20, "min_p": 0.0, "repeat_penalty": 1.05, "presence_penalty": 0.5}),
        ("openai", {"presence_penalty": 0.5}),
    ],
)
async def test_sampling_fields_reach_each_server_under_its_names(persona: str, sent: dict[str, Any]) -> None:
    sampling = Sampling(top_k=20, min_p=0.0, repetition_penalty=1.05, presence_penalty=0.5)
    with SimServer(SimScript(persona=persona)) as sim:  # type: ignore[arg-type]
        stats = ClientStats()
        async with LLMClient(settings_for(sim), stats=stats) as llm:
            reply = await llm.chat("solution", QUESTION, sampling=sampling)
        last = sim.chat_bodies()[-1]
    assert reply.ok, reply.error
    named = {"top_k", "min_p", "repetition_penalty", "repeat_penalty", "presence_penalty"}
    assert {k: v for k, v in last.items() if k in named} == sent
    # OpenAI refuses the fields it does not know: each left out at once, recorded.
    assert ("sampling" in stats.downgrades) == (persona == "openai")


@pytest.mark.parametrize(("persona", "connections"), [("llama-server", 4), ("vllm", 1)])
async def test_a_connection_llama_server_closes_after_a_stream_is_never_handed_to_the_next_call(
    persona: str, connections: int
) -> None:
    # llama-server closes its side after every streamed reply though its headers offer keep-alive: the client asks it
    # to close each connection (Connection: close), so each call opens its own (a call given the closed one would be
    # written into a closed socket). vLLM keeps its connections: one serves all four calls.
    with SimServer(SimScript(persona=persona)) as sim:  # type: ignore[arg-type]
        stats = ClientStats()
        async with LLMClient(settings_for(sim), stats=stats) as llm:
            for i in range(4):
                assert (await llm.chat("solution", [user(f"What is {i}*7?")])).ok
        served = sim.stats()
    assert served.connections == connections and stats.retries == 0


# ------------------------------------------------------------------------------------------------ reasoning
class Verdict(BaseModel):
    reasoning: str
    score: int


# A thinking model's reply whose chat template opened the think block in the prompt: the content holds the thinking
# and no tag at all until "</think>".
OPENED_IN_PROMPT = "Let me multiply seventeen by twenty three step by step . " * 20 + "</think> \\boxed{391}"


@pytest.mark.parametrize(
    "first",
    [
        # Cut inside a think block the reply opened: "<think>" and no closing tag yet.
        SimScript(persona="vllm", reasoning=True, think_tags=True),
        # Cut inside a think block the template opened: no tag at all.
        SimScript(persona="vllm", rules=[Rule(replies=[OPENED_IN_PROMPT])]),
    ],
)
async def test_a_replica_whose_first_reply_is_cut_mid_thought_gets_no_schema_that_forbids_thinking(
    first: SimScript,
) -> None:
    # vLLM without a reasoning parser: the thinking stays in the content, and a grammar from the first token would
    # forbid it. A first reply cut by max_tokens shows nothing of where reasoning goes; the next call, whose reply is
    # parsed as JSON, still goes without response_format, and a finished reply then shows the thinking inline.
    with SimServer(first) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            cut = await llm.chat("solution", QUESTION, sampling=Sampling(max_tokens=8))
            parsed = await llm.chat("verifier", [user("Grade the candidate 391.")], reply_model=Verdict)
            again = await llm.chat("verifier", [user("Grade the candidate 392.")], reply_model=Verdict)
        bodies = sim.chat_bodies()
    assert cut.ok and cut.finish_reason == "length"
    assert parsed.ok and parsed.finish_reason == "stop"
    assert [("response_format" in b) for b in bodies] == [False, False, False]
    assert again.ok


async def test_reasoning_tokens_of_a_vllm_persona_s_thinking_replies_come_within_2_percent(tmp_path: Path) -> None:
    # vLLM's chat completions before 2026-08 report no reasoning tokens, with a reasoning parser or without one (the
    # thinking then stays in the content): counted from the reasoning text with the model's tokenizer (one that
    # splits as the simulator does), they are the true count.
    tokenizer = _simulator_tokenizer(tmp_path)
    thought = "I multiply seventeen by twenty three : 17 * 23 = 391 , and check it by 391 / 17 = 23 . " * 30
    truth = 4 * count_tokens(thought)
    for script in (
        SimScript(persona="vllm", reports_reasoning_tokens=False, rules=[Rule(reasoning=thought)]),
        SimScript(persona="vllm", think_tags=True, rules=[Rule(reasoning=thought)]),
    ):
        with SimServer(script) as sim:
            for configured in (tokenizer, None):
                settings = settings_for(sim, endpoint__tokenizer=configured, sampling__max_tokens=4000)
                async with LLMClient(settings) as llm:
                    done = await asyncio.gather(*(llm.chat("solution", [user(f"What is {i}*23?")]) for i in range(4)))
                counted = sum(c.usage.reasoning_tokens for c in done)
                if configured is not None:
                    assert abs(counted - truth) <= 0.02 * truth and not any(c.usage.estimated for c in done)
                else:
                    # Without a tokenizer: estimated (4 characters a token), and marked so.
                    assert counted > 0 and all(c.usage.estimated for c in done)


async def test_cached_tokens_never_pass_the_prompt_where_older_sglang_sums_them_over_choices() -> None:
    # Older SGLang reports the first choice's cached tokens plus the whole prompt for each other choice: for three
    # samples of a new prompt, twice the prompt. The client never records more cached tokens than prompt tokens.
    script = SimScript(persona="sglang", cache_report=True, cached_summed_over_choices=True)
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            done = await _alike(llm, 3)
        served = sim.stats()
    assert [c.usage.prompt_tokens for c in done] == [served.prompt_tokens, 0, 0]
    assert done[0].usage.cached_prompt_tokens <= done[0].usage.prompt_tokens
    assert sum(c.usage.cached_prompt_tokens for c in done) <= served.prompt_tokens
