"""What reaches the wire both ways: the reasoning fields a client reads, a client's ``chat_template_kwargs`` on the
upstream calls, and a client's ``seed`` making the same request ask the same calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import settings_for
from tmas.serve.launch import ServeOptions
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer
from web_helpers import ProxyThread

QUESTION = [{"role": "user", "content": "What is 17*23?"}]
TMAS_SMALL = {"n": 2, "m": 1, "iterations": 1}


def post_chat(proxy: ProxyThread, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=30)


def sse_events(text: str) -> list[dict[str, Any]]:
    """The JSON events of a stream as the server sent them (comments and [DONE] left out)."""
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]


def test_progress_is_sent_under_both_reasoning_field_names(sim: SimServer, tmp_path: Path) -> None:
    body = {"model": "tmas/sim-model", "messages": QUESTION, "tmas": TMAS_SMALL, "seed": 3}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        streamed = post_chat(proxy, {**body, "stream": True})
        plain = post_chat(proxy, body)
    assert streamed.status_code == 200 and plain.status_code == 200
    deltas = [e["choices"][0]["delta"] for e in sse_events(streamed.text) if e["choices"]]
    thinking = [d for d in deltas if "reasoning" in d or "reasoning_content" in d]
    # Every progress delta says the same under vLLM's name and under the name older vLLM, SGLang and DeepSeek use.
    assert thinking and all(d["reasoning"] == d["reasoning_content"] for d in thinking)
    streamed_reasoning = "".join(d["reasoning"] for d in thinking)
    assert "iteration 0 done: 2 candidates" in streamed_reasoning
    # A whole message carries the same progress under both names, beside the content.
    message = plain.json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"]
    assert sorted(message["reasoning"].splitlines()) == sorted(streamed_reasoning.splitlines())
    assert "\\boxed{391}" in message["content"]


def test_a_request_without_reasoning_gets_no_reasoning_and_the_same_reply(sim: SimServer, tmp_path: Path) -> None:
    body = {"model": "tmas/sim-model", "messages": QUESTION, "tmas": TMAS_SMALL, "include_reasoning": False}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        plain = post_chat(proxy, body)
        streamed = post_chat(proxy, {**body, "stream": True})
    message = plain.json()["choices"][0]["message"]
    assert plain.status_code == 200 and set(message) == {"role", "content"} and "\\boxed{391}" in message["content"]
    events = sse_events(streamed.text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
    assert "\\boxed{391}" in "".join(d.get("content") or "" for d in deltas)
    # The progress still comes, machine-readable, on chunks whose delta is empty.
    progress = [e for e in events if e.get("tmas_progress", {}).get("kind") == "call"]
    assert len(progress) == 4 and all(e["choices"][0]["delta"] == {} for e in progress)


def test_chat_template_kwargs_reach_every_upstream_call(sim: SimServer, tmp_path: Path) -> None:
    settings = settings_for(sim).model_copy(deep=True)
    # The server's own template arguments: the request's keys go over them, the others stay.
    settings.sampling.extra_body = {"chat_template_kwargs": {"enable_thinking": True, "keep": 1}}
    kwargs = {"enable_thinking": False}
    body = {"model": "tmas/sim-model", "messages": QUESTION, "tmas": TMAS_SMALL, "chat_template_kwargs": kwargs}
    for policy in ("defaults", "ignore"):
        with ProxyThread(settings, ServeOptions(serve_dir=tmp_path / policy, client_sampling=policy)) as proxy:
            before = len(sim.chat_bodies())
            reply = post_chat(proxy, body)
            assert reply.status_code == 200, reply.text
            bodies = sim.chat_bodies()[before:]
            # Every call of the run (two solutions, their verifications) under either sampling policy.
            assert len(bodies) == 4
            assert all(b["chat_template_kwargs"] == {"enable_thinking": False, "keep": 1} for b in bodies)
            # Without them, the server's own go out as configured.
            before = len(sim.chat_bodies())
            without = post_chat(proxy, {**body, "chat_template_kwargs": None})
            assert without.status_code == 200
            bodies = sim.chat_bodies()[before:]
            assert len(bodies) == 4
            assert all(b["chat_template_kwargs"] == {"enable_thinking": True, "keep": 1} for b in bodies)
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "bad")) as proxy:
        bad = post_chat(proxy, {**body, "chat_template_kwargs": "enable_thinking=false"})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_value" and bad.json()["error"]["param"] == "chat_template_kwargs"


def call_keys(bodies: list[dict[str, Any]]) -> list[str]:
    """What decides an upstream call's reply: its messages, seed and sampling, one string a call, sorted."""
    keys = ("messages", "seed", "temperature", "max_tokens")
    return sorted(json.dumps({k: b.get(k) for k in keys}, sort_keys=True) for b in bodies)


def test_the_same_seeded_request_asks_the_same_calls_run_after_run(sim: SimServer, tmp_path: Path) -> None:
    body = {"model": "tmas/sim-model", "messages": QUESTION, "tmas": TMAS_SMALL, "seed": 1234}
    sent: list[list[str]] = []
    replies: list[dict[str, Any]] = []
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        for seed in (1234, 1234, 99):
            before = len(sim.chat_bodies())
            reply = post_chat(proxy, {**body, "seed": seed})
            assert reply.status_code == 200, reply.text
            replies.append(reply.json())
            sent.append(call_keys(sim.chat_bodies()[before:]))
    # Two runs (the first had ended: a new run, not a joined one) ...
    assert replies[0]["id"] != replies[1]["id"]
    # ... asked the very same calls, seeds included, so a seeded upstream answered the same.
    assert len(sent[0]) == 4 and sent[0] == sent[1]
    assert replies[0]["choices"][0]["message"]["content"] == replies[1]["choices"][0]["message"]["content"]
    # The seeds are still one per call (the two candidates are two samples), and another seed asks others.
    seeds = {json.loads(key)["seed"] for key in sent[0]}
    assert len(seeds) == 4
    assert seeds.isdisjoint(json.loads(key)["seed"] for key in sent[2])


# Fields a method's reply cannot carry, as the official client sends them: each a 400 naming it, before any call.
ASKS_WHAT_NO_METHOD_GIVES: list[dict[str, Any]] = [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
    {"logprobs": True},
    {"logprobs": True, "top_logprobs": 3},
    {"tools": [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]},
    {"tool_choice": "required"},
    {"logit_bias": {"1734": 5}},
    {"frequency_penalty": 0.5},
    {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
]
# The inference servers' own ways to constrain or shape a reply (vLLM, SGLang, llama-server), sent with extra_body,
# and OpenAI's web search.
SHAPES_THE_REPLY: list[dict[str, Any]] = [
    {"guided_choice": ["positive", "negative"]},
    {"guided_regex": "[0-9]+"},
    {"guided_json": {"type": "object"}},
    {"guided_grammar": "root ::= [0-9]+"},
    {"structured_outputs": {"choice": ["positive", "negative"]}},
    {"regex": "[0-9]+"},
    {"ebnf": "root ::= [0-9]+"},
    {"grammar": "root ::= [0-9]+"},
    {"json_schema": {}},
    {"web_search_options": {}},
    # vLLM's fields that shape the reply, none sent to a method's calls.
    {"stop_token_ids": [151643]},
    {"min_tokens": 50},
    {"ignore_eos": True},
    {"best_of": 4},
    {"use_beam_search": True},
    {"prompt_logprobs": 1},
    {"allowed_token_ids": [15, 16]},
    {"bad_words": ["therefore"]},
    {"skip_special_tokens": False},
    {"thinking_token_budget": 512},
    # llama-server's and SGLang's sampling fields, none sent to a method's calls.
    {"n_predict": 64},
    {"repeat_penalty": 1.1},
    {"typical_p": 0.9},
    {"mirostat": 2},
    {"dynatemp_range": 0.5},
    {"top_n_sigma": 1.0},
    {"xtc_probability": 0.5},
    {"dry_multiplier": 0.8},
    {"no_stop_trim": True},
]
# The same fields asking nothing, as clients send their defaults: served.
ASKS_NOTHING: dict[str, Any] = {
    "response_format": {"type": "text"},
    "logprobs": False,
    "tools": [],
    "tool_choice": "none",
    "logit_bias": {},
    "frequency_penalty": 0,
    "modalities": ["text"],
}


def test_fields_a_methods_reply_cannot_carry_are_refused_by_name(sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)
        for fields in ASKS_WHAT_NO_METHOD_GIVES:
            with pytest.raises(openai.BadRequestError) as caught:
                api.chat.completions.create(model="cot/sim-model", messages=QUESTION, **fields)
            assert caught.value.code == "unsupported_parameter"
            assert caught.value.param == next(iter(fields)), fields
            assert f"{caught.value.param} is not supported" in caught.value.message
        for fields in SHAPES_THE_REPLY:
            with pytest.raises(openai.BadRequestError) as caught:
                api.chat.completions.create(model="cot/sim-model", messages=QUESTION, extra_body=fields)
            assert caught.value.code == "unsupported_parameter" and caught.value.param == next(iter(fields))
            assert f"{caught.value.param} is not supported by tmas serve: " in caught.value.message
        # Nothing went upstream and no run was made for them.
        assert sim.chat_bodies() == []
        assert not any((tmp_path / "served").iterdir())
        nothing = {"guided_choice": None, "structured_outputs": {}, "grammar": "", "json_schema": None}
        # vLLM's defaults, as a client that always sends them sends them.
        nothing |= {"stop_token_ids": [], "min_tokens": 0, "ignore_eos": False, "best_of": 1, "use_beam_search": False}
        nothing |= {"allowed_token_ids": None, "bad_words": [], "skip_special_tokens": True, "typical_p": 1.0}
        nothing |= {"mirostat": 0, "top_n_sigma": -1, "xtc_probability": 0.0, "dry_multiplier": 0}
        nothing |= {"no_stop_trim": False, "n_predict": None, "repeat_penalty": None, "thinking_token_budget": None}
        reply = api.chat.completions.create(
            model="cot/sim-model", messages=QUESTION, **ASKS_NOTHING, extra_body=nothing
        )
    assert "\\boxed{391}" in (reply.choices[0].message.content or "")
    assert len(sim.chat_bodies()) == 1


def test_a_field_tmas_serve_does_not_know_is_refused_by_name_not_dropped(sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)
        # vLLM's own fields that no method's call is sent: served without them, the request would not be as asked.
        for fields, named in [
            ({"truncate_prompt_tokens": 512}, "truncate_prompt_tokens is"),
            ({"truncate_prompt_tokens": 512, "length_penalty": 0.8}, "length_penalty, truncate_prompt_tokens are"),
        ]:
            with pytest.raises(openai.BadRequestError) as caught:
                api.chat.completions.create(model="cot/sim-model", messages=QUESTION, extra_body=fields)
            assert caught.value.code == "unsupported_parameter" and caught.value.param == min(fields)
            assert f"- {named} not supported by tmas serve: " in caught.value.message
        assert sim.chat_bodies() == [] and not any((tmp_path / "served").iterdir())
        # What the official client sends that shapes no reply is served, as is any field sent as null.
        reply = api.chat.completions.create(
            model="cot/sim-model",
            messages=QUESTION,
            user="someone",
            metadata={"job": "eval"},
            store=False,
            service_tier="auto",
            parallel_tool_calls=False,
            prompt_cache_key="k",
            safety_identifier="h",
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"truncate_prompt_tokens": None},
        )
        assert "\\boxed{391}" in "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    assert len(sim.chat_bodies()) == 1


def test_reasoning_effort_and_verbosity_reach_every_upstream_call(sim: SimServer, tmp_path: Path) -> None:
    for policy in ("defaults", "ignore"):
        with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / policy, client_sampling=policy)) as proxy:
            api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)
            before = len(sim.chat_bodies())
            api.chat.completions.create(
                model="tmas/sim-model",
                messages=QUESTION,
                reasoning_effort="low",
                verbosity="high",
                extra_body={"tmas": TMAS_SMALL},
            )
            bodies = sim.chat_bodies()[before:]
            # Every call of the run (two solutions, their verifications) under either sampling policy.
            assert len(bodies) == 4
            assert all((b["reasoning_effort"], b["verbosity"]) == ("low", "high") for b in bodies)
            before = len(sim.chat_bodies())
            api.chat.completions.create(model="tmas/sim-model", messages=QUESTION, extra_body={"tmas": TMAS_SMALL})
            bodies = sim.chat_bodies()[before:]
            assert len(bodies) == 4 and all("reasoning_effort" not in b and "verbosity" not in b for b in bodies)


def test_stream_options_without_a_stream_is_refused_as_vllm_refuses_it(sim: SimServer, tmp_path: Path) -> None:
    body = {"model": "cot/sim-model", "messages": QUESTION}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        refused = [
            post_chat(proxy, {**body, **fields})
            for fields in ({"stream_options": {"include_usage": True}}, {"stream": False, "stream_options": {"x": 1}})
        ]
        assert sim.chat_bodies() == [] and not any((tmp_path / "served").iterdir())
        # Null or empty options ask nothing (vLLM serves them too); with a stream they are read.
        served = [post_chat(proxy, {**body, "stream_options": options}) for options in (None, {})]
        streamed = post_chat(proxy, {**body, "stream": True, "stream_options": {"include_usage": True}})
    error = {
        "message": "Stream options can only be defined when `stream=True`.",
        "type": "invalid_request_error",
        "param": "stream_options",
        "code": "invalid_value",
    }
    assert [(r.status_code, r.json()) for r in refused] == [(400, {"error": error})] * 2
    assert [r.status_code for r in served] == [200, 200]
    assert all("\\boxed{391}" in r.json()["choices"][0]["message"]["content"] for r in served)
    assert streamed.status_code == 200 and sse_events(streamed.text)[-1]["usage"]["total_tokens"] > 0


def test_usage_in_every_chunk_is_refused_where_a_run_sums_it_once_ended(sim: SimServer, tmp_path: Path) -> None:
    body = {"model": "cot/sim-model", "messages": QUESTION, "stream": True}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        refused = post_chat(proxy, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert sim.chat_bodies() == []
        served = post_chat(proxy, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": "stream_options.continuous_usage_stats is not supported by tmas serve: a run's usage is summed"
            " once it has ended (include_usage sends it in the stream's last chunk)",
            "type": "invalid_request_error",
            "param": "stream_options",
            "code": "unsupported_parameter",
        }
    }
    events = sse_events(served.text)
    assert served.status_code == 200 and events[-1]["usage"]["total_tokens"] > 0
    assert all(e["usage"] is None for e in events[:-1])


def test_an_empty_problem_is_a_400_naming_the_messages(sim: SimServer, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "What is 17*23?"}, {"role": "assistant", "content": "391"}]
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        reply = post_chat(proxy, {"model": "cot/sim-model", "messages": [*messages, {"role": "user", "content": " "}]})
    assert reply.status_code == 400 and sim.chat_bodies() == []
    assert reply.json() == {
        "error": {
            "message": "messages[2]: the problem (last user message) is empty",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "invalid_value",
        }
    }


def test_tags_in_a_question_are_inert_in_the_prompt_and_kept_everywhere_else(sim: SimServer, tmp_path: Path) -> None:
    asked = "Which tag does </think> close? Write it as HTML writes it.\n<problem>\n<b>bold</b> is not it."
    context = "Earlier I wrote </solution> by mistake."
    written = "Not a tag of HTML, where a closing tag is written as </b> is: \\boxed{</b>}."
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[written])]))
    messages = [{"role": "user", "content": context}, {"role": "assistant", "content": "Noted."}]
    body = {"model": "cot/sim-model", "messages": [*messages, {"role": "user", "content": asked}]}
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        reply = post_chat(proxy, body)
    assert reply.status_code == 200, reply.text
    [sent] = sim.chat_bodies()
    prompt = "\n".join(m["content"] for m in sent["messages"])
    # What the model reads: each tag of the question and its context once as an entity (never twice, "&amp;lt;"),
    # so none closes the prompt's problem block or reaches a tokenizer as Qwen3's </think> token.
    for tag in ("</think>", "</solution>", "</b>"):
        assert tag not in prompt and tag.replace("<", "&lt;").replace(">", "&gt;") in prompt
    assert "\n&lt;problem&gt;\n" in prompt and "&amp;" not in prompt
    # The run's problem is the question as asked; the reply and its answer are the model's text as written.
    [run_dir] = [p for p in (tmp_path / "served").iterdir() if (p / "run.sqlite").is_file()]
    with RunStore(run_dir, read_only=True) as store:
        [problem] = store.problems()
    assert problem.question.endswith(f"Problem:\n{asked}") and context in problem.question
    assert reply.json()["choices"][0]["message"]["content"] == written
    assert reply.json()["tmas"]["answer"] == "</b>"
