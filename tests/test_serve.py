"""`tmas serve` end to end: the official openai client against the proxy, the proxy against the simulated upstream."""

from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import clean_env, dead_url, settings_for
from tmas.errors import ConfigError, InputError
from tmas.methods import METHODS
from tmas.serve.api_errors import ApiError
from tmas.serve.launch import ServeOptions, resolve_token
from tmas.serve.protocol import ChatBody, split_model
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer
from tmas.view.app import view_app
from web_helpers import AppThread, ProxyThread, get, post, run_ref_for, wait_until

TMAS_SMALL = {"n": 2, "m": 1, "iterations": 1}


def test_the_problem_is_the_last_user_message_with_the_rest_as_data() -> None:
    body = ChatBody.parse(
        json.dumps(
            {
                "model": "tmas/m",
                "messages": [
                    {"role": "system", "content": "Answer {{ briefly }}."},
                    {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "text", "text": "1+1"}]},
                    {"role": "assistant", "content": "2"},
                    {"role": "user", "content": "Now {{ 7*7 }} and {% raw %}?"},
                ],
            }
        ).encode()
    )
    question, context = body.question()
    assert context == [
        {"role": "system", "content": "Answer {{ briefly }}."},
        {"role": "user", "content": "First:\n1+1"},
        {"role": "assistant", "content": "2"},
    ]
    # Template syntax in messages is text: nothing was evaluated, everything arrives in order.
    assert question.endswith("Problem:\nNow {{ 7*7 }} and {% raw %}?")
    assert question.index("Answer {{ briefly }}.") < question.index("First:\n1+1") < question.index("[assistant]\n2")
    alone = ChatBody.parse(b'{"model": "cot/m", "messages": [{"role": "user", "content": "What is 2+2?"}]}')
    assert alone.question() == ("What is 2+2?", [])
    # The same question asked the same way is the same request; other parameters make another.
    again = ChatBody.parse(b'{"model": "cot/m", "messages": [{"role": "user", "content": "What is 2+2?"}]}')
    other = ChatBody.parse(b'{"model": "cot/m", "messages": [{"role": "user", "content": "What is 2+2?"}], "seed": 1}')
    assert alone.fingerprint() == again.fingerprint() != other.fingerprint()
    # A tool's result or an assistant's start after the last user message would go unread: refused.
    for role in ("tool", "assistant"):
        tail = {"model": "cot/m", "messages": [{"role": "user", "content": "2+2?"}, {"role": role, "content": "x"}]}
        with pytest.raises(ApiError, match=rf"messages\[1\] \({role}\) follows the last user message") as caught:
            ChatBody.parse(json.dumps(tail).encode()).question()
        assert caught.value.status == 400 and caught.value.param == "messages"


def test_model_names_split_at_the_first_slash() -> None:
    methods, upstreams = {"tmas", "cot"}, ["Qwen/Qwen3-4B", "m"]
    assert split_model("tmas/Qwen/Qwen3-4B", methods, upstreams) == ("tmas", "Qwen/Qwen3-4B")
    for name, says in [("m", "expected <method>/<upstream model>"), ("rse/m", "unknown method"), ("cot/x", "upstream")]:
        with pytest.raises(ApiError, match=says) as caught:
            split_model(name, methods, upstreams)
        assert caught.value.status == 404 and caught.value.code == "model_not_found"


def client(proxy: ProxyThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0, timeout=30)


def runs_in(serve_dir: Path) -> list[Path]:
    return sorted(p for p in serve_dir.iterdir() if (p / "run.sqlite").is_file())


@pytest.fixture
def proxy(sim: SimServer, tmp_path: Path) -> Iterator[ProxyThread]:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as server:
        yield server


def test_the_start_says_where_each_requests_run_is_kept(
    sim: SimServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="tmas.serve")
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")):
        assert f"each request's run is kept in {tmp_path / 'served'} ('tmas view {tmp_path / 'served'}'" in caplog.text


def test_models_lists_every_method_on_every_upstream_model(proxy: ProxyThread) -> None:
    ids = {m.id for m in client(proxy).models.list()}
    assert ids == {f"{method}/sim-model" for method in METHODS}
    assert "tmas/sim-model" in ids and "majority/sim-model" in ids and "cot/sim-model" in ids


def test_each_listed_model_is_retrieved_by_name_and_an_unknown_one_is_a_404(proxy: ProxyThread) -> None:
    api = client(proxy)
    for listed in api.models.list():
        assert api.models.retrieve(listed.id) == listed
    for name, why in [("nosuch/sim-model", "unknown method 'nosuch'"), ("tmas/other", "unknown upstream model")]:
        with pytest.raises(openai.NotFoundError) as caught:
            api.models.retrieve(name)
        assert caught.value.code == "model_not_found" and why in caught.value.message


def test_tmas_reply_carries_the_selected_solution_and_the_upstream_usage(
    sim: SimServer, proxy: ProxyThread, tmp_path: Path
) -> None:
    reply = client(proxy).chat.completions.create(
        model="tmas/sim-model",
        messages=[
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "Please keep answers short."},
            {"role": "assistant", "content": "Understood."},
            {"role": "user", "content": "What is 17*23?"},
        ],
        temperature=0.3,
        extra_body={"tmas": TMAS_SMALL},
    )
    [run_dir] = runs_in(tmp_path / "served")
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
        [problem] = store.problems()
        calls = list(store.calls())
    # The selected solution is the reply; the upstream spend is the usage (as the simulated upstream counted it).
    assert reply.choices[0].message.content == result.text
    assert "\\boxed{391}" in (reply.choices[0].message.content or "")
    assert reply.model_extra is not None and reply.model_extra["tmas"]["answer"] == "391"
    stats = sim.stats()
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == stats.prompt_tokens == sum(c.usage.prompt_tokens for c in calls)
    assert reply.usage.completion_tokens == stats.completion_tokens
    assert reply.id == run_dir.name == problem.problem_id
    # The last user message is the problem; the earlier messages ride along as context; parameters from extra_body.
    solution_bodies = [r.body for r in sim.requests if r.role == "solution"]
    assert len(solution_bodies) == TMAS_SMALL["n"]
    prompt = json.dumps(solution_bodies[0]["messages"])
    assert "What is 17*23?" in prompt and "Please keep answers short." in prompt and "careful assistant" in prompt
    # The body's sampling becomes every upstream call's default.
    assert all(b["model"] == "sim-model" and b["temperature"] == 0.3 for b in solution_bodies)
    with RunStore(run_dir, read_only=True) as store:
        assert store.get_meta("method")["params"] == {**store.get_meta("method")["params"], **TMAS_SMALL}
    # One iteration, the last: no summaries or memory updates (skip_final_memory).
    assert {r.role for r in sim.requests} == {"solution", "verifier"}


def test_stream_shows_progress_then_the_answer_and_usage(sim: SimServer, proxy: ProxyThread, tmp_path: Path) -> None:
    stream = client(proxy).chat.completions.create(
        model="tmas/sim-model",
        messages=[{"role": "user", "content": "What is 12*12?"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"tmas": {"n": 2, "m": 1, "iterations": 2}},
    )
    chunks = list(stream)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    progress = [c.model_extra["tmas_progress"] for c in chunks if c.model_extra and "tmas_progress" in c.model_extra]
    # Progress came before the answer: iterations, candidates so far, the best score after each iteration.
    assert "iteration 0: solution call done (1 candidate so far)" in reasoning
    assert "iteration 1 done: 2 candidates, best score" in reasoning
    ends = [p for p in progress if p.get("kind") == "iteration"]
    assert [p["iteration"] for p in ends] == [0, 1] and all(p["best_score"] is not None for p in ends)
    first_content = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    last_progress = max(i for i, c in enumerate(chunks) if c.model_extra and "tmas_progress" in c.model_extra)
    assert first_content > 0 and "\\boxed{144}" in content
    [run_dir] = runs_in(tmp_path / "served")
    with RunStore(run_dir, read_only=True) as store:
        assert content == store.results()[0].text
    usage = chunks[-1].usage
    assert usage is not None and usage.total_tokens == sim.stats().prompt_tokens + sim.stats().completion_tokens
    assert chunks[last_progress].choices[0].finish_reason == "stop"
    # As OpenAI streams it: the usage chunk alone has no choices, every other says "usage": null.
    assert chunks[-1].choices == [] and all(c.choices and c.usage is None for c in chunks[:-1])


def test_a_reply_cut_at_max_tokens_says_length(sim: SimServer, proxy: ProxyThread) -> None:
    api = client(proxy)
    question = [{"role": "user", "content": "What is 17*23?"}]
    cut = api.chat.completions.create(model="cot/sim-model", messages=question, max_tokens=8)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content
    streamed = list(api.chat.completions.create(model="cot/sim-model", messages=question, max_tokens=8, stream=True))
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == ["length"]
    # Whole, or cut at a stop sequence: "stop".
    whole = api.chat.completions.create(model="cot/sim-model", messages=question)
    assert whole.choices[0].finish_reason == "stop"
    stopped = api.chat.completions.create(model="cot/sim-model", messages=question, max_tokens=8, stop=[" "])
    assert stopped.choices[0].finish_reason == "stop"


def test_a_request_the_upstream_refuses_is_a_400_no_client_retries(sim: SimServer, proxy: ProxyThread) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", fault="http_400")]))
    # As the OpenAI SDK sends it by default: a 502 it retries twice, a 400 never.
    api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="cot/sim-model", messages=[{"role": "user", "content": "What is 1+1?"}])
    assert caught.value.code == "upstream_refused" and "HTTP 400 from the upstream" in caught.value.message
    assert sim.base_url not in caught.value.message
    assert len(sim.chat_bodies("solution")) == 1


def test_an_upstream_refusing_every_call_is_a_424_no_client_retries(sim: SimServer, proxy: ProxyThread) -> None:
    # A key the upstream refuses: no retry of the client helps until the server's operator fixes it.
    sim.set_script(SimScript(rules=[Rule(fault="http_401")]))
    api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", timeout=30)
    with pytest.raises(openai.APIStatusError) as caught:
        api.chat.completions.create(model="cot/sim-model", messages=[{"role": "user", "content": "What is 1+1?"}])
    assert caught.value.status_code == 424 and caught.value.code == "upstream_unusable"
    message = caught.value.message
    assert "HTTP 401 from the upstream" in message and "operator fixes it" in message
    assert "send the request again" not in message and sim.base_url not in message
    # The SDK sent the request once, so the upstream was asked once.
    assert len(sim.chat_bodies("solution")) == 1


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
def test_a_refusal_in_the_upstreams_stream_is_a_400_as_its_status_would_be(
    sim: SimServer, proxy: ProxyThread, tmp_path: Path, persona: str
) -> None:
    # vLLM sends a stream's headers at once, so a request its engine refuses meets the refusal as an error event with
    # code 400 (in each server's shape), not as the reply's status: the request is refused all the same.
    refusal = "invalid value for 'reasoning_effort': must be one of low, medium, high"
    rule = Rule(role="solution", fault="stream_error", error_status=400, fault_after_tokens=0, error_message=refusal)
    sim.set_script(SimScript(persona=persona, rules=[rule]))
    question = [{"role": "user", "content": "What is 1+1?"}]
    api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="cot/sim-model", messages=question)  # type: ignore[arg-type]
    assert caught.value.code == "upstream_refused" and refusal in caught.value.message
    assert "send the request again" not in caught.value.message
    # Asked once by the SDK, which retries no 400; the refused run is done with: the same request is a new run.
    assert len(sim.chat_bodies("solution")) == 1
    sim.set_script(SimScript(persona=persona))
    assert api.chat.completions.create(model="cot/sim-model", messages=question).choices[0].message.content  # type: ignore[arg-type]
    assert len(runs_in(tmp_path / "served")) == 2


def test_an_upstream_failure_is_told_by_its_status_not_by_the_words_it_quotes(
    sim: SimServer, proxy: ProxyThread
) -> None:
    # A gateway's 503 that quotes another status in its message: the upstream failed for a while, it refused nothing.
    words = "upstream replica answered HTTP 400 to the health probe; try again later"
    sim.set_script(SimScript(persona="vllm", rules=[Rule(role="solution", error_status=503, error_message=words)]))
    with pytest.raises(openai.APIStatusError) as caught:
        client(proxy).chat.completions.create(
            model="cot/sim-model", messages=[{"role": "user", "content": "What is 1+1?"}]
        )
    assert caught.value.status_code == 502 and caught.value.code == "upstream_error"
    assert "send the request again to resume its run" in caught.value.message
    # A key the upstream no longer accepts, whatever its message says: the operator's to fix.
    words = "HTTP 400: the key given is revoked"
    sim.set_script(SimScript(persona="sglang", rules=[Rule(role="solution", error_status=401, error_message=words)]))
    with pytest.raises(openai.APIStatusError) as caught:
        client(proxy).chat.completions.create(
            model="cot/sim-model", messages=[{"role": "user", "content": "What is 2+2?"}]
        )
    assert caught.value.status_code == 424 and caught.value.code == "upstream_unusable"


def test_a_stream_not_asked_for_usage_has_a_choice_in_every_chunk(sim: SimServer, proxy: ProxyThread) -> None:
    question = [{"role": "user", "content": "What is 12*12?"}]
    stream = client(proxy).chat.completions.create(model="cot/sim-model", messages=question, stream=True)
    # The common client loop reads choices[0] of every chunk.
    assert "\\boxed{144}" in "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    raw = httpx.post(
        f"{proxy.url}/v1/chat/completions", json={"model": "cot/sim-model", "messages": question, "stream": True}
    )
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    assert events and all(e["choices"] and "usage" not in e for e in events)
    # "stream": null is no stream, as OpenAI reads it.
    plain = httpx.post(
        f"{proxy.url}/v1/chat/completions", json={"model": "cot/sim-model", "messages": question, "stream": None}
    )
    assert plain.status_code == 200 and plain.json()["object"] == "chat.completion"


def test_majority_and_cot_are_served_too(sim: SimServer, proxy: ProxyThread) -> None:
    api = client(proxy)
    reply = api.chat.completions.create(
        model="majority/sim-model",
        messages=[{"role": "user", "content": "What is 6*7?"}],
        extra_body={"tmas": {"k": 3}},
    )
    assert "\\boxed{42}" in (reply.choices[0].message.content or "")
    assert sum(r.role == "solution" for r in sim.requests) == 3
    cot = api.chat.completions.create(model="cot/sim-model", messages=[{"role": "user", "content": "What is 2+2?"}])
    assert "\\boxed{4}" in (cot.choices[0].message.content or "")


def test_unknown_method_or_model_is_a_404_in_openai_form(proxy: ProxyThread) -> None:
    api = client(proxy)
    with pytest.raises(openai.NotFoundError) as caught:
        api.chat.completions.create(model="nosuch/sim-model", messages=[{"role": "user", "content": "1+1?"}])
    assert caught.value.code == "model_not_found" and "unknown method 'nosuch'" in caught.value.message
    with pytest.raises(openai.NotFoundError, match="unknown upstream model 'other'"):
        api.chat.completions.create(model="tmas/other", messages=[{"role": "user", "content": "1+1?"}])


def test_bad_bodies_get_400_errors_without_tracebacks(sim: SimServer, proxy: ProxyThread) -> None:
    url = f"{proxy.url}/v1/chat/completions"
    cases: list[tuple[bytes, str]] = [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({"model": "tmas/sim-model"}).encode(), "'messages'"),
        (json.dumps({"model": "tmas/sim-model", "messages": [{"role": "user", "content": 5}]}).encode(), "content"),
        (json.dumps({"model": "cot/sim-model", "messages": [{"role": "system", "content": "hi"}]}).encode(), "no user"),
        (
            json.dumps(
                {"model": "tmas/sim-model", "messages": [{"role": "user", "content": "1+1?"}], "tmas": {"nn": 2}}
            ).encode(),
            "unknown parameter 'nn'",
        ),
        # What Python's decoder reads but JSON has not (a server's decoder may refuse it, or read it as a value no
        # setting takes): refused, not sent upstream nor failing the run as a 500.
        (
            b'{"model": "cot/sim-model", "messages": [{"role": "user", "content": "1+1?"}],'
            b' "repetition_penalty": Infinity}',
            "Infinity is not a JSON number",
        ),
        (
            b'{"model": "cot/sim-model", "messages": [{"role": "user", "content": "1+1?"}],'
            b' "repetition_penalty": 1e400}',
            "1e400 is out of a number's range",
        ),
        (
            b'{"model": "cot/sim-model", "messages": [{"role": "user", "content": "1+1?"}],'
            b' "chat_template_kwargs": {"enable_thinking": NaN}}',
            "NaN is not a JSON number",
        ),
        # Nested past what the JSON decoder can read, or past what it reads but the request's fingerprint and
        # store cannot write: a 400, not a 500.
        (b'{"model": "cot/sim-model", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 64"),
        (
            b'{"model": "cot/sim-model", "messages": [{"role": "user", "content": "1+1?"}],'
            b' "chat_template_kwargs": {"x": ' + b"[" * 900 + b"]" * 900 + b"}}",
            "nests deeper than 64",
        ),
    ]
    for body, expected in cases:
        status, reply = post(url, body)
        assert status == 400, (body, reply)
        error = reply["error"]
        assert expected in error["message"] and error["type"] == "invalid_request_error"
        assert "Traceback" not in json.dumps(reply)
    status, reply = post(f"{proxy.url}/v1/nowhere", b"{}")
    assert status == 404 and reply["error"]["code"] == "not_found"
    assert sim.stats().total_requests == 0


@pytest.mark.slow
def test_oversized_bodies_413_and_too_many_problems_429(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=1.0)]))
    # No queue: a request past the one slot is turned away at once.
    options = ServeOptions(serve_dir=tmp_path / "served", max_problems=1, max_queue=0, max_body_bytes=2000)
    with ProxyThread(settings_for(sim), options) as proxy:
        api = client(proxy)
        with pytest.raises(openai.APIStatusError) as caught:
            api.chat.completions.create(model="cot/sim-model", messages=[{"role": "user", "content": "x" * 3000}])
        assert caught.value.status_code == 413 and caught.value.code == "request_too_large"
        first = threading.Thread(
            target=lambda: api.chat.completions.create(
                model="cot/sim-model", messages=[{"role": "user", "content": "What is 3*3?"}]
            )
        )
        first.start()
        wait_until(lambda: json.loads(get(f"{proxy.url}/health")[1])["active_problems"] == 1, what="a busy proxy")
        with pytest.raises(openai.RateLimitError) as limited:
            api.chat.completions.create(model="cot/sim-model", messages=[{"role": "user", "content": "What is 4*4?"}])
        assert limited.value.code == "rate_limit_exceeded"
        assert limited.value.response.headers["retry-after"] == "1"  # nothing has finished yet: nothing measured
        first.join()


def test_a_token_is_required_beyond_loopback_and_checked_when_set(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"refusing to listen on 0\.0\.0\.0 without a bearer token"):
        resolve_token(ServeOptions(host="0.0.0.0"))
    assert resolve_token(ServeOptions(host="127.0.0.1")) is None
    monkeypatch.setenv("PROXY_TOKEN", "tok-123")
    assert resolve_token(ServeOptions(host="0.0.0.0", token_env="PROXY_TOKEN")) == "tok-123"
    options = ServeOptions(serve_dir=tmp_path / "served", token_env="PROXY_TOKEN")
    with ProxyThread(settings_for(sim), options) as proxy:
        status, body = post(f"{proxy.url}/v1/chat/completions", b"{}")
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and "missing" in body["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            client(proxy, key="wrong").models.list()
        with pytest.raises(openai.AuthenticationError):
            client(proxy, key="wrong").models.retrieve("cot/sim-model")
        assert client(proxy, key="tok-123").models.retrieve("cot/sim-model").id == "cot/sim-model"
        reply = client(proxy, key="tok-123").chat.completions.create(
            model="cot/sim-model", messages=[{"role": "user", "content": "What is 5*5?"}]
        )
        assert "\\boxed{25}" in (reply.choices[0].message.content or "")
    assert sim.stats().total_requests == 1


def _stream_until_progress(url: str, body: dict[str, Any], until: Callable[[], bool] | None = None) -> None:
    """Send a streaming request, read until the first progress event (and, with ``until``, until it holds), then
    drop the connection."""
    with _open_stream(url, body):
        if until is not None:
            wait_until(until, what="the stream's run to reach its point")


@contextlib.contextmanager
def _open_stream(url: str, body: dict[str, Any], *, progress: bool = True) -> Iterator[None]:
    """A streaming request, read until its first progress event (with ``progress``; else only sent); its connection is
    dropped as the block ends."""
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        sock.sendall(head.encode() + payload)
        seen = b"" if progress else b"tmas_progress"
        while b"tmas_progress" not in seen:
            data = sock.recv(4096)
            assert data, "the proxy closed the stream before any progress"
            seen += data
        yield


@pytest.mark.slow
def test_a_disconnected_client_cancels_its_run_and_a_restart_resumes_it(
    sim: SimServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="tmas.serve")
    # The run stops at a known point: the upstream answers the first iteration's 2 solutions and holds its 4
    # verifications silent, so the run can ask nothing else (its summaries wait on them) until it is cancelled.
    sim.set_script(SimScript(hold_after=2))
    serve_dir = tmp_path / "served"
    body = {
        "model": "tmas/sim-model",
        "messages": [{"role": "user", "content": "What is 17*23?"}],
        "stream": True,
        "seed": 7,
        "tmas": {"n": 2, "m": 2, "iterations": 2},
    }
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        _stream_until_progress(proxy.url, body, until=lambda: sim.stats().held == 4)
        # The client goes: the run is cancelled. Its task has ended once the proxy counts no active problem (the
        # count drops as the task finishes), so it asks nothing more; its 4 held calls were dropped, not answered.
        wait_until(lambda: json.loads(get(f"{proxy.url}/health")[1])["active_problems"] == 0, what="cancellation")
        wait_until(lambda: sim.stats().in_flight == 0, what="the held calls to be dropped")
        stats = sim.stats()
        assert stats.by_role == {"solution": 2, "verifier": 4}
        assert (stats.completed, stats.held, stats.disconnected) == (2, 0, 4)
    [run_dir] = runs_in(serve_dir)
    with RunStore(run_dir, read_only=True) as store:
        assert store.results() == []
        stored = sum(1 for c in store.calls() if c.ok)
    assert stored == 2
    sim.set_script(SimScript())
    sim.reset()
    # A restarted proxy finds the unfinished run and finishes it with nobody asking, replaying the stored calls.
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:

        def finished() -> bool:
            with RunStore(run_dir, read_only=True) as store:
                return bool(store.results())

        wait_until(finished, what="the resumed run to finish")
        with RunStore(run_dir, read_only=True) as store:
            [result] = store.results()
            total = sum(1 for c in store.calls() if c.ok)
        assert result.status == "done" and result.answer == "391"
        # Its start and its end are both logged, though no client asked for it this time.
        wait_until(lambda: f"request {run_dir.name}: done in " in caplog.text, what="the end to be logged")
        assert f"resuming unfinished request {run_dir.name}" in caplog.text
        assert f"request {run_dir.name}: cancelled after " in caplog.text  # the first proxy's end of it
        # Every call of the run: 2 solutions + 4 verifications per iteration, then 2 summaries and 2 bank updates in
        # the first iteration only (the last one skips them: skip_final_memory).
        assert total == 2 * (2 + 4) + 2 + 2
        assert sim.stats().total_requests == total - stored
        asked = sim.stats().total_requests

        def again() -> Any:
            return client(proxy).chat.completions.create(
                model="tmas/sim-model", messages=body["messages"], seed=7, extra_body={"tmas": body["tmas"]}
            )

        # The request it was resumed for, sent again now, gets its reply from the store: nothing is asked again.
        reply = again()
        assert reply.id == run_dir.name and reply.choices[0].message.content == result.text
        assert reply.usage is not None and reply.usage.total_tokens > 0
        assert sim.stats().total_requests == asked and runs_in(serve_dir) == [run_dir]
        # Once a client has had that reply, the same request is a new run (a finished one is not a cache).
        assert again().id != run_dir.name and len(runs_in(serve_dir)) == 2


def test_a_retry_without_a_seed_follows_the_run_a_restart_resumed_for_it(
    sim: SimServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="tmas.serve")
    # A request without a seed, cut off after its 2 solutions (its 2 verifications held until its client goes).
    sim.set_script(SimScript(hold_after=2))
    serve_dir = tmp_path / "served"
    small = {"n": 2, "m": 1, "iterations": 1}
    body = {"model": "tmas/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}], "tmas": small}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        _stream_until_progress(proxy.url, {**body, "stream": True}, until=lambda: sim.stats().held == 2)
        wait_until(lambda: json.loads(get(f"{proxy.url}/health")[1])["active_problems"] == 0, what="cancellation")
    [run_dir] = runs_in(serve_dir)
    # The restarted proxy resumes it with nobody asking: its 2 solutions replayed, its 2 verifications held.
    sim.set_script(SimScript(hold_after=0))
    sim.reset()
    replies: list[Any] = []
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        wait_until(lambda: sim.stats().held == 2, what="the resumed run's calls")

        def retry() -> None:
            replies.append(
                client(proxy).chat.completions.create(
                    model="tmas/sim-model", messages=body["messages"], extra_body={"tmas": small}
                )
            )

        thread = threading.Thread(target=retry)
        thread.start()
        wait_until(lambda: "(no stream" in caplog.text, what="the retry to arrive")
        sim.set_script(SimScript())  # the held calls are answered
        thread.join()
    # The retry got the resumed run's reply: no second run, nothing asked twice.
    assert [r.id for r in replies] == [run_dir.name]
    assert "\\boxed{391}" in (replies[0].choices[0].message.content or "")
    assert runs_in(serve_dir) == [run_dir]
    assert sim.stats().by_role == {"verifier": 2}


def test_twins_without_a_seed_cut_off_together_are_both_resumed_for_their_retries(
    sim: SimServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="tmas.serve")
    # Two identical requests without a seed at once: two runs, the first cut off after its 2 solutions (its 2
    # verifications held), the second before any call (its 2 solutions held).
    sim.set_script(SimScript(hold_after=2))
    serve_dir = tmp_path / "served"
    small = {"n": 2, "m": 1, "iterations": 1}
    body = {"model": "tmas/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}], "tmas": small}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        with _open_stream(proxy.url, {**body, "stream": True}):
            wait_until(lambda: sim.stats().held == 2, what="the first run's verifications")
            with _open_stream(proxy.url, {**body, "stream": True}, progress=False):
                wait_until(lambda: sim.stats().held == 4, what="the second run's solutions")
        wait_until(lambda: json.loads(get(f"{proxy.url}/health")[1])["active_problems"] == 0, what="cancellation")
    cut = runs_in(serve_dir)
    assert len(cut) == 2
    # The restarted proxy resumes both with nobody asking; the two retries follow them, one each.
    sim.set_script(SimScript(hold_after=0))
    sim.reset()
    replies: list[Any] = []
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        wait_until(lambda: sim.stats().held == 4, what="the resumed runs' calls")

        def retry() -> None:
            replies.append(
                client(proxy).chat.completions.create(
                    model="tmas/sim-model", messages=body["messages"], extra_body={"tmas": small}
                )
            )

        threads = [threading.Thread(target=retry) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: caplog.text.count("(no stream") == 2, what="both retries to arrive")
        sim.set_script(SimScript())  # the held calls are answered
        for thread in threads:
            thread.join()
    # Each retry got one of the resumed runs' replies: no third run, nothing asked twice.
    assert sorted(r.id for r in replies) == [run_dir.name for run_dir in cut]
    assert runs_in(serve_dir) == cut
    assert sim.stats().by_role == {"solution": 2, "verifier": 4}


def test_a_reply_no_client_had_survives_a_second_restart_and_is_replayed_once(sim: SimServer, tmp_path: Path) -> None:
    # A seeded request cut off after its 2 solutions (its 2 verifications held until its client goes).
    sim.set_script(SimScript(hold_after=2))
    serve_dir = tmp_path / "served"
    small = {"n": 2, "m": 1, "iterations": 1}
    body = {"model": "tmas/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}], "seed": 5}
    body["tmas"] = small
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        _stream_until_progress(proxy.url, {**body, "stream": True}, until=lambda: sim.stats().held == 2)
        wait_until(lambda: json.loads(get(f"{proxy.url}/health")[1])["active_problems"] == 0, what="cancellation")
    [run_dir] = runs_in(serve_dir)
    sim.set_script(SimScript())

    def finished() -> bool:
        with RunStore(run_dir, read_only=True) as store:
            return bool(store.results())

    # The first restart finishes the run with nobody asking, and stops before any request for it comes.
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)):
        wait_until(finished, what="the resumed run to finish")
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
    assert result.status == "done"
    sim.reset()

    def ask(proxy: ProxyThread) -> tuple[str, str]:
        """The reply's id and text, read from a stream to its end."""
        chunks = list(
            client(proxy).chat.completions.create(
                model="tmas/sim-model", messages=body["messages"], seed=5, extra_body={"tmas": small}, stream=True
            )
        )
        return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # The second restart still holds that reply: the request gets it from the store, the upstream asked nothing.
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        assert ask(proxy) == (run_dir.name, result.text)
        assert sim.requests == [] and runs_in(serve_dir) == [run_dir]
    # Once a client had it, a restart finds the run delivered: the same request is a new run.
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        again, _ = ask(proxy)
    assert again != run_dir.name and len(runs_in(serve_dir)) == 2
    assert sim.stats().by_role == {"solution": 2, "verifier": 2}


def test_a_retry_of_a_run_whose_method_failed_on_failed_calls_asks_only_those_again(
    sim: SimServer, tmp_path: Path
) -> None:
    # The first iteration is answered; the second one's 2 solutions fail after their retries, so the method fails.
    sim.set_script(SimScript(rules=[Rule(role="solution", times=2), Rule(role="solution", error_status=500)]))
    serve_dir = tmp_path / "served"
    body = {"model": "tmas/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}], "seed": 9}
    body["tmas"] = {"n": 2, "m": 1, "iterations": 2, "answer_fallback": False}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        status, failed = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
        assert status == 502 and failed["error"]["message"].startswith("the method failed: ")
        assert "send the request again to resume its run" in failed["error"]["message"]
        [run_dir] = runs_in(serve_dir)
        with RunStore(run_dir, read_only=True) as store:
            [result] = store.results()
            answered = sum(1 for c in store.calls() if c.ok)
        assert result.status == "failed" and result.failed_calls == 2 and answered == result.calls - 2
        refused = sim.chat_bodies("solution")[2:]
        sim.set_script(SimScript())
        sim.reset()
        # The retry resumes the run: its answered calls replayed, only the 2 failed solutions asked again (then the
        # second iteration's verifications, which wait on them and were never asked).
        status, reply = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
        assert status == 200 and reply["id"] == run_dir.name
        assert "\\boxed{391}" in reply["choices"][0]["message"]["content"]
        assert sim.stats().by_role == {"solution": 2, "verifier": 2} and runs_in(serve_dir) == [run_dir]
        asked = sim.chat_bodies("solution")
        assert sorted(map(json.dumps, asked)) == sorted({json.dumps(b) for b in refused})
        # Its reply had, the same request is a new run.
        status, again = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and again["id"] != run_dir.name and len(runs_in(serve_dir)) == 2


def test_keys_reach_no_store_page_or_log(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    upstream_key, proxy_token = "sk-upstream-SECRET-4242", "proxy-SECRET-9191"
    monkeypatch.setenv("UPSTREAM_KEY", upstream_key)
    monkeypatch.setenv("PROXY_TOKEN", proxy_token)
    serve_dir = tmp_path / "served"
    settings = settings_for(sim, endpoint__api_key_env="UPSTREAM_KEY")
    caplog.set_level("DEBUG")
    with ProxyThread(settings, ServeOptions(serve_dir=serve_dir, token_env="PROXY_TOKEN")) as proxy:
        api = client(proxy, key=proxy_token)
        api.chat.completions.create(
            model="tmas/sim-model",
            messages=[{"role": "user", "content": "What is 9*9?"}],
            extra_body={"tmas": TMAS_SMALL},
        )
        list(
            api.chat.completions.create(
                model="cot/sim-model", messages=[{"role": "user", "content": "What is 8*8?"}], stream=True
            )
        )
    # The upstream did get the key...
    assert {r.authorization for r in sim.requests} == {f"Bearer {upstream_key}"}
    # ...and neither it nor the proxy's token is in any file the proxy wrote, any log line, or any viewer page.
    for path in serve_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert upstream_key.encode() not in data and proxy_token.encode() not in data, path
    assert upstream_key not in caplog.text and proxy_token not in caplog.text
    assert "request chatcmpl-" in caplog.text  # the log was captured at all
    with AppThread(view_app([serve_dir])) as viewer:
        pages = [get(f"{viewer.url}/")[1]]
        for run_dir in runs_in(serve_dir):
            with RunStore(run_dir, read_only=True) as store:
                call_ids = [c.call_id for c in store.calls()]
                pid = store.problems()[0].problem_id
            ref = run_ref_for([serve_dir], run_dir)
            assert ref is not None
            pages.append(get(f"{viewer.url}/run/{ref.key}")[1])
            pages.append(get(f"{viewer.url}/run/{ref.key}/problem?id={pid}")[1])
            pages.append(get(f"{viewer.url}/run/{ref.key}/iteration?id={pid}&t=0")[1])
            pages += [get(f"{viewer.url}/run/{ref.key}/call/{i}")[1] for i in call_ids]
    assert all(b"<html" in page for page in pages)
    assert not any(upstream_key.encode() in page or proxy_token.encode() in page for page in pages)


def test_the_cli_refuses_an_open_address_without_a_token(sim: SimServer, tmp_path: Path) -> None:
    env = clean_env()
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    cmd = [sys.executable, "-m", "tmas", "serve", "--host", "0.0.0.0", "--base-url", sim.base_url, "--model", "m"]
    done = subprocess.run([*cmd, "--dir", str(tmp_path / "s")], capture_output=True, env=env, timeout=60, text=True)
    assert done.returncode == 2
    assert "refusing to listen on 0.0.0.0 without a bearer token" in done.stderr and "Traceback" not in done.stderr


def test_a_client_gone_before_a_plain_reply_cancels_its_run_too(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=0.5)]))
    body = json.dumps(
        {"model": "majority/sim-model", "messages": [{"role": "user", "content": "What is 7*7?"}], "tmas": {"k": 4}}
    )
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body.encode())
            wait_until(lambda: sim.stats().in_flight > 0, what="upstream calls to start")
        wait_until(lambda: json.loads(get(f"{proxy.url}/health")[1])["active_problems"] == 0, what="cancellation")
        wait_until(lambda: sim.stats().in_flight == 0, what="upstream calls to end")
        [run_dir] = runs_in(tmp_path / "served")
        with RunStore(run_dir, read_only=True) as store:
            assert store.results() == [] and not list(store.calls())


def test_every_run_store_is_closed_by_the_time_the_server_has_stopped(sim: SimServer, tmp_path: Path) -> None:
    # Stores are closed after their replies, off the request's path; a store left open would keep its WAL file.
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = client(proxy)
        for question in ("What is 2+2?", "What is 3*3?"):
            api.chat.completions.create(model="cot/sim-model", messages=[{"role": "user", "content": question}])
    runs = runs_in(tmp_path / "served")
    assert len(runs) == 2
    for run_dir in runs:
        assert not (run_dir / "run.sqlite-wal").exists()
        with RunStore(run_dir, read_only=True) as store:
            assert [r.status for r in store.results()] == ["done"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7, None])
def test_the_same_seeded_request_twice_at_once_is_one_run(sim: SimServer, tmp_path: Path, seed: int | None) -> None:
    sim.set_script(SimScript(rules=[Rule(role="solution", latency_s=0.5)]))
    replies: list[Any] = []
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = client(proxy)

        def ask() -> None:
            replies.append(
                api.chat.completions.create(
                    model="majority/sim-model",
                    messages=[{"role": "user", "content": "What is 11*11?"}],
                    seed=seed,
                    extra_body={"tmas": {"k": 3}},
                )
            )

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(replies) == 2
    if seed is not None:
        # A retry, or lm-eval's repeats: the same reply.
        assert replies[0].id == replies[1].id
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
        assert len(runs_in(tmp_path / "served")) == 1 and sim.stats().total_requests == 3
    else:
        # Without a seed each request is a sample of its own, as at OpenAI.
        assert replies[0].id != replies[1].id
        assert len(runs_in(tmp_path / "served")) == 2 and sim.stats().total_requests == 6


def test_an_unreachable_upstream_is_a_502_and_the_run_stays_resumable(sim: SimServer, tmp_path: Path) -> None:
    settings = settings_for(sim).model_copy(deep=True)
    with dead_url() as dead:
        settings.endpoint.base_url = [dead]
        with ProxyThread(settings, ServeOptions(serve_dir=tmp_path / "served")) as proxy:
            with pytest.raises(openai.APIStatusError) as caught:
                client(proxy).chat.completions.create(
                    model="cot/sim-model", messages=[{"role": "user", "content": "What is 1+1?"}]
                )
            assert caught.value.status_code == 502 and caught.value.code == "upstream_error"
            message = caught.value.message
            assert "cannot connect" in message and "send the request again" in message
            # The operator's own: the upstream's address, the advice on flags and commands, the server's paths.
            assert dead not in message and "--base-url" not in message and "tmas models" not in message
            assert str(tmp_path) not in message and "Traceback" not in message
    [run_dir] = runs_in(tmp_path / "served")
    with RunStore(run_dir, read_only=True) as store:
        assert store.results() == [] and store.get_meta("serve_request")["method"] == "cot"


def test_an_upstream_whose_tls_handshake_fails_is_a_424_no_client_retries(sim: SimServer, tmp_path: Path) -> None:
    # The simulated server speaks plain HTTP: an https:// URL to it fails its handshake, however often it is sent.
    settings = settings_for(sim).model_copy(deep=True)
    settings.endpoint.base_url = [sim.base_url.replace("http://", "https://")]
    question = [{"role": "user", "content": "What is 1+1?"}]
    with (
        ProxyThread(settings, ServeOptions(serve_dir=tmp_path / "served")) as proxy,
        pytest.raises(openai.APIStatusError) as caught,
    ):
        client(proxy).chat.completions.create(model="cot/sim-model", messages=question)  # type: ignore[arg-type]
    assert caught.value.status_code == 424 and caught.value.code == "upstream_unusable"
    message = caught.value.message
    assert "TLS handshake failed" in message and "operator fixes it" in message
    assert "send the request again" not in message and "127.0.0.1" not in message
    assert sim.chat_bodies("solution") == []


def test_a_method_whose_role_has_no_api_key_is_a_424_naming_the_role_before_any_run(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TMAS_SERVE_TEST_VERIFIER_KEY", raising=False)
    settings = settings_for(sim, roles__verifier__api_key_env="TMAS_SERVE_TEST_VERIFIER_KEY")
    question = [{"role": "user", "content": "What is 1+1?"}]
    with ProxyThread(settings, ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", timeout=30)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as caught:
                api.chat.completions.create(
                    model="verify_refine/sim-model",
                    messages=question,  # type: ignore[arg-type]
                    stream=stream,
                    extra_body={"tmas": {"iterations": 1}},
                )
            assert caught.value.status_code == 424 and caught.value.code == "upstream_unusable"
            message = caught.value.message
            assert "role 'verifier' of method 'verify_refine' has no API key" in message
            assert "roles.verifier.api_key_env = 'TMAS_SERVE_TEST_VERIFIER_KEY'" in message and "is not set" in message
        # Refused before a slot, a run directory or a call; a method without that role is served.
        assert runs_in(tmp_path / "served") == [] and sim.chat_bodies("solution") == []
        assert api.chat.completions.create(model="cot/sim-model", messages=question).choices[0].message.content  # type: ignore[arg-type]


@pytest.mark.slow
def test_stopping_the_server_answers_503_and_keeps_the_run_resumable(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(role="verifier", latency_s=30.0)]))
    errors: list[openai.APIStatusError] = []
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = client(proxy)

        def ask() -> None:
            try:
                api.chat.completions.create(
                    model="tmas/sim-model",
                    messages=[{"role": "user", "content": "What is 17*23?"}],
                    extra_body={"tmas": TMAS_SMALL},
                )
            except openai.APIStatusError as exc:
                errors.append(exc)

        asking = threading.Thread(target=ask)
        asking.start()
        wait_until(lambda: sim.stats().by_role.get("verifier", 0) > 0, what="the run to reach its verifiers")
    asking.join()
    assert [(e.status_code, e.code) for e in errors] == [(503, "server_shutting_down")]
    [run_dir] = runs_in(tmp_path / "served")
    with RunStore(run_dir, read_only=True) as store:
        assert store.results() == [] and [c.key.role for c in store.calls()] == ["solution", "solution"]


def test_stopping_the_server_ends_a_stream_in_flight_with_a_503_event(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The stream is told why it ends, as a request without a stream is, and the server logs no crash.
    monkeypatch.setattr("tmas.serve.launch.GRACEFUL_SHUTDOWN_S", 0.2)
    sim.set_script(SimScript(rules=[Rule(role="verifier", latency_s=30.0)]))
    body = {
        "model": "tmas/sim-model",
        "messages": [{"role": "user", "content": "What is 17*23?"}],
        "stream": True,
        "tmas": TMAS_SMALL,
    }
    lines: list[str] = []
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:

        def ask() -> None:
            with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=30) as reply:
                lines.extend(line for line in reply.iter_lines() if line)

        asking = threading.Thread(target=ask)
        asking.start()
        wait_until(lambda: sim.stats().by_role.get("verifier", 0) > 0, what="the run to reach its verifiers")
    asking.join()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "send the request again" in error["message"]
    assert "Exception in ASGI application" not in caplog.text
    [run_dir] = runs_in(tmp_path / "served")
    with RunStore(run_dir, read_only=True) as store:
        assert store.results() == [] and [c.key.role for c in store.calls()] == ["solution", "solution"]


def test_mattrl_is_served_and_its_deliberation_shows_in_the_viewer(
    sim: SimServer, proxy: ProxyThread, tmp_path: Path
) -> None:
    assert "mattrl" in METHODS  # registered methods are served without any change here
    stream = client(proxy).chat.completions.create(
        model="mattrl/sim-model", messages=[{"role": "user", "content": "What is 17*23?"}], stream=True
    )
    chunks = list(stream)
    assert "\\boxed{391}" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert {r.role for r in sim.requests} >= {"coordinator", "specialist"}
    served = tmp_path / "served"
    [run_dir] = runs_in(served)
    with RunStore(run_dir, read_only=True) as store:
        pid = store.problems()[0].problem_id
        last = store.iterations(pid)[-1]
    transcript = last.state["transcript"]
    with AppThread(view_app([served])) as viewer:
        ref = run_ref_for([served], run_dir)
        assert ref is not None
        status, page = get(f"{viewer.url}/run/{ref.key}/iteration?id={pid}&t={last.iteration}")
    assert status == 200 and b'id="transcript"' in page
    assert page.count(b"<td>opinion</td>") == sum(u["kind"] == "opinion" for u in transcript["utterances"])


def test_the_proxy_and_viewer_start_while_a_port_found_free_is_taken(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process takes a port between its being found free and the server binding it: the servers of the tests
    # bind port 0 and name the port the kernel gave them, so no such port is ever handed to them.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr("tmas.testing.web_servers.free_port", lambda: taken.getsockname()[1])
        with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
            assert get(f"{proxy.url}/health")[0] == 200
        with AppThread(view_app([tmp_path])) as viewer:
            assert get(f"{viewer.url}/")[0] == 200


def test_a_request_naming_a_pool_folder_is_a_400_before_any_call(
    sim: SimServer, proxy: ProxyThread, tmp_path: Path
) -> None:
    # A folder on the server's disk is the server's configuration: a client may not have it read one of its choice,
    # there or not.
    for folder in (tmp_path / "no-pool", tmp_path):
        body = {
            "model": "mattrl/sim-model",
            "messages": [{"role": "user", "content": "1+1?"}],
            "tmas": {"pool": str(folder)},
        }
        status, reply = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
        assert status == 400, reply
        error = reply["error"]
        assert error["message"] == "tmas.pool: a folder on the server, set by its configuration, not by a request"
        assert error["type"] == "invalid_request_error" and error["param"] == "tmas"
    assert sim.stats().total_requests == 0 and runs_in(tmp_path / "served") == []


def test_iterations_a_request_gives_a_method_of_one_round_is_a_400_before_any_call(
    sim: SimServer, proxy: ProxyThread, tmp_path: Path
) -> None:
    # Before, cot ran its one call as without it and answered 200, the request's parameter dropped without a word.
    body = {"model": "cot/sim-model", "messages": [{"role": "user", "content": "1+1?"}], "tmas": {"iterations": 3}}
    status, reply = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, reply
    error = reply["error"]
    assert error["message"] == "tmas.iterations does not apply to method 'cot': it runs one round; leave it out"
    assert error["param"] == "tmas"
    assert sim.stats().total_requests == 0 and runs_in(tmp_path / "served") == []
    # One round is what it runs: said so, it is no contradiction.
    status, reply = post(f"{proxy.url}/v1/chat/completions", json.dumps({**body, "tmas": {"iterations": 1}}).encode())
    assert status == 200, reply


def test_a_configured_pool_folder_that_is_not_there_stops_the_server_at_start(sim: SimServer, tmp_path: Path) -> None:
    missing = tmp_path / "no-pool"
    settings = settings_for(sim, method={"name": "mattrl", "params": {"pool": str(missing)}})
    with pytest.raises(InputError) as refused, ProxyThread(settings, ServeOptions(serve_dir=tmp_path / "served")):
        pass
    line = str(refused.value)
    assert line.startswith("cannot serve method 'mattrl' as configured: ") and str(missing) in line
    assert "\n" not in line and sim.stats().total_requests == 0


def _stored_before_the_one_round_check(run_dir: Path, tmas_params: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the served run in ``run_dir`` as a tmas that took ``iterations`` for a method of one round stored it
    (its request asked with ``tmas_params``), unfinished: its answered calls kept, its result not yet written. The
    request's body as stored."""
    with RunStore(run_dir) as store:
        request = store.get_meta("serve_request")
        request["body"]["tmas"] = tmas_params
        request["fingerprint"] = ChatBody.model_validate(request["body"]).fingerprint()
        store.set_meta("serve_request", request)
        for key in ("settings", "method"):
            value = store.get_meta(key)
            params = value["method"]["params"] if key == "settings" else value["params"]
            params.update(tmas_params)
            store.set_meta(key, value)
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM result_summaries")
    body: dict[str, Any] = request["body"]
    return body


@pytest.mark.parametrize("resume", [False, True])
def test_a_stored_unfinished_request_of_cot_with_iterations_resumes_as_it_was_asked(
    sim: SimServer, tmp_path: Path, resume: bool
) -> None:
    # Refused now when a request gives it (a 400), cot's iterations=3 was taken before: a request stored then is
    # finished as it was asked, by a restarted proxy on its own or for its retry, its answered call replayed.
    serve_dir = tmp_path / "served"
    first = {"model": "cot/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}], "seed": 3}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        status, reply = post(f"{proxy.url}/v1/chat/completions", json.dumps(first).encode())
    assert status == 200, reply
    [run_dir] = runs_in(serve_dir)
    body = _stored_before_the_one_round_check(run_dir, {"iterations": 3})
    sim.reset()
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir, resume=resume)) as proxy:
        status, again = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, again
    assert (
        again["id"] == run_dir.name
        and again["choices"][0]["message"]["content"] == reply["choices"][0]["message"]["content"]
    )
    assert sim.stats().total_requests == 0 and runs_in(serve_dir) == [run_dir]
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
    assert result.status == "done" and result.answer == "391"


def _content(reply: dict[str, Any]) -> str:
    content: str = reply["choices"][0]["message"]["content"]
    return content


def _served_once(sim: SimServer, serve_dir: Path, body: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The run of ``body`` served once, then left as a run whose client went away before its reply: its reply kept
    for the first request for it. Its run directory and the reply."""
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        status, reply = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply
    [run_dir] = runs_in(serve_dir)
    (run_dir / "reply-pending").touch()
    sim.reset()
    return run_dir, reply


def test_a_stored_reply_reaches_the_retry_that_asks_a_field_refused_since(
    sim: SimServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # web_search_options was accepted (and ignored) before it was refused: the retry of a request that asked it, whose
    # run ended with nobody to take its reply, gets that reply from the store, not a 400 that leaves it there.
    serve_dir = tmp_path / "served"
    first = {"model": "cot/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}], "seed": 3}
    run_dir, reply = _served_once(sim, serve_dir, first)
    caplog.set_level("INFO", logger="tmas.serve")
    caplog.clear()
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=serve_dir)) as proxy:
        # The start says which stored runs wait for their request.
        assert f"1 stored run keeps a reply no client has had, for the same request sent again: {run_dir.name}" in (
            caplog.text
        )
        retry = {**first, "web_search_options": {}}
        status, again = post(f"{proxy.url}/v1/chat/completions", json.dumps(retry).encode())
        assert status == 200, again
        assert again["id"] == run_dir.name and _content(again) == _content(reply)
        assert sim.stats().total_requests == 0
        wait_until(lambda: not (run_dir / "reply-pending").is_file(), what="the reply counted as had")
        # Its reply had, the same request is a new one: the field is refused as for any request.
        status, refused = post(f"{proxy.url}/v1/chat/completions", json.dumps(retry).encode())
    assert status == 400 and refused["error"]["param"] == "web_search_options"
    assert sim.stats().total_requests == 0


def test_a_stored_reply_reaches_its_retry_under_a_lower_cost_cap_and_an_unfinished_run_is_named(
    sim: SimServer, tmp_path: Path
) -> None:
    # A server restarted with a lower --max-request-calls: a reply kept in the store costs no call and is had; an
    # unfinished run it would resume past the cap is refused in one line naming that run.
    serve_dir = tmp_path / "served"
    first = {"model": "tmas/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}], "seed": 3}
    run_dir, reply = _served_once(sim, serve_dir, first)
    low = ServeOptions(serve_dir=serve_dir, max_request_calls=2)
    with ProxyThread(settings_for(sim), low) as proxy:
        status, again = post(f"{proxy.url}/v1/chat/completions", json.dumps(first).encode())
    assert status == 200, again
    assert again["id"] == run_dir.name and _content(again) == _content(reply)
    assert sim.stats().total_requests == 0
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM result_summaries")
    with ProxyThread(settings_for(sim), low) as proxy:
        status, refused = post(f"{proxy.url}/v1/chat/completions", json.dumps(first).encode())
    message = refused["error"]["message"]
    assert status == 400 and refused["error"]["code"] == "cost_limit"
    assert f"its run {run_dir.name}, stored unfinished, cannot be resumed" in message and "\n" not in message
    assert sim.stats().total_requests == 0
