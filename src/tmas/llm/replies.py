"""A server's reply read into the layer's types: the completion of one choice, its usage and log-probabilities, an
embeddings reply's vectors. Usage is the server's where it reports it (vLLM's and OpenAI's fields, SGLang's
``reasoning_tokens`` in usage itself, llama-server's ``timings.cache_n``), else counted here and marked estimated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from tmas.llm.failures import Failure
from tmas.llm.reasoning import split_reasoning
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, ChatRequest, Completion, Message, TokenLogprob, Usage

# Where a reply a watch stopped carries the watch's reason, from the stream reader to the completion.
STOPPED_EARLY = "tmas_stopped_early"


def completion(
    data: dict[str, Any],
    *,
    request: ChatRequest,
    key: CallKey,
    request_hash: str,
    counter: TokenCounter,
    url: str,
    attempts: int,
    sent_max: int | None,
) -> Completion:
    """The completion of the reply's first choice (a reply of several is split into one per choice first:
    :func:`tmas.llm.batching.one_per_choice`). A choice the server aborted (``finish_reason`` ``"abort"``: vLLM and
    SGLang end a request so when they drop it, e.g. on a scheduler's abort) is a failure to send again, never a
    finished sample."""
    try:
        choice = data["choices"][0]
        message = choice.get("message") or {}
        raw = message.get("content") or ""
        field_reasoning = message.get("reasoning_content") or message.get("reasoning")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise Failure(f"reply has an unexpected shape: {str(data)[:120]!r}", "malformed", retry=True) from None
    if not isinstance(raw, str) or (field_reasoning is not None and not isinstance(field_reasoning, str)):
        raise Failure("reply content is not text", "malformed", retry=True)
    finish = choice.get("finish_reason")
    if finish == "abort":
        raise Failure(f"{url} aborted the request (finish_reason 'abort')", "abort", retry=True)
    content, reasoning = split_reasoning(raw, field_reasoning)
    counted = usage(data, counter, request.messages, raw, field_reasoning or "")
    tokens = logprobs(choice.get("logprobs"))
    stopped = data.get(STOPPED_EARLY)
    if stopped is not None and not isinstance(data.get("usage"), dict):
        # Cut by us, the stream brought no usage: the text received is counted, and each log-probability received
        # stood for one generated token (the few the server made before it saw the connection close are unknown).
        counted.completion_tokens = max(counted.completion_tokens, len(tokens or ()))
        counted.estimated = True
    return Completion(
        key=key,
        request_hash=request_hash,
        endpoint=url,
        model=str(data.get("model") or request.model),
        content=content,
        reasoning=reasoning,
        usage=counted,
        finish_reason=finish,
        attempts=attempts,
        max_tokens_sent=sent_max if sent_max != request.sampling.max_tokens else None,
        logprobs=tokens,
        stopped_early=stopped,
    )


def vectors(data: dict[str, Any], count: int) -> list[list[float]]:
    """The float vectors of an embeddings reply, ordered by their ``index``."""
    items = data["data"]
    try:
        ordered = sorted(items, key=lambda item: int(item.get("index", 0)))
        vectors = [[float(x) for x in item["embedding"]] for item in ordered]
    except (TypeError, ValueError, KeyError, AttributeError):
        raise Failure(
            "embeddings reply has an unexpected shape (base64 vectors are not requested)", "malformed", retry=True
        ) from None
    if len(vectors) != count:
        raise Failure(f"embeddings reply has {len(vectors)} vectors for {count} inputs", "malformed", retry=True)
    return vectors


def usage(
    data: dict[str, Any], counter: TokenCounter, messages: Sequence[Message], content: str, reasoning: str
) -> Usage:
    raw = data.get("usage")
    if isinstance(raw, dict) and isinstance(raw.get("completion_tokens"), int):
        details = raw.get("completion_tokens_details") or {}
        reasoning_tokens = details.get("reasoning_tokens") if isinstance(details, dict) else None
        if reasoning_tokens is None:
            reasoning_tokens = raw.get("reasoning_tokens")  # SGLang's place: in usage itself
        return Usage(
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=raw["completion_tokens"],
            reasoning_tokens=int(reasoning_tokens or 0),
            cached_prompt_tokens=cached_tokens(raw, data.get("timings")),
        )
    # No usage from the server: count ourselves, and say so unless a real tokenizer did the counting.
    return Usage(
        prompt_tokens=sum(counter.count(m.content) + 4 for m in messages),
        completion_tokens=counter.count(content) + counter.count(reasoning),
        reasoning_tokens=counter.count(reasoning),
        estimated=not counter.exact,
    )


def cached_tokens(usage: dict[str, Any], timings: Any) -> int:
    """Prompt tokens served from the server's prompt cache: OpenAI's and vLLM's
    ``usage.prompt_tokens_details.cached_tokens``, else llama-server's ``timings.cache_n``; 0 when neither says."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(value, int) and isinstance(timings, dict):
        value = timings.get("cache_n")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def logprobs(raw: Any) -> list[TokenLogprob] | None:
    """The content tokens' log-probabilities in OpenAI's shape (``{"content": [{token, logprob, top_logprobs}]}``);
    None when the server sent none or sent them in a shape we cannot read (the caller then reads the score from the
    text)."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list) or not content:
        return None
    try:
        return [TokenLogprob.model_validate(item) for item in content]
    except ValidationError:
        return None


def reasoning_place(data: dict[str, Any]) -> str:
    """Where the reply's first choice put its reasoning: ``separate`` (a field of its own), ``inline`` (think blocks
    in the content) or ``none``."""
    choices = data.get("choices")
    message = (
        choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    )
    if not isinstance(message, dict):
        return "none"
    if message.get("reasoning_content") or message.get("reasoning"):
        return "separate"
    content = message.get("content")
    return "inline" if isinstance(content, str) and "</think>" in content else "none"
