"""The async client for OpenAI-compatible ``/v1/chat/completions`` endpoints: the only code that speaks HTTP.

It implements :class:`tmas.llm.model.ChatModel`. Per call: resolve the role's endpoint and sampling
(:mod:`tmas.llm.sampling`), join the alike calls sent with it where the endpoint takes several samples in one request
(:mod:`tmas.llm.batching`), take a slot under the global cap, pick a replica (:mod:`tmas.llm.routing`: the one
holding the longest prefix of the prompt within a load bound, or the least loaded; under its own cap), send, read the
reply (streamed where the endpoint allows it, :mod:`tmas.llm.stream`), retry transient failures with exponential
backoff and full jitter, split reasoning from the final content and account tokens. It stores nothing: replay from a
store and durability are :class:`tmas.llm.replay.StoreReplay`'s, which :func:`tmas.llm.factory.open_model` wraps
around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import aiohttp
from pydantic import BaseModel, ValidationError

from tmas.config import Endpoint, Sampling, Settings
from tmas.errors import ConfigError, LLMError
from tmas.llm.batching import (
    Sample,
    SampleBatcher,
    handed_out,
    one_per_choice,
    refuses_n,
    serves_samples,
    share_usage,
)
from tmas.llm.lanes import SlotQueue, call_affinity, current_lane, pinned_slot
from tmas.llm.reasoning import split_reasoning
from tmas.llm.replay import CallStore
from tmas.llm.routing import PrefixRouter
from tmas.llm.sampling import ResolvedSampling, resolve_role
from tmas.llm.schema import response_format
from tmas.llm.server_kind import ServerKind, server_kind
from tmas.llm.stream import StreamAssembler, StreamError, lines
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, ChatRequest, Completion, FallbackKind, Message, TokenLogprob, Usage
from tmas.llm.watch import TraceWatch

# Room left for the chat template's own tokens when max_tokens is lowered to fit the context window.
CONTEXT_MARGIN_TOKENS = 32
# vLLM/OpenAI wording of a context overflow; the numbers let us retry once with a smaller max_tokens.
_CONTEXT_ERROR = re.compile(r"maximum context length is (\d+) tokens.*?\((\d+) in the messages", re.S)
_RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
# OpenAI's wording of a field a model refuses: "Unsupported parameter: 'max_tokens' ... Use 'max_completion_tokens'
# instead." and "Unsupported value: 'temperature' does not support 0.7 with this model. Only the default (1) value is
# supported." Only these sampling fields are adapted; any other refusal fails the call as before.
_REFUSED_FIELD = re.compile(r"Unsupported (?:parameter|value): '(\w+)'(?:.*?Use '(\w+)' instead)?", re.S)
_ADAPTABLE_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "logprobs", "top_logprobs"})
# How servers without (full) structured-output support word their refusal of a response_format: llama-server
# ("response_format type not supported", grammar errors), vLLM/SGLang ("guided decoding", "xgrammar"), OpenAI.
_SCHEMA_REFUSAL = re.compile(r"response_format|json_schema|json schema|grammar|guided|structured output", re.I)
_SCHEMA_REFUSAL_STATUS = {400, 404, 415, 422, 500, 501}
# How a server that cannot stream refuses a streamed request (a 4xx or 501 whose message names the field).
_STREAM_REFUSAL = re.compile(r"\bstream", re.I)
_STREAM_REFUSAL_STATUS = {400, 404, 415, 422, 501}
# Where a reply a watch stopped carries the watch's reason, from the stream reader to the completion.
_STOPPED_EARLY = "tmas_stopped_early"


class FallbackLog(Protocol):
    """Where the client records that an endpoint refused something it asked and the run went on without it
    (:data:`tmas.llm.types.FALLBACKS`; implemented by the run store)."""

    def record_fallback(self, kind: FallbackKind, endpoint: str, role: str, message: str) -> None: ...


class RunCallStore(CallStore, FallbackLog, Protocol):
    """A store calls are replayed from and fallbacks recorded in (the run store)."""


class EndpointUnreachable(LLMError):
    """No connection could be made to any replica of an endpoint after all retries."""


class _Transient(Exception):
    """A failure worth retrying (connection, timeout, a stalled or cut stream, 429, 5xx, unparseable body)."""

    def __init__(self, message: str, cause: str, retry_after: float | None = None, connect: bool = False) -> None:
        super().__init__(message)
        # A short word for counting failures by kind in the store and the run summary.
        self.cause = cause
        self.retry_after = retry_after
        # True when no connection could be made at all (as opposed to one that broke).
        self.connect = connect


class _Fatal(Exception):
    """A failure not worth retrying (a 4xx other than 408/409/425/429)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class _Replica:
    url: str
    cap: asyncio.Semaphore | None
    # Calls routed to it and not finished (waiting for a cap, in flight or between retries): what routing balances.
    load: int = 0
    context_length: int | None = None
    # Which engine serves it, as /v1/models said (read once, with the context window).
    server_kind: ServerKind | None = None
    probed: bool = False
    # Set once the server refused a response_format: with structured_output = "auto" none is sent to it again.
    structured_refused: bool = False
    # Set once the server could not stream: with stream = "auto" its calls go unstreamed from then on.
    stream_refused: bool = False
    # Sampling fields the server refused -> the name it asked for instead, or None where it is left out (OpenAI's
    # reasoning models: max_tokens -> max_completion_tokens; temperature, top_p, logprobs left out).
    renamed: dict[str, str | None] = field(default_factory=dict)
    # Set once the server refused (or ignored) n > 1: its endpoint sends one request per sample from then on.
    samples_refused: bool = False
    # Calls that start together wait for the one probe of /v1/models instead of going out unchecked.
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The last call to it found no server listening: calls go to the replicas that answer while any does.
    unreachable: bool = False
    # pin_slots: one call at a time per server slot, a chain's calls together (tmas.llm.lanes), by the slot's index.
    slot_queues: dict[int, SlotQueue] = field(default_factory=dict)


@dataclass
class _Route:
    """A role's endpoint resolved against the default one: where to send (sampling is resolved per call)."""

    endpoint: Endpoint
    replicas: list[_Replica]
    api_key: str | None
    counter: TokenCounter


@dataclass
class ClientStats:
    calls: int = 0
    cached: int = 0
    failed: int = 0
    retries: int = 0
    in_flight: int = 0
    embedding_calls: int = 0
    usage: Usage = field(default_factory=Usage)
    # Kind (tmas.llm.types.FALLBACKS) -> replica URL -> the server's refusal, for what the run went on without.
    fallbacks: dict[str, dict[str, str]] = field(default_factory=dict)

    def count_replay(self, completion: Completion) -> None:
        """A call answered from a store (:class:`tmas.llm.replay.StoreReplay`'s ``on_replay``)."""
        self.cached += 1
        self.usage = self.usage + completion.usage


class LLMClient:
    """The HTTP implementation of :class:`tmas.llm.model.ChatModel`, one per run.

    Use as ``async with LLMClient(settings) as llm: await llm.chat(...)``; a run's model (provisioned, replayed from
    its store) comes from :func:`tmas.llm.factory.open_model`. ``fallbacks`` hears of what an endpoint refused and
    the run went on without; ``stats`` counts the calls (a fresh one by default)."""

    def __init__(
        self,
        settings: Settings,
        *,
        fallbacks: FallbackLog | None = None,
        stats: ClientStats | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if settings.uses_local_model:
            raise ConfigError("no endpoint configured: set endpoint.base_url (or TMAS_BASE_URL) or use the local model")
        self.settings = settings
        self.fallbacks = fallbacks
        self.stats = stats if stats is not None else ClientStats()
        self._cap = asyncio.Semaphore(settings.concurrency)
        self._rng = rng or random.Random()
        self._replicas: dict[str, _Replica] = {}
        self._routes: dict[str, _Route] = {}
        self._session: aiohttp.ClientSession | None = None
        self._router = PrefixRouter()
        self._batcher = SampleBatcher(self._send_samples)

    async def __aenter__(self) -> LLMClient:
        # The global cap bounds what we send; the connector must not add a lower hidden bound of its own.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ----------------------------------------------------------------------------------------- routing
    def route(self, role: str) -> _Route:
        """The endpoint a role uses: its own endpoint fields where given, the default endpoint's elsewhere."""
        if role in self._routes:
            return self._routes[role]
        base = self.settings.endpoint
        override = self.settings.roles.get(role)
        data = base.model_dump()
        if override is not None:
            for name in override.model_fields_set - {"sampling"}:
                value = getattr(override, name)
                if value is not None:
                    data[name] = value
        endpoint = Endpoint.model_validate(data)
        if not endpoint.base_url:
            raise ConfigError(f"role {role!r} has no base_url")
        api_key = None
        if endpoint.api_key_env:
            api_key = os.environ.get(endpoint.api_key_env)
            if not api_key:
                raise ConfigError(
                    f"environment variable {endpoint.api_key_env} (named by api_key_env for role {role!r}) is not set"
                )
        replicas = []
        for url in endpoint.base_url:
            if url not in self._replicas:
                cap = asyncio.Semaphore(endpoint.max_in_flight) if endpoint.max_in_flight else None
                self._replicas[url] = _Replica(url=url, cap=cap, context_length=endpoint.context_length)
            replicas.append(self._replicas[url])
        route = _Route(endpoint, replicas, api_key, TokenCounter(endpoint.tokenizer))
        self._routes[role] = route
        return route

    # ----------------------------------------------------------------------------------------- ChatModel
    def resolve_sampling(
        self,
        role: str,
        *,
        preset: Sampling | None = None,
        method: Sampling | None = None,
        call: Sampling | None = None,
    ) -> ResolvedSampling:
        return resolve_role(self.settings, role, preset=preset, method=method, call=call)

    def context_window(self, role: str) -> int | None:
        route = self.route(role)
        known = [r.context_length for r in route.replicas if r.context_length]
        return route.endpoint.context_length or (min(known) if known else None)

    def model_name(self, role: str) -> str:
        return self.route(role).endpoint.model or "default"

    def _pick(self, route: _Route, messages: Sequence[Message] = (), key: CallKey | None = None) -> _Replica:
        """The replica for a call (tmas.llm.routing): by its prompt's cached prefix with ``routing = "cache"``, else
        the least loaded. The caller counts the call in the replica's ``load`` until it ends."""
        endpoint = route.endpoint
        if endpoint.routing == "load" or not messages:
            return self._router.least_loaded(route.replicas)
        affinity = call_affinity(key.problem_id, self.settings.seed) if key is not None else None
        return self._router.choose(messages, route.replicas, affinity, endpoint.routing_load_bound)

    # ----------------------------------------------------------------------------------------- calls
    async def chat(
        self,
        role: str,
        messages: Sequence[Message],
        *,
        key: CallKey | None = None,
        sampling: Sampling | ResolvedSampling | None = None,
        reply_model: type[BaseModel] | None = None,
        watch: TraceWatch | None = None,
    ) -> Completion:
        """One chat completion for ``role`` (``sampling``: see :meth:`tmas.llm.model.ChatModel.chat`), sent over
        the wire. Never raises for a failed call: it returns a :class:`Completion` whose ``error`` says why, except
        :class:`EndpointUnreachable`, which ends a run.

        ``reply_model``: the pydantic model of a JSON reply; its schema goes out as ``response_format`` where the
        endpoint's ``structured_output`` allows it (see :mod:`tmas.llm.schema`). ``watch``: follows a streamed reply
        and may stop it (:mod:`tmas.llm.watch`)."""
        route = self.route(role)
        key = key or CallKey(role=role)
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.resolve_sampling(role, call=sampling)
        request = ChatRequest(
            model=route.endpoint.model or "default",
            messages=list(messages),
            sampling=sampling.sampling,
            sampling_sources=sampling.sources,
            response_format=self._response_format(route, sampling.sampling, reply_model),
        )
        request_hash = request.request_hash(key)
        completion = None
        # A watched call goes alone: closing the connection to stop it would stop the choices it shares too.
        if watch is None and self._batches_samples(route) is not False:
            completion = await self._batcher.submit(request, key, request_hash)
        if completion is None:  # alone: no alike call came with it, the endpoint takes no n, or it is watched
            [completion] = await self._call_with_retries(route, request, key, request_hash, watch=watch)
        self.stats.calls += 1
        self.stats.usage = self.stats.usage + completion.usage
        if not completion.ok:
            self.stats.failed += 1
        return completion

    @staticmethod
    def _response_format(
        route: _Route, sampling: Sampling, reply_model: type[BaseModel] | None
    ) -> dict[str, Any] | None:
        if reply_model is None or route.endpoint.structured_output == "off":
            return None
        if sampling.extra_body.get("logprobs"):
            # Scores read from token log-probabilities stay unconstrained: llama-server was seen reporting
            # log-probabilities of tokens other than the ones its grammar let through (a code fence first, where
            # the constrained output began with "{"), so an expected score read from them would be wrong.
            return None
        return response_format(reply_model)

    def _sends_schema(self, route: _Route, replica: _Replica, request: ChatRequest) -> bool:
        if request.response_format is None:
            return False
        return route.endpoint.structured_output == "json_schema" or not replica.structured_refused

    def _structured_refused(self, replica: _Replica, role: str, message: str) -> None:
        """Remember (and record, once per endpoint) that this server refuses response_format."""
        replica.structured_refused = True
        self._fell_back("structured_output", replica.url, role, message)

    def _fell_back(self, kind: FallbackKind, url: str, role: str, message: str) -> None:
        """Record, once per endpoint and kind, what the run goes on without (tmas.llm.types.FALLBACKS)."""
        seen = self.stats.fallbacks.setdefault(kind, {})
        if url in seen:
            return
        seen[url] = message
        if self.fallbacks is not None:
            self.fallbacks.record_fallback(kind, url, role, message)

    @staticmethod
    def _streams(route: _Route, replica: _Replica) -> bool:
        mode = route.endpoint.stream
        return mode == "on" or (mode == "auto" and not replica.stream_refused)

    def _stream_refused(self, replica: _Replica, role: str, message: str) -> None:
        """Remember (and record, once per endpoint) that this server cannot stream."""
        replica.stream_refused = True
        self._fell_back("stream", replica.url, role, message)

    def _batches_samples(self, route: _Route) -> bool | None:
        """Whether alike calls of ``route`` go as one request with ``n`` (``batch_samples``); None while "auto"
        waits for /v1/models to name the servers."""
        endpoint = route.endpoint
        if endpoint.batch_samples == "off" or endpoint.pin_slots or any(r.samples_refused for r in route.replicas):
            return False
        if endpoint.batch_samples == "on":
            return True
        if not all(r.probed for r in route.replicas):
            return None
        return serves_samples(r.server_kind for r in route.replicas)

    async def _send_samples(self, samples: list[Sample]) -> list[Completion | None]:
        """Two or more alike calls, in sample order (tmas.llm.batching), as one request with ``n`` where the
        endpoint serves it; None for each call left to its caller to send alone."""
        route = self.route(samples[0].key.role)
        if self._batches_samples(route) is None:
            await asyncio.gather(*(self._probe_models(r) for r in route.replicas))
        if not self._batches_samples(route):
            return [None] * len(samples)
        lead = samples[0]
        done = await self._call_with_retries(route, lead.request, lead.key, lead.request_hash, n=len(samples))
        if not done[0].ok and refuses_n(done[0]):
            self._samples_refused(route, done[0].endpoint, lead.key.role, done[0].error or "")
            return [None] * len(samples)
        if len(done) < len(samples):
            # A server that ignores `n` answers one choice: what came is kept, the other calls go one by one.
            message = f"asked for n = {len(samples)} choices, the reply held {len(done)}"
            self._samples_refused(route, done[0].endpoint, lead.key.role, message)
        return handed_out(done, samples)

    def _samples_refused(self, route: _Route, url: str, role: str, message: str) -> None:
        """Remember that ``route``'s servers take no ``n`` > 1, and record it once per endpoint."""
        for replica in route.replicas:
            replica.samples_refused = True
        self._fell_back("batch_samples", url, role, message)

    async def embed(self, texts: Sequence[str], *, role: str = "embedding") -> list[list[float]]:
        """Embedding vectors of ``texts`` from ``role``'s ``/v1/embeddings``, in order, with the same routing, caps
        and retries as chat calls. Raises :class:`LLMError` when the endpoint refuses or retries run out, and
        :class:`EndpointUnreachable` when no replica can be reached."""
        if not texts:
            return []
        route = self.route(role)
        body = {"model": route.endpoint.model or "default", "input": list(texts)}
        key = CallKey(role=role)
        retry = self.settings.retry
        all_connect_failures = True
        last_error = ""
        for attempt in range(1, retry.max_attempts + 1):
            replica = self._pick(route)
            replica.load += 1
            try:
                data = await self._post(route, replica, body, key, path="embeddings")
                self.stats.embedding_calls += 1
                return _vectors(data, len(texts))
            except _Fatal as exc:
                raise LLMError(f"embeddings for role {role!r}: {exc}") from None
            except _Transient as exc:
                last_error = str(exc)
                all_connect_failures = all_connect_failures and exc.connect
                if attempt < retry.max_attempts:
                    self.stats.retries += 1
                    await asyncio.sleep(self._backoff(attempt, exc))
            finally:
                replica.load -= 1
        if all_connect_failures:
            urls = ", ".join(r.url for r in route.replicas)
            raise EndpointUnreachable(f"endpoint {urls} unreachable for role {role!r}: {last_error}")
        raise LLMError(f"embeddings for role {role!r}: gave up after {retry.max_attempts} attempts: {last_error}")

    def _backoff(self, attempt: int, exc: _Transient) -> float:
        """Exponential backoff with full jitter, at least what the server asked for in Retry-After (capped)."""
        retry = self.settings.retry
        delay: float = min(retry.backoff_max_s, retry.backoff_base_s * 2 ** (attempt - 1)) * self._rng.random()
        if exc.retry_after is not None:
            delay = max(delay, min(exc.retry_after, retry.backoff_max_s))
        return delay

    async def _call_with_retries(
        self,
        route: _Route,
        request: ChatRequest,
        key: CallKey,
        request_hash: str,
        n: int = 1,
        watch: TraceWatch | None = None,
    ) -> list[Completion]:
        """The request's completion; with ``n`` > 1 one request for that many choices and a completion per choice
        received (tmas.llm.batching). A failure is one failed completion. ``watch`` follows each streamed attempt."""
        retry = self.settings.retry
        started = time.monotonic()
        max_tokens = request.sampling.max_tokens
        shrunk_on_error = False
        all_connect_failures = True
        last_error = ""
        causes: list[str] = []
        last_cause = "unknown"
        replica = route.replicas[0]
        pin = self._pinned(route)
        attempt = 0
        while attempt < retry.max_attempts:
            attempt += 1
            replica = route.replicas[pin[0]] if pin else self._pick(route, request.messages, key)
            replica.load += 1
            structured = streamed = False
            try:
                await self._probe_models(replica)
                sent_max = self._fit_context(route, replica, request, max_tokens)
                structured = self._sends_schema(route, replica, request)
                body = _adapted(request.body(sent_max, structured=structured), replica)
                if n > 1:
                    body["n"] = n
                streamed = self._streams(route, replica)
                if streamed:
                    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                data = await self._post(route, replica, body, key, slot=pin[1] if pin else None, watch=watch)
                done = [
                    self._parse(reply, route, request, key, request_hash, replica, started, attempt, sent_max)
                    for reply in one_per_choice(data, n)
                ]
                for completion in done:
                    completion.retry_causes = list(causes)
                return share_usage(done, data, route.counter, replica.server_kind)
            except _Fatal as exc:
                message = str(exc)
                # A refused response_format or stream: the same call again at once without it (not a failed
                # attempt), remembered for the replica and recorded, unless the endpoint's setting insists on it.
                if (exc.cause == "structured_output" and structured) or (exc.cause == "stream" and streamed):
                    setting = getattr(route.endpoint, exc.cause)
                    if setting in ("json_schema", "on"):
                        what = "streaming" if exc.cause == "stream" else "response_format"
                        message = f"server refused {what} ({exc.cause} = {setting!r}): {message}"
                        return [
                            self._failed(
                                key, request_hash, request, replica, started, attempt, message, exc.cause, causes
                            )
                        ]
                    refused_by = self._stream_refused if exc.cause == "stream" else self._structured_refused
                    refused_by(replica, key.role, message)
                    causes.append(exc.cause)
                    attempt -= 1
                    continue
                refused = _refused_field(message) if exc.cause == "http_400" else None
                if refused is not None and refused[0] in body:
                    # A sampling field this model refuses (OpenAI's reasoning models: max_tokens under another
                    # name, temperature and top_p only at their defaults): sent again at once without it, or under
                    # the name the server asked for, and so for the rest of the run; recorded. (A call sent before
                    # another learnt the same refusal just goes again: the field is no longer in its body.)
                    field_name, replacement = refused
                    replica.renamed[field_name] = replacement
                    self._fell_back("sampling", replica.url, key.role, message)
                    causes.append("sampling")
                    attempt -= 1
                    continue
                match = _CONTEXT_ERROR.search(message)
                if match and not shrunk_on_error:
                    # The server counted more prompt tokens than we estimated: learn its numbers, retry once.
                    context, prompt = int(match.group(1)), int(match.group(2))
                    replica.context_length = context
                    max_tokens = context - prompt - CONTEXT_MARGIN_TOKENS
                    shrunk_on_error = True
                    attempt -= 1
                    if max_tokens >= 1:
                        causes.append(exc.cause)
                        continue
                return [self._failed(key, request_hash, request, replica, started, attempt, message, exc.cause, causes)]
            except _Transient as exc:
                last_error = str(exc)
                all_connect_failures = all_connect_failures and exc.connect
                if exc.connect:
                    pin = None  # its replica is down: the retries go wherever the others can serve
                if attempt >= retry.max_attempts:
                    last_cause = exc.cause
                    break
                causes.append(exc.cause)
                self.stats.retries += 1
                await asyncio.sleep(self._backoff(attempt, exc))
            finally:
                replica.load -= 1
        message = f"gave up after {attempt} attempts: {last_error}"
        if all_connect_failures:
            urls = ", ".join(r.url for r in route.replicas)
            raise EndpointUnreachable(f"endpoint {urls} unreachable for role {key.role!r}: {last_error}")
        return [self._failed(key, request_hash, request, replica, started, attempt, message, last_cause, causes)]

    def _fit_context(
        self, route: _Route, replica: _Replica, request: ChatRequest, max_tokens: int | None
    ) -> int | None:
        """Lower max_tokens so prompt + completion fit the context window, instead of failing the call."""
        context = replica.context_length
        if context is None:
            return max_tokens
        # Checked even without max_tokens: a prompt that cannot fit is refused here rather than sent.
        prompt = sum(route.counter.count(m.content) + 4 for m in request.messages)
        if not route.counter.exact:
            prompt = int(prompt * 1.1)  # estimates err low on math text; stay on the safe side
        room = context - prompt - CONTEXT_MARGIN_TOKENS
        if room < 1:
            raise _Fatal(
                f"prompt of about {prompt} tokens does not fit the context window of {context} tokens", "context"
            )
        return None if max_tokens is None else min(max_tokens, room)

    async def _probe_models(self, replica: _Replica) -> None:
        """Read /v1/models once per replica: the context window where none is configured and the server reports
        one, and which engine the server is (:mod:`tmas.llm.server_kind`)."""
        if replica.probed:
            return
        async with replica.probe_lock:
            if not replica.probed:
                models = await self._read_models(replica)
                if replica.context_length is None:
                    replica.context_length = _context_length(models)
                replica.server_kind = server_kind(models)
                replica.probed = True

    async def _read_models(self, replica: _Replica) -> Any:
        """The server's /v1/models reply, or None where it gave none that reads as JSON."""
        try:
            assert self._session is not None
            async with self._session.get(f"{replica.url}/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def _pinned(self, route: _Route) -> tuple[int, int] | None:
        """(replica index, slot index) this call is pinned to (tmas.llm.lanes), or None."""
        if not route.endpoint.pin_slots:
            return None
        return pinned_slot(current_lane(), len(route.replicas), route.endpoint.max_in_flight)

    async def _post(
        self,
        route: _Route,
        replica: _Replica,
        body: dict[str, Any],
        key: CallKey,
        *,
        path: str = "chat/completions",
        slot: int | None = None,
        watch: TraceWatch | None = None,
    ) -> dict[str, Any]:
        """POST ``body``; with ``slot``, to that llama-server slot (``id_slot``), after the slot's previous call. A
        streamed request's reply is read as it comes (:mod:`tmas.llm.stream`) and returned whole, or as far as
        ``watch`` let it run."""
        session = self._session
        if session is None:
            raise RuntimeError("LLMClient used outside 'async with'")
        headers = {"X-Tmas-Role": key.role}
        if key.problem_id:
            headers["X-Tmas-Problem"] = key.problem_id
        session_header = route.endpoint.session_header
        if session_header and (session_key := call_affinity(key.problem_id, self.settings.seed)):
            headers[session_header] = session_key  # a serving router in front keeps the chain on one server
        if route.api_key:
            headers["Authorization"] = f"Bearer {route.api_key}"
        endpoint = route.endpoint
        streamed = bool(body.get("stream"))
        if streamed:
            # Each read waits at most timeout_s (for the first byte, then for each next chunk): a reply that keeps
            # coming is never cut however long it is, a silent one is.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=endpoint.timeout_s, sock_read=endpoint.timeout_s)
        else:
            timeout = aiohttp.ClientTimeout(total=endpoint.timeout_s)
        # The whole call's bound, streamed or not: asyncio's own, so that its expiry is told apart from a stall.
        deadline = asyncio.timeout(endpoint.deadline_s)
        in_stream = False
        data: dict[str, Any] | None = None
        text = ""
        turn: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()
        if slot is not None:
            body = {**body, "id_slot": slot}
            turn = replica.slot_queues.setdefault(slot, SlotQueue()).turn()
        async with turn, self._cap:
            if replica.cap is not None:
                await replica.cap.acquire()
            self.stats.in_flight += 1
            try:
                async with (
                    deadline,
                    session.post(f"{replica.url}/{path}", json=body, headers=headers, timeout=timeout) as resp,
                ):
                    status = resp.status
                    replica.unreachable = False
                    retry_after = resp.headers.get("Retry-After")
                    if streamed and status == 200 and resp.content_type != "application/json":
                        in_stream = True
                        data = await _read_stream(resp, replica.url, watch)
                    else:
                        text = await resp.text(errors="replace")
            except aiohttp.ClientConnectorError as exc:
                replica.unreachable = True
                raise _Transient(f"cannot connect to {replica.url}: {exc.os_error}", "connect", connect=True) from None
            except TimeoutError:
                # (Before ClientError: aiohttp's read timeouts are both.)
                if deadline.expired():
                    # Not retried: a call that ran out of its whole budget would most likely run out of it again.
                    raise _Fatal(
                        f"no whole reply from {replica.url} within deadline_s = {endpoint.deadline_s:g}s", "deadline"
                    ) from None
                if in_stream:
                    raise _Transient(
                        f"stream from {replica.url} stalled: no chunk within {endpoint.timeout_s:g}s", "stall"
                    ) from None
                raise _Transient(f"no reply from {replica.url} within {endpoint.timeout_s:g}s", "timeout") from None
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise _Transient(
                    f"connection to {replica.url} failed: {type(exc).__name__}: {exc}", "connection"
                ) from None
            finally:
                self.stats.in_flight -= 1
                if replica.cap is not None:
                    replica.cap.release()
        if data is not None:
            return data
        if status != 200:
            message = _error_message(text)
            if streamed and status in _STREAM_REFUSAL_STATUS and _STREAM_REFUSAL.search(message):
                raise _Fatal(f"HTTP {status}: {message}", "stream")
            if "response_format" in body and status in _SCHEMA_REFUSAL_STATUS and _SCHEMA_REFUSAL.search(message):
                raise _Fatal(f"HTTP {status}: {message}", "structured_output")
            if status in _RETRYABLE_STATUS:
                raise _Transient(f"HTTP {status}: {message}", f"http_{status}", retry_after=_seconds(retry_after))
            cause = "context" if _CONTEXT_ERROR.search(message) else f"http_{status}"
            raise _Fatal(f"HTTP {status}: {message}", cause)
        try:
            data = json.loads(text)
        except ValueError:
            raise _Transient(f"reply is not JSON: {text[:120]!r}", "malformed") from None
        wanted = "choices" if path == "chat/completions" else "data"
        if not isinstance(data, dict) or not data.get(wanted):
            raise _Transient(f"reply has no {wanted}: {text[:120]!r}", "malformed")
        if streamed and endpoint.stream == "auto":
            # A whole JSON reply to a streamed request: the server does not stream. Its reply is used; its later
            # calls go unstreamed, so that timeout_s bounds their whole reply, as it says for unstreamed ones.
            self._stream_refused(replica, key.role, "answered a streamed request with a plain JSON reply")
        return data

    def _parse(
        self,
        data: dict[str, Any],
        route: _Route,
        request: ChatRequest,
        key: CallKey,
        request_hash: str,
        replica: _Replica,
        started: float,
        attempts: int,
        sent_max: int | None,
    ) -> Completion:
        try:
            choice = data["choices"][0]
            message = choice.get("message") or {}
            raw = message.get("content") or ""
            field_reasoning = message.get("reasoning_content") or message.get("reasoning")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise _Transient(f"reply has an unexpected shape: {str(data)[:120]!r}", "malformed") from None
        if not isinstance(raw, str) or (field_reasoning is not None and not isinstance(field_reasoning, str)):
            raise _Transient("reply content is not text", "malformed")
        content, reasoning = split_reasoning(raw, field_reasoning)
        usage = _usage(data, route.counter, request.messages, raw, field_reasoning or "")
        logprobs = _logprobs(choice.get("logprobs"))
        stopped = data.get(_STOPPED_EARLY)
        if stopped is not None and not isinstance(data.get("usage"), dict):
            # Cut by us, the stream brought no usage: the text received is counted, and each log-probability received
            # stood for one generated token (the few the server made before it saw the connection close are unknown).
            usage.completion_tokens = max(usage.completion_tokens, len(logprobs or ()))
            usage.estimated = True
        return Completion(
            key=key,
            request_hash=request_hash,
            endpoint=replica.url,
            model=str(data.get("model") or request.model),
            content=content,
            reasoning=reasoning,
            usage=usage,
            finish_reason=choice.get("finish_reason"),
            latency_s=time.monotonic() - started,
            attempts=attempts,
            max_tokens_sent=sent_max if sent_max != request.sampling.max_tokens else None,
            logprobs=logprobs,
            stopped_early=stopped,
        )

    def _failed(
        self,
        key: CallKey,
        request_hash: str,
        request: ChatRequest,
        replica: _Replica,
        started: float,
        attempts: int,
        error: str,
        cause: str,
        retry_causes: list[str],
    ) -> Completion:
        return Completion(
            key=key,
            request_hash=request_hash,
            endpoint=replica.url,
            model=request.model,
            latency_s=time.monotonic() - started,
            attempts=attempts,
            error=error,
            error_cause=cause,
            retry_causes=retry_causes,
        )


async def list_models(url: str, api_key: str | None = None) -> list[str]:
    """Model ids served at ``url`` (raises :class:`LLMError` with the reason when it does not answer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/models", headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp,
        ):
            text = await resp.text(errors="replace")
            if resp.status != 200:
                raise LLMError(f"HTTP {resp.status}: {_error_message(text)}")
            data = json.loads(text)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise LLMError(f"{type(exc).__name__}: {exc}") from None
    return [str(m.get("id")) for m in data.get("data", []) if isinstance(m, dict)]


def _refused_field(message: str) -> tuple[str, str | None] | None:
    """(the sampling field a server refused, the name it asked for instead or None), where its message says so."""
    match = _REFUSED_FIELD.search(message)
    if match is None or match.group(1) not in _ADAPTABLE_FIELDS:
        return None
    return match.group(1), match.group(2)


def _adapted(body: dict[str, Any], replica: _Replica) -> dict[str, Any]:
    """``body`` with the fields ``replica``'s server refused renamed as it asked, or left out."""
    for name, replacement in replica.renamed.items():
        if name in body:
            value = body.pop(name)
            if replacement is not None:
                body[replacement] = value
    return body


def _context_length(models: Any) -> int | None:
    """The context window a /v1/models reply reports (vLLM's ``max_model_len``, or another server's name for it)."""
    for model in models.get("data", []) if isinstance(models, dict) else []:
        if not isinstance(model, dict):
            continue
        for name in ("max_model_len", "context_length", "context_window"):
            if isinstance(model.get(name), int):
                return int(model[name])
    return None


async def _read_stream(resp: aiohttp.ClientResponse, url: str, watch: TraceWatch | None = None) -> dict[str, Any]:
    """The whole reply of an event stream, in an unstreamed reply's shape. A stream that breaks or ends before every
    choice finished fails with cause "cut" (a partial reply is never returned), an error event with the server's
    message (cause "stream_error": retried, as vLLM and SGLang send one for internal errors met mid-generation), an
    event that is not a chunk with cause "malformed"; a stall (a read past timeout_s) raises TimeoutError.

    ``watch`` is told of the log-probabilities as each chunk brings them; when it stops the reply, the connection is
    closed there (the server aborts the request) and the reply so far is returned, marked (:mod:`tmas.llm.watch`)."""
    assembler = StreamAssembler()
    seen = 0
    if watch is not None:
        watch.begin()
    try:
        try:
            async for line in lines(resp.content.iter_any()):
                assembler.feed(line)
                if assembler.done:
                    break
                if watch is None or len(assembler.logprobs()) == seen:
                    continue
                arrived = assembler.logprobs()[seen:]
                seen += len(arrived)
                stop = watch.observe(_logprobs({"content": arrived}) or [])
                if stop is not None and not assembler.complete:
                    resp.close()
                    assembler.stop(stop.finish_reason)
                    return {**assembler.reply(), _STOPPED_EARLY: stop.detail}
        except TimeoutError:
            raise
        except (aiohttp.ClientError, ConnectionError) as exc:
            # The connection broke: the reply is whole only if every choice had finished.
            if not assembler.complete:
                raise _Transient(f"stream from {url} cut: {type(exc).__name__}: {exc}", "cut") from None
        return assembler.reply()
    except StreamError as exc:
        raise _Transient(f"stream from {url}: {exc}", exc.cause) from None


def _vectors(data: dict[str, Any], count: int) -> list[list[float]]:
    """The float vectors of an embeddings reply, ordered by their ``index``."""
    items = data["data"]
    try:
        ordered = sorted(items, key=lambda item: int(item.get("index", 0)))
        vectors = [[float(x) for x in item["embedding"]] for item in ordered]
    except (TypeError, ValueError, KeyError, AttributeError):
        raise _Transient(
            "embeddings reply has an unexpected shape (base64 vectors are not requested)", "malformed"
        ) from None
    if len(vectors) != count:
        raise _Transient(f"embeddings reply has {len(vectors)} vectors for {count} inputs", "malformed")
    return vectors


def _usage(
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
            cached_prompt_tokens=_cached_tokens(raw, data.get("timings")),
        )
    # No usage from the server: count ourselves, and say so unless a real tokenizer did the counting.
    return Usage(
        prompt_tokens=sum(counter.count(m.content) + 4 for m in messages),
        completion_tokens=counter.count(content) + counter.count(reasoning),
        reasoning_tokens=counter.count(reasoning),
        estimated=not counter.exact,
    )


def _cached_tokens(usage: dict[str, Any], timings: Any) -> int:
    """Prompt tokens served from the server's prompt cache: OpenAI's and vLLM's
    ``usage.prompt_tokens_details.cached_tokens``, else llama-server's ``timings.cache_n``; 0 when neither says."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(value, int) and isinstance(timings, dict):
        value = timings.get("cache_n")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _logprobs(raw: Any) -> list[TokenLogprob] | None:
    """The content tokens' log-probabilities in OpenAI's shape (``{"content": [{token, logprob, top_logprobs}]}``);
    None when the server sent none or sent them in a shape we cannot read (the caller then falls back to the text)."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list) or not content:
        return None
    try:
        return [TokenLogprob.model_validate(item) for item in content]
    except ValidationError:
        return None


def _error_message(text: str) -> str:
    """The server's own error message where it sent one in OpenAI's shape, else the start of the body."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300] or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
        if data.get("message"):
            return str(data["message"])[:300]
    return text.strip()[:300]


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
