"""What each server does with a request that does not fit its context window: the refusal's status, wording and
body, or (llama-server) a reply cut short where the window fills up.

The wordings are the servers' own because clients parse them (the numbers in them say how much to shrink); each
cites the source it follows. ``N`` is the prompt's tokens as the simulator counts them (the same count its
tokenize routes report), ``M`` the requested completion (``max_completion_tokens`` or ``max_tokens``), ``C`` the
context window (``SimScript.context_length``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tmas.testing.script import ContextWording


@dataclass(frozen=True)
class Refusal:
    """A context refusal before the persona shapes its body (``body`` set: the whole body, as llama-server's)."""

    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    body: dict[str, Any] | None = field(default=None)
    # Met after a streamed request's headers went out: an error event in the stream, not an HTTP status.
    midstream: bool = False


def _vllm_extras(message: str, parameter: str, value: int) -> str:
    # vllm/exceptions.py VLLMValidationError.__str__: the parameter and value follow the message in parentheses,
    # and the error body's "param" names the parameter.
    return f"{message} (parameter={parameter}, value={value})"


def _legacy(c: int, n: int, m: int | None) -> Refusal | None:
    # The simulator's own check and wording (vLLM's, and OpenAI's, before vLLM 0.9): prompt + max_tokens > C.
    requested = n + (m or 0)
    if requested <= c:
        return None
    return Refusal(
        f"This model's maximum context length is {c} tokens. However, you requested {requested} tokens "
        f"({n} in the messages, {m or 0} in the completion). Please reduce the length of the messages or completion."
    )


def _too_large(c: int, n: int, m: int | None) -> Refusal | None:
    # vLLM 0.9 to 0.11, entrypoints/openai/serving_engine.py _validate_input: a prompt that fills the window alone,
    # else a max_tokens over what is left (the wordings as those releases answer them).
    if n >= c:
        return Refusal(
            f"This model's maximum context length is {c} tokens. However, your request has {n} input tokens. "
            "Please reduce the length of the input messages."
        )
    if m is not None and n + m > c:
        return Refusal(
            f"'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is "
            f"{c} tokens and your request has {n} input tokens ({m} > {c} - {n})."
        )
    return None


def _max_output_check(c: int, m: int, field_name: str) -> Refusal:
    # renderers/params.py TokenizeParams.__post_init__: a completion budget larger than the whole window.
    message = (
        f"{field_name}={m} cannot be greater than max_model_len=max_total_tokens={c}. "
        "Please request fewer output tokens."
    )
    return Refusal(_vllm_extras(message, field_name, m), param=field_name)


# vLLM renderers/params.py _token_len_check's refusal of a prompt longer than the window leaves beside M, in each
# release's words ("{seen}": the prompt's tokens as counted, "{out}": M, "{room}": C - M, "{total}": seen + M).
_TOKEN_LEN_WORDINGS: dict[str, str] = {
    # The renderer releases before the "output tokens" wording.
    "passed": (
        "You passed {seen} input tokens and requested {out} output tokens. However, the model's context length is "
        "only {c} tokens, resulting in a maximum input length of {room} tokens. "
        "Please reduce the length of the input prompt."
    ),
    # vLLM today: the count is at most C - M + 1 (hence "at least"), so the total it reports is C + 1 for any prompt
    # too long.
    "output_tokens": (
        "This model's maximum context length is {c} tokens. However, you requested {out} output tokens and your "
        "prompt contains at least {seen} input tokens, for a total of at least {total} tokens. "
        "Please reduce the length of the input prompt or the number of requested output tokens."
    ),
}


def _token_len_check(c: int, n: int, m: int | None, field_name: str, wording: str) -> Refusal | None:
    # vLLM renderers/params.py _token_len_check, in a release's ``wording`` (_TOKEN_LEN_WORDINGS): a completion budget
    # larger than the whole window first, then the prompt. The prompt is tokenized with truncation at
    # max_input_tokens + 1 (get_encode_kwargs), so the count it reports is never more than C - M + 1, whatever the
    # prompt's true length.
    out = m or 0
    if out > c:
        return _max_output_check(c, out, field_name)
    if n <= c - out:
        return None
    seen = min(n, c - out + 1)
    message = wording.format(seen=seen, out=out, c=c, room=c - out, total=seen + out)
    return Refusal(_vllm_extras(message, "input_tokens", seen), param="input_tokens")


def _decoder_prompt(c: int, n: int, m: int | None) -> Refusal | None:
    # vLLM's engine, where no front-end check came first (vllm/v1/engine/input_processor.py, _validate_model_input: a
    # ValueError for a prompt longer than max_model_len). It is raised as the request enters the engine, inside the
    # generator a stream iterates after its headers went out: the stream carries it as an error event with code 400
    # (chat_completion/serving.py, create_streaming_error_response). A prompt that fits is generated until the window
    # is full (window_budget).
    if n <= c:
        return None
    message = (
        f"The decoder prompt (length {n}) is longer than the maximum model length of {c}. "
        "Make sure that `max_model_len` is no smaller than the number of text tokens."
    )
    return Refusal(message, midstream=True)


def _generic(c: int, n: int, m: int | None) -> Refusal | None:
    # A server (or proxy) that names the context window but gives no numbers.
    if n + (m or 0) <= c:
        return None
    return Refusal("The request does not fit in the model's context window. Please shorten the prompt or max_tokens.")


def _sglang(c: int, n: int, m: int | None) -> Refusal | None:
    # python/sglang/srt/entrypoints/openai/serving_chat.py _validate_request first: a max_tokens over the window given
    # by --context-length (the persona's server is started with it), worded with no space after the first period.
    if m is not None and m > c:
        return Refusal(f"max_completion_tokens is too large: {m}.This model supports at most {c} completion tokens.")
    # python/sglang/srt/managers/tokenizer_manager.py _validate_one_request: refused when the prompt alone, or the
    # prompt and max_new_tokens together, reach the context length (>=, not >); without
    # --allow-auto-truncate. serving_chat.py answers the ValueError with a 400.
    if n >= c:
        return Refusal(f"The input ({n} tokens) is longer than the model's context length ({c} tokens).")
    if m is not None and n + m >= c:
        return Refusal(
            f"Requested token count exceeds the model's maximum context length of {c} tokens. You requested a total "
            f"of {n + m} tokens: {n} tokens from the input messages and {m} tokens for the completion. Please reduce "
            "the number of tokens in the input messages or the completion to fit within the limit."
        )
    return None


def _sglang_bound(c: int, pool: int) -> int:
    # python/sglang/srt/managers/scheduler.py: a request's tokens, prompt and reply, stay below the smaller of the
    # context window and the KV cache pool's size (max_req_len, one less than that).
    return min(c, pool) - 1


def _sglang_pool(c: int, n: int, pool: int | None) -> Refusal | None:
    # python/sglang/srt/managers/utils.py validate_input_length, run by the scheduler as a request arrives: a prompt of
    # max_req_input_len tokens (max_req_len less five) or more is aborted with status 400. The tokenizer manager's
    # checks (_sglang) compared the prompt with the context window only, so a prompt that fits the window but not the
    # pool meets this one. Streamed, the abort comes as the stream's first event (serving_chat.py sends an abort that
    # carries a status as an error event); sent whole, as a 400.
    if pool is None:
        return None
    most = _sglang_bound(c, pool) - 5
    if n < most:
        return None
    message = (
        f"Input length ({n} tokens) exceeds the maximum allowed length ({most} tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )
    return Refusal(message, midstream=True)


def _llama(c: int, n: int, m: int | None) -> Refusal | None:
    # tools/server/server-context.cpp: a prompt that fills the slot's context (n_tokens >= n_ctx) is refused with
    # ERROR_TYPE_EXCEED_CONTEXT_SIZE (400); server-task.cpp server_task_result_error::to_json adds n_prompt_tokens
    # and n_ctx beside the usual fields. A prompt that fits is generated, whatever n_predict asks (window_budget).
    if n < c:
        return None
    message = f"request ({n} tokens) exceeds the available context size ({c} tokens), try increasing it"
    body = {
        "error": {
            "code": 400,
            "message": message,
            "type": "exceed_context_size_error",
            "n_prompt_tokens": n,
            "n_ctx": c,
        }
    }
    return Refusal(message, body=body)


def _openai(c: int, n: int, m: int | None) -> Refusal | None:
    # OpenAI's context_length_exceeded (not read from a source: its long-standing wording, which vLLM's legacy
    # one copied); without max_tokens the messages alone are named.
    if n + (m or 0) <= c:
        return None
    if m is None:
        message = (
            f"This model's maximum context length is {c} tokens. However, your messages resulted in {n} tokens. "
            "Please reduce the length of the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {c} tokens. However, you requested {n + m} tokens ({n} in the "
            f"messages, {m} in the completion). Please reduce the length of the messages or completion."
        )
    return Refusal(message, param="messages", code="context_length_exceeded")


_PERSONA_WORDING: dict[str, ContextWording | Literal["sglang", "llama", "openai"]] = {
    "sim": "legacy",
    "vllm": "output_tokens",
    "sglang": "sglang",
    "llama-server": "llama",
    "openai": "openai",
}


def context_refusal(
    persona: str,
    wording: ContextWording,
    c: int,
    n: int,
    m: int | None,
    field_name: str = "max_tokens",
    *,
    pool: int | None = None,
) -> Refusal | None:
    """The refusal a request of ``n`` prompt tokens asking ``m`` completion tokens (None: not said) meets under a
    window of ``c`` tokens, or None where the server takes it. ``field_name``: the request's field for ``m``;
    ``pool``: SGLang's KV cache pool, where it bounds a request (SimScript.kv_pool_tokens)."""
    kind = _PERSONA_WORDING[persona] if wording == "persona" else wording
    if kind == "sglang":
        return _sglang(c, n, m) or _sglang_pool(c, n, pool)
    if kind in _TOKEN_LEN_WORDINGS:
        return _token_len_check(c, n, m, field_name, _TOKEN_LEN_WORDINGS[kind])
    if kind == "too_large":
        return _too_large(c, n, m)
    if kind == "generic":
        return _generic(c, n, m)
    if kind == "decoder_prompt":
        return _decoder_prompt(c, n, m)
    if kind == "llama":
        return _llama(c, n, m)
    if kind == "openai":
        return _openai(c, n, m)
    return _legacy(c, n, m)


def window_budget(
    persona: str, wording: ContextWording, c: int, n: int, m: int | None, *, pool: int | None = None
) -> int | None:
    """The completion budget of a prompt that fits where no check refused ``m``: llama-server (tools/server/
    server-context.cpp stops a slot, STOP_TYPE_LIMIT, finish_reason "length", once its cache plus one reaches n_ctx)
    and vLLM's engine ("decoder_prompt": vllm/v1/core/sched/utils.py check_stop ends a request at max_model_len) leave
    the reply C - N tokens at most, whatever max_tokens asked; SGLang's scheduler, under a KV cache pool smaller than
    the window (``pool``), lowers max_new_tokens to what its bound leaves (scheduler.py, init_req_max_new_tokens).
    Elsewhere ``m`` stands."""
    if persona == "sglang" and wording == "persona" and pool is not None:
        room = max(_sglang_bound(c, pool) - n - 1, 0)
        return room if m is None or m > room else m
    engine_only = (persona == "llama-server" and wording == "persona") or wording == "decoder_prompt"
    if not engine_only or n >= c:
        return m
    room = c - n
    return room if m is None or m > room else m
