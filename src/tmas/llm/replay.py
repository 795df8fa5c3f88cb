"""Replay from a call store, as a wrapper around any :class:`tmas.llm.model.ChatModel`.

A call whose request (model, messages, resolved sampling, role, problem), sample index and iteration are already in
the store with a reply is answered from there, marked ``replayed``, and never reaches the wrapped model; any other
call goes to the wrapped model and is made durable in the store before it is returned. A reply a watch stopped early
(:mod:`tmas.llm.watch`) answers a caller that watches again, still stopped; a caller without a watch wants the whole
reply, and its call is sent. The run store is one such store (resume
replays a run's finished calls); anything with ``lookup_call`` and ``record_call`` is another (a cache shared between
runs, a fixture for tests).

A replayed call answers at once, so the problems of a resumed run, started together, would replay in lockstep and
none would send a new call before every one of them had replayed all its finished calls (at the paper's scale, tens
of thousands). :class:`ReplayTurns` has them replay one at a time instead: each until its first new call, then the
next, so new calls start after one problem's replays and the endpoint fills as the others catch up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from pydantic import BaseModel

from tmas.config import Sampling
from tmas.llm.model import ChatModel, WrappedModel, spent_before
from tmas.llm.sampling import ResolvedSampling
from tmas.llm.types import CallKey, ChatRequest, Completion, Message
from tmas.llm.watch import TraceWatch


class CallStore(Protocol):
    """Where finished calls are made durable and replayed from (implemented by the run store)."""

    def lookup_call(
        self, request_hash: str, sample: int, iteration: int | None, *, stopped_early: bool = False
    ) -> Completion | None: ...

    def record_call(self, completion: Completion, request: ChatRequest) -> int: ...


class StoreReplay(WrappedModel):
    """``StoreReplay(model, store)``: ``model`` with every finished call replayed from ``store``.

    ``on_replay`` hears of each replayed call (the HTTP client counts them in its stats), ``on_send`` of each call
    about to be sent (a problem's first one ends its replay turn: :class:`ReplayTurns`), ``on_sent`` of each
    completion the wrapped model returned (counted there for a model that keeps no stats of its own)."""

    def __init__(
        self,
        inner: ChatModel,
        store: CallStore,
        *,
        on_replay: Callable[[Completion], None] | None = None,
        on_send: Callable[[CallKey], None] | None = None,
        on_sent: Callable[[Completion], None] | None = None,
    ) -> None:
        super().__init__(inner)
        self.store = store
        self.on_replay = on_replay
        self.on_send = on_send
        self.on_sent = on_sent
        self.replayed = 0

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
        key = key or CallKey(role=role)
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.inner.resolve_sampling(role, call=sampling)
        request, request_hash, stored = self._lookup(role, messages, key, sampling, watched=watch is not None)
        if stored is not None:
            self.replayed += 1
            if self.on_replay is not None:
                self.on_replay(stored)
            return stored.model_copy(update={"replayed": True})
        if self.on_send is not None:
            self.on_send(key)
        try:
            completion = await self.inner.chat(
                role, messages, key=key, sampling=sampling, reply_model=reply_model, watch=watch
            )
        except asyncio.CancelledError as cancel:
            # What the cancelled call had the server generate is kept as a failed call (never replayed).
            if (spent := spent_before(cancel)) is not None:
                self._record(spent, request, request_hash)
            raise
        return self._record(completion, request, request_hash)

    def stored_reply(
        self, role: str, messages: Sequence[Message], key: CallKey, sampling: ResolvedSampling, *, watched: bool
    ) -> Completion | None:
        """The stored reply :meth:`chat` would answer this call from (``watched``: the call has a watch), or None
        where it would send it; nothing is sent or counted."""
        return self._lookup(role, messages, key, sampling, watched=watched)[2]

    def _lookup(
        self, role: str, messages: Sequence[Message], key: CallKey, sampling: ResolvedSampling, *, watched: bool
    ) -> tuple[ChatRequest, str, Completion | None]:
        # Built as the wrapped model builds it (the response_format aside: it is no part of the hash).
        request = ChatRequest.build(self.inner.model_name(role), messages, sampling)
        request_hash = request.request_hash(key)
        stored = self.store.lookup_call(request_hash, key.sample, key.iteration, stopped_early=watched)
        for seed in sampling.earlier_seeds:
            if stored is not None:
                break
            # Stored by a version that sent this call with another seed: its reply is this call's all the same.
            earlier = sampling.sampling.model_copy(update={"seed": seed})
            earlier_hash = request.model_copy(update={"sampling": earlier}).request_hash(key)
            stored = self.store.lookup_call(earlier_hash, key.sample, key.iteration, stopped_early=watched)
        return request, request_hash, stored

    def _record(self, completion: Completion, request: ChatRequest, request_hash: str) -> Completion:
        if self.on_sent is not None:
            self.on_sent(completion)
        # Saved under the hash it was looked up by, so a resumed run finds it whatever the wrapped model hashed.
        completion.request_hash = request_hash
        completion.call_id = self.store.record_call(completion, request)
        return completion

    # end_chain: replayed or sent, the chain's calls are over, and the wrapped model lets go of what it kept for them
    # (WrappedModel passes it on); embeddings, sampling resolution, windows and names are the wrapped model's too.


def store_replay(model: ChatModel) -> StoreReplay | None:
    """The :class:`StoreReplay` ``model`` is or wraps (through :class:`WrappedModel`\\ s), if any."""
    while not isinstance(model, StoreReplay):
        if not isinstance(model, WrappedModel):
            return None
        model = model.inner
    return model


class ReplayTurns:
    """The problems of ``replaying`` (those with finished calls in the store) replay one at a time, in the order
    they start: each holds the turn from its start until its first new call (:meth:`sent`, StoreReplay's
    ``on_send``) or its end. Any other problem starts at once. The calls and their replies are the same in any
    order; only when new calls begin changes."""

    def __init__(self, replaying: Collection[str]) -> None:
        self._replaying = replaying
        self._lock = asyncio.Lock()
        self._holder: str | None = None

    @asynccontextmanager
    async def turn(self, problem_id: str) -> AsyncIterator[None]:
        """Solve ``problem_id`` inside this block: it waits here for its turn when it has calls to replay."""
        if problem_id in self._replaying:
            await self._lock.acquire()
            self._holder = problem_id
        try:
            yield
        finally:
            self._release(problem_id)

    def sent(self, key: CallKey) -> None:
        """A call of ``key``'s problem is being sent: its replay is over, the next problem's turn begins."""
        self._release(key.problem_id)

    def _release(self, problem_id: str) -> None:
        if self._holder == problem_id:
            self._holder = None
            self._lock.release()
