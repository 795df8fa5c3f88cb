"""What a client's sampling fields mean for a served method's own calls: defaults of every call, or ignored
(`--client-sampling ignore`); `stop` ends the reply, never a call; temperature 0 for a sampling method is served
with a notice."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from conftest import settings_for
from tmas.serve.api_errors import ApiError
from tmas.serve.launch import ServeOptions
from tmas.serve.protocol import ChatBody, cut_at_stop
from tmas.testing import SimServer
from web_helpers import ProxyThread

QUESTION = [{"role": "user", "content": "What is 17*23?"}]


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_stop_ends_the_reply_at_its_first_sequence() -> None:
    assert cut_at_stop("a\n\nb STOP c", ["STOP", "\n\n"]) == "a"
    assert cut_at_stop("no sequence here", ["\n\n"]) == "no sequence here"
    assert cut_at_stop("text", []) == "text"
    # vLLM's include_stop_str_in_output keeps the sequence that ended it.
    assert cut_at_stop("a\n\nb STOP c", ["STOP", "\n\n"], keep=True) == "a\n\n"
    assert cut_at_stop("a STOP c", ["STOP", "ST"], keep=True) == "a ST"
    as_string = ChatBody.parse(b'{"model": "cot/m", "messages": [{"role": "user", "content": "1?"}], "stop": "x"}')
    assert as_string.stop_sequences() == ["x"]
    for stop in (b'["a", "b", "c", "d", "e"]', b'[""]'):
        with pytest.raises(ApiError, match="stop: at most 4 non-empty sequences"):
            ChatBody.parse(
                b'{"model": "cot/m", "messages": [{"role": "user", "content": "1?"}], "stop": ' + stop + b"}"
            )


def test_stop_cuts_the_reply_and_never_reaches_the_upstream(sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = client(proxy)
        whole = api.chat.completions.create(model="cot/sim-model", messages=QUESTION, seed=5)
        cut = api.chat.completions.create(model="cot/sim-model", messages=QUESTION, seed=5, stop=["\n\n"])
        streamed = api.chat.completions.create(
            model="cot/sim-model", messages=QUESTION, seed=5, stop=["\n\n"], stream=True
        )
        stream_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        kept = api.chat.completions.create(
            model="cot/sim-model",
            messages=QUESTION,
            seed=5,
            stop=["\n\n"],
            extra_body={"include_stop_str_in_output": True},
        )
    text = whole.choices[0].message.content or ""
    assert "\n\n" in text and "\\boxed{391}" in text
    # The reply ends where an OpenAI server would end it; the run itself (and its answer) is whole.
    assert cut.choices[0].message.content == text.split("\n\n")[0] == stream_text
    assert cut.model_extra is not None and cut.model_extra["tmas"]["answer"] == "391"
    # Asked to keep it (vLLM's include_stop_str_in_output), the reply ends with the sequence that ended it.
    assert kept.choices[0].message.content == text.split("\n\n")[0] + "\n\n"
    bodies = sim.chat_bodies()
    assert len(bodies) == 4 and not any("stop" in body or "include_stop_str_in_output" in body for body in bodies)


def ask(proxy: ProxyThread, sampling: dict[str, float]) -> None:
    client(proxy).chat.completions.create(
        model="tmas/sim-model",
        messages=QUESTION,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        max_tokens=int(sampling["max_tokens"]),
        extra_body={"tmas": {"n": 2, "m": 1, "iterations": 1}},
    )


def test_client_sampling_is_every_calls_default_or_ignored(sim: SimServer, tmp_path: Path) -> None:
    # The server's own sampling (settings_for): temperature 0.7, max_tokens 256.
    sent = {"temperature": 0.2, "top_p": 0.5, "max_tokens": 99.0}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "a")) as proxy:
        ask(proxy, sent)
    bodies = sim.chat_bodies()
    assert len(bodies) == 4
    assert all((b["temperature"], b["top_p"], b["max_tokens"]) == (0.2, 0.5, 99) for b in bodies)
    sim.reset()
    options = ServeOptions(serve_dir=tmp_path / "b", client_sampling="ignore")
    with ProxyThread(settings_for(sim), options) as proxy:
        ask(proxy, sent)
    bodies = sim.chat_bodies()
    assert len(bodies) == 4
    assert all(b["temperature"] == 0.7 and b["max_tokens"] == 256 and "top_p" not in b for b in bodies)


def test_temperature_zero_for_a_sampling_method_is_served_with_a_notice(sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = client(proxy)
        greedy = api.chat.completions.create(
            model="majority/sim-model", messages=QUESTION, temperature=0, extra_body={"tmas": {"k": 3}}
        )
        one_chain = api.chat.completions.create(model="cot/sim-model", messages=QUESTION, temperature=0)
    assert greedy.model_extra is not None and one_chain.model_extra is not None
    [notice] = greedy.model_extra["tmas"]["notices"]
    assert notice.startswith("temperature 0 was applied to every upstream call of majority")
    assert "--client-sampling ignore" in notice
    assert "notices" not in one_chain.model_extra["tmas"]
    # Served as asked: three samples at temperature 0, then the CoT call.
    assert [b["temperature"] for b in sim.chat_bodies()] == [0, 0, 0, 0]


def test_vllm_sampling_fields_at_the_top_level_reach_every_upstream_call(sim: SimServer, tmp_path: Path) -> None:
    # vLLM and SGLang read top_k, min_p and repetition_penalty at the top level of a chat request; OpenAI's client
    # sends them there through extra_body. Under the default policy they are every call's defaults, as temperature is.
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "a")) as proxy:
        client(proxy).chat.completions.create(
            model="tmas/sim-model",
            messages=QUESTION,
            extra_body={**extra, "tmas": {"n": 2, "m": 1, "iterations": 1}},
        )
    bodies = sim.chat_bodies()
    assert len(bodies) == 4
    assert all({key: b.get(key) for key in extra} == extra for b in bodies)
    sim.reset()
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "b", client_sampling="ignore")) as proxy:
        client(proxy).chat.completions.create(model="cot/sim-model", messages=QUESTION, extra_body=extra)
    [body] = sim.chat_bodies()
    assert not set(extra) & set(body)


def test_a_bad_vllm_sampling_field_is_a_400_naming_it() -> None:
    with pytest.raises(ApiError, match="bad value for 'min_p'"):
        ChatBody.parse(b'{"model": "cot/m", "messages": [{"role": "user", "content": "1?"}], "min_p": 2}')


def test_max_completion_tokens_is_every_calls_max_tokens_over_max_tokens(sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = client(proxy)
        api.chat.completions.create(model="cot/sim-model", messages=QUESTION, max_completion_tokens=77)
        # Both sent: OpenAI's newer field wins, as vLLM reads them.
        api.chat.completions.create(model="cot/sim-model", messages=QUESTION, max_tokens=10, max_completion_tokens=88)
    assert [b["max_tokens"] for b in sim.chat_bodies()] == [77, 88]
    assert not any("max_completion_tokens" in b for b in sim.chat_bodies())
