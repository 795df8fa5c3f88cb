"""A server's reply read into the layer's types: the completion of one choice, its usage and log-probabilities, an
embeddings reply's vectors, where it puts reasoning. Usage is the server's where it reports it (vLLM's and OpenAI's
fields, SGLang's ``reasoning_tokens`` in usage itself, llama-server's ``timings.cache_n``), else counted here (with the
tokenizer where configured, else estimated and marked so).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from tmas.llm.failures import Failure
from tmas.llm.reasoning import reply_place, split_reasoning
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, ChatRequest, Completion, Message, Reasoning, TokenLogprob, Usage

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
    thinks_inline: bool = False,
) -> Completion:
    """The completion of the reply's first choice (a reply of several is split into one per choice first:
    :func:`tmas.llm.batching.one_per_choice`). A choice the server aborted (``finish_reason`` ``"abort"``: vLLM and
    SGLang end a request so when they drop it, e.g. on a scheduler's abort) is a failure to send again, never a
    finished sample. ``thinks_inline``: the server's replies showed the model thinking inside its content, so a reply
    cut at max_tokens before any think tag is all thinking (:func:`tmas.llm.reasoning.split_reasoning`)."""
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
    content, reasoning = split_reasoning(raw, field_reasoning, cut_inline=thinks_inline and finish == "length")
    counted = usage(data, counter, request.messages, [raw, field_reasoning or ""], reasoning)
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


def _vector(raw: Any) -> list[float]:
    """One embedding: a list of numbers, or (``encoding_format = "base64"`` in the role's extra_body) the base64 of
    little-endian float32s, as the OpenAI API packs them."""
    if isinstance(raw, str):
        packed = base64.b64decode(raw, validate=True)
        return list(struct.unpack(f"<{len(packed) // 4}f", packed))
    return [float(x) for x in raw]


def vectors(data: dict[str, Any], count: int) -> list[list[float]]:
    """The float vectors of an embeddings reply, ordered by their ``index``."""
    items = data["data"]
    try:
        ordered = sorted(items, key=lambda item: int(item.get("index", 0)))
        vectors = [_vector(item["embedding"]) for item in ordered]
    except (TypeError, ValueError, KeyError, AttributeError, struct.error):
        raise Failure("embeddings reply has an unexpected shape", "malformed", retry=True) from None
    if len(vectors) != count:
        raise Failure(f"embeddings reply has {len(vectors)} vectors for {count} inputs", "malformed", retry=True)
    return vectors


def usage(
    data: dict[str, Any], counter: TokenCounter, messages: Sequence[Message], generated: Sequence[str], reasoning: str
) -> Usage:
    """The reply's usage as the server reported it, its gaps filled: reasoning tokens counted from the reasoning text
    where the server reported none for a reply that has some (vLLM's chat completions before 2026-08, PR 45802, and
    any server without a reasoning parser, whose thinking stays in the content), with the tokenizer where configured,
    else estimated and marked so; cached tokens never above the prompt's (older SGLang summed them over all ``n``
    choices: its usage_processor.py). ``generated``: the reply's texts (its content and reasoning field);
    ``reasoning``: its reasoning, from the field or the content's think blocks."""
    raw = data.get("usage")
    if isinstance(raw, dict) and isinstance(raw.get("completion_tokens"), int):
        prompt = int(raw.get("prompt_tokens") or 0)
        counted = Usage(
            prompt_tokens=prompt,
            completion_tokens=raw["completion_tokens"],
            reasoning_tokens=reported_reasoning(raw) or 0,
            cached_prompt_tokens=min(cached_tokens(raw, data.get("timings")), prompt),
        )
        if not counted.reasoning_tokens and reasoning:
            counted.reasoning_tokens = min(counter.count(reasoning), counted.completion_tokens)
            counted.estimated = not counter.exact
        return counted
    # No usage from the server: count ourselves, and say so unless a real tokenizer did the counting.
    return Usage(
        prompt_tokens=sum(counter.count(m.content) + 4 for m in messages),
        completion_tokens=sum(counter.count(text) for text in generated),
        reasoning_tokens=counter.count(reasoning),
        estimated=not counter.exact,
    )


def discarded(
    texts: tuple[str, str], counter: TokenCounter, reported: Any = None, *, thinks_inline: bool = False
) -> Usage:
    """The completion tokens of text (content, reasoning) a server generated for a reply that is not kept (an attempt
    whose stream was cut, stalled or ended in an error; a whole reply whose choice was aborted; the choices of a reply
    of several that did not finish): as ``reported`` usage (a stream's running one, a whole reply's) gave them where
    it did, else counted from the text (estimated unless a tokenizer counts). Its reasoning is the reasoning field's
    and the content's think blocks (``thinks_inline``: a model known to think inside its content, whose text without
    a tag is all thinking, as :func:`completion` reads a reply cut at max_tokens), counted where the reported usage
    counts none (vLLM's running usage), as a whole reply's is. Its prompt is not counted."""
    content, field = texts
    reasoning = field
    if thinks_inline or "<think>" in content or "</think>" in content:
        reasoning = split_reasoning(content, field or None, cut_inline=thinks_inline)[1]
    if isinstance(reported, dict) and isinstance(reported.get("completion_tokens"), int):
        spent = Usage(
            completion_tokens=reported["completion_tokens"], reasoning_tokens=reported_reasoning(reported) or 0
        )
        if not spent.reasoning_tokens and reasoning:
            spent.reasoning_tokens = min(counter.count(reasoning), spent.completion_tokens)
            spent.estimated = not counter.exact
        return spent
    generated = counter.count(content) + counter.count(field)
    if not generated:
        return Usage()
    thought = min(counter.count(reasoning), generated)
    return Usage(completion_tokens=generated, reasoning_tokens=thought, estimated=not counter.exact)


def reply_texts(data: Any) -> tuple[str, str]:
    """The text (content, reasoning) of a whole reply's choices, as far as its shape holds any."""
    content: list[str] = []
    reasoning: list[str] = []
    choices = data.get("choices") if isinstance(data, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        thought = message.get("reasoning_content") or message.get("reasoning")
        for value, parts in ((message.get("content"), content), (thought, reasoning)):
            if isinstance(value, str):
                parts.append(value)
    return "".join(content), "".join(reasoning)


def reported_reasoning(usage: Any) -> int | None:
    """The reasoning tokens a usage object reports: OpenAI's and vLLM's ``completion_tokens_details.reasoning_tokens``,
    else SGLang's ``reasoning_tokens`` in usage itself; None where neither is there."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("completion_tokens_details")
    value = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if value is None:
        value = usage.get("reasoning_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def reasoning_place(data: dict[str, Any]) -> Reasoning | None:
    """Where the reply's choices show their server puts reasoning (:func:`tmas.llm.reasoning.reply_place`): a
    reasoning field in any choice, else think tags in a finished one, else a finished one without; None where no
    choice shows anything (every one cut before its end)."""
    places: set[Reasoning] = set()
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        field = message.get("reasoning_content") or message.get("reasoning")
        place = reply_place(
            content if isinstance(content, str) else "", field if isinstance(field, str) else None,
            choice.get("finish_reason"),
        )  # fmt: skip
        if place is not None:
            places.add(place)
    return next((place for place in _STRONGEST_FIRST if place in places), None)


_STRONGEST_FIRST: tuple[Reasoning, ...] = ("separate", "inline", "none")
