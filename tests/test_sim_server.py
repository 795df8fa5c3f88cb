"""The simulated OpenAI-compatible server, exercised over real HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import re
import signal
import struct
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from conftest import eventually
from tmas.testing import FaultRates, Rule, SimScript, SimServer, count_tokens
from tmas.testing.responders import evaluate_expression

CONTEXT_MSG = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in the messages, (\d+) in the completion\)\. "
    r"Please reduce the length of the messages or completion\."
)


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with SimServer() as server:
        yield server


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def chat(
    http: aiohttp.ClientSession,
    sim: SimServer,
    text: str = "What is 17*23?",
    role: str | None = "solution",
    problem: str | None = None,
    **body: Any,
) -> tuple[int, dict[str, Any]]:
    headers = {}
    if role is not None:
        headers["X-Tmas-Role"] = role
    if problem is not None:
        headers["X-Tmas-Problem"] = problem
    payload = {"model": "sim-model", "messages": user(text), **body}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload, headers=headers) as resp:
        return resp.status, await resp.json()


def content_of(reply: dict[str, Any]) -> str:
    content = reply["choices"][0]["message"]["content"]
    assert isinstance(content, str)
    return content


def boxed(text: str) -> str:
    found = re.findall(r"\\boxed\{(.*?)\}\.?$", text, flags=re.M)
    assert found, text
    return str(found[-1])


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """The ``data:`` payloads of an SSE stream, ``[DONE]`` kept as the string."""
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- plain completions ------------------------------------------------------------------------------------


async def test_non_streaming_reply_shape_and_arithmetic(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, reply = await chat(http, sim, "What is 17*23?")
    assert status == 200
    assert reply["object"] == "chat.completion"
    assert reply["model"] == "sim-model"
    assert reply["id"].startswith("chatcmpl-")
    assert isinstance(reply["created"], int)
    choice = reply["choices"][0]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    assert "reasoning_content" not in choice["message"]
    content = content_of(reply)
    assert boxed(content) == "391"
    assert "17*23" in content  # a worked line, not just the answer
    usage = reply["usage"]
    assert usage["prompt_tokens"] == count_tokens("What is 17*23?") + 4
    assert usage["completion_tokens"] == count_tokens(content)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("Compute (12+5)*3", "51"),
        ("What is 2^10?", "1024"),
        ("What is 2**5 - 1?", "31"),
        ("What is 6 × 7?", "42"),
        ("Problem 4: evaluate -8 + 3 * (2 + 1).", "1"),
        ("What is 7/2?", "\\frac{7}{2}"),
        ("What is 100 / 4 / 5?", "5"),
    ],
)
async def test_arithmetic_answers(sim: SimServer, http: aiohttp.ClientSession, question: str, answer: str) -> None:
    status, reply = await chat(http, sim, question)
    assert status == 200
    assert boxed(content_of(reply)) == answer


def test_expression_finder_ignores_prose_numbers() -> None:
    assert evaluate_expression("Step 3 of 5: nothing to compute here") is None
    assert evaluate_expression("Divide 1/0 please") is None
    assert evaluate_expression("What is 9^99999999?") is None  # refused, not computed
    found = evaluate_expression("In 2 steps, what is (3+4)*(5-2)?")
    assert found is not None and found[1] == 21


async def test_question_without_arithmetic_gets_a_deterministic_small_integer(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    question = "How many ways can the letters of a word be arranged?"
    answers = [boxed(content_of((await chat(http, sim, question, seed=7))[1])) for _ in range(3)]
    assert len(set(answers)) == 1
    assert 1 <= int(answers[0]) <= 10
    # Other seeds give other (still small) guesses, so sampled answers vary like a real model's.
    by_seed = {boxed(content_of((await chat(http, sim, question, seed=s))[1])) for s in range(20)}
    assert len(by_seed) > 1
    assert all(1 <= int(a) <= 10 for a in by_seed)


async def test_accuracy_controls_wrong_answers(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(accuracy=0.0))
    wrong = [int(boxed(content_of((await chat(http, sim, seed=s))[1]))) for s in range(10)]
    assert all(a != 391 and abs(a - 391) <= 3 for a in wrong)

    sim.set_script(SimScript(accuracy=0.5))
    first = [boxed(content_of((await chat(http, sim, seed=s))[1])) for s in range(40)]
    again = [boxed(content_of((await chat(http, sim, seed=s))[1])) for s in range(40)]
    assert first == again  # deterministic per request body
    assert 5 < first.count("391") < 35


async def test_judge_role_returns_json_verdict(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, reply = await chat(http, sim, "Are 1/2 and 0.5 the same?", role="judge")
    assert status == 200
    verdict = json.loads(content_of(reply))
    assert verdict["equivalent"] is True
    assert isinstance(verdict["reasoning"], str)


async def test_missing_role_header_is_default_role(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, reply = await chat(http, sim, "What is 2+2?", role=None, problem="p-7")
    assert status == 200
    assert boxed(content_of(reply)) == "4"
    stats = sim.stats()
    assert stats.by_role == {"default": 1}
    [logged] = sim.requests
    assert logged.role == "default"
    assert logged.problem_id == "p-7"
    assert logged.endpoint == "chat"
    assert logged.body["messages"] == user("What is 2+2?")


# ---- streaming --------------------------------------------------------------------------------------------


async def test_streaming_matches_non_streaming(sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, plain = await chat(http, sim, "Compute (12+5)*3", seed=1)
    payload = {
        "messages": user("Compute (12+5)*3"),
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert sum(1 for d in deltas if d) > 1  # several pieces, not one blob
    assert "".join(deltas) == content_of(plain)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == plain["usage"]


async def test_streaming_without_include_usage_has_no_usage_chunk(sim: SimServer, http: aiohttp.ClientSession) -> None:
    payload = {"messages": user("What is 1+1?"), "stream": True}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_streaming_reasoning_and_per_token_latency(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(reasoning=True, latency_per_token_s=0.0005))
    payload = {"messages": user("What is 3*3?"), "stream": True}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        events = await read_sse(resp)
    deltas = [c["choices"][0]["delta"] for c in events[:-1] if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert "3*3" in reasoning
    assert boxed(content) == "9"


# ---- rules ------------------------------------------------------------------------------------------------


async def test_role_rule_cycles_replies(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(role="verifier", replies=["first", "second"])]))
    got = [content_of((await chat(http, sim, "check", role="verifier"))[1]) for _ in range(3)]
    assert got == ["first", "second", "first"]
    # Other roles are untouched by the rule.
    assert boxed(content_of((await chat(http, sim, "What is 2*4?", role="solution"))[1])) == "8"


async def test_pattern_rule_with_times_then_falls_through(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(
        SimScript(
            rules=[
                Rule(pattern=r"17\*23", replies=["\\boxed{0}"], times=2),
                Rule(pattern=r"17.*23", replies=["\\boxed{1}"]),
            ]
        )
    )
    got = [boxed(content_of((await chat(http, sim, "What is 17*23?"))[1])) for _ in range(4)]
    assert got == ["0", "0", "1", "1"]
    # A non-matching question gets the default responder.
    assert boxed(content_of((await chat(http, sim, "What is 5+5?"))[1])) == "10"


async def test_pattern_searches_all_messages_across_lines(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(pattern=r"SYSTEM-MARK.*LAST", replies=["matched"])]))
    payload = {
        "messages": [
            {"role": "system", "content": "SYSTEM-MARK\nbe brief"},
            {"role": "user", "content": "the LAST message"},
        ]
    }
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        assert content_of(await resp.json()) == "matched"


async def test_rule_overrides_finish_reason_and_reasoning(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(replies=["ok"], finish_reason="length", reasoning="I thought.")]))
    _, reply = await chat(http, sim)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"]["reasoning_content"] == "I thought."
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == count_tokens("I thought.")


async def test_reset_restarts_rule_counters_stats_and_log(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(replies=["once"], times=1)]))
    assert content_of((await chat(http, sim, "What is 1+2?"))[1]) == "once"
    assert content_of((await chat(http, sim, "What is 1+2?"))[1]) != "once"
    sim.reset()
    assert sim.stats().total_requests == 0
    assert sim.requests == []
    assert content_of((await chat(http, sim, "What is 1+2?"))[1]) == "once"


# ---- faults -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "status", "kind"),
    [
        ("http_500", 500, "InternalServerError"),
        ("http_503", 503, "ServiceUnavailableError"),
        ("http_429", 429, "RateLimitError"),
        ("http_400", 400, "BadRequestError"),
    ],
)
async def test_http_faults(sim: SimServer, http: aiohttp.ClientSession, fault: str, status: int, kind: str) -> None:
    sim.set_script(SimScript(rules=[Rule.model_validate({"fault": fault})]))
    payload = {"messages": user("hi")}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        assert resp.status == status
        body = await resp.json()
        assert body["error"]["type"] == kind
        assert body["error"]["code"] == status
        assert body["error"]["message"]
        if status == 429:
            assert resp.headers["Retry-After"] == "0"
        else:
            assert "Retry-After" not in resp.headers
    assert sim.stats().faults == {fault: 1}


async def test_drop_fault_disconnects(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="drop", times=1)]))
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await chat(http, sim)
    # The server keeps serving afterwards.
    status, reply = await chat(http, sim)
    assert status == 200 and boxed(content_of(reply)) == "391"
    assert sim.stats().faults == {"drop": 1}


async def test_malformed_fault_is_not_json(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="malformed")]))
    async with http.post(f"{sim.base_url}/chat/completions", json={"messages": user("hi")}) as resp:
        assert resp.status == 200
        text = await resp.text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    # Streaming: a broken event and no [DONE].
    payload = {"messages": user("hi"), "stream": True}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        lines = [ln for ln in (await resp.text()).splitlines() if ln.startswith("data: ")]
    assert "data: [DONE]" not in lines
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[-1][len("data: ") :])


async def test_truncate_fault(sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, full = await chat(http, sim)
    sim.set_script(SimScript(rules=[Rule(fault="truncate")]))
    _, cut = await chat(http, sim)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert content_of(full).startswith(content_of(cut))
    assert 0 < count_tokens(content_of(cut)) < count_tokens(content_of(full))
    assert "\\boxed" not in content_of(cut)


async def test_garbage_fault(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="garbage")]))
    status, reply = await chat(http, sim)
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "stop"
    text = content_of(reply)
    assert "\\boxed" not in text and "391" not in text
    assert re.fullmatch(r"[a-z]+( [a-z]+)+", text)


async def test_timeout_fault_hangs_then_answers(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(hang_s=30.0, rules=[Rule(fault="timeout", times=1)]))
    payload = {"messages": user("What is 17*23?")}
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            f"{sim.base_url}/chat/completions", json=payload, timeout=aiohttp.ClientTimeout(total=0.3)
        ) as resp:
            await resp.read()
    # The abandoned handler is cancelled rather than left hanging.
    await eventually(lambda: sim.stats().in_flight == 0)

    # A short hang answers normally.
    sim.set_script(SimScript(hang_s=0.05, rules=[Rule(fault="timeout")]))
    status, reply = await chat(http, sim)
    assert status == 200 and boxed(content_of(reply)) == "391"


async def test_random_faults_all_or_nothing(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(faults=FaultRates(http_503=1.0)))
    statuses = [(await chat(http, sim, f"What is {i}+1?", role=None))[0] for i in range(5)]
    assert statuses == [503] * 5
    # A matching rule takes precedence: no random fault for it.
    sim.set_script(SimScript(faults=FaultRates(http_503=1.0), rules=[Rule(role="judge")]))
    assert (await chat(http, sim, role="judge"))[0] == 200
    assert (await chat(http, sim, role="solution"))[0] == 503


async def test_random_faults_reproducible_from_seed(sim: SimServer, http: aiohttp.ClientSession) -> None:
    script = SimScript(seed=42, faults=FaultRates(http_500=0.3, http_429=0.2))

    async def run() -> list[int]:
        sim.set_script(script)
        out = []
        for _ in range(30):
            async with http.post(f"{sim.base_url}/chat/completions", json={"messages": user("x")}) as resp:
                await resp.read()
                out.append(resp.status)
        return out

    first, second = await run(), await run()
    assert first == second
    assert {200, 500, 429} == set(first)
    faults = sim.stats().faults
    assert faults["http_500"] == 2 * first.count(500)
    assert faults["http_429"] == 2 * first.count(429)


# ---- usage, reasoning, limits -----------------------------------------------------------------------------


async def test_usage_can_be_omitted(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(usage=False))
    _, reply = await chat(http, sim)
    assert "usage" not in reply
    payload = {"messages": user("What is 1+1?"), "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        events = await read_sse(resp)
    assert all("usage" not in c for c in events[:-1])
    assert events[-1] == "[DONE]"


async def test_reasoning_content(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(reasoning=True))
    _, reply = await chat(http, sim)
    message = reply["choices"][0]["message"]
    reasoning = message["reasoning_content"]
    assert "17*23" in reasoning
    assert "<think>" not in message["content"]
    details = reply["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == count_tokens(reasoning)
    assert reply["usage"]["completion_tokens"] == count_tokens(reasoning) + count_tokens(message["content"])


async def test_think_tags(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(think_tags=True))
    _, reply = await chat(http, sim)
    message = reply["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert re.match(r"<think>\n.+\n</think>\n\n", message["content"], flags=re.S)
    assert boxed(message["content"]) == "391"
    assert "completion_tokens_details" not in reply["usage"]


async def test_max_tokens_truncates(sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, full = await chat(http, sim)
    _, cut = await chat(http, sim, max_tokens=5)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 5
    assert count_tokens(content_of(cut)) == 5
    assert content_of(full).startswith(content_of(cut))
    # A generous limit changes nothing.
    _, roomy = await chat(http, sim, max_tokens=1000)
    assert roomy["choices"][0]["finish_reason"] == "stop"
    assert content_of(roomy) == content_of(full)


async def test_max_tokens_spends_reasoning_first(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(reasoning=True))
    _, reply = await chat(http, sim, max_tokens=4)
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert count_tokens(message["reasoning_content"]) == 4
    assert message["content"] == ""
    assert reply["usage"]["completion_tokens"] == 4


async def test_stop_sequence_cuts_reply(sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, reply = await chat(http, sim, stop=["Therefore"])
    assert "Therefore" not in content_of(reply)
    assert "\\boxed" not in content_of(reply)


async def test_context_length_error(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(context_length=50))
    text = "word " * 60
    status, body = await chat(http, sim, text)
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["code"] == 400
    match = CONTEXT_MSG.fullmatch(body["error"]["message"])
    assert match is not None
    limit, total, prompt, completion = map(int, match.groups())
    assert (limit, prompt, completion) == (50, 64, 0)
    assert total == prompt + completion

    # Fits alone, but not with the requested completion budget.
    status, body = await chat(http, sim, "What is 1+1?", max_tokens=45)
    assert status == 400
    match = CONTEXT_MSG.fullmatch(body["error"]["message"])
    prompt = count_tokens("What is 1+1?") + 4
    assert match is not None and match.groups()[1:] == (str(prompt + 45), str(prompt), "45")
    assert sim.stats().errors == 2


async def test_bad_requests_get_openai_errors(sim: SimServer, http: aiohttp.ClientSession) -> None:
    url = f"{sim.base_url}/chat/completions"
    async with http.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"
    async with http.post(url, json={"model": "m"}) as resp:
        assert resp.status == 400
        assert "messages" in (await resp.json())["error"]["message"]
    async with http.post(url, json={"messages": user("x"), "n": 0}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "n must be a positive integer."
    assert sim.stats().errors == 3


# ---- embeddings, models, health ---------------------------------------------------------------------------


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def test_embeddings(sim: SimServer, http: aiohttp.ClientSession) -> None:
    texts = [
        "the cat sat on the mat",
        "a cat sat on a mat today",
        "quantum chromodynamics lattice simulation",
    ]
    async with http.post(f"{sim.base_url}/embeddings", json={"input": texts, "model": "e"}) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list"
    vectors = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
    assert [d["object"] for d in body["data"]] == ["embedding"] * 3
    assert all(len(v) == 256 for v in vectors)
    assert all(math.isclose(math.sqrt(cosine(v, v)), 1.0, rel_tol=1e-9) for v in vectors)
    assert cosine(vectors[0], vectors[1]) > 0.4
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3
    assert body["usage"]["prompt_tokens"] == sum(count_tokens(t) for t in texts)

    # A single string, deterministic, and base64 encoding decodes to the same floats.
    async with http.post(f"{sim.base_url}/embeddings", json={"input": texts[0]}) as resp:
        single = (await resp.json())["data"]
    assert len(single) == 1 and single[0]["embedding"] == vectors[0]
    payload = {"input": texts[0], "encoding_format": "base64"}
    async with http.post(f"{sim.base_url}/embeddings", json=payload) as resp:
        raw = base64.b64decode((await resp.json())["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(decoded, vectors[0], strict=True))

    sim.set_script(SimScript(embedding_dim=32))
    async with http.post(f"{sim.base_url}/embeddings", json={"input": "hello"}) as resp:
        assert len((await resp.json())["data"][0]["embedding"]) == 32
    async with http.post(f"{sim.base_url}/embeddings", json={"input": 5}) as resp:
        assert resp.status == 400


async def test_embedding_faults(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(rules=[Rule(role="embedding", fault="http_503")]))
    headers = {"X-Tmas-Role": "embedding"}
    async with http.post(f"{sim.base_url}/embeddings", json={"input": "x"}, headers=headers) as resp:
        assert resp.status == 503
    assert sim.stats().by_role == {"embedding": 1}


async def test_models_and_health(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(model="m-1", context_length=4096))
    async with http.get(f"{sim.base_url}/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert model["id"] == "m-1"
    assert model["object"] == "model"
    assert model["owned_by"] == "tmas-sim"
    assert model["max_model_len"] == 4096
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200


# ---- the run queue (max_running) and /health -------------------------------------------------------------

HOLD = Rule(pattern="hold", latency_s=60.0)  # holds its turn until its client goes away


async def test_run_queue_is_first_in_first_out(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(max_running=1, rules=[HOLD]))
    first = asyncio.create_task(chat(http, sim, "hold 1"))
    await eventually(lambda: sim.stats().running == 1)
    quick = asyncio.create_task(chat(http, sim, "What is 1+1?"))
    await eventually(lambda: sim.stats().waiting == 1)
    slow = asyncio.create_task(chat(http, sim, "hold 2"))
    await eventually(lambda: sim.stats().waiting == 2)
    assert not quick.done() and sim.stats().max_waiting == 2

    first.cancel()  # its client goes away: the longest-waiting request runs, and answers
    status, reply = await quick
    assert status == 200 and boxed(content_of(reply)) == "2"
    await eventually(lambda: sim.stats().running == 1 and sim.stats().waiting == 0)
    slow.cancel()
    await eventually(lambda: sim.stats().running == 0)
    stats = sim.stats()
    assert (stats.queued, stats.completed, stats.aborted, stats.total_requests) == (2, 1, 0, 3)


async def test_a_client_that_leaves_the_queue_aborts_its_request(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(max_running=1, rules=[HOLD]))
    first = asyncio.create_task(chat(http, sim, "hold"))
    await eventually(lambda: sim.stats().running == 1)
    waiting = asyncio.create_task(chat(http, sim, "What is 1+1?"))
    await eventually(lambda: sim.stats().waiting == 1)
    waiting.cancel()
    await eventually(lambda: sim.stats().aborted == 1)
    assert sim.stats().waiting == 0 and sim.stats().running == 1
    first.cancel()
    await eventually(lambda: sim.stats().running == 0)
    stats = sim.stats()
    assert (stats.completed, stats.queued, stats.aborted) == (0, 1, 1)
    # Each call reached the server once, and none ran after its client left.
    assert [b["messages"][0]["content"] for b in sim.chat_bodies()] == ["hold", "What is 1+1?"]


async def test_raising_max_running_starts_waiting_requests(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(max_running=1, rules=[HOLD]))
    first = asyncio.create_task(chat(http, sim, "hold"))
    await eventually(lambda: sim.stats().running == 1)
    second = asyncio.create_task(chat(http, sim, "What is 2+2?"))
    await eventually(lambda: sim.stats().waiting == 1)
    sim.set_script(SimScript(max_running=2, rules=[HOLD]))
    status, reply = await second
    assert status == 200 and boxed(content_of(reply)) == "4"
    assert sim.stats().queued == 1
    first.cancel()
    await eventually(lambda: sim.stats().running == 0)


async def test_without_max_running_nothing_waits(sim: SimServer, http: aiohttp.ClientSession) -> None:
    results = await asyncio.gather(*(chat(http, sim, f"What is {i}+1?") for i in range(5)))
    assert all(status == 200 for status, _ in results)
    stats = sim.stats()
    assert (stats.queued, stats.waiting, stats.max_waiting, stats.aborted, stats.running) == (0, 0, 0, 0, 0)


async def test_health_answers_hangs_or_fails(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(health="error"))
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 503
    sim.set_script(SimScript(health="hang", hang_s=0.05))
    with pytest.raises(aiohttp.ServerDisconnectedError):  # nothing came back before the connection closed
        async with http.get(f"{sim.url}/health") as resp:
            await resp.read()
    sim.set_script(SimScript())
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200


# ---- keep-alive ---------------------------------------------------------------------------------------------


async def raw_get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str = "/health") -> bytes:
    """One HTTP/1.1 request on an open connection; its status line and headers (the body is small and read)."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: sim\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: (\d+)", head)
    assert length is not None
    await reader.readexactly(int(length.group(1)))
    return head


async def test_an_idle_keep_alive_connection_is_closed_by_the_server() -> None:
    async with SimServer(keepalive_timeout=0.1) as sim:
        reader, writer = await asyncio.open_connection(sim.host, sim.port)
        head = await raw_get(reader, writer)
        assert b"200 OK" in head and b"Connection: close" not in head
        # Idle past the timeout: the server closes the connection; a request sent now would meet a closed socket.
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""
        writer.close()


async def test_the_server_closes_a_connection_after_its_max_requests() -> None:
    async with SimServer(keepalive_max_requests=2) as sim:
        reader, writer = await asyncio.open_connection(sim.host, sim.port)
        first = await raw_get(reader, writer)
        second = await raw_get(reader, writer)
        assert b"Connection: close" not in first and b"Connection: close" in second
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""
        writer.close()
    with pytest.raises(ValueError):
        SimServer(keepalive_max_requests=0)


# ---- concurrency, control endpoints, lifecycle ------------------------------------------------------------


async def test_max_in_flight(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(latency_s=0.5))
    results = await asyncio.gather(*(chat(http, sim, f"What is {i}+1?") for i in range(20)))
    assert [boxed(content_of(r)) for _, r in results] == [str(i + 1) for i in range(20)]
    stats = sim.stats()
    assert stats.max_in_flight == 20
    assert stats.in_flight == 0
    assert stats.total_requests == stats.completed == 20
    assert stats.by_role == {"solution": 20}
    assert stats.prompt_tokens == sum(r["usage"]["prompt_tokens"] for _, r in results)
    assert stats.completion_tokens == sum(r["usage"]["completion_tokens"] for _, r in results)


async def test_control_endpoints(sim: SimServer, http: aiohttp.ClientSession) -> None:
    new = SimScript(model="scripted", rules=[Rule(replies=["canned"])])
    async with http.post(f"{sim.url}/_sim/script", json=new.model_dump()) as resp:
        assert resp.status == 200
    _, reply = await chat(http, sim, problem="q1")
    assert reply["model"] == "scripted" and content_of(reply) == "canned"

    async with http.get(f"{sim.url}/_sim/stats") as resp:
        stats = await resp.json()
    assert stats["total_requests"] == 1 and stats["completed"] == 1
    assert stats["by_role"] == {"solution": 1}

    async with http.get(f"{sim.url}/_sim/requests") as resp:
        [logged] = await resp.json()
    assert logged["role"] == "solution" and logged["problem_id"] == "q1"
    assert logged["body"]["messages"] == user("What is 17*23?")
    assert isinstance(logged["received_at"], float)

    async with http.post(f"{sim.url}/_sim/reset") as resp:
        assert resp.status == 200
    async with http.get(f"{sim.url}/_sim/stats") as resp:
        assert (await resp.json())["total_requests"] == 0
    async with http.get(f"{sim.url}/_sim/requests") as resp:
        assert await resp.json() == []

    async with http.post(f"{sim.url}/_sim/script", json={"model": "x", "bogus": 1}) as resp:
        assert resp.status == 400


async def test_request_log_is_capped(sim: SimServer, http: aiohttp.ClientSession) -> None:
    sim.set_script(SimScript(log_limit=3))
    for i in range(5):
        await chat(http, sim, f"What is {i}+0?")
    logged = sim.requests
    assert [r.body["messages"][0]["content"] for r in logged] == [f"What is {i}+0?" for i in (2, 3, 4)]
    assert sim.stats().total_requests == 5
    # The accessor tests assert wire bodies with: chat bodies only, optionally of one role.
    assert sim.chat_bodies() == [r.body for r in logged] == sim.chat_bodies(logged[0].role)
    assert sim.chat_bodies("no-such-role") == []


def test_script_validation() -> None:
    with pytest.raises(ValidationError):
        SimScript.model_validate({"latency": 1})
    with pytest.raises(ValidationError):
        FaultRates(http_500=1.5)
    with pytest.raises(ValidationError):
        FaultRates(http_500=0.6, drop=0.6)
    with pytest.raises(ValidationError):
        Rule(pattern="(unclosed")
    with pytest.raises(ValidationError):
        Rule.model_validate({"fault": "explode"})
    script = SimScript.model_validate_json('{"rules": [{"role": "judge", "replies": ["x"], "times": 2}]}')
    assert script.rules[0].times == 2
    for bad in ({"max_running": 0}, {"health": "dead"}, {"context_wording": "polite"}, {"models_unavailable": -1}):
        with pytest.raises(ValidationError):
            SimScript.model_validate(bad)
    with pytest.raises(ValidationError):
        Rule(fault="stream_error", error_status=200)
    # The new fields default to the simulator as it was.
    fresh = SimScript()
    assert (fresh.max_running, fresh.health, fresh.context_wording, fresh.api_key) == (None, "ok", "persona", None)
    assert (fresh.models_unavailable, fresh.deterministic) == (0, None)


def test_sync_context_manager_and_stop_with_hung_request() -> None:
    with SimServer(SimScript(hang_s=3600.0, rules=[Rule(role="stuck", fault="timeout")])) as sim:
        assert sim.base_url == f"http://127.0.0.1:{sim.port}/v1"
        assert sim.port > 0
        request = urllib.request.Request(
            f"{sim.base_url}/chat/completions",
            data=json.dumps({"messages": user("What is 40+2?")}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as resp:
            assert boxed(json.loads(resp.read())["choices"][0]["message"]["content"]) == "42"

        # A request that will hang for an hour must not keep stop() from returning.
        async def fire() -> None:
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(chat(session, sim, role="stuck"))
                await eventually(lambda: sim.stats().in_flight == 1)
                await asyncio.to_thread(sim.stop)
                with pytest.raises(aiohttp.ClientError):
                    await task

        asyncio.run(fire())
    assert not sim.running


def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model": "cli-model", "rules": [{"role": "judge", "replies": ["yes"]}]}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "tmas.testing.sim_server", "--port", "0", "--script", str(script)]
    command += ["--persona", "sglang"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None
            base_url = proc.stdout.readline().strip()
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base_url), base_url
            request = urllib.request.Request(
                f"{base_url}/chat/completions",
                data=json.dumps({"messages": user("ok?")}).encode(),
                headers={"Content-Type": "application/json", "X-Tmas-Role": "judge"},
            )
            with urllib.request.urlopen(request, timeout=10) as resp:
                body = json.loads(resp.read())
            assert body["model"] == "cli-model"
            assert body["choices"][0]["message"]["content"] == "yes"
            assert body["usage"]["reasoning_tokens"] == 0  # SGLang's usage shape
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert code == 0


def test_cli_rejects_bad_script(tmp_path: Path) -> None:
    script = tmp_path / "bad.json"
    script.write_text('{"nonsense": true}')
    done = subprocess.run(
        [sys.executable, "-m", "tmas.testing.sim_server", "--port", "0", "--script", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "nonsense" in done.stderr


async def test_a_rules_error_status_refuses_with_its_body_verbatim_streamed_or_not(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    quota = {
        "error": {
            "message": "You exceeded your current quota, please check your plan and billing details.",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
    }
    sim.set_script(SimScript(persona="openai", rules=[Rule(error_status=429, error_body=quota, times=2)]))
    assert await chat(http, sim) == (429, quota)
    assert await chat(http, sim, stream=True) == (429, quota)  # refused before any stream opens
    status, body = await chat(http, sim)
    assert status == 200 and "391" in body["choices"][0]["message"]["content"]
    assert sim.stats().faults == {"http_429": 2}
    # Without a body: the persona's error shape, carrying the rule's message.
    sim.set_script(SimScript(persona="vllm", rules=[Rule(error_status=503, error_message="Engine busy.")]))
    status, body = await chat(http, sim)
    assert (status, body["error"]["message"], body["error"]["code"]) == (503, "Engine busy.", 503)


async def test_the_gate_holds_requests_past_its_count_until_the_script_changes(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    sim.set_script(SimScript(hold_after=1))
    assert (await chat(http, sim))[0] == 200
    held = asyncio.ensure_future(chat(http, sim, "What is 2+3?"))
    await eventually(lambda: sim.stats().held == 1)
    assert not held.done() and sim.stats().completed == 1
    sim.set_script(SimScript())  # the gate opens: the held request is answered
    status, body = await held
    assert status == 200 and "5" in body["choices"][0]["message"]["content"]
    assert (sim.stats().held, sim.stats().completed) == (0, 2)


@pytest.mark.parametrize("where", ["mid-stream", "in prefill", "unstreamed, generating"])
async def test_a_client_that_goes_part_way_is_a_quiet_disconnect(
    sim: SimServer, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    # vLLM, SGLang and llama-server abort a request whose client went, without an error; the simulator counts it.
    # Before, one that went during its prefill or an unstreamed reply's generation was counted nowhere.
    caplog.set_level(logging.DEBUG)
    streams = where != "unstreamed, generating"
    latency = {"latency_s": 60.0} if where == "in prefill" else {"latency_per_token_s": 0.5}
    sim.set_script(SimScript(**latency))
    payload = {"messages": user("What is 17*23?"), "stream": streams, "max_tokens": 200}
    if where == "mid-stream":
        async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
            assert (await resp.content.readline()).startswith(b"data: ")
            resp.close()
    else:
        asked = asyncio.ensure_future(http.post(f"{sim.base_url}/chat/completions", json=payload))
        await eventually(lambda: sim.stats().engine_prompt_tokens > 0)  # prefilled: the latency or the generation
        asked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asked
    await eventually(lambda: sim.stats().in_flight == 0)
    stats = sim.stats()
    assert (stats.disconnected, stats.completed, stats.errors) == (1, 0, 0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
