"""The stream assembler on its own: server-sent event lines in, the reply an unstreamed call would have had out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tmas.llm.stream import StreamAssembler, StreamError, lines


def data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n"


def chunk(index: int = 0, finish: str | None = None, logprobs: list[Any] | None = None, **delta: Any) -> str:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return data({"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


def fed(*stream: str) -> StreamAssembler:
    assembler = StreamAssembler()
    for line in stream:
        assembler.feed(line)
    return assembler


USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def test_content_reasoning_and_usage_from_the_last_chunk() -> None:
    assembler = fed(
        chunk(role="assistant", content=""),
        "\n",
        ": keep-alive comment\n",
        chunk(reasoning_content="Think "),
        "\r\n",
        chunk(reasoning_content="hard."),
        chunk(content="The answer "),
        'data:{"choices": [{"index": 0, "delta": {"content": "is 4."}, "finish_reason": null}]}\r\n',
        chunk(finish="stop"),
        data({"id": "c1", "choices": [], "usage": USAGE}),
        "data: [DONE]\n",
    )
    assert assembler.done and assembler.complete
    assert assembler.reply() == {
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Think hard."},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": USAGE,
    }


def test_reasoning_under_either_name_is_taken_once() -> None:
    # vLLM's `reasoning`; a server that sends both names with the same text counts it once.
    reply = fed(
        chunk(reasoning="a "),
        chunk(reasoning="b ", reasoning_content="b "),
        chunk(content="x", finish="stop"),
    ).reply()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "x", "reasoning_content": "a b "}
    assert "reasoning_content" not in fed(chunk(content="x", finish="stop")).reply()["choices"][0]["message"]


def test_several_choices_are_assembled_by_index() -> None:
    assembler = fed(
        chunk(1, role="assistant"),
        chunk(0, role="assistant"),
        chunk(1, content="one "),
        chunk(0, content="zero "),
        chunk(0, content="again", finish="length"),
        chunk(1, content="more"),
    )
    assert not assembler.complete
    with pytest.raises(StreamError, match="choice 1 finished") as cut:
        assembler.reply()
    assert cut.value.cause == "cut"
    assembler.feed(chunk(1, finish="stop"))
    choices = assembler.reply()["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == [
        (0, "zero again", "length"),
        (1, "one more", "stop"),
    ]


def test_logprobs_deltas_are_concatenated() -> None:
    first = [{"token": "The", "logprob": -0.1, "top_logprobs": []}]
    second = [{"token": " end", "logprob": -0.2, "top_logprobs": []}, {"token": ".", "logprob": 0.0}]
    reply = fed(
        chunk(content="The", logprobs=first),
        chunk(content=" end.", logprobs=second),
        chunk(finish="stop"),
    ).reply()
    assert reply["choices"][0]["logprobs"] == {"content": first + second}


def test_a_reply_its_reader_stops_is_what_arrived_with_the_stops_finish_reason() -> None:
    first = [{"token": "Maybe", "logprob": -1.5, "top_logprobs": []}]
    assembler = fed(chunk(role="assistant", content=""), chunk(content="Maybe", logprobs=first))
    assert assembler.logprobs() == first and assembler.logprobs(1) == []
    with pytest.raises(StreamError):
        assembler.reply()  # unfinished: cut, unless its reader stops it on purpose
    assembler.stop("confidence_stop")
    choice = assembler.reply()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Maybe", "confidence_stop")
    assert choice["logprobs"] == {"content": first}
    # A choice that had finished keeps its own finish_reason.
    done = fed(chunk(content="all", finish="stop"))
    done.stop("confidence_stop")
    assert done.reply()["choices"][0]["finish_reason"] == "stop"


def test_usage_on_the_last_choice_chunk_and_llama_server_timings() -> None:
    timings = {"cache_n": 8, "prompt_n": 4}
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": USAGE, "timings": timings}
    reply = fed('data: {"usage": null, "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n', data(last)).reply()
    assert reply["usage"] == USAGE and reply["timings"] == timings
    assert "usage" not in fed(chunk(content="hi", finish="stop")).reply()


def test_a_finished_reply_without_done_is_whole() -> None:
    # Every choice has its finish_reason: the text is all there, whether or not [DONE] followed.
    assembler = fed(chunk(content="all of it"), chunk(finish="stop"), data({"choices": [], "usage": USAGE}))
    assert not assembler.done and assembler.complete
    assert assembler.reply()["choices"][0]["message"]["content"] == "all of it"


@pytest.mark.parametrize(
    "stream",
    [
        [],
        [chunk(role="assistant"), chunk(content="half a rep")],
        [chunk(content="no finish"), "data: [DONE]\n"],
    ],
)
def test_a_stream_that_ends_before_its_end_is_cut(stream: list[str]) -> None:
    assembler = fed(*stream)
    assert not assembler.complete
    with pytest.raises(StreamError) as failure:
        assembler.reply()
    assert failure.value.cause == "cut"


def test_an_error_event_fails_with_the_servers_message() -> None:
    # vLLM's and SGLang's shape for an internal error met mid-generation.
    error = {"error": {"message": "engine hiccup", "type": "InternalServerError", "param": None, "code": 500}}
    assembler = fed(chunk(content="partial"))
    with pytest.raises(StreamError, match="engine hiccup") as failure:
        assembler.feed(data(error))
    assert failure.value.cause == "stream_error"


@pytest.mark.parametrize(
    "line",
    [
        'data: {"choices": [{"index": 0, "delta": {"content": "x"}\n',
        "data: [1, 2]\n",
        'data: {"choices": {"index": 0}}\n',
        'data: {"choices": [{"index": "0", "delta": {}}]}\n',
        'data: {"choices": [{"index": 0, "delta": {"content": 7}}]}\n',
    ],
)
def test_an_event_that_is_not_a_chunk_is_malformed(line: str) -> None:
    with pytest.raises(StreamError) as failure:
        fed(line)
    assert failure.value.cause == "malformed"


async def test_lines_are_whole_however_the_bytes_arrive() -> None:
    text = 'data: {"content": "café ∑"}\n\ndata: [DONE]\nlast'.encode()

    async def pieces(size: int) -> AsyncIterator[bytes]:
        for start in range(0, len(text), size):
            yield text[start : start + size]

    for size in (1, 2, 5, len(text)):
        assert [line async for line in lines(pieces(size))] == [
            'data: {"content": "café ∑"}',
            "",
            "data: [DONE]",
            "last",
        ]
