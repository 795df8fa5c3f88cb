"""`tmas serve` under load: requests past the problem slots wait in a bounded queue, in arrival order."""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from conftest import settings_for
from tmas.serve.admission import Admission
from tmas.serve.api_errors import ApiError
from tmas.serve.launch import ServeOptions
from tmas.testing import Rule, SimScript, SimServer
from web_helpers import ProxyThread, get, wait_until


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)


def stats(proxy: ProxyThread) -> dict[str, int]:
    status, body = get(f"{proxy.url}/stats")
    assert status == 200
    data: dict[str, int] = json.loads(body)
    return data


def in_proxy(proxy: ProxyThread) -> int:
    now = stats(proxy)
    return now["active_problems"] + now["queued"]


def question(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {i}*7?"}]


def body_bytes(i: int, *, stream: bool) -> bytes:
    return json.dumps({"model": "cot/sim-model", "messages": question(i), "stream": stream}).encode()


def raw_post(proxy: ProxyThread, payload: bytes) -> socket.socket:
    """Send a chat request over a plain socket (to read the stream as it comes, or to drop the connection)."""
    sock = socket.create_connection(("127.0.0.1", proxy.options.port), timeout=20)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)
    return sock


def asked_upstream(sim: SimServer) -> list[str]:
    return [json.dumps(r.body["messages"]) for r in sim.requests]


@pytest.mark.slow
def test_requests_past_the_slots_wait_and_are_answered_in_arrival_order(
    sim: SimServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Upstream calls last long enough that the first two runs are still in flight when the sixth client arrives,
    # on a busy machine too (the clients enter one at a time).
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=1.5)]))
    caplog.set_level("INFO", logger="tmas.serve")
    replies: dict[int, Any] = {}
    options = ServeOptions(serve_dir=tmp_path / "served", max_problems=2)
    with ProxyThread(settings_for(sim), options) as proxy:
        api = client(proxy)

        def ask(i: int) -> None:
            replies[i] = api.chat.completions.create(model="cot/sim-model", messages=question(i))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for i, thread in enumerate(threads):
            thread.start()
            # One at a time into the proxy, so the arrival order is known.
            wait_until(lambda n=i + 1: in_proxy(proxy) == n, what=f"client {i} to be in")
        assert stats(proxy)["queued"] == 4 and stats(proxy)["active_problems"] == 2
        for thread in threads:
            thread.join()
        after = stats(proxy)
    assert sorted(replies) == list(range(6))
    for i, reply in replies.items():
        assert f"\\boxed{{{i * 7}}}" in (reply.choices[0].message.content or "")
    # Never more problems upstream at once than the slots; the runs started in the order their clients came.
    assert sim.stats().max_problems_in_flight == 2 and sim.stats().total_requests == 6
    started = re.findall(r"request (chatcmpl-\S+): cot/sim-model", caplog.text)
    assert started == [replies[i].id for i in range(6)]
    assert caplog.text.count("s in the queue") == 4
    assert after == {**after, "queued": 0, "peak_queued": 4, "rejected": 0, "max_queue": 1024}


@pytest.mark.slow
def test_a_full_queue_answers_429_with_retry_after(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=0.5)]))
    options = ServeOptions(serve_dir=tmp_path / "served", max_problems=2, max_queue=2)
    with ProxyThread(settings_for(sim), options) as proxy:
        api = client(proxy)
        answered: list[int] = []
        threads = [
            threading.Thread(
                target=lambda i=i: answered.append(
                    i if api.chat.completions.create(model="cot/sim-model", messages=question(i)) else -1
                )
            )
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        wait_until(lambda: in_proxy(proxy) == 4, what="two running and two waiting")
        with pytest.raises(openai.RateLimitError) as limited:
            api.chat.completions.create(model="cot/sim-model", messages=question(4))
        assert limited.value.code == "rate_limit_exceeded" and "2 requests waiting" in limited.value.message
        # No run has ended yet, so nothing says how fast the queue moves: the shortest wait.
        assert limited.value.response.headers["retry-after"] == "1"
        for thread in threads:
            thread.join()
        assert sorted(answered) == [0, 1, 2, 3]
        assert stats(proxy)["rejected"] == 1
    assert not any("What is 4*7?" in asked for asked in asked_upstream(sim))


def test_retry_after_is_the_time_the_full_queue_takes_to_move_one_place() -> None:
    admission = Admission(slots=2, queue_size=0)
    assert admission.enter() is None and admission.enter() is None

    def retry_after() -> str:
        with pytest.raises(ApiError) as caught:
            admission.enter()
        assert caught.value.status == 429
        return caught.value.headers["Retry-After"]

    assert retry_after() == "1"
    # Runs hold a slot 30 s on average and 2 slots free one every 15 s.
    admission.release(held_s=30.0)
    assert admission.enter() is None
    assert retry_after() == "15"
    admission.release(held_s=1000.0)  # one very long run: the wait advised stays within a minute
    assert admission.enter() is None
    assert retry_after() == "60"
    assert admission.rejected == 3 and admission.held == 2


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_queued_is_never_run(sim: SimServer, tmp_path: Path, stream: bool) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=0.5)]))
    options = ServeOptions(serve_dir=tmp_path / "served", max_problems=1)
    with ProxyThread(settings_for(sim), options) as proxy:
        api = client(proxy)
        first = threading.Thread(
            target=lambda: api.chat.completions.create(model="cot/sim-model", messages=question(1))
        )
        first.start()
        wait_until(lambda: stats(proxy)["active_problems"] == 1, what="the slot to be taken")
        with raw_post(proxy, body_bytes(2, stream=stream)):
            wait_until(lambda: stats(proxy)["queued"] == 1, what="the second request to queue")
        wait_until(lambda: stats(proxy)["queued"] == 0, what="the gone client to leave the queue")
        first.join()
        # Its place was dropped, not run: the slot is free, nothing is waiting, and the next request goes straight in.
        assert stats(proxy)["active_problems"] == 0
        api.chat.completions.create(model="cot/sim-model", messages=question(3))
    asked = asked_upstream(sim)
    assert len(asked) == 2 and "What is 1*7?" in asked[0] and "What is 3*7?" in asked[1]
    assert len([p for p in (tmp_path / "served").iterdir() if (p / "run.sqlite").is_file()]) == 2


@pytest.mark.slow
def test_queued_streams_open_at_once_and_get_their_answers(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=0.3)]))
    options = ServeOptions(serve_dir=tmp_path / "served", max_problems=1)
    contents: dict[int, str] = {}
    with ProxyThread(settings_for(sim), options) as proxy:
        api = client(proxy)

        def ask(i: int) -> None:
            chunks = list(api.chat.completions.create(model="cot/sim-model", messages=question(i), stream=True))
            contents[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for i, thread in enumerate(threads):
            thread.start()
            wait_until(lambda n=i + 1: in_proxy(proxy) == n, what=f"client {i} to be in")
        with raw_post(proxy, body_bytes(2, stream=True)) as sock:
            seen = b""
            while b": queued" not in seen:
                data = sock.recv(4096)
                assert data, "the proxy closed the queued stream"
                seen += data
            # The stream is open (200, event stream) and says it waits, before its run has started.
            assert seen.startswith(b"HTTP/1.1 200") and b"text/event-stream" in seen
            assert stats(proxy)["queued"] >= 1 and b"chat.completion.chunk" not in seen
            while b"data: [DONE]" not in seen:
                data = sock.recv(4096)
                assert data, "the proxy closed the stream before its end"
                seen += data
        assert b'"content": "' in seen and b"\\\\boxed{14}" in seen
        for thread in threads:
            thread.join()
    assert "\\boxed{0}" in contents[0] and "\\boxed{7}" in contents[1]
    assert sim.stats().max_problems_in_flight == 1 and sim.stats().total_requests == 3
