"""A simulated OpenAI-compatible server on loopback, for tests and benchmarks.

``SimServer`` runs the aiohttp app on its own event loop in a daemon thread, so synchronous and async tests
alike talk real HTTP to it. ``python -m tmas.testing.sim_server`` serves the same app from the command line.

All request handling happens on the server's loop thread; a lock guards the few structures (stats, request
log) that other threads read, so methods such as ``stats()`` are safe to call from the test thread.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

from aiohttp import web
from pydantic import BaseModel

from tmas.testing.long_replies import long_choice, request_digest
from tmas.testing.personas import PERSONAS, Persona, cache_capacity, persona_of
from tmas.testing.prefix_cache import PrefixCache, SlotCache, prompt_tokens
from tmas.testing.replies import Choice, Reply, certain_logprobs, sse
from tmas.testing.responders import (
    SimRequest,
    content_text,
    count_tokens,
    count_tokens_cached,
    cut_tokens,
    fake_reasoning,
    garbage_text,
    get_responder,
    stable_hash,
)
from tmas.testing.script import FaultKind, Rule, ScriptedUsage, SimScript

ROLE_HEADER = "X-Tmas-Role"
PROBLEM_HEADER = "X-Tmas-Problem"
_SHUTDOWN_TIMEOUT_S = 0.25  # hung "timeout" faults must not hold up stop()
_WORD_RE = re.compile(r"\w+")


class SimStats(BaseModel):
    """Counters since start or the last reset."""

    total_requests: int = 0  # chat completions + embeddings received
    completed: int = 0  # answered with a 200 and a well-formed body (garbage/truncate faults included)
    errors: int = 0  # rejected as invalid (bad JSON, context too long, ...), not counting injected faults
    in_flight: int = 0
    max_in_flight: int = 0
    # Problems (X-Tmas-Problem) in flight at once, most ever: a problem is in flight from its first chat request's
    # arrival to the end of its latest answer so far, so the pauses between its calls count as in flight too.
    max_problems_in_flight: int = 0
    # llama-server's `id_slot`: the most requests in flight at once that named one slot (a real server would queue
    # the extra ones inside itself, where the client's timeouts run).
    max_in_flight_per_slot: int = 0
    by_role: dict[str, int] = {}
    faults: dict[str, int] = {}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Of completion_tokens, the reasoning (reported by the personas as each server does, or hidden by OpenAI).
    reasoning_tokens: int = 0
    # Of prompt_tokens, those served from this replica's prefix cache (SimScript.prefix_cache_tokens).
    cached_prompt_tokens: int = 0
    # Request fields the persona's server does not know and ignored, by name (vLLM logs them).
    ignored_fields: dict[str, int] = {}
    # Streams the client closed before their end (a real server then aborts the request): they are not completed.
    disconnected: int = 0


class LoggedRequest(BaseModel):
    """One entry of the request log."""

    endpoint: str  # "chat" or "embeddings"
    role: str
    problem_id: str | None
    body: dict[str, Any]
    received_at: float  # time.time()
    # The Authorization header as received (tests prove a key was sent without it reaching any artefact).
    authorization: str | None = None
    # Every other request header, by its lower-cased name (e.g. a router's session key).
    headers: dict[str, str] = {}


class _LogEntry(NamedTuple):
    # Kept as a tuple on the hot path; turned into LoggedRequest only when someone reads the log.
    endpoint: str
    role: str
    problem_id: str | None
    body: dict[str, Any]
    received_at: float
    authorization: str | None
    headers: dict[str, str]


@dataclass
class _Active:
    """The script with its per-script state, replaced wholesale so a request sees one consistent set."""

    script: SimScript
    rule_counts: list[int]
    rng: random.Random
    persona: Persona
    # The replica's prefix cache (None: off); only the server's loop thread touches it.
    cache: PrefixCache | SlotCache | None
    faults: list[tuple[FaultKind, float]] = field(default_factory=list)

    @classmethod
    def of(cls, script: SimScript) -> _Active:
        persona = persona_of(script)
        capacity = cache_capacity(script)
        cache: PrefixCache | SlotCache | None = None
        if capacity > 0 and persona.slot_cache:
            cache = SlotCache(script.slots)
        elif capacity > 0:
            if capacity < persona.cache_block_tokens:
                raise ValueError(
                    f"prefix_cache_tokens={capacity} is less than one {persona.name} cache block "
                    f"({persona.cache_block_tokens} tokens)"
                )
            cache = PrefixCache(capacity, persona.cache_block_tokens)
        rng = random.Random(script.seed)
        return cls(script, [0] * len(script.rules), rng, persona, cache, script.faults.cumulative())


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body."""
    payload = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(payload, status=status, headers=headers)


_FAULT_STATUS: dict[str, tuple[int, str, str]] = {
    "http_500": (500, "InternalServerError", "Simulated internal server error."),
    "http_503": (503, "ServiceUnavailableError", "Simulated overload: the server is not ready."),
    "http_429": (429, "RateLimitError", "Simulated rate limit: too many requests."),
    "http_400": (400, "BadRequestError", "Simulated bad request."),
}
_EMBEDDING_FAULTS = frozenset(
    {"http_500", "http_503", "http_429", "http_400", "timeout", "drop", "malformed", "stall", "cut", "stream_error"}
)
# A stream's faults on a reply sent whole: a stalled server hangs, a cut connection drops, an error is a 500.
_UNSTREAMED: dict[FaultKind, FaultKind] = {"stall": "timeout", "cut": "drop", "stream_error": "http_500"}
# The error event vLLM and SGLang send inside a stream when generation fails.
_STREAM_ERROR = {
    "error": {"message": "Simulated error mid-generation.", "type": "InternalServerError", "param": None, "code": 500}
}
_MALFORMED_BODY = '{"id": "chatcmpl-sim", "choices": ['


def embed_text(text: str, dim: int) -> list[float]:
    """Hashed bag of words, L2-normalised: texts that share words point in similar directions."""
    vec = [0.0] * dim
    for word in _WORD_RE.findall(text.lower()):
        # crc32, not hash(): the same vector in every process. The top bit picks a sign so unrelated words
        # colliding in one bucket tend to cancel rather than add up.
        h = zlib.crc32(word.encode())
        vec[h % dim] += 1.0 if h & 0x80000000 else -1.0
    norm = math.sqrt(sum(x * x for x in vec))
    if norm == 0.0:
        vec[0] = 1.0  # empty text: a fixed unit vector, so cosine maths never divides by zero
        return vec
    return [x / norm for x in vec]


class SimApp:
    """The simulator's state and request handlers; ``build()`` gives the aiohttp application."""

    def __init__(self, script: SimScript | None = None) -> None:
        self._lock = threading.Lock()
        script = script or SimScript()
        self._active = _Active.of(script)
        self._log: deque[_LogEntry] = deque(maxlen=script.log_limit)
        self._stats = SimStats()
        # Problem id -> [first arrival, latest answer's end, chat requests open] (time.monotonic()).
        self._spans: dict[str, list[float]] = {}
        # id_slot -> requests naming it now in flight; id(request) -> the slot it named, until it is answered.
        self._slots: dict[str, int] = {}
        self._request_slots: dict[int, str] = {}

    # ---- thread-safe control ---------------------------------------------------------------------

    @property
    def script(self) -> SimScript:
        return self._active.script

    def set_script(self, script: SimScript) -> None:
        """Replace the script; rule counters and the fault generator start afresh, stats and log are kept."""
        with self._lock:
            self._active = _Active.of(script)
            if self._log.maxlen != script.log_limit:
                self._log = deque(self._log, maxlen=script.log_limit)

    def reset(self) -> None:
        """Clear stats, the request log and rule counters (and reseed the fault generator)."""
        with self._lock:
            in_flight = self._stats.in_flight
            self._stats = SimStats(in_flight=in_flight, max_in_flight=in_flight)
            self._log.clear()
            self._spans.clear()
            self._active = _Active.of(self._active.script)

    def stats(self) -> SimStats:
        with self._lock:
            return self._stats.model_copy(
                update={
                    "by_role": dict(self._stats.by_role),
                    "faults": dict(self._stats.faults),
                    "ignored_fields": dict(self._stats.ignored_fields),
                    "max_problems_in_flight": self._most_problems_at_once(),
                }
            )

    def _most_problems_at_once(self) -> int:
        """The most problem spans that overlap (called under the lock). A span still open ends now."""
        now = time.monotonic()
        # At equal times an end sorts before a start: a problem answered as the next one arrives is not overlapping.
        events = sorted(
            [(start, 1) for start, _, _ in self._spans.values()]
            + [(end if open_ == 0 else now, -1) for _, end, open_ in self._spans.values()]
        )
        most = running = 0
        for _, step in events:
            running += step
            most = max(most, running)
        return most

    def _problem_enter(self, problem: str | None) -> None:
        if problem is None:
            return
        with self._lock:
            span = self._spans.setdefault(problem, [time.monotonic(), 0.0, 0])
            span[2] += 1

    def _problem_leave(self, problem: str | None) -> None:
        if problem is None:
            return
        with self._lock:
            span = self._spans.get(problem)
            if span is not None:  # (a reset between arrival and answer dropped it)
                span[1] = time.monotonic()
                span[2] -= 1

    def requests(self, last: int | None = None) -> list[LoggedRequest]:
        with self._lock:
            entries = list(self._log)
        if last is not None:
            entries = entries[-last:] if last > 0 else []
        return [LoggedRequest.model_construct(**entry._asdict()) for entry in entries]

    # ---- application -----------------------------------------------------------------------------

    def build(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/_sim/stats", self._get_stats)
        app.router.add_post("/_sim/script", self._post_script)
        app.router.add_post("/_sim/reset", self._post_reset)
        app.router.add_get("/_sim/requests", self._get_requests)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        active = self._active
        persona, script = active.persona, active.script
        extra = persona.models_extra(script) if persona.models_extra is not None else {}
        return web.json_response({**extra, "object": "list", "data": [persona.model_card(script)]})

    async def _get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats().model_dump())

    async def _post_script(self, request: web.Request) -> web.Response:
        try:
            self.set_script(SimScript.model_validate_json(await request.read()))
        except ValueError as exc:  # pydantic's ValidationError included
            return error_response(400, f"invalid script: {exc}", "BadRequestError")
        return web.json_response({"ok": True})

    async def _post_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    async def _get_requests(self, request: web.Request) -> web.Response:
        last = request.query.get("last")
        try:
            entries = self.requests(int(last) if last is not None else None)
        except ValueError:
            return error_response(400, "last must be an integer", "BadRequestError")
        return web.json_response([entry.model_dump() for entry in entries])

    # ---- shared request plumbing -----------------------------------------------------------------

    def _enter(self, role: str) -> None:
        with self._lock:
            stats = self._stats
            stats.total_requests += 1
            stats.in_flight += 1
            if stats.in_flight > stats.max_in_flight:
                stats.max_in_flight = stats.in_flight
            stats.by_role[role] = stats.by_role.get(role, 0) + 1

    def _leave(self) -> None:
        with self._lock:
            self._stats.in_flight -= 1

    def _slot_enter(self, request: web.Request, slot: Any) -> None:
        if slot is None:
            return
        with self._lock:
            self._request_slots[id(request)] = slot = str(slot)
            self._slots[slot] = self._slots.get(slot, 0) + 1
            self._stats.max_in_flight_per_slot = max(self._stats.max_in_flight_per_slot, self._slots[slot])

    def _slot_leave(self, request: web.Request) -> None:
        with self._lock:
            slot = self._request_slots.pop(id(request), None)
            if slot is not None:
                self._slots[slot] -= 1

    def _log_request(self, request: web.Request, endpoint: str, role: str, body: dict[str, Any], at: float) -> None:
        headers = {name.lower(): value for name, value in request.headers.items() if name.lower() != "authorization"}
        if endpoint == "chat" and self._active.script.log_digests:
            body = request_digest(body)
        entry = _LogEntry(
            endpoint, role, request.headers.get(PROBLEM_HEADER), body, at, request.headers.get("Authorization"), headers
        )
        with self._lock:
            self._log.append(entry)

    def _count_fault(self, kind: str) -> None:
        with self._lock:
            self._stats.faults[kind] = self._stats.faults.get(kind, 0) + 1

    def _count_disconnect(self) -> None:
        with self._lock:
            self._stats.disconnected += 1

    def _count_error(self) -> None:
        with self._lock:
            self._stats.errors += 1

    def _count_ignored(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._stats.ignored_fields[name] = self._stats.ignored_fields.get(name, 0) + 1

    def _count_done(self, prompt_tokens: int, completion_tokens: int, reasoning: int = 0, cached: int = 0) -> None:
        with self._lock:
            stats = self._stats
            stats.completed += 1
            stats.prompt_tokens += prompt_tokens
            stats.completion_tokens += completion_tokens
            stats.reasoning_tokens += reasoning
            stats.cached_prompt_tokens += cached

    @staticmethod
    async def _read_json(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadRequest(f"Request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _BadRequest("Request body must be a JSON object.")
        return body

    @staticmethod
    def _pick_rule(active: _Active, role: str, texts: list[str], uses: int = 1) -> tuple[Rule | None, int]:
        """The first matching rule with ``times`` not used up, and how many times it applied before; it counts
        ``uses`` applications (one per choice of the request).

        Only the loop thread touches ``rule_counts`` (a reset swaps in a new list), so no lock is needed.
        """
        joined: str | None = None
        for i, rule in enumerate(active.script.rules):
            used = active.rule_counts[i]
            if rule.times is not None and used >= rule.times:
                continue
            if rule.role is not None and rule.role != role:
                continue
            if rule.regex is not None:
                if joined is None:
                    joined = "\n".join(texts)
                if rule.regex.search(joined) is None:
                    continue
            active.rule_counts[i] = used + uses
            return rule, used
        return None, 0

    @staticmethod
    def _draw_fault(active: _Active) -> FaultKind | None:
        if not active.faults:
            return None  # no draw at all: a fault-free script costs nothing here
        r = active.rng.random()
        for kind, bound in active.faults:
            if r < bound:
                return kind
        return None

    async def _fault_response(
        self, request: web.Request, fault: FaultKind, script: SimScript, stream: bool = False
    ) -> web.StreamResponse | None:
        """The response for faults that replace the answer altogether; ``None`` for those that alter it."""
        if not stream:
            fault = _UNSTREAMED.get(fault, fault)
        if fault in _FAULT_STATUS:
            status, kind, message = _FAULT_STATUS[fault]
            headers = {"Retry-After": "0"} if status == 429 else None
            return error_response(status, message, kind, headers)
        if fault == "drop":
            # Close the socket under the client: it sees a disconnect, never a status line. The empty
            # response returned afterwards fails to write, which aiohttp takes as a client disconnect.
            if request.transport is not None:
                request.transport.close()
            return web.Response()
        if fault == "malformed" and not stream:
            # (A stream instead gets one broken event and no [DONE]: see _stream.)
            return web.Response(status=200, text=_MALFORMED_BODY, content_type="application/json")
        if fault == "timeout":
            await asyncio.sleep(script.hang_s)  # then answer normally, as a very slow server would
        return None

    # ---- /v1/chat/completions --------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        role = request.headers.get(ROLE_HEADER) or "default"
        problem = request.headers.get(PROBLEM_HEADER)
        self._enter(role)
        self._problem_enter(problem)
        persona = self._active.persona
        try:
            return await self._chat_inner(request, role, received)
        except _BadRequest as exc:
            self._count_error()
            return web.json_response(persona.error(exc.status, exc.message, exc.param, exc.code), status=exc.status)
        finally:
            self._slot_leave(request)
            self._problem_leave(problem)
            self._leave()

    async def _chat_inner(self, request: web.Request, role: str, received: float) -> web.StreamResponse:
        problem = request.headers.get(PROBLEM_HEADER)
        active = self._active
        script, persona = active.script, active.persona
        try:
            body = await self._read_json(request)
        except _BadRequest:
            self._log_request(request, "chat", role, {}, received)
            raise
        self._log_request(request, "chat", role, body, received)
        self._slot_enter(request, body.get("id_slot"))

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _BadRequest("'messages' must be a non-empty list of message objects.")
        n = 1 if body.get("n") is None else body["n"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _BadRequest("n must be a positive integer.")
        most = persona.max_n(script)
        if most is not None and n > most:
            raise _BadRequest(persona.n_refusal)
        self._check_fields(active, body)
        if body.get("response_format") is not None:
            rf = body["response_format"]
            kind = rf.get("type") if isinstance(rf, dict) else None
            if script.response_format == "reject" or (
                persona.response_formats is not None and kind not in persona.response_formats
            ):
                raise _BadRequest(f"response_format type {kind!r} is not supported by this server")
        if script.stream == "refuse" and body.get("stream"):
            raise _BadRequest("stream is not supported by this server")
        streams = bool(body.get("stream")) and script.stream == "accept"
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise _BadRequest("max_tokens must be a positive integer.")
        id_slot = body.get("id_slot")
        valid_slot = id_slot in (None, -1) or (isinstance(id_slot, int) and 0 <= id_slot < script.slots)
        if persona.slot_cache and not valid_slot:
            raise _BadRequest("Invalid slot ID")

        texts = [content_text(m.get("content")) for m in messages]
        prompt_tokens = sum(count_tokens_cached(t) for t in texts) + 4 * len(texts)
        requested = prompt_tokens + (max_tokens or 0)
        if requested > script.context_length:
            raise _BadRequest(
                f"This model's maximum context length is {script.context_length} tokens. "
                f"However, you requested {requested} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens or 0} in the completion). "
                "Please reduce the length of the messages or completion."
            )

        rule, used = self._pick_rule(active, role, texts, n)
        fault = rule.fault if rule is not None else self._draw_fault(active)
        if fault is not None:
            self._count_fault(fault)
        fixed_latency = rule.latency_s if rule is not None and rule.latency_s is not None else script.latency_s
        per_token = 0.0 if rule is not None and rule.latency_s is not None else script.latency_per_token_s
        if fixed_latency > 0:
            await asyncio.sleep(fixed_latency)
        if fault is not None:
            replaced = await self._fault_response(request, fault, script, streams)
            if replaced is not None:
                return replaced

        # The prompt is served from the cache once, whatever n is: the choices share its prefill.
        cached = self._serve_cache(active, messages, texts, id_slot)
        scripted = rule.usage if rule is not None else None
        timings: dict[str, Any] | None = None
        if scripted is not None:
            prompt_tokens = scripted.prompt_tokens
            if scripted.cached_tokens is not None and scripted.cached_in == "timings" and not persona.timings:
                # A scripted llama-server shape: the tokens reused, and the ones computed.
                timings = {"cache_n": scripted.cached_tokens, "prompt_n": prompt_tokens - scripted.cached_tokens}
            elif scripted.cached_tokens is not None:
                cached = scripted.cached_tokens
        choices = [
            self._choice(active, role, problem, body, i, n, rule, used, fault, max_tokens, scripted) for i in range(n)
        ]
        model = body.get("model") if persona.echoes_model and isinstance(body.get("model"), str) else script.model
        reply = Reply(
            persona=persona,
            script=script,
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(received),
            model=str(model),
            choices=choices,
            prompt_tokens=prompt_tokens,
            cached=cached,
            timings=timings,
        )
        counts = reply.counts()
        done = (prompt_tokens, counts.completion, counts.reasoning, cached or 0)
        if streams:
            stream_options = body.get("stream_options")
            options = stream_options if isinstance(stream_options, dict) else {}
            reply.continuous_usage = bool(options.get("continuous_usage_stats"))
            include_usage = bool(options.get("include_usage"))
            return await self._stream(
                request, reply, include_usage, per_token, fault, script.hang_s, lambda: self._count_done(*done)
            )
        if per_token > 0 and counts.completion:
            await asyncio.sleep(per_token * counts.completion)
        self._count_done(*done)
        return web.json_response(reply.completion())

    def _check_fields(self, active: _Active, body: dict[str, Any]) -> None:
        """What the persona's server does with the request's fields: unknown ones ignored (and counted) or refused;
        a reasoning model's unsupported parameters; another model's name."""
        persona, script = active.persona, active.script
        if persona.known_fields is not None:
            unknown = [name for name in body if name not in persona.known_fields]
            if unknown and persona.rejects_unknown:
                raise _BadRequest(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
            if unknown:
                self._count_ignored(unknown)
        if script.reasoning:  # the model reasons: a reasoning model's restrictions apply
            for name, tail in persona.unsupported.items():
                if body.get(name) is not None:
                    message = f"Unsupported parameter: '{name}' is not supported with this model.{tail}"
                    raise _BadRequest(message, param=name, code="unsupported_parameter")
            for name in persona.default_only:
                value = body.get(name)
                if value is not None and value != 1:
                    message = (
                        f"Unsupported value: '{name}' does not support {value} with this model. "
                        "Only the default (1) value is supported."
                    )
                    raise _BadRequest(message, param=name, code="unsupported_value")
        model = body.get("model")
        if persona.unknown_model is not None and model is not None and model != script.model:
            raise _BadRequest(persona.unknown_model.format(model=model), 404, "model", "model_not_found")

    @staticmethod
    def _serve_cache(active: _Active, messages: list[dict[str, Any]], texts: list[str], id_slot: Any) -> int | None:
        """Prompt tokens this replica's prefix cache served (None: it has none); the prompt then enters it."""
        cache = active.cache
        if cache is None:
            return None
        tokens = prompt_tokens([(str(m.get("role")), text) for m, text in zip(messages, texts, strict=True)])
        if isinstance(cache, SlotCache):
            slot = id_slot if isinstance(id_slot, int) and id_slot >= 0 else None
            return cache.serve(tokens, slot)[1]
        hits = cache.serve(tokens)
        return hits if hits >= active.persona.cache_min_tokens else 0

    def _choice(
        self,
        active: _Active,
        role: str,
        problem: str | None,
        body: dict[str, Any],
        index: int,
        n: int,
        rule: Rule | None,
        used: int,
        fault: FaultKind | None,
        max_tokens: int | None,
        scripted: ScriptedUsage | None,
    ) -> Choice:
        """Choice ``index`` of ``n``. With n > 1 each choice is sampled as if asked alone with its own seed (the
        request's for the first, one derived from it and the index for the others), so the choices differ and are
        the same on every run."""
        script, persona = active.script, active.persona
        seed = body.get("seed")
        sample_body = body
        if n > 1:
            sample_body = {k: v for k, v in body.items() if k != "n"}
            if index > 0:
                seed = stable_hash(seed, "choice", index) % 2**31
                sample_body["seed"] = seed
        sim = SimRequest(
            role=role,
            problem_id=problem,
            messages=body["messages"],
            body=sample_body,
            seed=seed if isinstance(seed, int) else None,
            script=script,
        )
        if rule is not None and rule.replies:
            content = rule.replies[(used + index) % len(rule.replies)]
        else:
            content = get_responder(role)(sim)
        long = script.long_replies
        if (
            long is not None
            and long.covers(role)
            and fault not in ("garbage", "truncate")
            and not (rule and rule.replies)
        ):
            return long_choice(long, sim, content, max_tokens, persona, script)
        reasoning: str | None = None
        if rule is not None and rule.reasoning is not None:
            reasoning = rule.reasoning
        elif script.reasoning or script.think_tags:
            reasoning = fake_reasoning(sim)

        finish_reason = "stop"
        if fault == "garbage":
            content = garbage_text(random.Random(sim.sample_key))
        elif fault == "truncate":
            content = cut_tokens(content, max(1, count_tokens(content) // 2))
            finish_reason = "length"
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        for s in stops:
            if isinstance(s, str) and s and s in content:
                content = content[: content.index(s)]
        if reasoning is not None and script.think_tags:
            content = f"<think>\n{reasoning}\n</think>\n\n{content}"
            reasoning = None

        # max_tokens covers the whole completion: the chain of thought spends the budget first, as in a model.
        reasoning_tokens = count_tokens(reasoning) if reasoning is not None else 0
        content_tokens = count_tokens(content)
        if max_tokens is not None and reasoning_tokens + content_tokens > max_tokens:
            if reasoning is not None and reasoning_tokens >= max_tokens:
                reasoning, reasoning_tokens = cut_tokens(reasoning, max_tokens), max_tokens
            content = cut_tokens(content, max_tokens - reasoning_tokens)
            content_tokens = count_tokens(content)
            finish_reason = "length"
        if rule is not None and rule.finish_reason is not None:
            finish_reason = rule.finish_reason
        completion_tokens = reasoning_tokens + content_tokens
        if scripted is not None:
            completion_tokens, reasoning_tokens = scripted.completion_tokens, scripted.reasoning_tokens

        logprobs: list[dict[str, Any]] | None = None
        if body.get("logprobs") and script.logprobs:
            given = rule.logprobs if rule is not None else None
            top = body.get("top_logprobs")
            top = persona.default_top_logprobs if top is None else top
            logprobs = given if given is not None else certain_logprobs(content, top, persona)
        return Choice(content, reasoning, finish_reason, logprobs, reasoning_tokens, completion_tokens)

    async def _stream(
        self,
        request: web.Request,
        reply: Reply,
        include_usage: bool,
        per_token: float,
        fault: FaultKind | None,
        hang_s: float,
        answered: Callable[[], None],
    ) -> web.StreamResponse:
        """The reply as a stream; ``answered`` is told just before its last event goes out (so the stats count it
        before the client can read it whole), and not at all where the client closed the stream first."""
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        # With a per-token latency tokens trickle out one delta each, as from a real server; else in a few pieces.
        events = reply.events(include_usage, per_token_deltas=per_token > 0)
        if fault == "malformed":
            events = [events[0], (b"data: " + _MALFORMED_BODY.encode() + b"\n\n", 0)]
        elif fault == "stream_error":
            events = [*events[:2], (sse(_STREAM_ERROR), 0), (b"data: [DONE]\n\n", 0)]

        # stall and cut: the opening chunk and the first delta go out, then nothing for hang_s, or a closed socket.
        head = 2 if fault in ("stall", "cut") else len(events) - 1
        try:
            await _write_events(response, events[:head], per_token)
            if fault == "cut":
                answered()
                if request.transport is not None:
                    request.transport.close()
                return response
            if fault == "stall":
                await asyncio.sleep(hang_s)
            await _write_events(response, events[head:-1], per_token)
            answered()
            await _write_events(response, events[-1:], per_token)
            await response.write_eof()
        except ConnectionResetError:
            # The client closed the stream (e.g. it stopped a weak trace): the rest is never generated.
            self._count_disconnect()
            return response
        except asyncio.CancelledError:
            # The same, noticed first by the server (handler_cancellation), as vLLM and SGLang abort such a request.
            self._count_disconnect()
            raise
        return response

    # ---- /v1/embeddings --------------------------------------------------------------------------

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        role = request.headers.get(ROLE_HEADER) or "default"
        self._enter(role)
        try:
            return await self._embeddings_inner(request, role, received)
        except _BadRequest as exc:
            self._count_error()
            return error_response(400, exc.message, "BadRequestError")
        finally:
            self._leave()

    async def _embeddings_inner(self, request: web.Request, role: str, received: float) -> web.StreamResponse:
        active = self._active
        script = active.script
        try:
            body = await self._read_json(request)
        except _BadRequest:
            self._log_request(request, "embeddings", role, {}, received)
            raise
        self._log_request(request, "embeddings", role, body, received)

        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
            raise _BadRequest("'input' must be a string or a non-empty list of strings.")
        dim = body.get("dimensions") or script.embedding_dim
        if not isinstance(dim, int) or dim < 1:
            raise _BadRequest("dimensions must be a positive integer.")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise _BadRequest("encoding_format must be 'float' or 'base64'.")
        prompt_tokens = sum(count_tokens_cached(t) for t in inputs)
        if max(count_tokens_cached(t) for t in inputs) > script.context_length:
            raise _BadRequest(
                f"This model's maximum context length is {script.context_length} tokens. "
                "However, an input is longer. Please reduce the length of the input."
            )

        rule, _ = self._pick_rule(active, role, inputs)
        fault = rule.fault if rule is not None else self._draw_fault(active)
        if fault is not None and fault not in _EMBEDDING_FAULTS:
            fault = None  # truncate / garbage mean nothing for a vector
        if fault is not None:
            self._count_fault(fault)
        latency = rule.latency_s if rule is not None and rule.latency_s is not None else script.latency_s
        if latency > 0:
            await asyncio.sleep(latency)
        if fault is not None:
            replaced = await self._fault_response(request, fault, script)
            if replaced is not None:
                return replaced

        data: list[dict[str, Any]] = []
        for i, text in enumerate(inputs):
            vec = embed_text(text, dim)
            embedding: list[float] | str = vec
            if encoding == "base64":  # little-endian float32, as the OpenAI SDK decodes it
                embedding = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        payload = {
            "object": "list",
            "data": data,
            "model": script.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
        self._count_done(prompt_tokens, 0)
        return web.json_response(payload)


async def _write_events(response: web.StreamResponse, events: list[tuple[bytes, int]], per_token: float) -> None:
    if per_token > 0:
        # Tokens trickle out: each delta waits for its share of the per-token latency.
        for data, tokens in events:
            if tokens:
                await asyncio.sleep(per_token * tokens)
            await response.write(data)
    elif events:
        await response.write(b"".join(data for data, _ in events))  # one write: far fewer syscalls


# ---- running it ---------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    # Bound in the caller's thread so "address in use" surfaces right there, and port 0 resolves at once.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def _start_site(app: SimApp, sock: socket.socket) -> web.AppRunner:
    # No access log (it costs more than the request itself); cancel handlers whose client went away so a hung
    # "timeout" fault does not linger after the client gave up.
    runner = web.AppRunner(
        app.build(), access_log=None, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    return runner


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class SimServer:
    """The simulator in a background thread: ``with SimServer(script) as sim: ... sim.base_url ...``."""

    def __init__(self, script: SimScript | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = SimApp(script)
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock = threading.Lock()

    @property
    def url(self) -> str:
        """Root URL, for the control endpoints (``/_sim/...``, ``/health``)."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL, ending in ``/v1``."""
        return f"{self.url}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> SimServer:
        """Start serving; returns once the socket is listening. Idempotent."""
        with self._start_lock:
            if self.running:
                return self
            sock = _bind(self.host, self.port)
            self.port = sock.getsockname()[1]
            ready = threading.Event()
            failure: list[BaseException] = []
            self._thread = threading.Thread(
                target=self._run, args=(sock, ready, failure), name=f"tmas-sim-{self.port}", daemon=True
            )
            self._thread.start()
            ready.wait()
            if failure:
                self._thread.join()
                self._thread = None
                raise RuntimeError(f"simulated server failed to start: {failure[0]}") from failure[0]
            return self

    def _run(self, sock: socket.socket, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = loop.run_until_complete(_start_site(self.app, sock))
        except BaseException as exc:
            failure.append(exc)
            sock.close()
            loop.close()
            ready.set()
            return
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self._loop = None

    def stop(self) -> None:
        """Stop serving and join the thread (requests still hanging are cancelled). Idempotent."""
        with self._start_lock:
            thread, loop = self._thread, self._loop
            if thread is None:
                return
            if thread is threading.current_thread():
                raise RuntimeError("SimServer.stop() called from its own server thread")
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed under us
                    loop.call_soon_threadsafe(loop.stop)
            thread.join()
            self._thread = None

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> SimServer:
        # start() and stop() block briefly on the server thread: keep the caller's event loop free meanwhile.
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    # ---- control (safe from any thread) ----------------------------------------------------------

    @property
    def script(self) -> SimScript:
        return self.app.script

    def set_script(self, script: SimScript) -> None:
        self.app.set_script(script)

    def reset(self) -> None:
        self.app.reset()

    def stats(self) -> SimStats:
        return self.app.stats()

    @property
    def requests(self) -> list[LoggedRequest]:
        """A snapshot of the request log, oldest first."""
        return self.app.requests()

    def chat_bodies(self, role: str | None = None) -> list[dict[str, Any]]:
        """The bodies of the chat completions received (of ``role`` only, when given), oldest first: what tests
        assert to prove configuration reached the wire. The log keeps the last ``SimScript.log_limit`` requests."""
        return [r.body for r in self.app.requests() if r.endpoint == "chat" and (role is None or r.role == role)]


# ---- command line -------------------------------------------------------------------------------


async def _serve_forever(app: SimApp, host: str, port: int) -> None:
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    runner = await _start_site(app, sock)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"http://{_url_host(host)}:{bound_port}/v1", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tmas.testing.sim_server",
        description="Serve a simulated OpenAI-compatible endpoint until SIGINT/SIGTERM.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default 8000)")
    parser.add_argument("--script", type=Path, help="SimScript as a JSON file")
    parser.add_argument("--latency", type=float, help="fixed seconds per call (overrides the script)")
    parser.add_argument("--seed", type=int, help="fault / sampling seed (overrides the script)")
    parser.add_argument(
        "--persona",
        choices=list(PERSONAS),
        help="answer in this server's shapes (overrides the script)",
    )
    args = parser.parse_args(argv)

    try:
        data: dict[str, Any] = json.loads(args.script.read_text()) if args.script else {}
        if args.latency is not None:
            data["latency_s"] = args.latency
        if args.seed is not None:
            data["seed"] = args.seed
        if args.persona is not None:
            data["persona"] = args.persona
        script = SimScript.model_validate(data)
        app = SimApp(script)
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        print(f"error: bad script: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_forever(app, args.host, args.port))
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
