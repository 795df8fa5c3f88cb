"""Failure classification without HTTP: each server's refusal bodies, stream error events and exceptions, as the
personas send them, become the cause and retry decision the client acts on; and the retry policy's decisions."""

from __future__ import annotations

import json
import random

import aiohttp
import pytest

from tmas.config import Retry
from tmas.llm import failures
from tmas.llm.failures import ContextRefusal, Failure
from tmas.llm.retry import RetryPolicy


def _vllm(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})


def _sglang(message: str) -> str:
    return json.dumps({"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400})


CONTEXT_BODIES = {
    "vllm, today": _vllm(
        "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's maximum context length is 1500 "
        "tokens and your request has 620 input tokens (4000 > 1500 - 620). None"
    ),
    "vllm, output tokens": _vllm(
        "This model's maximum context length is 1500 tokens. However, you requested 4000 output tokens and your "
        "prompt contains at least 621 input tokens, for a total of at least 4621 tokens. Please reduce the length of "
        "the input prompt or the number of requested output tokens."
    ),
    "vllm, passed": _vllm(
        "You passed 620 input tokens and requested 4000 output tokens. However, the model's context length is only "
        "1500 tokens, resulting in a maximum input length of -2500 tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=620)"
    ),
    "vllm, legacy": _vllm(
        "This model's maximum context length is 1500 tokens. However, you requested 4620 tokens (620 in the "
        "messages, 4000 in the completion). Please reduce the length of the messages or completion."
    ),
    "sglang": _sglang(
        "Requested token count exceeds the model's maximum context length of 1500 tokens. You requested a total of "
        "4620 tokens: 620 tokens from the input messages and 4000 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit."
    ),
}


@pytest.mark.parametrize("server", sorted(CONTEXT_BODIES))
def test_every_context_wording_gives_the_window_and_the_prompt(server: str) -> None:
    failure = failures.from_status(400, CONTEXT_BODIES[server], {"max_tokens": 4000})
    assert failure.cause == "context" and not failure.retry
    assert failure.context is not None
    assert failure.context.context == 1500
    # vLLM's "at least N" and "You passed N" are a bound (the prompt tokenized only so far): the client counts it.
    if server in ("vllm, output tokens", "vllm, passed"):
        assert failure.context.prompt is None and failure.context.prompt_at_least in (620, 621)
    else:
        assert failure.context.prompt == 620


def test_llama_server_states_its_numbers_as_fields() -> None:
    body = json.dumps(
        {
            "error": {
                "code": 400,
                "message": "request (2710 tokens) exceeds the available context size (512 tokens), try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 2710,
                "n_ctx": 512,
            }
        }
    )
    failure = failures.from_status(400, body, {})
    assert failure.cause == "context"
    assert failure.context == ContextRefusal(context=512, prompt=2710)
    sglang = failures.from_status(
        400, _sglang("The input (2710 tokens) is longer than the model's context length (512 tokens)."), {}
    )
    assert sglang.context == ContextRefusal(context=512, prompt=2710)


def test_sglang_s_scheduler_states_the_prompt_and_its_bound() -> None:
    # A prompt the window holds but the KV cache pool does not: a 400 sent whole, an error event on a stream.
    message = (
        "Input length (370 tokens) exceeds the maximum allowed length (294 tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )
    whole = failures.from_status(400, _sglang(message), {"max_tokens": 100})
    event = {"object": "error", "message": message, "type": "BAD_REQUEST", "param": None, "code": 400}
    streamed = failures.from_stream_event(event, body={"max_tokens": 100, "stream": True})
    for failure in (whole, streamed):
        assert failure.cause == "context" and not failure.retry
        assert failure.context == ContextRefusal(context=294, prompt=370)


def test_the_two_wordings_once_unread() -> None:
    # vLLM's engine (vllm/v1/engine/input_processor.py): the prompt's length and the window.
    decoder = failures.from_status(
        400,
        _vllm(
            "The decoder prompt (length 12324) is longer than the maximum model length of 8192. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens."
        ),
        {},
    )
    assert decoder.cause == "context" and decoder.context == ContextRefusal(context=8192, prompt=12324)
    # SGLang's serving_chat.py, a max_tokens over --context-length (no space after the first period): the window.
    sglang = failures.from_status(
        400, _sglang("max_completion_tokens is too large: 4000.This model supports at most 3000 completion tokens."), {}
    )
    assert sglang.cause == "context" and sglang.context == ContextRefusal(context=3000)
    # OpenAI's: a cap on the reply, not the window.
    openai = json.dumps(
        {
            "error": {
                "message": "max_tokens is too large: 64000. This model supports at most 16384 completion tokens, "
                "whereas you provided 64000.",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": "invalid_value",
            }
        }
    )
    assert failures.from_status(400, openai, {}).context == ContextRefusal(completion_cap=16384)


@pytest.mark.parametrize(
    ("event", "began", "cause"),
    [
        # A 5xx event is the server's: retried as before.
        ({"message": "boom", "code": 500}, True, "stream_error"),
        # vLLM's 400 for an OverflowError, a RuntimeError naming CUDA, a TypeError: the engine's, before or after text.
        ({"message": "out of range integral type conversion attempted", "code": 400}, True, "engine_fault"),
        ({"message": "CUDA error: an illegal memory access was encountered", "code": 400}, False, "engine_fault"),
        ({"message": "'NoneType' object is not subscriptable", "code": 400}, True, "engine_fault"),
        # Saying nothing of the request after text began: the engine's.
        ({"message": "Simulated error (400) mid-generation.", "code": 400}, True, "engine_fault"),
        # Before any text: the request's.
        ({"message": "Simulated error (400) mid-generation.", "code": 400}, False, "http_400"),
        # Naming the request, or a parameter (vLLM's VLLMValidationError), after text began: still the request's.
        ({"message": "Invalid JSON schema in response_format", "code": 400}, True, "http_400"),
        ({"message": "value out of range", "param": "top_logprobs", "code": 400}, True, "http_400"),
        # A context refusal mid-stream goes to the client's shrinking.
        ({"message": "The decoder prompt (length 9) is longer than the maximum model length of 8.", "code": 400},
         False, "context"),
    ],
)  # fmt: skip
def test_a_4xx_error_event_is_told_apart_by_what_it_says(event: dict[str, object], began: bool, cause: str) -> None:
    failure = failures.from_stream_event(event, began=began)
    assert failure.cause == cause
    assert failure.retry == (cause in ("stream_error", "engine_fault"))


def test_an_engine_fault_is_sent_again_once_per_call() -> None:
    attempts = RetryPolicy(Retry(max_attempts=6, backoff_base_s=0.0), random.Random(0)).attempts()
    fault = failures.from_stream_event({"message": "out of range integral type conversion attempted", "code": 400})
    attempts.begin()
    assert attempts.after(fault) is not None
    attempts.begin()
    again = failures.from_stream_event({"message": "out of range integral type conversion attempted", "code": 400})
    assert attempts.after(again) is None and "a second time in this call" in str(again)


def test_a_400_naming_the_context_without_numbers_is_still_a_context_refusal() -> None:
    failure = failures.from_status(400, _vllm("Input is longer than the model's context window."), {})
    assert failure.cause == "context" and failure.context == ContextRefusal()


def test_other_refusals_keep_their_status_cause() -> None:
    failure = failures.from_status(400, _vllm("messages must not be empty"), {})
    assert (failure.cause, failure.retry, failure.context) == ("http_400", False, None)
    assert failures.from_status(404, _vllm("The model `x` does not exist."), {}).cause == "http_404"


@pytest.mark.parametrize(
    ("cause", "refuses", "lasts"),
    [
        ("context", True, False),  # a prompt past the window: this request's, not the next one's
        ("sampling", True, False),
        ("http_400", True, False),
        ("http_413", True, False),
        ("http_422", True, False),
        ("http_401", False, True),  # a key refused: every request, until the operator fixes it
        ("http_404", False, True),
        ("quota", False, True),
        ("tls", False, True),
        ("structured_output", False, True),  # refused where the endpoint's configuration requires it
        ("stream", False, True),
        ("http_429", False, False),  # a busy or broken upstream: a later try may succeed
        ("http_503", False, False),
        ("running_timeout", False, False),
        ("engine_fault", False, False),
        ("stream_error", False, False),
        ("timeout", False, False),
        ("connect", False, False),
        ("malformed", False, False),
    ],
)
def test_a_failures_cause_says_whether_the_request_or_the_upstream_is_at_fault(
    cause: str, refuses: bool, lasts: bool
) -> None:
    assert (failures.refuses_request(cause), failures.lasting(cause)) == (refuses, lasts)


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_busy_and_broken_servers_are_retried_with_their_retry_after(status: int) -> None:
    failure = failures.from_status(status, _vllm("busy"), {}, retry_after="7")
    assert failure.retry and failure.cause == f"http_{status}" and failure.retry_after == 7.0


def test_a_spent_quota_is_final_unlike_a_rate_limit() -> None:
    quota = {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
    failure = failures.from_status(429, json.dumps({"error": quota}), {}, retry_after="20")
    assert (failure.cause, failure.retry) == ("quota", False) and "quota is spent" in str(failure)
    limited = {"message": "Rate limit reached for requests", "type": "requests", "code": "rate_limit_exceeded"}
    assert failures.from_status(429, json.dumps({"error": limited}), {}).retry


def test_refused_fields_and_features() -> None:
    openai = json.dumps({"error": {"message": "Unrecognized request argument supplied: top_k", "type": "x"}})
    assert failures.from_status(400, openai, {}).refused_field == ("top_k", None)
    renamed = json.dumps(
        {
            "error": {
                "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
                "Use 'max_completion_tokens' instead.",
                "type": "invalid_request_error",
            }
        }
    )
    assert failures.from_status(400, renamed, {}).refused_field == ("max_tokens", "max_completion_tokens")
    stream = failures.from_status(400, _vllm("stream is not supported"), {"stream": True})
    assert stream.cause == "stream" and not stream.retry
    schema = failures.from_status(
        400, _vllm("response_format type 'json_schema' is not supported"), {"response_format": {}}
    )
    assert schema.cause == "structured_output"


def test_stream_error_events_by_status() -> None:
    # vLLM and SGLang send the status an error would have had as the event's code.
    server = failures.from_stream_event({"message": "CUDA error", "type": "InternalServerError", "code": 500})
    assert server.retry and server.cause == "stream_error"
    client = failures.from_stream_event({"message": "invalid grammar", "type": "BadRequestError", "code": 400})
    assert not client.retry and client.cause == "http_400"
    context = failures.from_stream_event(
        {
            "message": "This model's maximum context length is 1500 tokens and your request has 1600 input tokens",
            "code": 400,
        }
    )
    assert context.cause == "context" and context.context == ContextRefusal(context=1500, prompt=1600)
    assert failures.from_stream_event("something broke").retry


def test_a_schema_refused_in_a_stream_is_a_structured_output_refusal() -> None:
    event = {"message": "The provided JSON schema contains features not supported by xgrammar.", "code": 400}
    sent = {"model": "m", "response_format": {"type": "json_schema"}}
    refused = failures.from_stream_event(event, body=sent)
    assert refused.cause == "structured_output" and not refused.retry
    assert str(refused) == f"server error in stream: {event['message']} (HTTP 400)"
    # Not without a schema in the request, nor once reply text came (then it is the stream's own fault).
    assert failures.from_stream_event(event, body={"model": "m"}).cause == "http_400"
    assert failures.from_stream_event(event, began=True, body=sent).cause != "structured_output"
    assert failures.from_stream_event({**event, "code": 500}, body=sent).cause == "stream_error"


def test_exceptions_by_when_they_happened() -> None:
    url = "http://127.0.0.1:1/v1"
    closed = failures.from_exception(aiohttp.ServerDisconnectedError(), url, sent=False)
    assert closed.cause == "disconnected" and closed.retry
    cut = failures.from_exception(aiohttp.ServerDisconnectedError(), url, sent=True)
    assert cut.cause == "cut"
    timeout = failures.from_exception(aiohttp.ServerTimeoutError("read"), url, sent=False)
    assert timeout.cause == "timeout"
    unanswered = failures.from_exception(aiohttp.ConnectionTimeoutError("connect"), url, sent=False)
    assert (unanswered.cause, unanswered.connect, unanswered.retry) == ("connect", True, True)
    unwritten = failures.from_exception(aiohttp.ClientOSError(None, "Can not write request body"), url, sent=False)
    assert unwritten.cause == "disconnected"
    other = failures.from_exception(aiohttp.ClientOSError(104, "reset"), url, sent=True)
    assert other.cause == "connection" and other.retry


def test_the_policy_gives_up_on_final_failures_and_after_max_attempts() -> None:
    policy = RetryPolicy(Retry(max_attempts=3, backoff_base_s=1.0, backoff_max_s=10.0), random.Random(0))
    final = policy.attempts()
    final.begin()
    assert final.after(Failure("no", "http_400", retry=False)) is None
    busy = policy.attempts()
    delays = []
    for _ in range(3):
        busy.begin()
        delays.append(busy.after(Failure("busy", "http_503", retry=True, retry_after=2.0)))
    # Two retries, each at least the Retry-After; the third failure ends the call.
    assert delays[2] is None and all(d is not None and 2.0 <= d <= 10.0 for d in delays[:2])
    assert busy.causes == ["http_503", "http_503"]


def test_backoff_is_exponential_with_full_jitter() -> None:
    # backoff = min(max, base * 2^(attempt-1)) * U[0, 1): with U fixed by the seed, the values are known.
    rng = random.Random(5)
    draws = [rng.random() for _ in range(3)]
    policy = RetryPolicy(Retry(backoff_base_s=0.5, backoff_max_s=1.5), random.Random(5))
    failure = Failure("busy", "http_503", retry=True)
    got = [policy.backoff(a, failure) for a in (1, 2, 3)]
    assert got == pytest.approx([0.5 * draws[0], 1.0 * draws[1], 1.5 * draws[2]])


# Every refusal each persona sends (tmas.testing.context_limits, shaped by the persona's error body), read without
# HTTP: the window always, the prompt where the wording states it, a bound where it states only that.
PERSONA_WORDINGS = [
    ("vllm", "persona"),
    ("vllm", "decoder_prompt"),
    ("vllm", "output_tokens"),
    ("vllm", "passed"),
    ("vllm", "too_large"),
    ("vllm", "legacy"),
    ("vllm", "generic"),
    ("sglang", "persona"),
    ("llama-server", "persona"),
    ("openai", "persona"),
    ("sim", "persona"),
]


@pytest.mark.parametrize(("persona", "wording"), PERSONA_WORDINGS)
@pytest.mark.parametrize(("prompt", "asked"), [(620, 4000), (1600, 10), (700, 1500)])
def test_the_personas_refusals_are_read_without_http(persona: str, wording: str, prompt: int, asked: int) -> None:
    from tmas.testing.context_limits import context_refusal
    from tmas.testing.personas import PERSONAS

    refusal = context_refusal(persona, wording, 1500, prompt, asked)  # type: ignore[arg-type]
    if refusal is None:
        # Taken: llama-server and vLLM's engine refuse only a prompt that alone passes the window (and cut the reply
        # instead).
        assert (persona == "llama-server" or wording == "decoder_prompt") and prompt < 1500
        return
    body = refusal.body or PERSONAS[persona].error(refusal.status, refusal.message, refusal.param, refusal.code)
    failure = failures.from_status(refusal.status, json.dumps(body), {"max_tokens": asked})
    assert failure.cause == "context" and not failure.retry and failure.context is not None, refusal.message
    if wording == "generic":
        assert failure.context == ContextRefusal()
        return
    assert failure.context.context == 1500
    stated = failure.context.prompt if failure.context.prompt is not None else failure.context.prompt_at_least
    if wording in ("output_tokens", "passed") or (persona == "vllm" and wording == "persona"):
        # Today's vLLM tokenizes the prompt only so far: the bound it states, never more than the prompt (none at all
        # for a max_tokens over the whole window: "max_tokens=M cannot be greater than max_model_len=C").
        assert failure.context.prompt is None and (stated is None or stated <= max(prompt, 1500 - asked + 1))
    elif persona == "sglang" and asked > 1500:
        # SGLang refuses a max_tokens over its --context-length before it counts the prompt: the window alone.
        assert stated is None
    else:
        assert stated == prompt


def test_a_page_that_is_not_json_is_said_in_one_line() -> None:
    # An HTML page without a title gives its first heading; plain text is joined onto one line.
    page = "<html><body>\n<h1>504 Gateway Time-out</h1>\nThe server didn't respond in time.\n</body></html>"
    said = str(failures.from_status(504, page, {}))
    assert said == "HTTP 504: 504 Gateway Time-out (an HTML page, not an API error: a proxy or web server answered)"
    assert str(failures.from_status(500, "Internal\r\n  Server Error\n", {})) == "HTTP 500: Internal Server Error"
