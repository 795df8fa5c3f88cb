"""A streamed chat completion read back into the reply an unstreamed call would have had.

A streamed reply is a series of server-sent events, one ``data: {chunk}`` line each, ended by ``data: [DONE]``. Each
chunk carries, per choice ``index``, a ``delta`` (``content``; reasoning as ``reasoning_content`` or ``reasoning``),
and at the end a ``finish_reason``; log-probabilities come as ``logprobs.content`` lists per chunk. Usage comes in a
last chunk with empty ``choices`` when the request asked for it (``stream_options.include_usage``), on the last choice
chunk on some servers, on every chunk with ``continuous_usage_stats`` (vLLM and SGLang: that chunk's choice's tokens so
far), and llama-server adds its ``timings``. An error met once the stream is open comes as an event
``{"error": {...}}``, or (older llama-server) as a line ``error: {...}``. :class:`StreamAssembler` puts the chunks
together into ``{"choices": [{"index", "message": {"content", "reasoning_content"}, "finish_reason", "logprobs"}],
"usage", "timings", "model"}``, so the client parses streamed and unstreamed replies with one code path.

A reply is complete once every choice it began has a ``finish_reason``: a server that then closes the stream before
its usage chunk or ``[DONE]`` has still sent the whole text (its usage is counted instead). A stream that ends before
that was cut, and its partial text is never returned, unless its reader stopped it on purpose (:meth:`StreamAssembler.
stop`: a watched reply, tmas.llm.watch).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

# Marks a reply that holds only the choices that finished before its stream ended: their indices missing.
PARTIAL = "tmas_partial"


class StreamError(Exception):
    """A stream that cannot give a whole reply: ``cause`` is ``"malformed"`` (an event that is not a chunk),
    ``"stream_error"`` (the server sent an error event) or ``"cut"`` (it ended before every choice finished)."""

    def __init__(self, message: str, cause: str, error: Any = None, *, began: bool = False) -> None:
        super().__init__(message)
        self.cause = cause
        # The error event's own object (its message and status ``code``), for the failure's classification.
        self.error = error
        # Whether reply text (content or reasoning) had arrived before the error event.
        self.began = began


@dataclass
class _Choice:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[Any] | None = None


class StreamAssembler:
    """Feed it a stream's lines (:meth:`feed`); :meth:`reply` gives the whole reply once the stream ended.

    Each ``data:`` line is read as one event (JSON never holds a raw line break, and some servers leave out the
    blank line between events); comments (``:`` lines, keep-alives) and the other fields are skipped."""

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}
        self.model: str | None = None
        # Usage on a chunk of no choice (the usage chunk; llama-server's per choice), the last one that came; and
        # usage on a chunk of one choice, per choice: vLLM's and SGLang's continuous_usage_stats (that choice's tokens
        # so far), or a server's whole usage on its last chunk.
        self._usage: dict[str, Any] | None = None
        self._running: dict[int, dict[str, Any]] = {}
        self.timings: dict[str, Any] | None = None
        # True once ``data: [DONE]`` arrived: nothing follows it.
        self.done = False

    @property
    def usage(self) -> dict[str, Any] | None:
        """The stream's usage: its usage chunk where one came; else the usage the choices' own chunks reported, the
        last of each, over every choice that reported any (the prompt once), so that a stream cut before its usage
        chunk counts what each choice generated so far."""
        if self._usage is not None or len(self._running) < 2:
            return self._usage if self._usage is not None else next(iter(self._running.values()), None)
        return _summed(list(self._running.values()))

    @property
    def complete(self) -> bool:
        """Every choice the stream began has its ``finish_reason``."""
        return bool(self._choices) and all(c.finish_reason is not None for c in self._choices.values())

    def logprobs(self, index: int = 0) -> list[Any]:
        """The log-probability entries choice ``index`` received so far, as sent (empty before any)."""
        choice = self._choices.get(index)
        return (choice.logprobs or []) if choice is not None else []

    def stop(self, finish_reason: str) -> None:
        """End the reply here, as its reader cut it: every unfinished choice finishes with ``finish_reason``, so that
        :meth:`reply` gives what arrived."""
        for choice in self._choices.values():
            if choice.finish_reason is None:
                choice.finish_reason = finish_reason

    def feed(self, line: str) -> None:
        """One line of the stream, with or without its line break. Raises :class:`StreamError` on a line that is not
        a chunk and on an error event."""
        name, _, value = line.rstrip("\r\n").partition(":")
        if name == "data":
            self._data(value.removeprefix(" "))
        elif name == "error":
            self._error_line(value.removeprefix(" "))

    def _data(self, value: str) -> None:
        if value.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(value)
        except ValueError:
            raise StreamError(f"stream event is not JSON: {value[:120]!r}", "malformed") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"stream event is not a JSON object: {value[:120]!r}", "malformed")
        if chunk.get("error"):
            # vLLM and SGLang report an internal error met mid-generation as an event {"error": {"message": ...}}.
            began = any(c.content or c.reasoning for c in self._choices.values())
            message = f"server error in stream: {_error_text(chunk)}"
            raise StreamError(message, "stream_error", chunk["error"], began=began)
        self._take(chunk)

    def _error_line(self, value: str) -> None:
        # llama-server builds before server-http.cpp send an error met once the stream is open (a prompt over n_ctx
        # among them) as a line of the field "error" holding the error object itself (server_sent_event(sink,
        # "error", ...)), then data: [DONE].
        try:
            error = json.loads(value)
        except ValueError:
            error = value
        began = any(c.content or c.reasoning for c in self._choices.values())
        message = f"server error in stream: {_error_text({'error': error})}"
        raise StreamError(message, "stream_error", error or value, began=began)

    def _take(self, chunk: dict[str, Any]) -> None:
        if self.model is None and isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        choices = chunk.get("choices")
        if choices is not None and not isinstance(choices, list):
            raise StreamError(f"stream chunk's choices is not a list: {str(choices)[:120]!r}", "malformed")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            # The last one wins: usage reported on every chunk counts up.
            index = (
                choices[0].get("index", 0) if choices and len(choices) == 1 and isinstance(choices[0], dict) else None
            )
            if isinstance(index, int):
                self._running[index] = usage
            else:
                self._usage = usage
        if choices is None:
            return
        for item in choices:
            self._take_choice(item)

    def _take_choice(self, item: Any) -> None:
        index = item.get("index", 0) if isinstance(item, dict) else None
        delta = (item.get("delta") or {}) if isinstance(item, dict) else None
        if not isinstance(index, int) or not isinstance(delta, dict):
            raise StreamError(f"stream chunk has an unexpected choice: {str(item)[:120]!r}", "malformed")
        choice = self._choices.setdefault(index, _Choice())
        text = delta.get("content")
        # vLLM around v0.11 sent the same reasoning under both names: take one of them, never both.
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        for value, parts in ((text, choice.content), (thought, choice.reasoning)):
            if value is None or value == "":
                continue
            if not isinstance(value, str):
                raise StreamError(f"stream delta is not text: {str(delta)[:120]!r}", "malformed")
            parts.append(value)
        if item.get("finish_reason") is not None:
            choice.finish_reason = str(item["finish_reason"])
        logprobs = item.get("logprobs")
        tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(tokens, list):
            # Extended in place: a 100,000-token reply arrives in as many chunks.
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(tokens)

    def received(self, *, unfinished: bool = False) -> tuple[str, str]:
        """The text (content, reasoning) the stream brought so far, over its choices (``unfinished``: only those without
        a ``finish_reason``): what a reply that is discarded had the server generate."""
        chosen = [c for c in self._choices.values() if not unfinished or c.finish_reason is None]
        return "".join("".join(c.content) for c in chosen), "".join("".join(c.reasoning) for c in chosen)

    def finished_reply(self) -> dict[str, Any] | None:
        """The choices that finished, in a reply's shape, when a stream of several choices ended early (SGLang sends
        its choices' finishes only at the end, vLLM as each choice ends); None when none finished or none was
        missing. The reply is marked :data:`PARTIAL` with the indices that did not finish."""
        finished = {i: c for i, c in self._choices.items() if c.finish_reason is not None}
        if not finished or len(finished) == len(self._choices):
            return None
        missing = sorted(set(self._choices) - set(finished))
        return {**self._reply(finished), PARTIAL: missing}

    def reply(self) -> dict[str, Any]:
        """The whole reply in an unstreamed reply's shape; :class:`StreamError` (cause ``"cut"``) if the stream
        ended before every choice finished."""
        if not self._choices:
            raise StreamError("stream ended before any choice began", "cut")
        unfinished = sorted(i for i, c in self._choices.items() if c.finish_reason is None)
        if unfinished:
            which = ", ".join(str(i) for i in unfinished)
            raise StreamError(f"stream ended before choice {which} finished", "cut")
        return self._reply(self._choices)

    def _reply(self, chosen: dict[int, _Choice]) -> dict[str, Any]:
        choices = []
        for index, choice in sorted(chosen.items()):
            message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.content)}
            if choice.reasoning:
                message["reasoning_content"] = "".join(choice.reasoning)
            logprobs = {"content": choice.logprobs} if choice.logprobs is not None else None
            choices.append(
                {"index": index, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs}
            )
        out: dict[str, Any] = {"object": "chat.completion", "model": self.model, "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        if self.timings is not None:
            out["timings"] = self.timings
        return out


async def lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The lines of a byte stream as they complete, whatever the size of the pieces it arrives in (a line is cut at
    ``\\n`` before decoding, which never splits a UTF-8 character); a last line without a break comes at the end."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


def _summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Several choices' own usage as one: their completion (and reasoning) tokens summed, the prompt counted once."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages if isinstance(u.get("completion_tokens"), int))
    prompt = first.get("prompt_tokens") if isinstance(first.get("prompt_tokens"), int) else 0
    out = {**first, "completion_tokens": completion, "total_tokens": prompt + completion}
    details = [u.get("completion_tokens_details") for u in usages]
    if any(isinstance(d, dict) for d in details):
        reasoning = sum(d.get("reasoning_tokens") or 0 for d in details if isinstance(d, dict))
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    if isinstance(first.get("reasoning_tokens"), int):  # SGLang's, in usage itself
        out["reasoning_tokens"] = sum(u.get("reasoning_tokens") or 0 for u in usages)
    return out


def _error_text(chunk: dict[str, Any]) -> str:
    error = chunk.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    if isinstance(error, str):
        return error[:300]
    return str(chunk)[:300]
