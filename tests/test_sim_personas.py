"""The simulator's server personas over real HTTP: each server's reply, stream, usage, n, unknown-field and /v1/models
shapes, the prefix cache per replica with its hits worked by hand, and TMAS, majority vote and MATTRL run through the
project's client against every persona."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from conftest import eventually, settings_for
from tmas.api import asolve
from tmas.methods import METHODS
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimRequest, SimScript, SimServer, register_responder
from tmas.testing.prefix_cache import PrefixCache, SlotCache, prompt_tokens
from tmas.testing.script import LongReplies, PersonaName
from tmas.testing.sim_server import main

PERSONAS: list[PersonaName] = ["vllm", "sglang", "llama-server", "openai"]
# A reply whose counts are worked by hand: "What is 2+3?" is 6 tokens + 4 for the message = 10 prompt tokens;
# "The answer is 5." 5 content tokens; "Add two and three." 5 reasoning tokens.
Q = "What is 2+3?"
RULE = Rule(replies=["The answer is 5."], reasoning="Add two and three.")


@register_responder("seed-probe")
def _seed_probe(req: SimRequest) -> str:
    return f"seed={req.seed} key={req.sample_key}"


async def post(
    http: aiohttp.ClientSession, sim: SimServer, role: str | None = None, **body: Any
) -> tuple[int, dict[str, Any]]:
    payload = {"model": "sim-model", "messages": [{"role": "user", "content": Q}], **body}
    headers = {"X-Tmas-Role": role} if role else {}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload, headers=headers) as resp:
        return resp.status, await resp.json()


async def stream(http: aiohttp.ClientSession, sim: SimServer, **body: Any) -> list[Any]:
    payload = {"model": "sim-model", "messages": [{"role": "user", "content": Q}], "stream": True, **body}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    events = [e[len("data: ") :] for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def words(n: int, tag: str = "w") -> str:
    """A message of exactly ``n`` simulator tokens."""
    return " ".join(f"{tag}{i}" for i in range(n))


# ---- plain replies ----------------------------------------------------------------------------------------

TOTALS = {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
MESSAGES: dict[str, dict[str, Any]] = {
    "vllm": {
        "role": "assistant",
        "content": "The answer is 5.",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning": "Add two and three.",
    },
    "sglang": {
        "role": "assistant",
        "content": "The answer is 5.",
        "reasoning_content": "Add two and three.",
        "tool_calls": None,
    },
    "llama-server": {"role": "assistant", "content": "The answer is 5.", "reasoning_content": "Add two and three."},
    "openai": {"role": "assistant", "content": "The answer is 5.", "refusal": None, "annotations": []},
}
USAGES: dict[str, dict[str, Any]] = {
    "vllm": {**TOTALS, "prompt_tokens_details": None, "completion_tokens_details": {"reasoning_tokens": 5}},
    "sglang": {**TOTALS, "prompt_tokens_details": None, "reasoning_tokens": 5},
    "llama-server": {**TOTALS, "prompt_tokens_details": {"cached_tokens": 0}},
    "openai": {
        **TOTALS,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 5,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    },
}
CHOICE_KEYS = {
    "vllm": {"index", "message", "logprobs", "stop_reason", "token_ids", "finish_reason"},
    "sglang": {"index", "message", "logprobs", "matched_stop", "finish_reason"},
    "llama-server": {"index", "message", "finish_reason"},
    "openai": {"index", "message", "logprobs", "finish_reason"},
}
REPLY_KEYS = {"id", "object", "created", "model", "choices", "usage"}
EXTRA_REPLY_KEYS = {
    "vllm": {"service_tier", "system_fingerprint", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params"},
    "sglang": {"metadata"},
    "llama-server": {"system_fingerprint", "timings"},
    "openai": {"service_tier", "system_fingerprint"},
}


@pytest.mark.parametrize("persona", PERSONAS)
async def test_plain_reply_shapes(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona=persona, rules=[RULE])) as sim:
        status, reply = await post(http, sim, max_completion_tokens=100)
    assert status == 200
    assert set(reply) == REPLY_KEYS | EXTRA_REPLY_KEYS[persona]
    [choice] = reply["choices"]
    assert set(choice) == CHOICE_KEYS[persona]
    assert choice["message"] == MESSAGES[persona]
    assert choice["finish_reason"] == "stop"
    assert reply["usage"] == USAGES[persona]


async def test_llama_server_timings_say_what_was_reused_and_computed(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="llama-server", rules=[RULE])) as sim:
        _, reply = await post(http, sim)
    timings = reply["timings"]
    # No slot held anything yet: all 11 tokens of the emulated prompt (10 counted) are computed.
    assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == (0, 10, 10)


async def test_sglang_reports_the_request_model_and_vllm_refuses_another(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="sglang")) as sim:
        status, reply = await post(http, sim, model="whatever")
    assert status == 200 and reply["model"] == "whatever"
    async with SimServer(SimScript(persona="vllm")) as sim:
        status, body = await post(http, sim, model="whatever")
    assert status == 404
    assert body["error"] == {
        "message": "The model `whatever` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    # OpenAI names the refusal by a code of its own.
    async with SimServer(SimScript(persona="openai")) as sim:
        status, body = await post(http, sim, model="whatever")
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_sglang_error_body_is_flat(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="sglang")) as sim:
        status, body = await post(http, sim, n=0)
    assert status == 400
    assert body == {
        "object": "error",
        "message": "n must be a positive integer.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


# ---- streams ----------------------------------------------------------------------------------------------


def shape_of(events: list[Any]) -> list[Any]:
    """Each event as (delta keys, finish_reason) or "usage" or "[DONE]", a run of alike events as one."""
    out: list[Any] = []
    for e in events:
        if e == "[DONE]":
            shape: Any = e
        elif not e["choices"]:
            shape = "usage"
        else:
            [c] = e["choices"]
            shape = (tuple(c["delta"]), c["finish_reason"])
        if not out or out[-1] != shape:
            out.append(shape)
    return out


# The role delta, reasoning deltas, content deltas, the finish, usage, [DONE].
STREAMS = {
    "vllm": [
        (("role", "content"), None),
        (("reasoning",), None),
        (("content",), None),
        (("content",), "stop"),  # the finish rides on the last content delta
        "usage",
        "[DONE]",
    ],
    "sglang": [
        (("role", "content"), None),
        (("reasoning_content",), None),
        (("content",), None),
        ((), "stop"),
        "usage",
        "[DONE]",
    ],
    "llama-server": [
        (("role", "content"), None),
        (("reasoning_content",), None),
        (("content",), None),
        ((), "stop"),
        "usage",
        "[DONE]",
    ],
    "openai": [(("role", "content", "refusal"), None), (("content",), None), ((), "stop"), "usage", "[DONE]"],
}


@pytest.mark.parametrize("persona", PERSONAS)
async def test_stream_event_sequence_and_usage_chunk(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    script = SimScript(persona=persona, rules=[RULE], prefix_cache_tokens=0)
    async with SimServer(script) as sim:
        events = await stream(http, sim, stream_options={"include_usage": True})
        _, plain = await post(http, sim)
    assert shape_of(events) == STREAMS[persona]
    usage_chunk = events[-2]
    expected = dict(plain["usage"])
    if persona == "vllm":  # its last chunk drops null fields (exclude_none)
        expected = {k: v for k, v in expected.items() if v is not None}
    assert usage_chunk["usage"] == expected
    deltas = [e["choices"][0]["delta"] for e in events[:-2] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 5."


async def test_stream_details_each_server_adds(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="llama-server", rules=[RULE])) as sim:
        with_usage = await stream(http, sim, stream_options={"include_usage": True})
        without = await stream(http, sim)
    # llama-server: the first delta's content is null, and the last chunk before [DONE] carries the timings.
    assert with_usage[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert "timings" in with_usage[-2] and "timings" not in with_usage[-3]
    assert without[-2]["choices"][0]["finish_reason"] == "stop" and "timings" in without[-2]
    async with SimServer(SimScript(persona="openai", rules=[RULE])) as sim:
        events = await stream(http, sim, stream_options={"include_usage": True})
        bare = await stream(http, sim)
    # OpenAI: every chunk says "usage": null until the last one, and without include_usage none does.
    assert all(e["usage"] is None for e in events[:-2]) and events[-2]["usage"]["total_tokens"] == 20
    assert all("usage" not in e for e in bare[:-1])


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_continuous_usage_stats(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona=persona, rules=[RULE])) as sim:
        events = await stream(http, sim, stream_options={"include_usage": True, "continuous_usage_stats": True})
    running = [e["usage"]["completion_tokens"] for e in events[1:-2] if e["choices"] and "usage" in e]
    # "Add two", " and", " three." then "The answer", " is", " 5.": the completion so far after each delta.
    assert running == [2, 3, 5, 7, 8, 10]


async def test_sglang_counts_continuous_usage_without_include_usage(http: aiohttp.ClientSession) -> None:
    # SGLang's should_include_usage reads each option alone, vLLM's counts continuous_usage_stats only beside
    # include_usage: without it, usage so far on each delta from SGLang and no usage chunk; none at all from vLLM.
    running = {}
    for persona in ("sglang", "vllm"):
        async with SimServer(SimScript(persona=persona, rules=[RULE])) as sim:
            events = await stream(http, sim, stream_options={"continuous_usage_stats": True})
        running[persona] = [e["usage"]["completion_tokens"] for e in events[:-1] if "usage" in e]
        assert all(e["choices"] for e in events[:-1])
    assert running == {"sglang": [2, 3, 5, 7, 8, 10], "vllm": []}


async def test_hidden_reasoning_still_costs_its_tokens(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="openai", reasoning=True)) as sim:
        _, reply = await post(http, sim)
        events = await stream(http, sim)
    assert "reasoning" not in json.dumps(reply["choices"])
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert all("reasoning" not in e["choices"][0]["delta"] for e in events[:-1] if e["choices"])
    assert sim.stats().reasoning_tokens == 2 * reply["usage"]["completion_tokens_details"]["reasoning_tokens"]


@pytest.mark.parametrize("long", [False, True])
async def test_a_think_block_the_template_opened_shows_only_its_closing_tag(
    long: bool, http: aiohttp.ClientSession
) -> None:
    # Without a reasoning parser, a template that opens the think block leaves the closing tag alone in a finished
    # reply, and no tag in a reply cut inside its thinking (thinking-length replies too).
    lengths = LongReplies(
        reasoning_min_tokens=50, reasoning_max_tokens=50, answer_min_tokens=5, answer_max_tokens=5, corpus_tokens=1000
    )
    # A rule's replies would stand in for the thinking-length ones.
    rules = [] if long else [RULE]
    script = SimScript(think_tags=True, think_in_prompt=True, long_replies=lengths if long else None, rules=rules)
    async with SimServer(script) as sim:
        _, finished = await post(http, sim)
        _, cut = await post(http, sim, max_tokens=3)
    content = finished["choices"][0]["message"]["content"]
    assert "<think>" not in content and content.count("</think>") == 1
    assert cut["choices"][0]["finish_reason"] == "length"
    assert "think>" not in cut["choices"][0]["message"]["content"]


@pytest.mark.parametrize("persona", ["vllm", "sglang", "sim"])
async def test_a_reply_cut_inside_its_thinking_has_null_content(
    persona: PersonaName, http: aiohttp.ClientSession
) -> None:
    # vLLM's reasoning parser gives no content for a reply that never closed its thinking, SGLang none for any empty
    # text: "content": null sent whole, and no content delta streamed.
    rule = Rule(replies=["The answer is 5."], reasoning=words(20, "t"))
    async with SimServer(SimScript(persona=persona, reasoning=True, rules=[rule])) as sim:
        _, whole = await post(http, sim, max_tokens=8)
        events = await stream(http, sim, max_tokens=8)
    [choice] = whole["choices"]
    key = {"vllm": "reasoning", "sglang": "reasoning_content", "sim": "reasoning_content"}[persona]
    assert choice["finish_reason"] == "length" and choice["message"][key] == words(8, "t")
    assert choice["message"]["content"] == ("" if persona == "sim" else None)
    deltas = [c["delta"] for e in events if e != "[DONE]" for c in e["choices"]]
    assert [d["content"] for d in deltas if d.get("content")] == []
    assert "".join(d.get(key) or "" for d in deltas) == words(8, "t")


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize(
    "script", [{"persona": "vllm", "reasoning": True}, {"persona": "sglang", "reasoning": True}, {"think_tags": True}]
)
async def test_thinking_turned_off_in_the_template_gives_the_answer_alone(
    script: dict[str, Any], long: bool, http: aiohttp.ClientSession
) -> None:
    # Qwen3's enable_thinking=false: the template closes an empty think block in the prompt, so the reply holds no
    # reasoning (in a field or between tags) and its usage counts none; left on (or unset), the model thinks.
    lengths = LongReplies(
        reasoning_min_tokens=50, reasoning_median_tokens=60, reasoning_max_tokens=80, corpus_tokens=5000
    )
    sim_script = SimScript.model_validate({**script, "long_replies": lengths if long else None})
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    async with SimServer(sim_script) as sim:
        _, thinking = await post(http, sim, role="solution", chat_template_kwargs={"enable_thinking": True})
        _, answering = await post(http, sim, role="solution", **off)
        events = await stream(http, sim, stream_options={"include_usage": True}, **off)
    key = {"vllm": "reasoning"}.get(script.get("persona", ""), "reasoning_content")
    said, plain = thinking["choices"][0]["message"], answering["choices"][0]["message"]
    assert said.get(key) or "</think>" in said["content"]
    assert not plain.get(key) and "think>" not in plain["content"] and plain["content"]
    assert answering["usage"].get("reasoning_tokens", 0) == 0
    assert (answering["usage"].get("completion_tokens_details") or {}).get("reasoning_tokens", 0) == 0
    assert not any(c["delta"].get(key) for e in events if e != "[DONE]" for c in e["choices"])


# ---- n ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("persona", ["sim", "vllm", "sglang", "openai"])
async def test_n_choices_with_usage_summed_over_choices(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    rule = Rule(replies=["One.", "Two two.", "Three three three."], reasoning="Add two and three.")
    async with SimServer(SimScript(persona=persona, rules=[rule])) as sim:
        status, reply = await post(http, sim, n=3)
        stats = sim.stats()
    assert status == 200
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in reply["choices"]] == ["One.", "Two two.", "Three three three."]
    # Completions 2 + 3 + 4 content tokens and 5 reasoning tokens each; the prompt counted once.
    assert reply["usage"]["prompt_tokens"] == 10
    assert reply["usage"]["completion_tokens"] == 2 + 3 + 4 + 3 * 5
    assert (stats.completed, stats.prompt_tokens, stats.completion_tokens) == (1, 10, 24)


async def test_llama_server_n_is_bounded_by_slots_and_reports_the_first_choice(http: aiohttp.ClientSession) -> None:
    rule = Rule(replies=["One.", "Two two."])
    async with SimServer(SimScript(persona="llama-server", slots=2, rules=[rule])) as sim:
        status, reply = await post(http, sim, n=2)
        refused, body = await post(http, sim, n=3)
    assert status == 200 and [c["message"]["content"] for c in reply["choices"]] == ["One.", "Two two."]
    # server-context.cpp merges the child tasks' choices into the first result: its usage is the first choice's.
    assert reply["usage"]["completion_tokens"] == 2 and reply["timings"]["predicted_n"] == 2
    assert refused == 400
    assert body == {
        "error": {
            "code": 400,
            "message": "n_cmpl cannot be greater than the number of slots, please increase -np",
            "type": "invalid_request_error",
        }
    }


async def test_each_choice_sees_its_own_sample_key_deterministically(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="vllm")) as sim:
        _, first = await post(http, sim, role="seed-probe", n=3, seed=7)
        _, again = await post(http, sim, role="seed-probe", n=3, seed=7)
        _, alone = await post(http, sim, role="seed-probe", seed=7)
    texts = [c["message"]["content"] for c in first["choices"]]
    assert len(set(texts)) == 3
    assert texts == [c["message"]["content"] for c in again["choices"]]
    # The first choice is sampled as the request alone would be; the others with seeds derived from its seed.
    assert alone["choices"][0]["message"]["content"] == texts[0]
    assert texts[0].startswith("seed=7 ") and not texts[1].startswith("seed=7 ")


async def test_streamed_choices_are_interleaved_by_index(http: aiohttp.ClientSession) -> None:
    rule = Rule(replies=["alpha beta gamma delta epsilon zeta eta theta", "one two three four five six seven"])
    async with SimServer(SimScript(persona="sglang", rules=[rule])) as sim:
        events = await stream(http, sim, n=2, stream_options={"include_usage": True})
    chunks = [e for e in events[:-1] if e["choices"]]
    indices = [c["choices"][0]["index"] for c in chunks]
    assert indices[:2] == [0, 1]  # each choice's role delta first
    assert indices[2:6] == [0, 1, 0, 1]  # then their pieces, taking turns
    texts = {
        i: "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i)
        for i in (0, 1)
    }
    assert texts == {0: rule.replies[0], 1: rule.replies[1]}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop", "stop"]
    assert events[-2]["usage"]["completion_tokens"] == 8 + 7


TWO_LENGTHS = Rule(replies=["Short one.", "A much longer reply that keeps going for many more words than the first."])


def finishes(events: list[Any]) -> list[tuple[int, int, str]]:
    """(position in the stream, choice index, finish_reason) of each finishing chunk."""
    return [
        (pos, e["choices"][0]["index"], e["choices"][0]["finish_reason"])
        for pos, e in enumerate(events)
        if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
    ]


def last_content(events: list[Any], index: int) -> int:
    return max(
        pos
        for pos, e in enumerate(events)
        if isinstance(e, dict)
        and e.get("choices")
        and e["choices"][0]["index"] == index
        and e["choices"][0]["delta"].get("content")
    )


async def test_when_each_choice_of_a_stream_finishes(http: aiohttp.ClientSession) -> None:
    """vLLM finishes each choice on its own last delta; SGLang sends every finish after all the content."""
    async with SimServer(SimScript(persona="vllm", rules=[TWO_LENGTHS])) as sim:
        events = await stream(http, sim, n=2)
    (short_at, short, _), (long_at, long, _) = finishes(events)
    assert (short, long) == (0, 1)
    assert short_at < last_content(events, 1) and long_at == last_content(events, 1)
    async with SimServer(SimScript(persona="sglang", rules=[TWO_LENGTHS])) as sim:
        events = await stream(http, sim, n=2)
    found = finishes(events)
    assert [i for _, i, _ in found] == [0, 1]
    assert min(pos for pos, _, _ in found) > max(last_content(events, 0), last_content(events, 1))


async def raw_stream(http: aiohttp.ClientSession, sim: SimServer, **body: Any) -> list[Any]:
    """The events of a stream that may end without its end (a cut connection)."""
    payload = {"model": "sim-model", "messages": [{"role": "user", "content": Q}], "stream": True, **body}
    lines: list[bytes] = []
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        try:
            async for raw in resp.content:
                lines.append(raw)
        except aiohttp.ClientPayloadError:
            pass
    data = [line.decode().strip()[len("data: ") :] for line in lines if line.strip()]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def test_a_stream_cut_after_its_first_choice_finished(http: aiohttp.ClientSession) -> None:
    rule = TWO_LENGTHS.model_copy(update={"fault": "cut_after_finish"})
    async with SimServer(SimScript(persona="vllm", rules=[rule])) as sim:
        events = await raw_stream(http, sim, n=2)
        assert sim.stats().faults == {"cut_after_finish": 1}
    assert [(i, reason) for _, i, reason in finishes(events)] == [(0, "stop")]  # choice 1 never finished
    assert events[-1] != "[DONE]"
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"][0]["index"] == 0)
        == (TWO_LENGTHS.replies[0])
    )


@pytest.mark.parametrize(
    ("persona", "event"),
    [
        ("vllm", {"message": "Simulated error (400) mid-generation.", "type": "BadRequestError", "param": None}),
        ("sglang", {"object": "error", "message": "Simulated error (400) mid-generation.", "type": "BAD_REQUEST"}),
    ],
)
async def test_an_error_event_carrying_a_4xx(
    persona: PersonaName, event: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    rule = Rule(fault="stream_error", error_status=400)
    async with SimServer(SimScript(persona=persona, rules=[rule])) as sim:
        events = await stream(http, sim)
        status, body = await post(http, sim)
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {**event, **({"param": None} if persona == "sglang" else {}), "code": 400}}
    assert status == 400  # unstreamed: the status itself, in the server's error body
    assert body == (events[-2]["error"] if persona == "sglang" else events[-2])


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_an_aborted_request_finishes_with_abort(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    rule = Rule(replies=["one two three four five six"], fault="abort")
    async with SimServer(SimScript(persona=persona, rules=[rule])) as sim:
        events = await stream(http, sim)
        status, reply = await post(http, sim)
    assert [reason for _, _, reason in finishes(events)] == ["abort"]
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "abort"
    assert reply["choices"][0]["message"]["content"] == "one two three"


async def test_sglang_seeds_count_only_with_deterministic_inference(http: aiohttp.ClientSession) -> None:
    async def contents(deterministic: bool | None, **body: Any) -> list[str]:
        async with SimServer(SimScript(persona="sglang", deterministic=deterministic)) as sim:
            _, reply = await post(http, sim, role="seed-probe", **body)
        return [c["message"]["content"] for c in reply["choices"]]

    # Deterministic inference: the n choices all sample with the request's seed, so they are one reply n times.
    same = await contents(True, n=3, seed=7)
    assert len(set(same)) == 1 and same[0].startswith("seed=7 ")
    assert await contents(True, n=3, seed=7) == same
    # Without it the seed is ignored: the choices differ, and do not carry the seed asked for.
    ignored = await contents(False, n=3, seed=7)
    assert len(set(ignored)) == 3 and not any(text.startswith("seed=7 ") for text in ignored)
    # Unset: the simulator's own seeding, as before.
    assert (await contents(None, seed=7))[0].startswith("seed=7 ")


# ---- request fields ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("persona", ["vllm", "sglang", "llama-server"])
async def test_unknown_fields_are_ignored_and_counted(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona=persona)) as sim:
        status, _ = await post(http, sim, frobnicate=1, top_k=20, chat_template_kwargs={"enable_thinking": False})
        stats = sim.stats()
    assert status == 200
    assert stats.ignored_fields == {"frobnicate": 1}


async def test_openai_refuses_unknown_fields_and_a_reasoning_models_parameters(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="openai", reasoning=True)) as sim:
        cases = {
            "id_slot": await post(http, sim, id_slot=0),
            "max_tokens": await post(http, sim, max_tokens=64),
            "temperature": await post(http, sim, temperature=0.7),
        }
        ok, _ = await post(http, sim, temperature=1, max_completion_tokens=64, seed=3)
    assert ok == 200
    assert all(status == 400 for status, _ in cases.values())
    assert cases["id_slot"][1]["error"] == {
        "message": "Unrecognized request argument supplied: id_slot",
        "type": "invalid_request_error",
        "param": "id_slot",
        "code": None,
    }
    assert cases["max_tokens"][1]["error"] == {
        "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
        "Use 'max_completion_tokens' instead.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "unsupported_parameter",
    }
    assert cases["temperature"][1]["error"]["code"] == "unsupported_value"
    assert "does not support 0.7 with this model" in cases["temperature"][1]["error"]["message"]
    async with SimServer(SimScript(persona="openai")) as sim:  # a chat model that does not reason takes them
        assert (await post(http, sim, max_tokens=64, temperature=0.7, logprobs=True))[0] == 200


async def test_response_format_types_each_server_takes(http: aiohttp.ClientSession) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with SimServer(SimScript(persona="llama-server")) as sim:
        assert (await post(http, sim, response_format=schema))[0] == 200
        status, body = await post(http, sim, response_format={"type": "structural_tag"})
    assert status == 400 and "structural_tag" in body["error"]["message"]
    async with SimServer(SimScript(persona="vllm")) as sim:
        assert (await post(http, sim, response_format={"type": "structural_tag"}))[0] == 200


async def test_sglang_refuses_a_grammar_as_its_scheduler_aborts_it(http: aiohttp.ClientSession) -> None:
    # The scheduler aborts the request with status 400: a whole reply is an HTTP 400 in SGLang's flat error shape, a
    # streamed one an error event with code 400 on an HTTP 200 stream, then [DONE].
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    said = "Invalid grammar request: req.grammar_key=('json', '{\"type\": \"object\"}')"
    async with SimServer(SimScript(persona="sglang", response_format="reject")) as sim:
        status, body = await post(http, sim, response_format=rf)
        events = await stream(http, sim, response_format=rf)
    assert status == 400 and body == {
        "object": "error",
        "message": said,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert events == [
        {"error": {"object": "error", "message": said, "type": "BAD_REQUEST", "param": None, "code": 400}},
        "[DONE]",
    ]


async def test_llama_server_refuses_a_schema_bound_its_grammar_cannot_repeat(http: aiohttp.ClientSession) -> None:
    def schema(length: int, items: int) -> dict[str, Any]:
        text = {"type": "string", "maxLength": length}
        body = {"type": "object", "properties": {"a": {"type": "array", "items": text, "maxItems": items}}}
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": body}}

    async with SimServer(SimScript(persona="llama-server")) as sim:
        assert (await post(http, sim, response_format=schema(1999, 2000)))[0] == 200
        for refused in (schema(2000, 2), schema(10, 2001)):
            status, body = await post(http, sim, response_format=refused)
            assert status == 400
            assert body["error"]["message"] == "Failed to initialize samplers: failed to parse grammar"
    async with SimServer(SimScript(persona="vllm")) as sim:
        assert (await post(http, sim, response_format=schema(5060, 2001)))[0] == 200


@pytest.mark.parametrize(
    ("persona", "entry_keys"),
    [
        ("sim", {"token", "logprob", "top_logprobs"}),
        ("vllm", {"token", "logprob", "bytes", "top_logprobs"}),
        ("sglang", {"token", "logprob", "bytes", "top_logprobs"}),
        ("llama-server", {"id", "token", "logprob", "bytes", "top_logprobs"}),
        ("openai", {"token", "logprob", "bytes", "top_logprobs"}),
    ],
)
async def test_logprobs_in_each_servers_shape(
    persona: PersonaName, entry_keys: set[str], http: aiohttp.ClientSession
) -> None:
    async with SimServer(SimScript(persona=persona, rules=[RULE])) as sim:
        _, reply = await post(http, sim, logprobs=True, top_logprobs=1)
        events = await stream(http, sim, logprobs=True, top_logprobs=1)
    logprobs = reply["choices"][0]["logprobs"]
    assert set(logprobs) == ({"content", "refusal"} if persona == "openai" else {"content"})
    content = logprobs["content"]
    # vLLM, SGLang and llama-server give them for every generated token, the reasoning's first, though it is in a
    # field of its own.
    thought = "Add two and three." if persona in ("vllm", "sglang", "llama-server") else ""
    assert "".join(e["token"] for e in content) == thought + "The answer is 5."
    assert all(set(e) == entry_keys and len(e["top_logprobs"]) == 1 for e in content)
    # In a stream each delta carries its own tokens' log-probabilities (the reasoning's where they are given).
    streamed = [e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0].get("logprobs")]
    assert all(c["logprobs"]["content"] for c in streamed)
    assert [t["token"] for c in streamed for t in c["logprobs"]["content"]] == [t["token"] for t in content]


@pytest.mark.parametrize(("persona", "answer_only"), [("sim", True), ("openai", True), ("vllm", False)])
async def test_scripted_logprobs_of_reasoning_and_answer_agree_streamed_or_not(
    persona: PersonaName, answer_only: bool, http: aiohttp.ClientSession
) -> None:
    """A rule's payload that covers the reasoning and the answer: a server that gives the answer's log-probabilities
    alone sends the answer's entries, streamed or not; one that gives every generated token's sends them all."""
    scripted = [
        {"token": token, "logprob": -0.5 * i, "top_logprobs": []}
        for i, token in enumerate(["Add", " two", " and", " three", ".", "The", " answer", " is", " 5", "."])
    ]
    rule = Rule(replies=["The answer is 5."], reasoning="Add two and three.", logprobs=scripted)
    async with SimServer(SimScript(persona=persona, rules=[rule])) as sim:
        _, reply = await post(http, sim, logprobs=True)
        events = await stream(http, sim, logprobs=True)
    sent = reply["choices"][0]["logprobs"]["content"]
    assert sent == (scripted[5:] if answer_only else scripted)
    streamed = [e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0].get("logprobs")]
    assert [t for c in streamed for t in c["logprobs"]["content"]] == sent


# ---- waiting for a turn (max_running) ---------------------------------------------------------------------

HOLD = Rule(pattern="hold", latency_s=60.0)  # holds its turn until its client goes away


async def hold_the_only_turn(http: aiohttp.ClientSession, sim: SimServer) -> asyncio.Task[Any]:
    holder = asyncio.create_task(post(http, sim, messages=[{"role": "user", "content": "hold"}]))
    await eventually(lambda: sim.stats().running == 1)
    return holder


async def waiting_stream(http: aiohttp.ClientSession, sim: SimServer, seen: list[tuple[int, int]]) -> list[Any]:
    """A streamed request; ``seen`` gets (waiting, running) as the server counted them when its headers came."""
    payload = {"model": "sim-model", "messages": [{"role": "user", "content": Q}], "stream": True}
    async with http.post(f"{sim.base_url}/chat/completions", json=payload) as resp:
        stats = sim.stats()
        seen.append((stats.waiting, stats.running))
        text = (await resp.read()).decode()
    return [e[len("data: ") :] for e in text.split("\n\n") if e]


@pytest.mark.parametrize(("persona", "waiting_at_headers"), [("vllm", 1), ("sglang", 0), ("llama-server", 0)])
async def test_what_a_waiting_stream_shows(
    persona: PersonaName, waiting_at_headers: int, http: aiohttp.ClientSession
) -> None:
    """vLLM sends its headers at once and nothing more until its first token; SGLang sends nothing at all until
    its first chunk; llama-server sends its headers when a slot takes the request."""
    async with SimServer(SimScript(persona=persona, max_running=1, rules=[HOLD])) as sim:
        holder = await hold_the_only_turn(http, sim)
        seen: list[tuple[int, int]] = []
        streamed = asyncio.create_task(waiting_stream(http, sim, seen))
        await eventually(lambda: sim.stats().waiting == 1)
        if waiting_at_headers:
            await eventually(lambda: bool(seen))
        else:
            await asyncio.sleep(0.2)  # room for headers that should not come
        # Whether the headers came while the request still waited (the holder has run all along).
        assert len(seen) == waiting_at_headers and sim.stats().waiting == 1 and sim.stats().completed == 0
        holder.cancel()
        events = await streamed
        assert events[-1] == "[DONE]" and sim.stats().completed == 1
        assert len(seen) == 1


async def test_vllm_fails_a_stream_whose_headers_went_out_with_an_error_event(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="vllm", max_running=1, rules=[Rule(fault="http_503")])) as sim:
        events = await stream(http, sim)  # 200: the status line went out before the failure
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503


async def test_llama_server_headers_come_with_the_slot_before_any_token(http: aiohttp.ClientSession) -> None:
    slow = Rule(pattern="2\\+3", latency_s=60.0)  # the waiting request's first token is far off
    async with SimServer(SimScript(persona="llama-server", max_running=1, rules=[HOLD, slow])) as sim:
        holder = await hold_the_only_turn(http, sim)
        seen: list[tuple[int, int]] = []
        streamed = asyncio.create_task(waiting_stream(http, sim, seen))
        await eventually(lambda: sim.stats().waiting == 1)
        holder.cancel()
        await eventually(lambda: bool(seen))
        assert seen == [(0, 1)] and sim.stats().completed == 0  # its slot, no token yet
        streamed.cancel()
        await eventually(lambda: sim.stats().running == 0)


def gauges(text: str) -> dict[str, float]:
    """Prometheus samples by metric name (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


async def load_seen(http: aiohttp.ClientSession, sim: SimServer, persona: PersonaName) -> tuple[float, float]:
    """(running, waiting) as the persona's load endpoints report them."""
    async with http.get(f"{sim.url}/metrics") as resp:
        metrics = gauges(await resp.text())
    if persona == "vllm":
        return metrics["vllm:num_requests_running"], metrics["vllm:num_requests_waiting"]
    if persona == "sglang":
        async with http.get(f"{sim.url}/get_load") as resp:
            [load] = await resp.json()
        assert (metrics["sglang:num_running_reqs"], metrics["sglang:num_queue_reqs"]) == (
            load["num_reqs"] - load["num_waiting_reqs"],
            load["num_waiting_reqs"],
        )
        return load["num_reqs"] - load["num_waiting_reqs"], load["num_waiting_reqs"]
    async with http.get(f"{sim.url}/slots") as resp:
        slots = await resp.json()
    busy = sum(slot["is_processing"] for slot in slots)
    assert busy == metrics["llamacpp:requests_processing"]
    return busy, metrics["llamacpp:requests_deferred"]


@pytest.mark.parametrize("persona", ["vllm", "sglang", "llama-server"])
async def test_load_endpoints_count_running_and_waiting(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona=persona, max_running=1, slots=1, rules=[HOLD])) as sim:
        assert await load_seen(http, sim, persona) == (0, 0)
        holder = await hold_the_only_turn(http, sim)
        waiting = asyncio.create_task(post(http, sim))
        await eventually(lambda: sim.stats().waiting == 1)
        assert await load_seen(http, sim, persona) == (1, 1)
        holder.cancel()
        assert (await waiting)[0] == 200
        await eventually(lambda: sim.stats().running == 0)
        assert await load_seen(http, sim, persona) == (0, 0)


# ---- context refusals, token counting, the stated window -------------------------------------------------

# Q is 10 prompt tokens; with a window of 100, max_tokens 90 fits exactly and 95 does not.
VLLM_WORDINGS: dict[str, str] = {
    "output_tokens": (
        "This model's maximum context length is 100 tokens. However, you requested 95 output tokens and your "
        "prompt contains at least 6 input tokens, for a total of at least 101 tokens. Please reduce the length of "
        "the input prompt or the number of requested output tokens. (parameter=input_tokens, value=6)"
    ),
    "passed": (
        "You passed 6 input tokens and requested 95 output tokens. However, the model's context length is only 100 "
        "tokens, resulting in a maximum input length of 5 tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value=6)"
    ),
    "too_large": (
        "'max_tokens' or 'max_completion_tokens' is too large: 95. This model's maximum context length is 100 "
        "tokens and your request has 10 input tokens (95 > 100 - 10)."
    ),
    "legacy": (
        "This model's maximum context length is 100 tokens. However, you requested 105 tokens (10 in the messages, "
        "95 in the completion). Please reduce the length of the messages or completion."
    ),
}


@pytest.mark.parametrize("wording", ["persona", *VLLM_WORDINGS, "generic"])
async def test_vllm_context_refusal_in_each_wording(wording: str, http: aiohttp.ClientSession) -> None:
    script = SimScript.model_validate({"persona": "vllm", "context_length": 100, "context_wording": wording})
    async with SimServer(script) as sim:
        assert (await post(http, sim, max_tokens=90))[0] == 200
        status, body = await post(http, sim, max_tokens=95)
    assert status == 400
    error = body["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    if wording == "generic":
        assert "context window" in error["message"] and not any(ch.isdigit() for ch in error["message"])
        return
    assert error["message"] == VLLM_WORDINGS["output_tokens" if wording == "persona" else wording]
    assert error["param"] == ("input_tokens" if wording in ("persona", "output_tokens", "passed") else None)


@pytest.mark.parametrize("wording", ["persona", "output_tokens", "passed"])
async def test_vllm_renderer_refuses_a_budget_over_the_whole_window(wording: str, http: aiohttp.ClientSession) -> None:
    # Both renderer releases check the budget against the whole window before the prompt, in the same words.
    script = SimScript.model_validate({"persona": "vllm", "context_length": 100, "context_wording": wording})
    async with SimServer(script) as sim:
        status, body = await post(http, sim, max_completion_tokens=150)
    assert status == 400
    assert body["error"]["message"] == (
        "max_completion_tokens=150 cannot be greater than max_model_len=max_total_tokens=100. Please request fewer"
        " output tokens. (parameter=max_completion_tokens, value=150)"
    )
    assert body["error"]["param"] == "max_completion_tokens"


async def test_sglang_context_refusals_count_a_full_window_as_too_long(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="sglang", context_length=100)) as sim:
        assert (await post(http, sim, max_tokens=89))[0] == 200
        status, body = await post(http, sim, max_tokens=90)  # 100 tokens: refused, the limit is exclusive
        assert status == 400
        assert body == {
            "object": "error",
            "message": (
                "Requested token count exceeds the model's maximum context length of 100 tokens. You requested a "
                "total of 100 tokens: 10 tokens from the input messages and 90 tokens for the completion. Please "
                "reduce the number of tokens in the input messages or the completion to fit within the limit."
            ),
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    async with SimServer(SimScript(persona="sglang", context_length=10)) as sim:
        status, body = await post(http, sim)
    assert status == 400
    assert body["message"] == "The input (10 tokens) is longer than the model's context length (10 tokens)."


async def test_sglang_under_a_small_kv_pool_refuses_a_prompt_its_window_holds(http: aiohttp.ClientSession) -> None:
    # A 16-token pool under a 32768-token window: the bound is 15, a prompt of 10 tokens (15 - 5) or more is refused by
    # the scheduler, in its own words, although the model card states the window.
    async with SimServer(SimScript(persona="sglang", kv_pool_tokens=16)) as sim:
        status, body = await post(http, sim, max_tokens=5)
        events = await stream(http, sim, max_tokens=5)
        async with http.get(f"{sim.base_url}/models") as resp:
            card = (await resp.json())["data"][0]
    message = (
        "Input length (10 tokens) exceeds the maximum allowed length (10 tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )
    assert status == 400
    assert body == {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
    # Streamed: an HTTP 200 stream whose first event is the abort, with the status as its code.
    error = {"object": "error", "message": message, "type": "BAD_REQUEST", "param": None, "code": 400}
    assert events == [{"error": error}, "[DONE]"]
    assert card["max_model_len"] == 32768
    # A 17-token pool takes the prompt, and cuts its reply where prompt and reply reach 15 tokens (the bound, 16, less
    # one), whatever max_tokens asked.
    rule = Rule(replies=["The answer is five and not six."])
    async with SimServer(SimScript(persona="sglang", kv_pool_tokens=17, rules=[rule])) as sim:
        status, reply = await post(http, sim, max_tokens=100)
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"]["content"] == "The answer is five and"
    assert reply["usage"]["completion_tokens"] == 5


async def test_llama_server_refuses_only_a_prompt_that_fills_the_slot(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="llama-server", context_length=10)) as sim:
        status, body = await post(http, sim, max_tokens=5)
    assert status == 400
    assert body == {
        "error": {
            "code": 400,
            "message": "request (10 tokens) exceeds the available context size (10 tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 10,
            "n_ctx": 10,
        }
    }
    # A prompt that fits is generated until the context is full, whatever max_tokens asked.
    rule = Rule(replies=["The answer is 5."])
    async with SimServer(SimScript(persona="llama-server", context_length=13, rules=[rule])) as sim:
        status, reply = await post(http, sim, max_tokens=100)
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"]["content"] == "The answer is"
    assert reply["usage"]["completion_tokens"] == 3


async def test_openai_names_the_context_length_exceeded(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="openai", context_length=100)) as sim:
        status, body = await post(http, sim, max_tokens=95)
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert "However, you requested 105 tokens (10 in the messages, 95 in the completion)" in body["error"]["message"]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}]


async def test_vllm_tokenize_counts_what_the_context_check_counts(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="vllm", context_length=100)) as sim:
        async with http.post(f"{sim.url}/tokenize", json={"model": "sim-model", "messages": CHAT}) as resp:
            counted = await resp.json()
        async with http.post(f"{sim.url}/tokenize", json={"model": "sim-model", "prompt": Q}) as resp:
            assert (await resp.json())["count"] == 6  # a bare prompt: no template
        _, reply = await post(http, sim, messages=CHAT)
        n = counted["count"]
        assert n == reply["usage"]["prompt_tokens"] == len(counted["tokens"])
        assert counted["max_model_len"] == 100
        assert (await post(http, sim, messages=CHAT, max_tokens=100 - n))[0] == 200
        assert (await post(http, sim, messages=CHAT, max_tokens=101 - n))[0] == 400
        async with http.get(f"{sim.url}/props") as resp:
            assert resp.status == 404  # llama-server's


async def test_sglang_tokenize_and_server_info(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="sglang", context_length=4096, max_running=8)) as sim:
        async with http.post(f"{sim.base_url}/tokenize", json={"prompt": Q}) as resp:
            counted = await resp.json()
        assert (counted["count"], len(counted["tokens"]), counted["max_model_len"]) == (6, 6, 4096)
        async with http.post(f"{sim.url}/tokenize", json={"messages": CHAT}) as resp:
            assert resp.status == 400  # prompts only
        async with http.get(f"{sim.url}/get_server_info") as resp:
            info = await resp.json()
        assert (info["context_length"], info["max_running_requests"]) == (4096, 8)
        async with http.get(f"{sim.url}/get_model_info") as resp:
            assert (await resp.json())["model_path"] == "sim-model"


async def test_llama_server_template_tokenize_and_props(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="llama-server", context_length=2048, slots=3)) as sim:
        async with http.post(f"{sim.url}/apply-template", json={"messages": CHAT}) as resp:
            prompt = (await resp.json())["prompt"]
        async with http.post(f"{sim.url}/tokenize", json={"content": prompt, "with_pieces": True}) as resp:
            tokens = (await resp.json())["tokens"]
        _, reply = await post(http, sim, messages=CHAT)
        assert len(tokens) == reply["usage"]["prompt_tokens"]
        assert "".join(t["piece"] for t in tokens) == "".join(prompt.split())
        async with http.get(f"{sim.url}/props") as resp:
            props = await resp.json()
        assert (props["default_generation_settings"]["n_ctx"], props["total_slots"]) == (2048, 3)


# ---- the API key and a replica still loading --------------------------------------------------------------

UNAUTHORIZED: dict[str, tuple[dict[str, Any], list[str]]] = {
    # persona: (the 401 body, open paths besides /health)
    "vllm": ({"error": "Unauthorized"}, ["/tokenize"]),
    "sglang": ({"error": "Unauthorized"}, []),
    "llama-server": (
        {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}},
        ["/v1/models"],
    ),
}


@pytest.mark.parametrize("persona", list(UNAUTHORIZED))
async def test_api_key_guards_the_routes_its_server_guards(persona: PersonaName, http: aiohttp.ClientSession) -> None:
    body, open_paths = UNAUTHORIZED[persona]
    payload = {"model": "sim-model", "messages": [{"role": "user", "content": Q}]}
    async with SimServer(SimScript(persona=persona, api_key="k-1")) as sim:
        url = f"{sim.base_url}/chat/completions"
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k-1"}):
            async with http.post(url, json=payload, headers=headers) as resp:
                assert (resp.status, await resp.json()) == (401, body)
        async with http.post(url, json=payload, headers={"Authorization": "Bearer k-1"}) as resp:
            assert resp.status == 200
        async with http.get(f"{sim.url}/health") as resp:
            assert resp.status == 200
        for path in open_paths:
            method = http.post if path == "/tokenize" else http.get
            async with method(f"{sim.url}{path}", json={"prompt": Q}) as resp:
                assert resp.status == 200, path
        stats = sim.stats()
        assert (stats.unauthorized, stats.completed) == (3, 1)
        assert [r.authorization for r in sim.requests] == ["Bearer k-1"]  # refused calls never reached the model


async def test_models_answer_503_while_the_replica_loads(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="vllm", models_unavailable=2)) as sim:
        statuses = []
        for _ in range(3):
            async with http.get(f"{sim.base_url}/models") as resp:
                statuses.append(resp.status)
                body = await resp.json()
        assert statuses == [503, 503, 200]
        assert body["data"][0]["max_model_len"] == 32768
        assert sim.stats().models_unavailable == 2


async def test_llama_server_lists_its_model_without_meta_while_it_loads(http: aiohttp.ClientSession) -> None:
    # server-http.cpp middleware_server_state lets the model list through while the model loads (every other route
    # answers 503 "Loading model"); server-context.cpp get_models leaves the card's meta null until it is loaded.
    async with SimServer(SimScript(persona="llama-server", models_unavailable=1)) as sim:
        async with http.get(f"{sim.url}/health") as resp:
            health = (resp.status, await resp.json())
        async with http.get(f"{sim.base_url}/models") as resp:
            loading = (resp.status, await resp.json())
        async with http.get(f"{sim.base_url}/models") as resp:
            loaded = (resp.status, await resp.json())
    assert loading[0] == 200 and loading[1]["data"][0]["owned_by"] == "llamacpp"
    assert loading[1]["data"][0]["meta"] is None
    assert health == (503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
    assert loaded[0] == 200 and loaded[1]["data"][0]["meta"]["n_ctx"] == 32768


# ---- sampling fields --------------------------------------------------------------------------------------

SAMPLING = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "presence_penalty": 0.5, "frequency_penalty": 0.1}


@pytest.mark.parametrize(
    ("persona", "ignored"),
    [("vllm", {}), ("sglang", {}), ("llama-server", {"repetition_penalty": 1})],
)
async def test_sampling_fields_reach_the_server_and_which_it_reads(
    persona: PersonaName, ignored: dict[str, int], http: aiohttp.ClientSession
) -> None:
    """vLLM and SGLang read all five at the top level of a chat request; llama-server reads top_k, min_p and the
    two OpenAI penalties, and its own repeat_penalty, but not repetition_penalty."""
    async with SimServer(SimScript(persona=persona)) as sim:
        status, _ = await post(http, sim, **SAMPLING, repeat_penalty=1.1)
        assert status == 200
        [body] = sim.chat_bodies()
        assert {k: body[k] for k in SAMPLING} == SAMPLING
        expected = {**ignored, **({} if persona == "llama-server" else {"repeat_penalty": 1})}
        assert sim.stats().ignored_fields == expected


async def test_openai_refuses_the_sampling_fields_it_does_not_have(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="openai")) as sim:
        assert (await post(http, sim, presence_penalty=0.5, frequency_penalty=0.1))[0] == 200
        status, body = await post(http, sim, top_k=20)
    assert status == 400
    assert body["error"]["message"] == "Unrecognized request argument supplied: top_k"
    assert body["error"]["param"] == "top_k"


# ---- /v1/models -------------------------------------------------------------------------------------------


async def test_models_say_which_server_this_is(http: aiohttp.ClientSession) -> None:
    cards = {}
    for persona in PERSONAS:
        script = SimScript(persona=persona, model="m-1", context_length=4096)
        async with SimServer(script) as sim, http.get(f"{sim.base_url}/models") as resp:
            cards[persona] = await resp.json()
    owners = {p: body["data"][0]["owned_by"] for p, body in cards.items()}
    assert owners == {"vllm": "vllm", "sglang": "sglang", "llama-server": "llamacpp", "openai": "system"}
    assert cards["vllm"]["data"][0]["max_model_len"] == cards["sglang"]["data"][0]["max_model_len"] == 4096
    assert cards["llama-server"]["data"][0]["meta"]["n_ctx"] == 4096
    assert cards["llama-server"]["models"][0]["name"] == "m-1"
    assert set(cards["openai"]["data"][0]) == {"id", "object", "created", "owned_by"}


# ---- the prefix cache -------------------------------------------------------------------------------------


async def ask(http: aiohttp.ClientSession, sim: SimServer, text: str, **body: Any) -> dict[str, Any]:
    status, reply = await post(http, sim, messages=[{"role": "user", "content": text}], **body)
    assert status == 200, reply
    return reply


async def test_vllm_reports_whole_cached_blocks_only_with_its_flag(http: aiohttp.ClientSession) -> None:
    prompt = words(39)  # 40 emulated tokens with the role marker
    async with SimServer(SimScript(persona="vllm", cache_report=True)) as sim:
        first = await ask(http, sim, prompt)
        second = await ask(http, sim, prompt)
        stats = sim.stats()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # 40 tokens, the last always computed again: 39 usable, two whole 16-token blocks = 32.
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert stats.cached_prompt_tokens == 32 and stats.prompt_tokens == 2 * (39 + 4)
    async with SimServer(SimScript(persona="vllm")) as sim:
        await ask(http, sim, prompt)
        quiet = await ask(http, sim, prompt)
        stats = sim.stats()
    assert quiet["usage"]["prompt_tokens_details"] is None  # the flag is off: nothing said, though 32 were cached
    assert stats.cached_prompt_tokens == 32


async def test_sglang_caches_token_by_token_and_reports_only_hits(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="sglang", cache_report=True)) as sim:
        first = await ask(http, sim, words(39))
        second = await ask(http, sim, words(39))
        # A prompt sharing 25 of its leading tokens (marker + 24 words) with the cached one.
        third = await ask(http, sim, words(24) + " " + words(10, "x"))
    assert first["usage"]["prompt_tokens_details"] is None  # nothing cached: null, not zero
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 39}
    assert third["usage"]["prompt_tokens_details"] == {"cached_tokens": 25}


async def test_llama_server_slots_keep_one_prompt_each(http: aiohttp.ClientSession) -> None:
    p, q = words(20, "p"), words(20, "q")  # 21 emulated tokens each, sharing only the role marker
    async with SimServer(SimScript(persona="llama-server", slots=2)) as sim:
        await ask(http, sim, p)  # slot 0 (least recently used)
        await ask(http, sim, q)  # slot 1: 1 of q's 21 tokens in common with slot 0 is under the 0.1 similarity
        again = await ask(http, sim, p)  # back to slot 0 by similarity: 20 of 21 reused (the last is computed)
        pinned = await ask(http, sim, p, id_slot=1)  # slot 1 holds q: only the role marker to reuse
        bad, body = await post(http, sim, id_slot=2)
    assert again["timings"]["cache_n"] == 20 and again["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
    assert again["timings"]["prompt_n"] == 24 - 20
    assert pinned["timings"]["cache_n"] == 1
    assert bad == 400 and body["error"]["message"] == "Invalid slot ID"


async def test_openai_caches_only_long_prompts_in_steps_of_128(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript(persona="openai")) as sim:
        await ask(http, sim, words(1099))
        long = await ask(http, sim, words(1099))  # 1100 emulated tokens: 1099 usable, 8 blocks of 128
        await ask(http, sim, words(600, "s"))
        short = await ask(http, sim, words(600, "s"))  # 512 cached is under the 1024 minimum
    assert long["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024
    assert short["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_the_cache_evicts_least_recently_used_blocks_tails_first(http: aiohttp.ClientSession) -> None:
    a, b = words(39, "a"), words(39, "b")  # two whole 16-token blocks each
    async with SimServer(SimScript(persona="vllm", cache_report=True, prefix_cache_tokens=48)) as sim:
        await ask(http, sim, a)
        await ask(http, sim, b)  # three blocks fit: a's tail block goes, its first block stays
        reply = await ask(http, sim, a)
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    async with SimServer(SimScript(persona="vllm", cache_report=True, prefix_cache_tokens=32)) as sim:
        await ask(http, sim, a)
        await ask(http, sim, b)  # two blocks fit: all of a goes
        reply = await ask(http, sim, a)
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_n_serves_the_prompt_once_and_reset_empties_the_cache(http: aiohttp.ClientSession) -> None:
    prompt = words(39)
    async with SimServer(SimScript(persona="vllm", cache_report=True)) as sim:
        await ask(http, sim, prompt, n=4)
        reply = await ask(http, sim, prompt, n=4)
        assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert sim.stats().cached_prompt_tokens == 32
        sim.reset()
        fresh = await ask(http, sim, prompt)
    assert fresh["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_sim_persona_has_no_cache_unless_asked(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimScript()) as sim:
        await ask(http, sim, words(39))
        plain = await ask(http, sim, words(39))
        sim.set_script(SimScript(prefix_cache_tokens=1024))
        await ask(http, sim, words(39))
        cached = await ask(http, sim, words(39))
    assert "prompt_tokens_details" not in plain["usage"]
    assert cached["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def test_a_cache_smaller_than_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="less than one openai cache block"):
        SimServer(SimScript(persona="openai", prefix_cache_tokens=100))


def test_command_line_persona_and_its_cache_checked_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"prefix_cache_tokens": 100}))
    assert main(["--port", "0", "--script", str(script), "--persona", "openai"]) == 2
    assert "less than one openai cache block (128 tokens)" in capsys.readouterr().err


def test_prefix_and_slot_caches_by_hand() -> None:
    a = prompt_tokens([("system", words(15)), ("user", words(16))])  # 33 tokens
    cache = PrefixCache(capacity_tokens=64, block_tokens=16)
    assert cache.serve(a) == 0 and len(cache) == 2
    assert cache.lookup(a) == 32 and cache.serve(a) == 32
    # The same system message, another question: the first block (marker + 15 words) is shared.
    b = prompt_tokens([("system", words(15)), ("user", words(16, "z"))])
    assert cache.serve(b) == 16
    per_token = PrefixCache(capacity_tokens=100, block_tokens=1)
    per_token.serve(a)
    assert per_token.serve(b) == 17  # marker, 15 words and the user marker
    slots = SlotCache(slots=2)
    assert slots.serve(a) == (0, 0)
    assert slots.serve(b) == (0, 17)  # similar enough (17/33 > 0.1): the same slot, its common prefix reused
    assert slots.serve(a, slot=1) == (1, 0)


# ---- TMAS, majority vote and MATTRL through the client ----------------------------------------------------

# Registered methods whose calls repeat prompt prefixes, with parameters that make them repeat.
PERSONA_RUNS = {
    "tmas": {"n": 2, "m": 1, "iterations": 2},
    # Two rounds: on vLLM and SGLang a round's 3 samples go as one request (one prefill, nothing cached), the second
    # round's finds the first's prompt in the cache.
    "majority": {"k": 3, "iterations": 2},
    "mattrl": {},
}


@pytest.mark.parametrize("method", list(PERSONA_RUNS))
@pytest.mark.parametrize("persona", PERSONAS)
async def test_methods_run_against_every_persona(persona: PersonaName, method: str, tmp_path: Path) -> None:
    assert method in METHODS, f"{method} is not a registered method"
    # A thinking model behind each server with the switch a user sets to see cached tokens; behind OpenAI a chat model
    # (a reasoning one refuses what tmas sends: see the next test).
    reasoning = persona != "openai"
    script = SimScript(persona=persona, reasoning=reasoning, cache_report=True)
    async with SimServer(script) as sim:
        settings = settings_for(sim, method={"name": method, "params": PERSONA_RUNS[method]})
        result = await asolve("What is 17*23?", settings, run_dir=tmp_path / "run")
        stats = sim.stats()
    assert result.status == "done" and result.answer == "391"
    assert stats.errors == 0 and stats.completed > 0
    usage = result.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (stats.prompt_tokens, stats.completion_tokens)
    assert (stats.reasoning_tokens > 0) == reasoning
    # llama-server counts no reasoning tokens in its usage: the client counts them from the reasoning text (estimated,
    # with no tokenizer configured), and says so.
    if persona == "llama-server":
        assert usage.reasoning_tokens > 0 and usage.estimated
    else:
        assert usage.reasoning_tokens == stats.reasoning_tokens
    if persona == "openai":
        assert usage.cached_prompt_tokens == stats.cached_prompt_tokens == 0  # every prompt is under 1024 tokens
    else:
        assert usage.cached_prompt_tokens == stats.cached_prompt_tokens > 0


async def test_majority_vote_against_an_openai_reasoning_model(tmp_path: Path) -> None:
    # OpenAI's reasoning models refuse max_tokens (for max_completion_tokens) and any temperature but 1: the client
    # sends each refused call again at once as the server asked, keeps doing so, and records it once.
    async with SimServer(SimScript(persona="openai", reasoning=True)) as sim:
        settings = settings_for(sim, method={"name": "majority", "params": {"k": 3}})
        result = await asolve("What is 17*23?", settings, run_dir=tmp_path / "run")
        bodies = sim.chat_bodies("solution")
        stats = sim.stats()
    with RunStore(tmp_path / "run") as store:
        recorded = store.downgrades("sampling")
    assert result.status == "done" and result.answer == "391"
    # Each sample was refused once or twice (the three go out together), then accepted as the server asked.
    accepted = [b for b in bodies if "max_tokens" not in b and "temperature" not in b]
    assert stats.completed == len(accepted) == 3 and 2 <= stats.errors <= 6
    assert all(b["max_completion_tokens"] == bodies[0]["max_tokens"] for b in accepted)
    [(url, models)] = recorded.items()
    assert url == sim.base_url and "max_completion_tokens" in models["sim-model"]["message"]
    assert result.status == "done" and result.answer == "391"


async def test_a_field_one_model_refuses_is_still_sent_to_another_model_at_the_same_url(tmp_path: Path) -> None:
    # A hosted API serves a reasoning model (the solver: it refuses temperature) and a chat model (the refiner: it
    # takes it) at one URL; what the first refused is learnt for it alone.
    script = SimScript(persona="openai", reasoning=True, model="o3-mini", also_serves=["gpt-4.1"])
    async with SimServer(script) as sim:
        roles = {"refiner": {"model": "gpt-4.1", "sampling": {"temperature": 0.2}}}
        method = {"name": "self_refine", "params": {"n": 1, "iterations": 2}}
        settings = settings_for(
            sim, endpoint={"model": "o3-mini", "base_url": [sim.base_url]}, roles=roles, method=method
        )
        result = await asolve("What is 17*23?", settings, run_dir=tmp_path / "run")
        solver, refiner = sim.chat_bodies("solution"), sim.chat_bodies("refiner")
    assert result.status == "done"
    assert refiner and all(b["model"] == "gpt-4.1" and b["temperature"] == 0.2 for b in refiner)
    assert all("max_completion_tokens" not in b for b in refiner)
    # The solver's were refused until sent without what its model refuses.
    assert solver[-1]["model"] == "o3-mini" and "temperature" not in solver[-1] and "max_tokens" not in solver[-1]


async def test_without_the_cache_flag_the_client_sees_no_cached_tokens(tmp_path: Path) -> None:
    async with SimServer(SimScript(persona="vllm", reasoning=True)) as sim:
        settings = settings_for(sim, method={"name": "majority", "params": PERSONA_RUNS["majority"]})
        result = await asolve("What is 17*23?", settings, run_dir=tmp_path / "run")
        stats = sim.stats()
    assert result.answer == "391"
    assert result.usage.cached_prompt_tokens == 0 < stats.cached_prompt_tokens


async def test_sglangs_full_queue_opens_the_stream_with_its_503_abort(http: aiohttp.ClientSession) -> None:
    # serving_chat.py sends an abort carrying an HTTP status as the stream's first event, before the role chunk, then
    # [DONE]; sent whole, the same abort is an HTTP 503 (http_server.py's HTTPException handler: the status as type).
    async with SimServer(SimScript(persona="sglang", max_running=1, max_queued=0, latency_s=60)) as sim:
        holder = asyncio.ensure_future(post(http, sim))
        await eventually(lambda: sim.stats().running == 1)
        events = await stream(http, sim)
        status, body = await post(http, sim)
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
    error = {"object": "error", "message": "The request queue is full.", "param": None, "code": 503}
    assert events == [{"error": {**error, "type": "SERVICE_UNAVAILABLE"}}, "[DONE]"]
    assert status == 503 and body == {**error, "type": "503"}
