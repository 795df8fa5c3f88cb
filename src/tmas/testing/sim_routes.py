"""The simulated server's routes: the OpenAI endpoints (chat completions, embeddings, models) and the control ones
(``/_sim/...``), as an aiohttp application built by :class:`SimApp`.

A request is checked as the persona's server checks it, meets the script (tmas.testing.scripted_replies), maybe a
fault (tmas.testing.sim_faults), and is counted and logged (tmas.testing.sim_stats) before its reply goes out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from tmas.testing.context_limits import context_refusal, window_budget
from tmas.testing.long_replies import long_choice, request_digest
from tmas.testing.personas import Persona, cache_capacity, persona_of, schema_refusal, schema_repetitions
from tmas.testing.prefix_cache import PrefixCache, SlotCache, prompt_tokens
from tmas.testing.replies import DONE, Choice, Reply, sse
from tmas.testing.responders import (
    SimRequest,
    chat_prompt_tokens,
    content_text,
    count_tokens_cached,
    get_responder,
    stable_hash,
)
from tmas.testing.script import FaultKind, Rule, SimScript
from tmas.testing.scripted_replies import (
    RuleBook,
    aborted_choices,
    embed_text,
    scripted_logprobs,
    scripted_text,
)
from tmas.testing.sim_access import auth_refusal, loading_response
from tmas.testing.sim_faults import (
    EMBEDDING_FAULTS,
    QUEUE_FULL,
    draw_fault,
    error_response,
    fault_response,
    faulty_events,
    rule_error,
    status_error,
    stream_head,
)
from tmas.testing.sim_info import InfoRoutes
from tmas.testing.sim_queue import RunQueue
from tmas.testing.sim_stats import LogEntry, LoggedRequest, SimRecorder, SimStats

ROLE_HEADER = "X-Tmas-Role"
# Seconds between the engine's progress ticks while it works (SimApp._tick).
TICK_S = 0.02
# The seed SGLang's deterministic sampling uses when a request names none (not read from the source: an assumption).
DETERMINISTIC_DEFAULT_SEED = 42
PROBLEM_HEADER = "X-Tmas-Problem"


@dataclass
class _Active:
    """The script with its per-script state, replaced wholesale so a request sees one consistent set."""

    script: SimScript
    rules: RuleBook
    rng: random.Random
    persona: Persona
    # The replica's prefix cache (None: off); only the server's loop thread touches it.
    cache: PrefixCache | SlotCache | None
    faults: list[tuple[FaultKind, float]] = field(default_factory=list)
    # /v1/models requests answered while loading so far (SimScript.models_unavailable).
    models_refused: int = 0
    # Fresh seeds for a server that ignores the request's (SimScript.deterministic False).
    sampling_rng: random.Random = field(default_factory=random.Random)
    # Chat requests received under this script, for its gate (SimScript.hold_after).
    chat_received: int = 0

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
        active = cls(script, RuleBook(script), rng, persona, cache, script.faults.cumulative())
        active.sampling_rng.seed(f"{script.seed}/sampling")
        return active


class _Turn:
    """Whether a chat request holds a turn in the run queue (to give back when it is done)."""

    held = False


@dataclass
class _Asked:
    """A chat request's fields, checked: its messages and their texts, the choices asked for, whether it streams,
    its max_tokens and the slot it names."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    texts: list[str]
    n: int
    streams: bool
    max_tokens: int | None
    id_slot: Any


def streams(script: SimScript, body: dict[str, Any]) -> bool:
    """Whether a request is answered as a stream: it asks for one, and the script does not refuse streaming."""
    return bool(body.get("stream")) and script.stream == "accept"


class _BadRequest(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        # The whole error body, where the server's differs from the persona's usual shape.
        self.body = body


class SimApp:
    """The simulator's state and request handlers; ``build()`` gives the aiohttp application."""

    def __init__(self, script: SimScript | None = None, *, keepalive_max_requests: int | None = None) -> None:
        if keepalive_max_requests is not None and keepalive_max_requests < 1:
            raise ValueError("keepalive_max_requests must be at least 1")
        self.keepalive_max_requests = keepalive_max_requests
        # Requests answered per open connection (by the client's address), for keepalive_max_requests.
        self._served: dict[Any, int] = {}
        self._lock = threading.Lock()
        script = script or SimScript()
        self._active = _Active.of(script)
        self.recorder = SimRecorder(script.log_limit)
        self.queue = RunQueue(self.recorder)
        # Requests waiting on the engine's work now, and the task that moves its counters meanwhile (SimApp._working).
        self._busy = 0
        self._ticker: asyncio.Future[None] | None = None

    # ---- thread-safe control ---------------------------------------------------------------------

    @property
    def script(self) -> SimScript:
        return self._active.script

    @property
    def persona(self) -> Persona:
        return self._active.persona

    def set_script(self, script: SimScript) -> None:
        """Replace the script; rule counters and the fault generator start afresh, stats and log are kept."""
        with self._lock:
            self._active = _Active.of(script)
            self.recorder.resize_log(script.log_limit)
        loop = self.queue.loop
        if loop is not None and not loop.is_closed():
            # A raised (or removed) max_running starts waiting requests at once, on the server's own thread.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.queue.grant, script.max_running)

    def reset(self) -> None:
        """Clear stats, the request log and rule counters (and reseed the fault generator)."""
        with self._lock:
            self.recorder.reset()
            self._active = _Active.of(self._active.script)

    def stats(self) -> SimStats:
        return self.recorder.stats()

    def requests(self, last: int | None = None) -> list[LoggedRequest]:
        return self.recorder.requests(last)

    # ---- application -----------------------------------------------------------------------------

    async def _count_on_connection(self, request: web.Request, response: web.StreamResponse) -> None:
        """cpp-httplib's keep-alive max count: the connection's last allowed answer says Connection: close."""
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        served = self._served.get(peer, 0) + 1
        self._served[peer] = served
        if self.keepalive_max_requests is not None and served >= self.keepalive_max_requests:
            self._served.pop(peer, None)
            response.force_close()  # closed once answered; the header says so (headers are built by now)
            response.headers["Connection"] = "close"

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Before any route: a replica still loading its model refuses it (SimScript.models_unavailable; its
        /v1/models counts the loading down), then the API key check (SimScript.api_key)."""
        active = self._active
        loading = active.models_refused < active.script.models_unavailable
        if loading and request.path != "/v1/models" and not request.path.startswith("/_sim/"):
            self.recorder.count_refused_while_loading()
            return loading_response(active.persona.name)
        key = active.script.api_key
        if key is not None:
            refusal = auth_refusal(active.persona.name, request.path, request.headers.get("Authorization"), key)
            if refusal is not None:
                self.recorder.count_unauthorized()
                return refusal
        return await handler(request)

    def build(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._guard])
        if self.keepalive_max_requests is not None:
            app.on_response_prepare.append(self._count_on_connection)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/_sim/stats", self._get_stats)
        app.router.add_post("/_sim/script", self._post_script)
        app.router.add_post("/_sim/reset", self._post_reset)
        app.router.add_get("/_sim/requests", self._get_requests)
        InfoRoutes(self).add_to(app)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        script = self._active.script
        if script.health == "hang":
            # A dead replica that still accepts connections: nothing comes back until the client gives up.
            await asyncio.sleep(script.hang_s)
            if request.transport is not None:
                request.transport.close()
            return web.Response()
        if script.health == "error":
            return error_response(503, "Service Unavailable", "ServiceUnavailableError")
        if script.wedged and self._active.persona.name == "sglang":
            # python/sglang/srt/entrypoints/http_server.py health_generate: it waits for any output of the scheduler
            # (sending a one-token request of its own) and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT without.
            # vLLM's /health reads its engine's error flag only (vllm/v1/engine/async_llm.py check_health) and
            # llama-server's answers from its HTTP thread (tools/server/server-context.cpp get_health): both 200.
            await asyncio.sleep(script.health_check_timeout_s)
            if self._active.script.wedged:
                return web.Response(status=503)
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        active = self._active
        persona, script = active.persona, active.script
        self.recorder.count_models_request()
        loading = active.models_refused < script.models_unavailable
        if loading:
            active.models_refused += 1
            self.recorder.count_models_unavailable()
            if not persona.lists_models_while_loading:
                return loading_response(persona.name)
        extra = persona.models_extra(script) if persona.models_extra is not None else {}
        served = [script, *(script.model_copy(update={"model": name}) for name in script.also_serves)]
        cards = [persona.model_card(s) for s in served]
        if loading:
            cards = [{**card, "meta": None} for card in cards]  # llama-server: no model meta until it is loaded
        return web.json_response({**extra, "object": "list", "data": cards})

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

    def _log_request(self, request: web.Request, endpoint: str, role: str, body: dict[str, Any], at: float) -> None:
        headers = {name.lower(): value for name, value in request.headers.items() if name.lower() != "authorization"}
        if endpoint == "chat" and self._active.script.log_digests:
            body = request_digest(body)
        entry = LogEntry(
            endpoint, role, request.headers.get(PROBLEM_HEADER), body, at, request.headers.get("Authorization"), headers
        )
        self.recorder.log(entry)

    @staticmethod
    async def _read_json(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadRequest(f"Request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _BadRequest("Request body must be a JSON object.")
        return body

    # ---- /v1/chat/completions --------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        role = request.headers.get(ROLE_HEADER) or "default"
        problem = request.headers.get(PROBLEM_HEADER)
        self.recorder.enter(role)
        self.recorder.connection(request.transport.get_extra_info("peername") if request.transport else None)
        self.recorder.problem_enter(problem)
        persona = self._active.persona
        turn = _Turn()
        try:
            return await self._chat_inner(request, role, received, turn)
        except _BadRequest as exc:
            self.recorder.count_error()
            payload = exc.body if exc.body is not None else persona.error(exc.status, exc.message, exc.param, exc.code)
            return web.json_response(payload, status=exc.status)
        finally:
            if turn.held:
                self.queue.leave(self._active.script.max_running)
            self.recorder.slot_leave(id(request))
            self.recorder.problem_leave(problem)
            self.recorder.leave()

    async def _chat_inner(self, request: web.Request, role: str, received: float, turn: _Turn) -> web.StreamResponse:
        """One chat request: read and checked as the persona's server checks it, refused where its prompt does not
        fit, generated in its turn (a scripted rule's reply, a drawn fault), then answered whole or streamed."""
        problem = request.headers.get(PROBLEM_HEADER)
        active = self._active
        script, persona = active.script, active.persona
        try:
            body = await self._read_json(request)
        except _BadRequest:
            self._log_request(request, "chat", role, {}, received)
            raise
        self._log_request(request, "chat", role, body, received)
        await self._at_gate(active)
        self.recorder.slot_enter(id(request), body.get("id_slot"))
        asked = self._checked(active, body)
        prompt_tokens = chat_prompt_tokens(asked.texts)
        if (
            script.response_format == "reject"
            and persona.schema_refusal_midstream
            and asked.body.get("response_format") is not None
            and asked.streams
        ):
            # A refusal the server meets only once the stream is open (Persona.schema_refusal_midstream).
            event = status_error(persona.name, 400, schema_refusal(persona, asked.body["response_format"]))
            return await self._error_event(await self._open_stream(request), event)
        refused = await self._context_refusal(request, active, asked, prompt_tokens)
        if refused is not None:
            return refused
        # llama-server (and SGLang under a KV cache pool smaller than its window) cuts a reply where its bound is met.
        max_tokens = window_budget(
            persona.name,
            script.context_wording,
            script.context_length,
            prompt_tokens,
            asked.max_tokens,
            pool=script.kv_pool_tokens,
        )
        if self.queue.full(script.max_running, script.max_queued):
            return await self._queue_full(request, persona, asked.streams)
        rule, used = active.rules.pick(role, asked.texts, asked.n)
        fault = rule.fault if rule is not None else draw_fault(active.rng, active.faults)
        if fault is not None:
            self.recorder.count_fault(fault)
        per_token = 0.0 if rule is not None and rule.latency_s is not None else script.latency_per_token_s
        if rule is not None and rule.error_status is not None and fault is None:
            # Refused before any generation: the status and its body, streamed or not.
            self.recorder.count_fault(f"http_{rule.error_status}")
            if rule.error_page is not None:
                return web.Response(text=rule.error_page, status=rule.error_status, content_type="text/html")
            return web.json_response(rule_error(persona.name, rule, rule.error_status), status=rule.error_status)
        opened = await self._generation_turn(request, active, asked, rule, turn, prompt_tokens)
        # A rule's error_status: the stream_error fault carries that status, in the persona's shape.
        error_status = rule.error_status if rule is not None and fault == "stream_error" else None
        error = None
        if rule is not None and error_status is not None:
            error = rule_error(persona.name, rule, error_status, event=True)
            if not asked.streams:
                return web.json_response(rule_error(persona.name, rule, error_status), status=error_status)
        if fault is not None and error is None:
            replaced = await fault_response(request, fault, script.hang_s, asked.streams)
            if isinstance(replaced, web.Response) and opened is not None and replaced.status >= 400:
                # The status line is already out: the error goes as an event in the stream, as vLLM sends it.
                return await self._stream_failure(opened, replaced.status, replaced.text or "")
            if replaced is not None:
                return replaced
        reply = self._reply(active, role, problem, asked, rule, used, fault, max_tokens, received, prompt_tokens)
        counts = reply.counts()
        done = (reply.prompt_tokens, counts.completion, counts.reasoning, reply.cached or 0)
        if asked.streams:
            stream_options = body.get("stream_options")
            options: dict[str, Any] = stream_options if isinstance(stream_options, dict) else {}
            reply.continuous_usage = bool(options.get("continuous_usage_stats"))
            return await self._stream(
                request,
                reply,
                bool(options.get("include_usage")),
                per_token,
                fault,
                script.hang_s,
                lambda: self.recorder.count_done(*done),
                opened,
                error,
                rule.fault_after_tokens if rule is not None else None,
            )
        if per_token > 0 and counts.completion:
            await self._working_unless_gone(per_token * counts.completion)
        self.recorder.generated(counts.completion)
        self.recorder.count_done(*done)
        return web.json_response(reply.completion())

    def _checked(self, active: _Active, body: dict[str, Any]) -> _Asked:
        """The request's fields as the persona's server checks them (a field it refuses is a 400)."""
        script, persona = active.script, active.persona
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
            if persona.response_formats is not None and kind not in persona.response_formats:
                raise _BadRequest(f"response_format type {kind!r} is not supported by this server")
            if script.response_format == "reject" and not (persona.schema_refusal_midstream and streams(script, body)):
                raise _BadRequest(schema_refusal(persona, rf))
            limit = persona.grammar_repetitions
            schema = rf.get("json_schema", {}).get("schema") if kind == "json_schema" else None
            if limit is not None and schema_repetitions(schema) > limit:
                raise _BadRequest(persona.grammar_refusal)
        if script.stream == "refuse" and body.get("stream"):
            raise _BadRequest("stream is not supported by this server")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise _BadRequest("max_tokens must be a positive integer.")
        id_slot = body.get("id_slot")
        valid_slot = id_slot in (None, -1) or (isinstance(id_slot, int) and 0 <= id_slot < script.slots)
        if persona.slot_cache and not valid_slot:
            raise _BadRequest("Invalid slot ID")
        return _Asked(
            body=body,
            messages=messages,
            texts=[content_text(m.get("content")) for m in messages],
            n=n,
            streams=streams(script, body),
            max_tokens=max_tokens,
            id_slot=id_slot,
        )

    async def _context_refusal(
        self, request: web.Request, active: _Active, asked: _Asked, prompt_tokens: int
    ) -> web.StreamResponse | None:
        """The refusal of a prompt and max_tokens the context cannot hold, in the persona's wording: a 400 (raised),
        or an error event in a stream already open (returned); None when it fits."""
        script, persona = active.script, active.persona
        field_name = "max_completion_tokens" if asked.body.get("max_completion_tokens") else "max_tokens"
        refusal = context_refusal(
            persona.name,
            script.context_wording,
            script.context_length,
            prompt_tokens,
            asked.max_tokens,
            field_name,
            pool=script.kv_pool_tokens,
        )
        if refusal is not None and refusal.midstream and asked.streams:
            event = status_error(persona.name, refusal.status, refusal.message)
            return await self._error_event(await self._open_stream(request), event)
        if refusal is not None and refusal.body is not None and script.sse_error_field and asked.streams:
            # Older llama-server: the refusal on an "error:" line of the stream now open (SimScript.sse_error_field).
            line = b"error: " + json.dumps(refusal.body["error"]).encode() + b"\n\n"
            return await self._error_event(await self._open_stream(request), None, line)
        if refusal is not None:
            raise _BadRequest(refusal.message, refusal.status, refusal.param, refusal.code, refusal.body)
        return None

    async def _queue_full(self, request: web.Request, persona: Persona, streams: bool) -> web.StreamResponse:
        """A request refused for a full waiting queue (SimScript.max_queued). SGLang's scheduler aborts it with status
        503 before its first token: streamed, serving_chat.py sends that abort as the stream's first event
        (create_streaming_error_response(message, status.name, status.value), on an HTTP 200 whose headers went out),
        then [DONE]; sent whole, an HTTP 503 whose flat body its HTTPException handler (http_server.py) types with the
        status's number. The other personas answer an HTTP 503 in their error shape."""
        self.recorder.count_fault("queue_full")
        error = status_error(persona.name, 503, QUEUE_FULL)
        if persona.name != "sglang":
            return web.json_response(error, status=503)
        if streams:
            return await self._error_event(await self._open_stream(request), error)
        return web.json_response({**error["error"], "type": "503"}, status=503)

    async def _generation_turn(
        self, request: web.Request, active: _Active, asked: _Asked, rule: Rule | None, turn: _Turn, prompt_tokens: int
    ) -> web.StreamResponse | None:
        """Wait for a turn to generate and prefill the prompt; a streamed request meanwhile shows what its server
        shows (headers at arrival or at its slot, else nothing). Without max_running no request waits and the
        headers go out with the first chunk. The stream opened so far, if any."""
        script, persona = active.script, active.persona
        opened: web.StreamResponse | None = None
        queued = script.max_running is not None or script.wedged
        if asked.streams and queued and persona.headers_at == "arrival":
            opened = await self._open_stream(request)
        await self._while_wedged()
        await self.queue.enter(self._active.script.max_running)
        turn.held = True
        self.recorder.prefilled(prompt_tokens)
        if asked.streams and queued and persona.headers_at == "slot":
            opened = await self._open_stream(request)
        fixed_latency = rule.latency_s if rule is not None and rule.latency_s is not None else script.latency_s
        if fixed_latency > 0:
            await self._working_unless_gone(fixed_latency)
        return opened

    def _reply(
        self,
        active: _Active,
        role: str,
        problem: str | None,
        asked: _Asked,
        rule: Rule | None,
        used: int,
        fault: FaultKind | None,
        max_tokens: int | None,
        received: float,
        prompt_tokens: int,
    ) -> Reply:
        """The reply's choices and usage: the prompt served from the cache once, whatever n is (the choices share
        its prefill), or a rule's scripted usage."""
        script, persona, body = active.script, active.persona, asked.body
        cached = self._serve_cache(active, asked.messages, asked.texts, asked.id_slot)
        scripted = rule.usage if rule is not None else None
        timings: dict[str, Any] | None = None
        if scripted is not None:
            prompt_tokens = scripted.prompt_tokens
            if scripted.cached_tokens is not None and scripted.cached_in == "timings" and not persona.timings:
                # A scripted llama-server shape: the tokens reused, and the ones computed.
                timings = {"cache_n": scripted.cached_tokens, "prompt_n": prompt_tokens - scripted.cached_tokens}
            elif scripted.cached_tokens is not None:
                cached = scripted.cached_tokens
        n = asked.n
        # Several choices meet an abort at one moment (aborted_choices): each is asked whole first.
        whole = fault if n == 1 or fault != "abort" else None
        choices = [self._choice(active, role, problem, body, i, n, rule, used, whole, max_tokens) for i in range(n)]
        if whole != fault:
            choices = aborted_choices(choices)
        named = body.get("model")
        own = isinstance(named, str) and (persona.echoes_model or named in script.also_serves)
        model = named if own else script.model
        return Reply(
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

    def _check_fields(self, active: _Active, body: dict[str, Any]) -> None:
        """What the persona's server does with the request's fields: unknown ones ignored (and counted) or refused;
        a reasoning model's unsupported parameters; another model's name."""
        persona, script = active.persona, active.script
        if persona.known_fields is not None:
            unknown = [name for name in body if name not in persona.known_fields]
            if unknown and persona.rejects_unknown:
                raise _BadRequest(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
            if unknown:
                self.recorder.count_ignored(unknown)
        model = body.get("model")
        if script.reasoning and model not in script.also_serves:  # a reasoning model's restrictions apply
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
        served = model == script.model or model in script.also_serves
        if persona.unknown_model is not None and model is not None and not served:
            raise _BadRequest(persona.unknown_model.format(model=model), 404, "model", persona.unknown_model_code)

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
    ) -> Choice:
        """Choice ``index`` of ``n``. With n > 1 each choice is sampled as if asked alone with its own seed (the
        request's for the first, one derived from it and the index for the others; under a persona whose server adds
        the index to the seed (Persona.choice_seed_plus_index: vLLM, llama-server) the request's + the index, so a
        choice is the reply the same request would get alone with that seed), so the choices differ and are the same
        on every run."""
        script, persona = active.script, active.persona
        seed = body.get("seed")
        sample_body = body
        if persona.name == "sglang" and script.deterministic is not None:
            # serving_chat.py passes seed on as sampling_seed, which the sampler uses only with
            # --enable-deterministic-inference: there the n copies of the request all sample with the same seed
            # (the scheduler's default when none is given), so identical prompts give identical choices; without
            # it the seed is ignored and every choice samples afresh.
            if script.deterministic:
                seed = seed if isinstance(seed, int) else DETERMINISTIC_DEFAULT_SEED
            else:
                seed = active.sampling_rng.randrange(2**31)
            sample_body = {**{k: v for k, v in body.items() if k != "n"}, "seed": seed}
        elif n > 1:
            sample_body = {k: v for k, v in body.items() if k != "n"}
            if index > 0:
                if persona.choice_seed_plus_index and isinstance(seed, int) and not isinstance(seed, bool):
                    seed = seed + index
                else:
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
        long = script.long_replies
        if (
            long is not None
            and long.covers(role)
            and fault not in ("garbage", "truncate", "abort")
            and not (rule and rule.replies)
        ):
            return long_choice(long, sim, get_responder(role)(sim), max_tokens, persona, script)
        text = scripted_text(sim, rule, used, index=index, fault=fault, max_tokens=max_tokens)
        logprobs = scripted_logprobs(script, body, rule, text.content, persona, text.reasoning)
        return Choice(
            text.content, text.reasoning, text.finish_reason, logprobs, text.reasoning_tokens, text.completion_tokens
        )

    async def _stream(
        self,
        request: web.Request,
        reply: Reply,
        include_usage: bool,
        per_token: float,
        fault: FaultKind | None,
        hang_s: float,
        answered: Callable[[], None],
        opened: web.StreamResponse | None = None,
        error: dict[str, Any] | None = None,
        fault_after_tokens: int | None = None,
    ) -> web.StreamResponse:
        """The reply as a stream (on ``opened`` where its headers went out already); ``answered`` is told just
        before its last event goes out (so the stats count it before the client can read it whole), and not at all
        where the client closed the stream first."""
        response = opened if opened is not None else await self._open_stream(request)
        # With a per-token latency tokens trickle out one delta each, as from a real server; else in a few pieces.
        events = reply.events(include_usage, per_token_deltas=per_token > 0)
        # stall, freeze and cut: the opening chunk and the first delta (or fault_after_tokens) go out, then nothing
        # for hang_s, or a closed socket; stream_error: an error event there.
        head = stream_head(fault, events, fault_after_tokens)
        if fault in ("stream_error", "malformed"):
            events = faulty_events(events, fault, error, head)
            head = len(events) - 1
        try:
            await self._write_events(response, events[:head], per_token)
            if fault in ("cut", "cut_after_finish"):
                answered()
                if request.transport is not None:
                    request.transport.close()
                return response
            if fault == "stall":
                await self._working(hang_s)  # preempted: the engine works on other sequences meanwhile
            elif fault == "freeze":
                await asyncio.sleep(hang_s)
            await self._write_events(response, events[head:-1], per_token)
            answered()
            await self._write_events(response, events[-1:], per_token)
            await response.write_eof()
            if self._active.persona.closes_after_stream and request.transport is not None:
                request.transport.close()
        except ConnectionResetError:
            # The client closed the stream (e.g. it stopped a weak trace): the rest is never generated.
            self.recorder.count_disconnect()
            return response
        except asyncio.CancelledError:
            # The same, noticed first by the server (handler_cancellation), as vLLM and SGLang abort such a request.
            self.recorder.count_disconnect()
            raise
        return response

    @staticmethod
    async def _open_stream(request: web.Request) -> web.StreamResponse:
        """A 200 event-stream response with its status line and headers sent."""
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    async def _error_event(
        self, response: web.StreamResponse, event: dict[str, Any] | None, line: bytes = b""
    ) -> web.StreamResponse:
        """An error met after a stream's headers went out: the error event (or ``line``, as sent), then ``[DONE]``."""
        with contextlib.suppress(ConnectionResetError):
            await response.write((sse(event) if event is not None else line) + DONE)
            await response.write_eof()
        return response

    async def _stream_failure(self, response: web.StreamResponse, status: int, body: str) -> web.StreamResponse:
        """An error met after the headers went out: an error event carrying the status, then ``[DONE]``."""
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            payload = {}
        error = payload.get("error") if isinstance(payload, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        event = {"error": {"message": message or "error", "type": "error", "param": None, "code": status}}
        with contextlib.suppress(ConnectionResetError):
            await response.write(sse(event) + DONE)
            await response.write_eof()
        return response

    async def _write_events(
        self, response: web.StreamResponse, events: list[tuple[bytes, int]], per_token: float
    ) -> None:
        """``events`` written out, their tokens counted as generated as they go."""
        if per_token > 0:
            # Tokens trickle out: each delta waits for its share of the per-token latency.
            for data, tokens in events:
                if tokens:
                    await self._working(per_token * tokens)
                await response.write(data)
                self.recorder.generated(tokens)
        elif events:
            await response.write(b"".join(data for data, _ in events))  # one write: far fewer syscalls
            self.recorder.generated(sum(tokens for _, tokens in events))

    # ---- the engine ------------------------------------------------------------------------------

    async def _working(self, seconds: float) -> None:
        """Wait ``seconds`` while the engine works (on this request, or on others while this one waits): its progress
        counters move (:meth:`_tick`), unless it is wedged."""
        self._busy += 1
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())
        try:
            await asyncio.sleep(seconds)
        finally:
            self._busy -= 1

    async def _working_unless_gone(self, seconds: float) -> None:
        """:meth:`_working`, where the client going meanwhile (its prefill, or an unstreamed reply's generation) is a
        disconnect: vLLM, SGLang and llama-server abort such a request, quietly, as they abort a stream cut short."""
        try:
            await self._working(seconds)
        except asyncio.CancelledError:
            self.recorder.count_disconnect()
            raise

    async def _tick(self) -> None:
        """One token generated every :data:`TICK_S` while any request waits on the engine's work (a real engine's
        counters move every step), none while it is wedged."""
        while True:
            await asyncio.sleep(TICK_S)
            if self._busy and not self._active.script.wedged:
                self.recorder.generated(1)

    async def _at_gate(self, active: _Active) -> None:
        """Past the script's ``hold_after`` chat requests, hold this one silent until the script is replaced or reset
        (or the client goes, counted as a disconnect); it then goes on under the script it came in under."""
        active.chat_received += 1
        limit = active.script.hold_after
        if limit is None or active.chat_received <= limit:
            return
        self.recorder.hold(1)
        try:
            # Polled: the script is replaced from the test's thread.
            while self._active is active:  # noqa: ASYNC110
                await asyncio.sleep(TICK_S)
        except asyncio.CancelledError:
            self.recorder.count_disconnect()
            raise
        finally:
            self.recorder.hold(-1)

    async def _while_wedged(self) -> None:
        """A wedged engine holds a request it accepted, silent, until the script is no longer wedged (or the client
        goes: the server aborts it, counted as a disconnect)."""
        if not self._active.script.wedged:
            return
        try:
            # Polled: the script is replaced from the test's thread.
            while self._active.script.wedged:  # noqa: ASYNC110
                await asyncio.sleep(TICK_S)
        except asyncio.CancelledError:
            self.recorder.count_disconnect()
            raise

    # ---- /v1/embeddings --------------------------------------------------------------------------

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        role = request.headers.get(ROLE_HEADER) or "default"
        self.recorder.enter(role)
        try:
            return await self._embeddings_inner(request, role, received)
        except _BadRequest as exc:
            self.recorder.count_error()
            return error_response(400, exc.message, "BadRequestError")
        finally:
            self.recorder.leave()

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
        if script.max_embedding_inputs is not None and len(inputs) > script.max_embedding_inputs:
            raise _BadRequest(f"'input' may hold at most {script.max_embedding_inputs} items, got {len(inputs)}.")
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

        rule, _ = active.rules.pick(role, inputs)
        fault = rule.fault if rule is not None else draw_fault(active.rng, active.faults)
        if fault is not None and fault not in EMBEDDING_FAULTS:
            fault = None  # truncate / garbage mean nothing for a vector
        if fault is not None:
            self.recorder.count_fault(fault)
        latency = rule.latency_s if rule is not None and rule.latency_s is not None else script.latency_s
        if latency > 0:
            await asyncio.sleep(latency)
        if fault is not None:
            replaced = await fault_response(request, fault, script.hang_s)
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
        self.recorder.count_done(prompt_tokens, 0)
        return web.json_response(payload)
