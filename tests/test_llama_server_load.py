"""The client against the real embedded llama-server under load: calls queued behind busy slots are waited for and
sent once, a closed stream frees its slot, and a prompt the context cannot hold is refused with both numbers."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tmas.config import LocalModel, Sampling, Settings
from tmas.errors import LocalModelError
from tmas.llm import vitals
from tmas.llm.client import LLMClient
from tmas.llm.failures import Failure
from tmas.llm.local_server import LocalServer
from tmas.llm.model import ClientStats
from tmas.llm.types import CallKey, Message

pytestmark = [
    pytest.mark.local_model,
    pytest.mark.skipif(os.environ.get("TMAS_SKIP_LOCAL_MODEL") == "1", reason="TMAS_SKIP_LOCAL_MODEL=1"),
]


@pytest.fixture
async def one_slot(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalServer]:
    cfg = LocalModel(
        model="smollm2-135m", parallel=1, ctx_per_slot=512, startup_timeout_s=120, extra_args=["--metrics", "--slots"]
    )
    async with LocalServer(cfg, log_dir=tmp_path_factory.mktemp("llama")) as srv:
        yield srv


def _settings(srv: LocalServer, concurrency: int = 64, **endpoint: object) -> Settings:
    return Settings.model_validate(
        {
            "endpoint": {"base_url": srv.base_url, "model": srv.model, **endpoint},
            "retry": {"max_attempts": 3, "backoff_base_s": 0.01},
            "concurrency": concurrency,
        }
    )


async def _metric(session: aiohttp.ClientSession, srv: LocalServer, name: str) -> float:
    async with session.get(srv.base_url.removesuffix("/v1") + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(f"llamacpp:{name} "):
                return float(line.split()[1])
    raise AssertionError(f"no llamacpp:{name}")


async def _slot_busy(session: aiohttp.ClientSession, srv: LocalServer) -> bool:
    async with session.get(srv.base_url.removesuffix("/v1") + "/slots") as resp:
        return any(slot.get("is_processing") for slot in await resp.json())


@pytest.mark.slow
async def test_calls_queued_behind_a_busy_slot_are_waited_for_and_sent_once(
    one_slot: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One slot, four calls at once, each generating 160 tokens: three wait in llama-server's queue, silent (no
    # headers), the last behind three whole calls. timeout_s is short, so the queued calls' silences are judged (the
    # spy below sees each verdict); progress_timeout_s is at least one call's time (measured by a first call), so a
    # slow machine's steps still count as progress. While the server answers /health and its /metrics counters move,
    # the queued calls are waited for, not sent again.
    sampling = {"temperature": 0.0, "max_tokens": 160, "extra_body": {"ignore_eos": True}}
    async with LLMClient(_settings(one_slot)) as llm:
        warm = await llm.chat(
            "solution", [Message(role="user", content="Count.")], sampling=Sampling.model_validate(sampling)
        )
    assert warm.ok, warm.error
    verdicts: list[tuple[bool, Failure | None]] = []  # (streaming, what the judge said) of each silence judged
    judge = vitals.judge

    def spied(*args: Any) -> vitals.Judge:
        verdict = judge(*args)

        async def said(silent_since: float, streaming: bool) -> Failure | None:
            verdicts.append((streaming, failure := await verdict(silent_since, streaming)))
            return failure

        return said

    monkeypatch.setattr(vitals, "judge", spied)
    stats = ClientStats()
    settings = _settings(one_slot, timeout_s=0.2, progress_timeout_s=max(5.0, 2 * warm.latency_s))
    deferred_seen = 0.0
    async with LLMClient(settings, stats=stats) as llm, aiohttp.ClientSession() as session:
        before = await _metric(session, one_slot, "tokens_predicted_total")
        calls = [
            asyncio.ensure_future(
                llm.chat(
                    "solution",
                    [Message(role="user", content=f"Count from {i} upwards.")],
                    key=CallKey(role="solution", sample=i),
                    sampling=Sampling.model_validate(sampling),
                )
            )
            for i in range(4)
        ]
        for _ in range(400):  # until the server reports a deferred request (bounded: 400 looks)
            deferred_seen = max(deferred_seen, await _metric(session, one_slot, "requests_deferred"))
            if deferred_seen or all(c.done() for c in calls):
                break
            await asyncio.sleep(0.02)
        done = await asyncio.gather(*calls)
        predicted = await _metric(session, one_slot, "tokens_predicted_total")
    assert deferred_seen >= 1, "the server never queued a request: the test did not load it"
    assert all(c.ok for c in done), [c.error for c in done]
    assert [c.attempts for c in done] == [1, 1, 1, 1]
    assert stats.retries == 0 and all(c.retry_causes == [] for c in done)
    # Every token the server generated went to a reply that was used: nothing was generated twice.
    assert predicted - before == sum(c.usage.completion_tokens for c in done) == 4 * 160
    # A queued call's silence before its first chunk was judged, and the judge kept it waiting.
    assert (False, None) in verdicts
    assert all(failure is None for _, failure in verdicts)


@pytest.mark.slow
async def test_a_closed_stream_frees_its_slot(one_slot: LocalServer) -> None:
    body = {
        "model": one_slot.model,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{one_slot.base_url}/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first event: the slot is generating
            assert await _slot_busy(session, one_slot)
        # Closed after its first event: llama-server stops generating for it.
        freed = False
        for _ in range(200):  # bounded: 200 looks
            if not await _slot_busy(session, one_slot):
                freed = True
                break
            await asyncio.sleep(0.05)
        assert freed
        assert await _metric(session, one_slot, "tokens_predicted_total") < 400


@pytest.mark.slow
async def test_a_prompt_the_context_cannot_hold_is_refused_with_both_numbers(one_slot: LocalServer) -> None:
    # The endpoint claims a larger window than the server has, so the prompt is sent and the server refuses it.
    settings = _settings(one_slot, context_length=8192)
    prompt = " ".join(f"item{i}" for i in range(900))
    async with LLMClient(settings) as llm:
        done = await llm.chat("solution", [Message(role="user", content=prompt)], sampling=Sampling(max_tokens=8))
    assert not done.ok and done.error_cause == "context"
    assert done.attempts == 1
    assert "context window of 512 tokens" in (done.error or "")


@pytest.mark.slow
async def test_no_call_is_sent_on_a_connection_llama_server_closed(one_slot: LocalServer) -> None:
    # llama-server closes its side after every streamed reply, and a connection idle for 5 s. A pool that handed
    # such a connection to the next call lost that call before the server read it ("Server disconnected", "Can not
    # write request body"). Calls back to back, two at a time, then after gaps of 5 and 4 s: none is sent twice.
    stats = ClientStats()
    hi = [Message(role="user", content="Hi")]
    async with LLMClient(_settings(one_slot, concurrency=2), stats=stats) as llm:
        done = list(
            await asyncio.gather(*(llm.chat("solution", hi, sampling=Sampling(max_tokens=2)) for _ in range(12)))
        )
        for gap in (5.0, 4.0):
            await asyncio.sleep(gap)
            done.append(await llm.chat("solution", hi, sampling=Sampling(max_tokens=2)))
    assert all(c.ok and c.retry_causes == [] for c in done), [c.error for c in done]
    assert stats.retries == 0


async def test_a_port_another_process_holds_is_named_in_one_line(tmp_path: Path) -> None:
    # llama-server binds a port of its own choosing unless local.extra_args names one: that one may be taken.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        cfg = LocalModel(model="smollm2-135m", parallel=1, startup_timeout_s=120, extra_args=["--port", str(taken)])
        with pytest.raises(LocalModelError) as failed:
            async with LocalServer(cfg, log_dir=tmp_path):
                pass
    assert str(failed.value) == (
        f"llama-server could not listen on 127.0.0.1:{taken} (the port is in use, or not this user's to take)"
        f" and stopped with exit code 1; its log: {tmp_path / 'local_server.log'}"
    )
