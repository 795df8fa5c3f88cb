"""Replay from a call store, as a wrapper around any :class:`tmas.llm.model.ChatModel`.

A call whose request (model, messages, resolved sampling, role, problem) and sample index are already in the store
with a reply is answered from there, marked ``cached``, and never reaches the wrapped model; any other call goes to
the wrapped model and is made durable in the store before it is returned. A reply a watch stopped early
(:mod:`tmas.llm.watch`) answers a caller that watches again, still stopped; a caller without a watch wants the whole
reply, and its call is sent. The run store is one such store (resume
replays a run's finished calls); anything with ``lookup_call`` and ``record_call`` is another (a cache shared between
runs, a fixture for tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pydantic import BaseModel

from tmas.config import Sampling, Settings
from tmas.llm.model import ChatModel
from tmas.llm.sampling import ResolvedSampling
from tmas.llm.types import CallKey, ChatRequest, Completion, Message
from tmas.llm.watch import TraceWatch


class CallStore(Protocol):
    """Where finished calls are made durable and replayed from (implemented by the run store)."""

    def lookup_call(self, request_hash: str, sample: int, *, stopped_early: bool = False) -> Completion | None: ...

    def record_call(self, completion: Completion, request: ChatRequest) -> int: ...


class StoreReplay:
    """``StoreReplay(model, store)``: ``model`` with every finished call replayed from ``store``.

    ``on_replay`` hears of each replayed call (the HTTP client counts them in its stats)."""

    def __init__(
        self, inner: ChatModel, store: CallStore, *, on_replay: Callable[[Completion], None] | None = None
    ) -> None:
        self.inner = inner
        self.store = store
        self.on_replay = on_replay
        self.replayed = 0

    @property
    def settings(self) -> Settings:
        return self.inner.settings

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
        # What the wrapped model hashes too (the response_format aside: it is no part of the hash).
        request = ChatRequest(
            model=self.inner.model_name(role),
            messages=list(messages),
            sampling=sampling.sampling,
            sampling_sources=sampling.sources,
        )
        stored = self.store.lookup_call(request.request_hash(key), key.sample, stopped_early=watch is not None)
        if stored is not None:
            self.replayed += 1
            if self.on_replay is not None:
                self.on_replay(stored)
            return stored.model_copy(update={"cached": True})
        completion = await self.inner.chat(
            role, messages, key=key, sampling=sampling, reply_model=reply_model, watch=watch
        )
        completion.call_id = self.store.record_call(completion, request)
        return completion

    async def embed(self, texts: Sequence[str], *, role: str = "embedding") -> list[list[float]]:
        return await self.inner.embed(texts, role=role)

    def resolve_sampling(
        self,
        role: str,
        *,
        preset: Sampling | None = None,
        method: Sampling | None = None,
        call: Sampling | None = None,
    ) -> ResolvedSampling:
        return self.inner.resolve_sampling(role, preset=preset, method=method, call=call)

    def context_window(self, role: str) -> int | None:
        return self.inner.context_window(role)

    def model_name(self, role: str) -> str:
        return self.inner.model_name(role)
