"""``tmas serve``'s cost gate, through the official openai client against the proxy and the simulated upstream: a
request that gives no parameters runs the quick setting (a few dozen upstream calls, not the paper's 1,630), and a
request whose run could pass the server's cap is refused before any upstream call, saying how many and why."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from conftest import settings_for
from tmas.serve.launch import ServeOptions
from tmas.testing import SimServer
from web_helpers import ProxyThread

QUESTION = [{"role": "user", "content": "What is 7*8?"}]


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_request_without_parameters_costs_a_few_dozen_calls(sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        reply = client(proxy).chat.completions.create(model="tmas/sim-model", messages=QUESTION)  # type: ignore[arg-type]
    assert "\\boxed{56}" in (reply.choices[0].message.content or "")
    # TMAS's quick preset: N = 4, M = 2, T = 3, at most 48 calls (16 when the first iteration settles).
    assert 16 <= len(sim.chat_bodies()) <= 48 and reply.model_extra["tmas"]["calls"] == len(sim.chat_bodies())


def test_a_request_past_the_cap_is_refused_before_any_upstream_call(sim: SimServer, tmp_path: Path) -> None:
    with (
        ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy,
        pytest.raises(openai.BadRequestError) as caught,
    ):
        client(proxy).chat.completions.create(
            model="tmas/sim-model",
            messages=QUESTION,  # type: ignore[arg-type]
            extra_body={"tmas": {"preset": "paper"}},
        )
    assert caught.value.code == "cost_limit"
    assert "could make 2,000 upstream calls" in caught.value.message  # 1,640, and 360 replies asked again
    assert "at most 500 (tmas serve --max-request-calls)" in caught.value.message
    assert sim.stats().total_requests == 0


def test_the_cap_is_the_servers_to_set(sim: SimServer, tmp_path: Path) -> None:
    options = ServeOptions(serve_dir=tmp_path / "served", max_request_calls=10)
    with ProxyThread(settings_for(sim), options) as proxy:
        api = client(proxy)
        with pytest.raises(openai.BadRequestError, match="could make 80 upstream calls"):
            api.chat.completions.create(model="tmas/sim-model", messages=QUESTION)  # type: ignore[arg-type]
        reply = api.chat.completions.create(
            model="majority/sim-model",
            messages=QUESTION,  # type: ignore[arg-type]
            extra_body={"tmas": {"k": 4}},
        )
    assert "\\boxed{56}" in (reply.choices[0].message.content or "") and len(sim.chat_bodies()) == 4
