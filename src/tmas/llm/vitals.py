"""Whether a replica still works while a call waits on it in silence: its ``/health``, and its progress.

A streamed call is silent while its request waits in the server's queue, while the server has preempted it (vLLM
frees a preempted request's KV cache and computes it again once it is rescheduled: ``vllm/v1/core/sched/scheduler.py``,
``_preempt_request``), and while an engine is wedged. Only the last is worth closing the request for: closing aborts
it and loses its place. So a silence past ``timeout_s`` is judged by what the replica shows:

- **health**: ``GET /health``. vLLM's reads an error flag only (``vllm/v1/engine/async_llm.py``, ``check_health``): a
  wedged engine answers 200. SGLang's waits for any output of its scheduler (running a one-token generation when
  idle) and answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) without (``python/sglang/srt/entrypoints/
  http_server.py``, ``health_generate``). llama-server's answers from its HTTP thread (``tools/server/
  server-context.cpp``, ``get_health``), whatever its main loop does.
- **progress**: a chunk to any of this client's calls on the replica, or its counters moving: ``/metrics``
  (vLLM's ``vllm:generation_tokens_total`` and ``vllm:prompt_tokens_total``, recorded every engine step:
  ``vllm/v1/metrics/loggers.py``; SGLang's ``sglang:generation_tokens_total`` and ``sglang:prompt_tokens_total`` with
  ``--enable-metrics``; llama-server's ``llamacpp:tokens_predicted_total``, ``llamacpp:prompt_tokens_total`` and
  ``llamacpp:n_decode_total`` with ``--metrics``, answered by its main loop, so a wedged one does not answer), else
  SGLang's ``/get_load`` (``num_reqs``, ``num_waiting_reqs``, ``num_tokens``). Each look reads them twice,
  :data:`READING_GAP_S` apart: a working engine moves them within a step; a reading that differs from the previous
  look's shows work in between.

A replica whose ``/health`` fails is dead (cause ``dead``), unless its port refused the connection while the call's own
request is still open: a server shutting down (uvicorn, under vLLM and SGLang, and cpp-httplib) closes its port and
finishes the requests it holds, so the call waits on (bounded by ``progress_timeout_s``) and the replica takes no new
ones until it answers again. One that showed no progress for ``progress_timeout_s`` while a call waited on it is
stuck (``no_progress`` before the call's first chunk, ``stall`` after it). Either leaves routing
(:meth:`tmas.llm.replica.Replica.leave`) until it shows life again (:func:`recheck`). A look is shared by the calls
waiting on one replica: concurrent ones wait for it, and one younger than half the check interval is reused.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp

from tmas.config import Endpoint
from tmas.llm.failures import Failure

# Counters whose movement is an engine's progress, under each server's name.
PROGRESS_COUNTERS = frozenset(
    {
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:prompt_tokens_total",
        "llamacpp:n_decode_total",
    }
)
# SGLang's /get_load fields (one entry per data-parallel rank), read where /metrics is off.
LOAD_FIELDS = ("num_reqs", "num_waiting_reqs", "num_tokens")
# The causes of a failure the replica's own vitals gave: it does not answer /health, or showed no progress.
LIFELESS = frozenset({"dead", "no_progress", "stall"})
# Seconds between a look's two readings (at most half of timeout_s): an engine that works moves its counters every
# step, tens of milliseconds.
READING_GAP_S = 1.0
# The longest a look waits for /health or a reading.
LOOK_TIMEOUT_S = 30.0

# What a replica's /health said at a look: it answered ("up"), failed or gave no answer ("down"), or its port refused
# the connection ("refused").
Health = Literal["up", "down", "refused"]
# What a silent call asks of its replica after each check interval: (when its silence began, whether chunks had come
# before it) -> the failure that ends the attempt, or None to wait on.
Judge = Callable[[float, bool], Awaitable[Failure | None]]


@dataclass
class Vitals:
    """What this client has seen of one replica's life."""

    # time.monotonic() of the last progress seen: a chunk to one of its calls, or its counters moving.
    seen_at: float = -math.inf
    # Its /health at the last look: "up" where it answered 200 (or 404: a server without the route).
    health: Health = "up"
    looked_at: float = -math.inf
    reading: tuple[float, ...] | None = None
    # Where its counters are read: "metrics", "get_load", "" (nowhere), None (not found out yet).
    source: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def progressed(self) -> None:
        self.seen_at = time.monotonic()


class Replica(Protocol):
    """What a look reads and marks of a replica (:class:`tmas.llm.replica.Replica`)."""

    vitals: Vitals
    down: str | None
    down_at: float

    @property
    def url(self) -> str: ...

    @property
    def root(self) -> str: ...

    def leave(self, cause: str) -> None: ...

    def back(self) -> None: ...

    def refused(self) -> None: ...


def check_interval(endpoint: Endpoint) -> float:
    """Seconds between the checks of a silence past ``timeout_s``."""
    bound = endpoint.progress_timeout_s
    return endpoint.timeout_s if bound is None else min(endpoint.timeout_s, bound)


def judge(session: aiohttp.ClientSession, replica: Replica, endpoint: Endpoint, api_key: str | None) -> Judge:
    """The judge of a call's silences on ``replica`` (see the module's docstring)."""

    async def verdict(silent_since: float, streaming: bool) -> Failure | None:
        vitals = await look(session, replica, api_key, endpoint, fresh_s=check_interval(endpoint) / 2)
        now = time.monotonic()
        silent = now - silent_since
        what = "no chunk" if streaming else "no first chunk"
        if vitals.health == "refused":
            replica.refused()  # shutting down: it finishes this call's request, and takes no new one
        elif vitals.health == "down":
            replica.leave("dead")
            message = f"{replica.url} sent {what} for {silent:.0f}s and does not answer /health"
            return Failure(message, "dead", retry=True)
        bound = endpoint.progress_timeout_s
        if bound is None:
            return None
        # A replica already out for showing no progress, and silent since, is still stuck: its calls go at once.
        still_stuck = replica.down == "no_progress" and vitals.seen_at <= replica.down_at
        idle = now - max(silent_since, vitals.seen_at)
        if idle < bound and not still_stuck:
            return None
        replica.leave("no_progress")
        said = f"{what} from {replica.url} for {silent:.0f}s, and it showed no progress"
        said += f" (progress_timeout_s = {bound:g}s)"
        if streaming:
            return Failure(f"stream stalled: {said}", "stall", retry=True)
        return Failure(said, "no_progress", retry=True)

    return verdict


async def look(
    session: aiohttp.ClientSession, replica: Replica, api_key: str | None, endpoint: Endpoint, *, fresh_s: float
) -> Vitals:
    """Ask ``replica`` for its health and read its counters twice (see the module's docstring), unless a look younger
    than ``fresh_s`` stands."""
    vitals = replica.vitals
    async with vitals.lock:
        if time.monotonic() - vitals.looked_at < fresh_s:
            return vitals
        timeout_s = min(endpoint.timeout_s, LOOK_TIMEOUT_S)
        health = asyncio.ensure_future(health_of(session, replica, api_key, timeout_s))
        try:
            first = await reading(session, replica, api_key, timeout_s)
            if first is not None:
                if vitals.reading is not None and first != vitals.reading:
                    vitals.progressed()
                await asyncio.sleep(min(READING_GAP_S, endpoint.timeout_s / 2))
                second = await reading(session, replica, api_key, timeout_s)
                if second is not None and second != first:
                    vitals.progressed()
                vitals.reading = second if second is not None else first
            vitals.health = await health
        finally:
            if not health.done():
                health.cancel()
        vitals.looked_at = time.monotonic()
    return vitals


async def recheck(session: aiohttp.ClientSession, replica: Replica, endpoint: Endpoint, api_key: str | None) -> None:
    """Look again at a replica out of routing. It comes back once it answers /health and, out for showing no
    progress, its counters moved or it has been out for ``progress_timeout_s`` (then it is tried again: a replica still
    wedged leaves again after another bound)."""
    vitals = await look(session, replica, api_key, endpoint, fresh_s=0.0)
    if vitals.health != "up":
        return
    stuck = replica.down == "no_progress" and vitals.seen_at <= replica.down_at
    if stuck and time.monotonic() - replica.down_at < (endpoint.progress_timeout_s or 0.0):
        return
    replica.back()


async def health_of(session: aiohttp.ClientSession, replica: Replica, api_key: str | None, timeout_s: float) -> Health:
    """What the replica's /health says (a server working through a long queue still answers). A 5xx is a server that
    says it is unhealthy (vLLM, SGLang); a 404 one that has no such route but answered (a hosted API)."""
    try:
        answer = await _fetch(session, f"{replica.root}/health", api_key, timeout_s)
    except ConnectionRefusedError:
        return "refused"
    return "up" if answer is not None and answer[0] < 500 else "down"


async def reading(
    session: aiohttp.ClientSession, replica: Replica, api_key: str | None, timeout_s: float
) -> tuple[float, ...] | None:
    """The replica's progress counters now, or None where none could be read this time (none stated, or no answer)."""
    vitals = replica.vitals
    answered = True
    if vitals.source in (None, "metrics"):
        answer = await _get(session, f"{replica.root}/metrics", api_key, timeout_s)
        counters = prometheus_counters(answer[1]) if answer is not None and answer[0] == 200 else None
        if counters is not None:
            vitals.source = "metrics"
            return counters
        answered = answer is not None
        if vitals.source == "metrics":
            return None
    if vitals.source in (None, "get_load"):
        answer = await _get(session, f"{replica.root}/get_load", api_key, timeout_s)
        load = load_counters(answer[1]) if answer is not None and answer[0] == 200 else None
        if load is not None:
            vitals.source = "get_load"
            return load
        answered = answered and answer is not None
    if vitals.source is None and answered:
        vitals.source = ""  # both routes answered without counters: nothing to read on this replica
    return None


def prometheus_counters(text: str) -> tuple[float, ...] | None:
    """The :data:`PROGRESS_COUNTERS` in a Prometheus text exposition, each summed over its labels, in name order;
    None when it has none of them."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        # "name{labels} value [timestamp]" or "name value [timestamp]".
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, rest = (line[:space], line[space:]) if space != -1 else (line, "")
        if name not in PROGRESS_COUNTERS:
            continue
        try:
            sums[name] = sums.get(name, 0.0) + float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return tuple(sums[name] for name in sorted(sums)) if sums else None


def load_counters(text: str) -> tuple[float, ...] | None:
    """SGLang's /get_load fields (:data:`LOAD_FIELDS`) summed over its ranks; None when the reply has none."""
    try:
        data: Any = json.loads(text)
    except ValueError:
        return None
    entries = data if isinstance(data, list) else [data]
    sums = [0.0] * len(LOAD_FIELDS)
    found = False
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        for i, name in enumerate(LOAD_FIELDS):
            value = entry.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                sums[i] += float(value)
                found = True
    return tuple(sums) if found else None


async def _get(
    session: aiohttp.ClientSession, url: str, api_key: str | None, timeout_s: float
) -> tuple[int, str] | None:
    """(status, body) of a GET of ``url``; None when no answer came (refused, cut, or not within ``timeout_s``)."""
    try:
        return await _fetch(session, url, api_key, timeout_s)
    except ConnectionRefusedError:
        return None


async def _fetch(
    session: aiohttp.ClientSession, url: str, api_key: str | None, timeout_s: float
) -> tuple[int, str] | None:
    """:func:`_get`, but a refused connection raises ConnectionRefusedError."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await resp.text(errors="replace")
    except aiohttp.ClientConnectorError as exc:
        if isinstance(exc.os_error, ConnectionRefusedError):
            raise ConnectionRefusedError(str(exc)) from None
        return None
    except (aiohttp.ClientError, TimeoutError):
        return None
