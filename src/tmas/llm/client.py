"""The async client for OpenAI-compatible endpoints, :class:`tmas.llm.model.ChatModel` over HTTP.

Per call: resolve the role's endpoint (:mod:`tmas.llm.routes`) and sampling (:mod:`tmas.llm.sampling`), join alike
calls into one request with ``n`` (:mod:`tmas.llm.batching`), take a slot under the global cap, pick a replica, send
and read the reply (:mod:`tmas.llm.transport`: a queued request is waited for while its server lives), decide what a
failure means (:mod:`tmas.llm.failures`) and what to do next (:mod:`tmas.llm.retry`), adapt to what a server refused
(:mod:`tmas.llm.refusals`), read the reply (:mod:`tmas.llm.replies`). It stores nothing: replay and durability are
:class:`tmas.llm.replay.StoreReplay`'s, which :func:`tmas.llm.factory.open_model` wraps around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any

import aiohttp
from pydantic import BaseModel

from tmas.config import Sampling, Settings
from tmas.errors import ConfigError, LLMError
from tmas.llm import replica as replicas
from tmas.llm import vitals
from tmas.llm.batching import (
    Sample,
    SampleBatcher,
    choice_indices,
    handed_out,
    one_per_choice,
    share_usage,
    without_aborted,
)
from tmas.llm.failures import Failure
from tmas.llm.lanes import SlotQueue, call_affinity
from tmas.llm.model import CANCELLED, ClientStats, EndpointUnreachable, QuotaSpent, leave_spent, spent_before
from tmas.llm.reasoning import thinking_off
from tmas.llm.refusals import MAX_SHRINKS, DowngradeLog, Refusals, Shrinks, reasoning_of
from tmas.llm.replica import Replica
from tmas.llm.replies import completion as read_completion
from tmas.llm.replies import discarded as discarded_usage
from tmas.llm.replies import reasoning_place, reply_texts, vectors
from tmas.llm.retry import Attempts, RetryPolicy
from tmas.llm.routes import DEFAULT_MODEL, Route, Routes
from tmas.llm.sampling import ResolvedSampling, resolve_role
from tmas.llm.stream import PARTIAL
from tmas.llm.tokens import TokenCounter
from tmas.llm.transport import Exchange, Timing, send
from tmas.llm.types import CallKey, ChainKey, ChatRequest, Completion, Message, Usage
from tmas.llm.watch import TraceWatch

# Causes whose retries go to another replica while one is left (see LLMClient._call).
MOVE_ON = vitals.LIFELESS | {"queue_timeout"}


class LLMClient:
    """The HTTP implementation of :class:`tmas.llm.model.ChatModel`, one per run.

    Use as ``async with LLMClient(settings) as llm: await llm.chat(...)``; a run's model (provisioned, replayed from
    its store) comes from :func:`tmas.llm.factory.open_model`. ``downgrade_log`` hears of what an endpoint refused and
    the run went on without, and of what each server said of itself; ``stats`` counts the calls."""

    def __init__(
        self,
        settings: Settings,
        *,
        downgrade_log: DowngradeLog | None = None,
        stats: ClientStats | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if settings.uses_local_model:
            raise ConfigError("no endpoint configured: set endpoint.base_url (or TMAS_BASE_URL) or use the local model")
        self.settings = settings
        self.stats = stats if stats is not None else ClientStats()
        self.refusals = Refusals(self.stats, downgrade_log)
        self.policy = RetryPolicy(settings.retry, rng or random.Random())
        self._cap = asyncio.Semaphore(settings.concurrency)
        self._routes = Routes(settings, downgrade_log.servers() if downgrade_log is not None else {})
        # Role -> the model its last embeddings reply said served it: the model of a role that names none.
        self._embedded_by: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._batcher = SampleBatcher(self._send_samples)
        # Background looks at replicas out of routing, by URL (at most one each).
        self._rechecks: dict[str, asyncio.Future[None]] = {}

    async def __aenter__(self) -> LLMClient:
        # The global cap bounds what we send; the connector must not add a lower hidden bound of its own. Idle
        # connections are dropped after 3 s, before the servers drop them (uvicorn and cpp-httplib after 5 s): a
        # connection reused just as the server closes it loses its request (cause "disconnected").
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=3.0)
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for task in list(self._rechecks.values()):
            task.cancel()
        await asyncio.gather(*self._rechecks.values(), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("LLMClient used outside 'async with'")
        return self._session

    def route(self, role: str) -> Route:
        return self._routes.route(role)

    # ----------------------------------------------------------------------------------------- ChatModel
    def resolve_sampling(
        self, role: str, *, preset: Sampling | None = None, method: Sampling | None = None, call: Sampling | None = None
    ) -> ResolvedSampling:
        return resolve_role(self.settings, role, preset=preset, method=method, call=call)

    def context_window(self, role: str) -> int | None:
        route = self.route(role)
        known = [r.context_length for r in route.replicas if r.context_length]
        return route.endpoint.context_length or (min(known) if known else None)

    def model_name(self, role: str) -> str:
        return self.route(role).endpoint.model or self._embedded_by.get(role, DEFAULT_MODEL)

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
        """One chat completion for ``role`` (see :meth:`tmas.llm.model.ChatModel.chat`), sent over the wire. Never
        raises for a failed call: it returns a :class:`Completion` whose ``error`` says why, except
        :class:`EndpointUnreachable`, which ends a run. A watched call goes alone: closing its connection to stop it
        would stop the choices it shares too."""
        route = self.route(role)
        key = key or CallKey(role=role)
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.resolve_sampling(role, call=sampling)
        schema = self.refusals.response_format(route, sampling.sampling, reply_model)
        request = ChatRequest.build(route.model, messages, sampling, schema)
        request_hash = request.request_hash(key)
        completion = None
        try:
            if watch is None and self.refusals.batches(route) is not False:
                completion = await self._batcher.submit(request, key, request_hash)
            if completion is None:
                [completion] = await self._call(route, request, key, request_hash, watch=watch)
        except asyncio.CancelledError as cancel:
            if (spent := spent_before(cancel)) is not None:
                self.stats.count(spent)
            raise
        self.stats.count(completion)
        return completion

    def end_chain(self, chain: ChainKey) -> None:
        """``chain`` made its last call (see :meth:`tmas.llm.model.ChatModel.end_chain`): a pinned slot it holds
        goes to the next call in line (tmas.llm.lanes.SlotQueue)."""
        for replica in self._routes.replicas():
            for queue in replica.slot_queues.values():
                queue.chain_ended(chain)

    async def _send_samples(self, samples: list[Sample]) -> list[Completion | None]:
        """Two or more alike calls as one request with ``n`` where the endpoint serves it (tmas.llm.batching); None
        for each call left to its caller to send alone."""
        route = self.route(samples[0].key.role)
        if self.refusals.batches(route) is None:
            await asyncio.gather(
                *(
                    self.refusals.probe(self.session, route, r, partial(self._routes.ready_elsewhere, route, r))
                    for r in route.replicas
                )
            )
        if not self.refusals.batches(route):
            return [None] * len(samples)
        lead = samples[0]
        indices: list[int] = []
        done = await self._call(route, lead.request, lead.key, lead.request_hash, n=len(samples), indices=indices)
        kept = self.refusals.kept(route, lead, done, len(samples))
        return [None] * len(samples) if kept is None else handed_out(kept, samples, indices)

    async def embed(self, texts: Sequence[str], *, role: str = "embedding") -> list[list[float]]:
        """``texts``' vectors from ``role``'s ``/v1/embeddings``, in order, with the caps and retry policy of chat
        calls; :class:`LLMError` when refused or out of retries (:class:`EndpointUnreachable`: no replica answers).
        The role's own ``extra_body`` (``[roles.embedding.sampling]``: ``dimensions``, ``encoding_format``, ...) goes
        in the body, under the ``model`` and ``input`` tmas sends (settings that set either are refused); the default
        sampling's, meant for chat, does not."""
        if not texts:
            return []
        route = self.route(role)
        own = self.settings.roles.get(role)
        body = {**(own.sampling.extra_body if own is not None else {}), "model": route.model, "input": list(texts)}
        attempts = self.policy.attempts()
        refused: set[str] = set()
        while True:
            attempts.begin()
            self._recheck(route)
            replica = self._routes.router.least_loaded(route.replicas)
            replica.load += 1
            try:
                data = await self._post(route, replica, body, CallKey(role=role), Timing(), path="embeddings")
                self.stats.embedding_calls += 1
                found = vectors(data, len(texts))
                if isinstance(served := data.get("model"), str) and served:
                    self._embedded_by[role] = served
                return found
            except Failure as failure:
                if self._moved_on(route, replica, failure, attempts, refused):
                    continue
                if (delay := attempts.after(failure)) is None:
                    break
                self.stats.retried(failure.cause)
                await asyncio.sleep(delay)
            finally:
                replica.load -= 1
        last = _unreachable(route, role, attempts)
        if not last.retry:
            raise LLMError(f"embeddings for role {role!r}: {last}")
        raise LLMError(f"embeddings for role {role!r}: gave up after {attempts.count} attempts: {last}")

    async def _call(
        self,
        route: Route,
        request: ChatRequest,
        key: CallKey,
        request_hash: str,
        n: int = 1,
        watch: TraceWatch | None = None,
        indices: list[int] | None = None,
    ) -> list[Completion]:
        """The request's completion; with ``n`` > 1 one request for that many choices and a completion per choice
        received (their choice indices put in ``indices``). A failure is one failed completion. A call cancelled once
        its server generated something leaves what it did on the cancel (:func:`tmas.llm.model.leave_spent`: a failed
        completion of cause ``cancelled``)."""
        spend = _Spend(attempts=self.policy.attempts(), url=route.replicas[0].url)
        try:
            return await self._attempts(route, request, key, request_hash, spend, n, watch, indices)
        except asyncio.CancelledError as cancel:
            spend.close_attempt(route.counter)
            if spend.discarded.completion_tokens:
                attempts = spend.attempts
                spent = Completion(
                    key=key, request_hash=request_hash, endpoint=spend.url, model=request.model,
                    latency_s=time.monotonic() - spend.started, attempts=attempts.count, error=CANCELLED,
                    error_cause="cancelled", retry_causes=attempts.causes, usage=spend.discarded,
                )  # fmt: skip
                leave_spent(cancel, spent)
            raise

    async def _attempts(
        self,
        route: Route,
        request: ChatRequest,
        key: CallKey,
        request_hash: str,
        spend: _Spend,
        n: int,
        watch: TraceWatch | None,
        indices: list[int] | None = None,
    ) -> list[Completion]:
        """:meth:`_call`'s attempts, what they had the server generate noted in ``spend`` as they go."""
        started = spend.started
        attempts = spend.attempts
        max_tokens = request.sampling.max_tokens
        # Once a context refusal told what fits, the max_tokens it gave stands, not the client's estimate.
        shrinks = Shrinks()
        pin = self._routes.pinned(route, key)
        replica = route.replicas[0]
        # Replicas that ended an attempt of this call by their vitals, or held it in their queue past queue_timeout_s:
        # its retries go to another while one is left, even where such a replica is back in routing by then (its
        # prompt's prefix would draw the call back to it, to the end of the queue it left).
        shunned: frozenset[str] = frozenset()
        # Replicas that refused this call's connection: each moves it on to another at most once (see _moved_on).
        refused: set[str] = set()
        while True:
            attempts.begin()
            self._recheck(route)
            pinned = route.replicas[pin[0]] if pin else None
            if pinned is not None and pinned.avoided and self._routes.ready_elsewhere(route, pinned, shunned):
                pin = None  # its replica is out of routing (down, refusing, loading): the others serve the call
            replica = route.replicas[pin[0]] if pin else self._routes.pick(route, request.messages, key, shunned)
            replica.load += 1
            timing = spend.attempt = Timing()
            spend.url = replica.url
            # A model its replica's replies showed thinking in its content: a text it leaves is thinking unless tagged.
            spend.inline = reasoning_of(route, replica) == "inline" and not thinking_off(request.sampling.extra_body)
            body: dict[str, Any] = {}
            data: dict[str, Any] | None = None
            try:
                elsewhere = partial(self._ready_elsewhere, route, replica, shunned)
                await self.refusals.probe(self.session, route, replica, elsewhere)
                if replica.loading and elsewhere():
                    attempts.unsent()  # still loading its model: the call goes to a replica in routing instead
                    pin = None
                    continue
                sent_max = max_tokens
                if not shrinks.done:
                    sent_max = self.refusals.fit_context(route, replica, request, max_tokens)
                body = self.refusals.body(route, replica, request, sent_max, n)
                data = await self._post(route, replica, body, key, timing, slot=pin[1] if pin else None, watch=watch)
                if timing.plain_reply and body.get("stream") and route.endpoint.stream == "auto":
                    self.refusals.stream_refused(replica, key.role, "answered a streamed request with a plain reply")
                was_cut = data.pop(PARTIAL, None)
                aborted = without_aborted(data) if n > 1 else []
                off = thinking_off(request.sampling.extra_body)
                place = reasoning_place(data)
                self.refusals.saw_reasoning(replica, key.role, None if off and place == "none" else place)
                inline = reasoning_of(route, replica) == "inline" and not off
                replies = one_per_choice(data, n)
                done = [
                    read_completion(reply, request=request, key=key, request_hash=request_hash, counter=route.counter,
                                    url=replica.url, attempts=attempts.count, sent_max=sent_max, thinks_inline=inline)
                    for reply in replies
                ]  # fmt: skip
                if was_cut and timing.stream is not None and "usage" not in data:
                    # Without usage, the unfinished choices' text is counted; a running usage already counted it.
                    left = timing.stream.received(unfinished=True)
                    spend.discarded += discarded_usage(left, route.counter, thinks_inline=inline)
                if aborted and "usage" not in data:
                    left = reply_texts({"choices": aborted})
                    spend.discarded += discarded_usage(left, route.counter, thinks_inline=inline)
                causes = attempts.causes + (["cut"] if was_cut else []) + (["abort"] if aborted else [])
                for completion in done:
                    completion.retry_causes = list(causes)
                    completion.latency_s = time.monotonic() - started
                    completion.first_token_s = timing.first_token_s
                    completion.queued_s = timing.queued_s
                done = share_usage(done, data, route.counter, replica.server_kind)
                if done and spend.discarded.completion_tokens:
                    done[0].usage = done[0].usage + spend.discarded
                if indices is not None:
                    indices[:] = choice_indices(replies)
                return done
            except Failure as failure:
                if timing.stream is None and data is not None:
                    # A whole reply that is not kept (a choice the server aborted): what it says it generated.
                    spend.discarded += discarded_usage(
                        reply_texts(data), route.counter, data.get("usage"), thinks_inline=spend.inline
                    )
                spend.close_attempt(route.counter)
                if self.refusals.adapt(failure, route, replica, key, body):
                    attempts.again_at_once(failure.cause)
                    continue
                if failure.context is not None and shrinks.done < MAX_SHRINKS:
                    shrunk = await self.refusals.shrunk(self.session, route, replica, request, failure, shrinks)
                    if shrunk is not None:
                        max_tokens = shrunk
                        attempts.again_at_once("context")
                        continue
                elif failure.context is not None:
                    failure.args = (f"{failure} (refused again after max_tokens was lowered {shrinks.done} times)",)
                if failure.connect or replica.avoided:
                    pin = None  # its replica is down: the retries go wherever the others can serve
                if self._moved_on(route, replica, failure, attempts, refused, shunned):
                    continue
                if failure.cause in MOVE_ON:
                    shunned |= {replica.url}
                if failure.cause == "http_503":
                    replica.unavailable()
                delay = attempts.after(failure)
                if delay is None:
                    break
                self.stats.retried(failure.cause)
                await asyncio.sleep(delay)
            finally:
                replica.load -= 1
        last = _unreachable(route, key.role, attempts)
        message = str(last) if not last.retry else f"gave up after {attempts.count} attempts: {last}"
        failed = Completion(
            key=key, request_hash=request_hash, endpoint=replica.url, model=request.model,
            latency_s=time.monotonic() - started, attempts=attempts.count, error=message,
            error_cause=last.cause, retry_causes=attempts.causes, usage=spend.discarded,
        )  # fmt: skip
        return [failed]

    async def _post(
        self,
        route: Route,
        replica: Replica,
        body: dict[str, Any],
        key: CallKey,
        timing: Timing,
        *,
        path: str = "chat/completions",
        slot: int | None = None,
        watch: TraceWatch | None = None,
    ) -> dict[str, Any]:
        """The reply to ``body`` as JSON, sent once the caps (and ``slot``'s previous call) let it go; or Failure."""
        headers = {"X-Tmas-Role": key.role, **replicas.auth_headers(route.api_key)}
        if key.problem_id:
            headers["X-Tmas-Problem"] = key.problem_id
        if route.endpoint.session_header and (session_key := call_affinity(key, self.settings.seed)):
            headers[route.endpoint.session_header] = session_key  # a serving router keeps the chain on one server
        turn: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()
        if slot is not None:
            body = {**body, "id_slot": slot}
            turn = replica.slot_queues.setdefault(slot, SlotQueue()).turn(key.chain_key)

        def on_chunk() -> None:
            replica.vitals.progressed()
            replica.back(timing.sent_at)

        if replica.server_kind == "llama-server":
            headers["Connection"] = "close"  # it drops a streamed reply's connection: never hand one to a next call
        judge = vitals.judge(self.session, replica, route.endpoint, route.api_key)
        url = f"{replica.url}/{path}"
        exchange = Exchange(self.session, url, body, headers, route.endpoint, judge, on_chunk, watch)
        async with turn, self._cap, route.caps.get(replica.url) or contextlib.nullcontext():
            self.stats.in_flight += 1
            try:
                data = await send(exchange, timing)
            except Failure as failure:
                if failure.connect:
                    replica.refused()
                raise
            finally:
                self.stats.in_flight -= 1
        replica.vitals.progressed()
        replica.back(timing.sent_at)
        return data

    def _moved_on(
        self,
        route: Route,
        replica: Replica,
        failure: Failure,
        attempts: Attempts,
        refused: set[str],
        shunned: frozenset[str] = frozenset(),
    ) -> bool:
        """Whether a call whose connection ``replica`` refused goes at once to another replica in routing, costing no
        attempt: no server listened there, so nothing was generated, and a call that could reach another replica must
        not count as unreachable (with ``retry.max_attempts = 1`` it would end the run). Once per replica and call, so
        a call that every replica refuses spends its attempts as before and then ends the run."""
        if not failure.connect or replica.url in refused or not self._routes.ready_elsewhere(route, replica, shunned):
            return False
        refused.add(replica.url)
        attempts.again_at_once(failure.cause)
        self.stats.retried(failure.cause)
        return True

    def _ready_elsewhere(self, route: Route, replica: Replica, shunned: frozenset[str]) -> bool:
        """Whether a call on ``replica`` may go to another replica in routing (tmas.llm.routes.Routes.ready_elsewhere).
        Asked again and again while the call waits for ``replica`` to load its model, it looks again at those out of
        routing first, so the call goes to whichever replica is ready first."""
        self._recheck(route)
        return self._routes.ready_elsewhere(route, replica, shunned)

    def _recheck(self, route: Route) -> None:
        """Look again, in the background, at the replicas of ``route`` out of routing whose last look is older than
        the recheck interval: each comes back once it shows life (tmas.llm.vitals.recheck), or, out for loading its
        model, once its model card answers (asked at most once per tmas.llm.refusals.LOADING_POLL_S)."""
        if len(route.replicas) < 2:
            return
        every = min(route.endpoint.timeout_s, vitals.LOOK_TIMEOUT_S)
        now = time.monotonic()
        for replica in route.replicas:
            if not replica.avoided or replica.url in self._rechecks:
                continue
            look: Awaitable[None]
            if replica.loading:
                if replica.probe_lock.locked() or not self.refusals.poll_due(replica):
                    continue  # a call waiting for it asks it already
                look = self.refusals.probe(self.session, route, replica, elsewhere=lambda: True)
            elif now - replica.vitals.looked_at < every:
                continue
            else:
                look = vitals.recheck(self.session, replica, route.endpoint, route.api_key)
            task = asyncio.ensure_future(look)
            self._rechecks[replica.url] = task
            task.add_done_callback(partial(self._recheck_done, replica.url))

    def _recheck_done(self, url: str, task: asyncio.Future[None]) -> None:
        self._rechecks.pop(url, None)
        if not task.cancelled():
            task.exception()  # retrieved, so that asyncio does not warn of it (a look answers aiohttp's errors itself)


@dataclass
class _Spend:
    """What a call had its server generate for text it does not keep: the attempts (and choices) not kept so far,
    and the attempt under way, whose stream counts once it fails or the call is cancelled."""

    attempts: Attempts
    # The replica of the latest attempt.
    url: str
    started: float = field(default_factory=time.monotonic)
    discarded: Usage = field(default_factory=Usage)
    attempt: Timing | None = None
    # The attempt under way went to a replica whose model thinks inside its content (tmas.llm.replies.discarded).
    inline: bool = False

    def close_attempt(self, counter: TokenCounter) -> None:
        """The attempt under way ended without its reply kept: what its stream brought counts (its running usage
        where the server sent one, else its text)."""
        stream = self.attempt.stream if self.attempt is not None else None
        if stream is not None:
            self.discarded += discarded_usage(stream.received(), counter, stream.usage, thinks_inline=self.inline)
        self.attempt = None


def _unreachable(route: Route, role: str, attempts: Attempts) -> Failure:
    """The last failure of a call that gave up; :class:`EndpointUnreachable` when no replica could be reached,
    :class:`QuotaSpent` when the account's quota is spent."""
    last = attempts.last
    assert last is not None
    urls = ", ".join(r.url for r in route.replicas)
    if attempts.unreachable:
        raise EndpointUnreachable(f"endpoint {urls} unreachable for role {role!r}: {last}", last.cause)
    if last.cause == "quota":
        raise QuotaSpent(f"endpoint {urls} refused role {role!r}: {last}")
    return last
