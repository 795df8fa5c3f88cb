"""`tmas serve`'s /metrics: Prometheus' text format, read with the library's own parser, against a scripted load whose
every count is known in advance."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import settings_for
from tmas.serve.launch import ServeOptions
from tmas.serve.metrics import ServeMetrics
from tmas.testing import Rule, ScriptedUsage, SimScript, SimServer
from web_helpers import ProxyThread, get, post, wait_until

SOLUTION_USAGE = ScriptedUsage(prompt_tokens=100, completion_tokens=30, reasoning_tokens=7, cached_tokens=60)
VERIFIER_USAGE = ScriptedUsage(prompt_tokens=50, completion_tokens=10, cached_tokens=20)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(proxy: ProxyThread) -> tuple[dict[str, str], Samples]:
    """The page's metric families (name -> type) and every sample, parsed by prometheus_client's own parser."""
    status, page = get(f"{proxy.url}/metrics")
    assert status == 200
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(page.decode()):
        if family.name.endswith("_created"):
            continue  # the library's creation timestamps of counters and histograms, read as gauges by the parser
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)


def ask(proxy: ProxyThread, model: str, question: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], **extra}
    return post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())


@pytest.mark.slow
def test_metrics_count_a_scripted_load_exactly(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(
        SimScript(
            rules=[
                # A client error upstream is final (not retried): its request fails with a 400, the upstream's.
                Rule(role="solution", pattern="fails for good", fault="http_400"),
                # A busy upstream once: the call is retried and succeeds.
                Rule(role="solution", pattern="busy once", fault="http_503", times=1),
                Rule(role="solution", pattern="slow", latency_s=3.0, usage=SOLUTION_USAGE),
                Rule(role="solution", usage=SOLUTION_USAGE),
                Rule(role="verifier", usage=VERIFIER_USAGE),
            ]
        )
    )
    options = ServeOptions(serve_dir=tmp_path / "served", max_problems=1)
    with ProxyThread(settings_for(sim), options) as proxy:
        types, before = scrape(proxy)
        # Every family is there from the start, named by Prometheus' conventions.
        assert types == {
            "tmas_requests": "counter",
            "tmas_request_duration_seconds": "histogram",
            "tmas_queue_wait_seconds": "histogram",
            "tmas_queue_depth": "gauge",
            "tmas_problems_in_flight": "gauge",
            "tmas_upstream_calls": "counter",
            "tmas_upstream_retries": "counter",
            "tmas_upstream_call_duration_seconds": "histogram",
            "tmas_upstream_tokens": "counter",
        }
        assert {k: v for k, v in before.items() if k[0] == "tmas_upstream_tokens_total"} == {
            ("tmas_upstream_tokens_total", frozenset({("kind", kind)})): 0.0
            for kind in ("prompt", "cached", "completion", "reasoning")
        }

        # One slow run holds the only slot; the next request waits in the queue: both gauges show it.
        replies: list[tuple[int, dict[str, Any]]] = []
        slow = threading.Thread(target=lambda: replies.append(ask(proxy, "cot/sim-model", "What is 2+2? slow")))
        slow.start()
        wait_until(lambda: scrape(proxy)[1].get(("tmas_problems_in_flight", frozenset())) == 1.0, what="in flight")
        queued = threading.Thread(target=lambda: replies.append(ask(proxy, "cot/sim-model", "What is 3+3?")))
        queued.start()
        wait_until(lambda: scrape(proxy)[1].get(("tmas_queue_depth", frozenset())) == 1.0, what="queued")
        slow.join()
        queued.join()
        assert [status for status, _ in replies] == [200, 200]

        assert ask(proxy, "cot/sim-model", "What is 5*5? busy once")[0] == 200
        assert ask(proxy, "tmas/sim-model", "What is 17*23?", tmas={"n": 2, "m": 1, "iterations": 1})[0] == 200
        assert ask(proxy, "cot/sim-model", "This one fails for good.")[0] == 400
        assert ask(proxy, "nosuch/sim-model", "What is 1+1?")[0] == 404
        assert ask(proxy, "tmas/sim-model", "What is 1+1?", tmas={"nn": 2})[0] == 400
        streamed = client(proxy).chat.completions.create(
            model="cot/sim-model", messages=[{"role": "user", "content": "What is 4+4?"}], stream=True
        )
        assert "\\boxed{8}" in "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)

        _, after = scrape(proxy)

    # Requests, by method and status: 4 CoT answered (the stream too), 1 CoT refused upstream (a 400), 1 TMAS answered,
    # 1 TMAS refused for its parameter, 1 unknown method.
    requests = {
        dict(k[1])["method"] + "/" + dict(k[1])["status"]: v for k, v in after.items() if k[0] == "tmas_requests_total"
    }
    assert requests == {"cot/200": 4, "cot/400": 1, "tmas/200": 1, "tmas/400": 1, "unknown/404": 1}
    assert value(after, "tmas_request_duration_seconds_count", method="cot") == 5
    assert value(after, "tmas_request_duration_seconds_count", method="tmas") == 2
    assert value(after, "tmas_request_duration_seconds_count", method="unknown") == 1
    # Runs started: the 5 CoT requests and the one TMAS request; one of them waited (the second behind the slow one).
    assert value(after, "tmas_queue_wait_seconds_count") == 6
    assert value(after, "tmas_queue_wait_seconds_bucket", le="0.0") == 5
    assert value(after, "tmas_queue_depth") == 0 and value(after, "tmas_problems_in_flight") == 0

    # Upstream calls: 4 CoT and 2 TMAS solutions, 2 verifications, and the one that failed for good.
    assert value(after, "tmas_upstream_calls_total", role="solution", cause="ok") == 6
    assert value(after, "tmas_upstream_calls_total", role="verifier", cause="ok") == 2
    assert value(after, "tmas_upstream_calls_total", role="solution", cause="http_400") == 1
    assert value(after, "tmas_upstream_retries_total", cause="http_503") == 1
    assert value(after, "tmas_upstream_call_duration_seconds_count", role="solution") == 7
    assert value(after, "tmas_upstream_call_duration_seconds_count", role="verifier") == 2
    # The slow call alone took its scripted 3 s: one observation above the 2.5 s bucket.
    slow_calls = value(after, "tmas_upstream_call_duration_seconds_count", role="solution") - value(
        after, "tmas_upstream_call_duration_seconds_bucket", role="solution", le="2.5"
    )
    assert slow_calls == 1

    # Tokens as the upstream reported them: 6 successful solution calls and 2 verifications.
    assert value(after, "tmas_upstream_tokens_total", kind="prompt") == 6 * 100 + 2 * 50
    assert value(after, "tmas_upstream_tokens_total", kind="cached") == 6 * 60 + 2 * 20
    assert value(after, "tmas_upstream_tokens_total", kind="completion") == 6 * 30 + 2 * 10
    assert value(after, "tmas_upstream_tokens_total", kind="reasoning") == 6 * 7
    # ... and what the simulated upstream was asked: a body per call, the failed one and the retried attempt too.
    assert len(sim.chat_bodies("solution")) == 6 + 1 + 1 and len(sim.chat_bodies("verifier")) == 2


def test_two_apps_in_one_process_count_apart() -> None:
    first = ServeMetrics(queued=lambda: 0, in_flight=lambda: 0)
    second = ServeMetrics(queued=lambda: 3, in_flight=lambda: 1)
    first.request_done("cot", 200, 0.1)
    page = first.page()[0].decode()
    assert 'tmas_requests_total{method="cot",status="200"} 1.0' in page
    other = second.page()[0].decode()
    assert "tmas_requests_total{" not in other
    assert "tmas_queue_depth 3.0" in other and "tmas_problems_in_flight 1.0" in other


@pytest.mark.parametrize("path", ["/metrics"])
def test_metrics_need_no_token(sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setenv("TMAS_TEST_TOKEN", "s3cret-token")
    options = ServeOptions(serve_dir=tmp_path / "served", token_env="TMAS_TEST_TOKEN")
    with ProxyThread(settings_for(sim), options) as proxy:
        status, page = get(f"{proxy.url}{path}")
        assert status == 200 and b"tmas_requests" in page and b"s3cret-token" not in page
        assert ask(proxy, "cot/sim-model", "What is 1+1?")[0] == 401
        _, samples = scrape(proxy)
    assert value(samples, "tmas_requests_total", method="unknown", status="401") == 1


def test_a_stream_whose_client_goes_away_counts_as_499(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=5.0)]))
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        body = json.dumps(
            {"model": "cot/sim-model", "messages": [{"role": "user", "content": "What is 9*9?"}], "stream": True}
        ).encode()
        sock = socket.create_connection(("127.0.0.1", proxy.options.port), timeout=20)
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        assert b"200 OK" in sock.recv(4096)  # the stream is open; its run waits on the slow upstream
        wait_until(lambda: len(sim.chat_bodies()) == 1, what="the upstream call")
        sock.close()

        def counted() -> bool:
            return value(scrape(proxy)[1], "tmas_requests_total", method="cot", status="499") == 1

        wait_until(counted, what="the dropped stream to be counted")
        _, samples = scrape(proxy)
    assert value(samples, "tmas_requests_total", method="cot", status="200") == 0
    assert value(samples, "tmas_upstream_calls_total", role="solution", cause="ok") == 0
