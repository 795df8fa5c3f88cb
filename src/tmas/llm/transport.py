"""Sending one request and reading its reply, streamed or whole, with the times it took.

**Waiting is not stalling.** A server under load keeps a request in its queue (or preempts it) before its first token:
vLLM sends its stream's headers at once and then nothing until that token (Starlette starts a ``StreamingResponse``
before its generator yields), SGLang sends nothing at all (it awaits the first chunk before it returns the response),
llama-server answers once a slot takes the request; vLLM pauses a stream it preempted until it computed it again.
Closing such a request aborts it and loses its place. So a silence of a streamed reply (before its first chunk, or
between two) is judged, once it passes ``timeout_s`` and then every check interval, by what its replica shows
(:mod:`tmas.llm.vitals`): it is waited out while the replica answers ``/health`` and shows progress within
``progress_timeout_s``, and ends the attempt otherwise (causes ``dead``, ``no_progress``, ``stall``); the wait for the
first chunk is bounded too by ``queue_timeout_s`` where set, and the whole call by ``deadline_s``. An unstreamed reply
is silent until whole, whether it waits in the queue or is generated: its silence is judged alike, so a call queued
behind others is waited for rather than closed and sent to the back of the queue (``queue_timeout_s``, which would
bound its generation too, does not apply to it).

``deadline_s`` counts from the moment the request is sent, after the client's own slots and caps let it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tmas.config import Endpoint
from tmas.llm import failures
from tmas.llm.failures import Failure
from tmas.llm.replies import STOPPED_EARLY, logprobs
from tmas.llm.stream import StreamAssembler, StreamError, lines
from tmas.llm.vitals import Judge, check_interval
from tmas.llm.watch import TraceWatch

# Seconds a stream's end is read for after its end marker (see _drain); the rest of a proper reply is already there.
DRAIN_S = 0.25


@dataclass
class Timing:
    """Where an attempt's time went: waiting inside tmas for its slot and caps, then for the server's first chunk (its
    queue and the prompt's prefill); the rest of a call's ``latency_s`` is the reply streaming."""

    # When the attempt began: before the client's own slot and caps let it go.
    began_at: float = field(default_factory=time.monotonic)
    sent_at: float = 0.0
    first_chunk_at: float | None = None
    last_chunk_at: float | None = None
    # When the replica was last asked about a silence of this attempt.
    checked_at: float | None = None
    # A streamed request answered with a plain JSON reply: the server does not stream.
    plain_reply: bool = False
    # The attempt's event stream as far as it arrived: what an attempt that failed part way had the server generate.
    stream: StreamAssembler | None = None

    @property
    def queued_s(self) -> float | None:
        return None if not self.sent_at else self.sent_at - self.began_at

    @property
    def first_token_s(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.sent_at


@dataclass
class Exchange:
    """One request to send: where, what, and how long its silences may last."""

    session: aiohttp.ClientSession
    url: str
    body: dict[str, Any]
    headers: dict[str, str]
    endpoint: Endpoint
    # What ends a silence past timeout_s, asked of the replica (tmas.llm.vitals.judge).
    judge: Judge
    # Told of each chunk that arrives: the replica progresses.
    on_chunk: Callable[[], None] = lambda: None
    watch: TraceWatch | None = None


async def send(exchange: Exchange, timing: Timing) -> dict[str, Any]:
    """POST the request; its whole reply as JSON (a streamed one assembled), or as far as ``watch`` let it run.
    Raises :class:`Failure`."""
    endpoint = exchange.endpoint
    timing.sent_at = time.monotonic()
    try:
        async with asyncio.timeout(endpoint.deadline_s) as deadline:
            if not exchange.body.get("stream"):
                return await _watched(exchange, timing, _whole(exchange, timing), streamed=False)
            return await _watched(exchange, timing, _streamed(exchange, timing), streamed=True)
    except TimeoutError:
        if deadline.expired():
            # Not retried: a call that ran out of its whole budget would most likely run out of it again.
            raise Failure(
                f"no whole reply from {exchange.url} within deadline_s = {endpoint.deadline_s:g}s",
                "deadline",
                retry=False,
            ) from None
        raise


async def _whole(exchange: Exchange, timing: Timing) -> dict[str, Any]:
    # No limit on the wait itself: its silence is judged (_watched).
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout(exchange.endpoint))
    try:
        async with exchange.session.post(
            exchange.url, json=exchange.body, headers=exchange.headers, timeout=timeout
        ) as resp:
            timing.first_chunk_at = time.monotonic()
            text = await resp.text(errors="replace")
            status, retry_after = resp.status, resp.headers.get("Retry-After")
    except aiohttp.ConnectionTimeoutError as exc:
        raise failures.from_exception(exc, exchange.url, sent=False) from None
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise failures.from_exception(exc, exchange.url, sent=timing.first_chunk_at is not None) from None
    return _json_reply(status, text, exchange, retry_after)


async def _watched(
    exchange: Exchange, timing: Timing, reply: Coroutine[Any, Any, dict[str, Any]], *, streamed: bool
) -> dict[str, Any]:
    """Run the exchange (``reply``); each silence past ``timeout_s`` is judged (see the module's docstring)."""
    endpoint = exchange.endpoint
    queue_timeout_s = endpoint.queue_timeout_s if streamed else None
    task = asyncio.ensure_future(reply)
    try:
        while True:
            # A wait that times out leaves the exchange running. Not wait_for: on Python 3.11 it returns a reply that
            # came whole in the turn its caller was cancelled, and the cancel (a Ctrl-C, a client gone) is lost.
            await asyncio.wait({task}, timeout=_until_next_check(endpoint, timing, queue_timeout_s))
            if task.done():
                return task.result()
            now = time.monotonic()
            began = streamed and timing.first_chunk_at is not None
            silent_since = timing.last_chunk_at if timing.last_chunk_at is not None else timing.sent_at
            if not began and queue_timeout_s is not None and now - timing.sent_at >= queue_timeout_s:
                raise Failure(
                    f"{exchange.url} sent no first chunk within queue_timeout_s = {queue_timeout_s:g}s",
                    "queue_timeout",
                    retry=True,
                )
            if now - silent_since < endpoint.timeout_s:
                continue  # a chunk came meanwhile: this silence has not lasted timeout_s yet
            failure = await exchange.judge(silent_since, began)
            if failure is not None and task.done() and not task.cancelled() and task.exception() is None:
                return task.result()  # the reply came whole while the replica was being asked
            if failure is not None:
                raise failure
            timing.checked_at = time.monotonic()
    finally:
        if not task.done():
            task.cancel()  # closes the connection: the server aborts the request
            await asyncio.gather(task, return_exceptions=True)


def connect_timeout(endpoint: Endpoint) -> float:
    """Seconds a connection to the endpoint may take to open (tmas.llm.failures.CONNECT_TIMEOUT_S)."""
    return min(endpoint.timeout_s, failures.CONNECT_TIMEOUT_S)


def _until_next_check(endpoint: Endpoint, timing: Timing, queue_timeout_s: float | None) -> float:
    """Seconds until the current silence is next judged: when it reaches ``timeout_s``, then every check interval
    after the last check; no later than ``queue_timeout_s`` before the first chunk."""
    now = time.monotonic()
    silent_since = timing.last_chunk_at if timing.last_chunk_at is not None else timing.sent_at
    due = silent_since + endpoint.timeout_s
    if timing.checked_at is not None and timing.checked_at > silent_since:
        due = max(due, timing.checked_at + check_interval(endpoint))
    if timing.first_chunk_at is None and queue_timeout_s is not None:
        due = min(due, timing.sent_at + queue_timeout_s)
    return max(0.0, due - now)


async def _streamed(exchange: Exchange, timing: Timing) -> dict[str, Any]:
    # No read bound of aiohttp's own: silences are judged by the loop above.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout(exchange.endpoint), sock_read=None)
    got_headers = False
    try:
        async with exchange.session.post(
            exchange.url, json=exchange.body, headers=exchange.headers, timeout=timeout
        ) as resp:
            got_headers = True
            if resp.status == 200 and resp.content_type != "application/json":
                return await _read_stream(resp, exchange, timing)
            text = await resp.text(errors="replace")
            status, retry_after = resp.status, resp.headers.get("Retry-After")
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise failures.from_exception(exc, exchange.url, sent=got_headers) from None
    timing.first_chunk_at = timing.last_chunk_at = time.monotonic()
    timing.plain_reply = status == 200
    return _json_reply(status, text, exchange, retry_after)


async def _chunks(resp: aiohttp.ClientResponse, exchange: Exchange, timing: Timing) -> AsyncIterator[bytes]:
    """The reply's bytes as they come, each arrival noted (its silences are judged by :func:`_watched`)."""
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            return
        timing.last_chunk_at = time.monotonic()
        exchange.on_chunk()
        yield chunk


def _is_event(line: str) -> bool:
    """Whether a stream's line carries an event: not blank, not a comment (``:``, the keep-alive a gateway such as
    OpenRouter sends while the request waits for its first token)."""
    return bool(line.strip()) and not line.startswith(":")


async def _read_stream(resp: aiohttp.ClientResponse, exchange: Exchange, timing: Timing) -> dict[str, Any]:
    """The whole reply of an event stream, in an unstreamed reply's shape (:mod:`tmas.llm.stream`).

    A stream that breaks or ends before every choice finished fails with cause ``cut``, unless some choices had
    finished: those are returned (the caller asks again only for the others). ``watch`` is told of the
    log-probabilities as they arrive; when it stops the reply, the connection is closed there (the server aborts the
    request) and the reply so far is returned, marked."""
    watch = exchange.watch
    assembler = timing.stream = StreamAssembler()
    seen = 0
    if watch is not None:
        watch.begin()
    try:
        try:
            async for line in lines(_chunks(resp, exchange, timing)):
                if timing.first_chunk_at is None and _is_event(line):
                    # The first event, not the first byte: keep-alive comments show the connection, not a token.
                    timing.first_chunk_at = timing.last_chunk_at
                assembler.feed(line)
                if assembler.done:
                    await _drain(resp)
                    break
                if watch is None or len(assembler.logprobs()) == seen:
                    continue
                arrived = assembler.logprobs()[seen:]
                seen += len(arrived)
                stop = watch.observe(logprobs({"content": arrived}) or [])
                if stop is not None and not assembler.complete:
                    resp.close()
                    assembler.stop(stop.finish_reason)
                    return {**assembler.reply(), STOPPED_EARLY: stop.detail}
        except (aiohttp.ClientError, ConnectionError) as exc:
            if not assembler.complete:
                finished = assembler.finished_reply()
                if finished is not None:
                    return finished
                raise Failure(
                    f"stream from {exchange.url} cut: {type(exc).__name__}: {exc}", "cut", retry=True
                ) from None
        if not assembler.complete and (finished := assembler.finished_reply()) is not None:
            return finished
        return assembler.reply()
    except StreamError as exc:
        if exc.error is not None:
            raise failures.from_stream_event(exc.error, began=exc.began, body=exchange.body) from None
        raise Failure(f"stream from {exchange.url}: {exc}", exc.cause, retry=True) from None


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read what follows the stream's end marker (the chunked body's last, empty chunk), so that the connection goes
    back to the pool: left unread, aiohttp closes the connection instead, and the next call opens another. A server
    that sends nothing more within ``DRAIN_S`` is not waited for (its connection is closed)."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, ConnectionError):
        await asyncio.wait_for(resp.content.read(), DRAIN_S)


def _json_reply(status: int, text: str, exchange: Exchange, retry_after: str | None) -> dict[str, Any]:
    if status != 200:
        raise failures.from_status(status, text, exchange.body, retry_after, url=exchange.url)
    try:
        data = json.loads(text)
    except ValueError:
        raise Failure(f"reply is not JSON: {text[:120]!r}", "malformed", retry=True) from None
    wanted = "data" if exchange.url.endswith("/embeddings") else "choices"
    if not isinstance(data, dict) or not data.get(wanted):
        raise Failure(f"reply has no {wanted}: {text[:120]!r}", "malformed", retry=True)
    return data
