"""The seam between the LLM layer and everything above it: the :class:`ChatModel` protocol.

Methods, agents, judges, experience building and the RL novelty judge depend on this protocol only, never on the
HTTP client, so a wrapper (replay, cache, tracing) or an in-process scripted model (``tmas.testing.ScriptedModel``,
for unit tests of logic) can stand where :class:`tmas.llm.client.LLMClient` stands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from tmas.config import Sampling, Settings
from tmas.errors import LLMError
from tmas.llm.sampling import ResolvedSampling
from tmas.llm.types import CallKey, ChainKey, Completion, Message, Usage
from tmas.llm.watch import TraceWatch

# The error of a call cancelled by its caller after its server began generating (cause "cancelled").
CANCELLED = "cancelled by its caller before its reply was whole; what the server generated for it is counted"
# The attribute of a cancel that carries what its call had the server generate (see leave_spent).
_SPENT = "tmas_spent"


def leave_spent(cancel: asyncio.CancelledError, spent: Completion) -> None:
    """A call cancelled after its server generated something leaves what it did on its cancel, as a failed
    completion of cause ``cancelled`` whose usage is the tokens streamed (the server's running usage, else counted
    from the text received) and those of failed attempts before: the layers the cancel passes through on its way up
    (the store that records calls, the problem session that counts spend, the client's stats) count it, as they
    count a failed call's, and the cancel goes on."""
    setattr(cancel, _SPENT, spent)


def spent_before(cancel: BaseException) -> Completion | None:
    """What the call ``cancel`` stopped had the server generate (see :func:`leave_spent`); None where nothing was."""
    spent = getattr(cancel, _SPENT, None)
    return spent if isinstance(spent, Completion) else None


class EndpointUnreachable(LLMError):
    """No connection could be made to any replica of an endpoint after all retries: it ends a run. ``cause``: the last
    failure's (tmas.llm.failures), ``connect`` or ``tls``."""

    def __init__(self, message: str, cause: str = "connect") -> None:
        super().__init__(message)
        self.cause = cause


class QuotaSpent(EndpointUnreachable):
    """The endpoint's account has no quota left (OpenAI's 429 ``insufficient_quota``): every later call would be
    refused the same way, so it ends a run as an unreachable endpoint does, its finished work kept."""

    def __init__(self, message: str, cause: str = "quota") -> None:
        super().__init__(message, cause)


@dataclass
class ClientStats:
    """What a run's model did: calls sent and replayed, failed, retried (by cause), tokens."""

    calls: int = 0
    # Calls answered from the run store (replayed), not sent.
    replayed: int = 0
    failed: int = 0
    retries: int = 0
    retries_by_cause: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    embedding_calls: int = 0
    usage: Usage = field(default_factory=Usage)
    # Kind (tmas.llm.types.DOWNGRADES) -> replica URL -> model -> the server's refusal, for what the run went on
    # without (one URL may serve several models, each refusing its own fields).
    downgrades: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)

    def count(self, completion: Completion) -> None:
        """A call answered over the wire (failed or not), or cancelled once its server generated for it."""
        self.calls += 1
        self.usage = self.usage + completion.usage
        if not completion.ok:
            self.failed += 1

    def retried(self, cause: str) -> None:
        """An attempt failed for ``cause`` and the call goes again."""
        self.retries += 1
        self.retries_by_cause[cause] = self.retries_by_cause.get(cause, 0) + 1

    def count_replay(self, completion: Completion) -> None:
        """A call answered from a store (:class:`tmas.llm.replay.StoreReplay`'s ``on_replay``)."""
        self.replayed += 1
        self.usage = self.usage + completion.usage


class ChatModel(Protocol):
    """Chat completions and embeddings per agent role, with what each role resolves to."""

    @property
    def settings(self) -> Settings:
        """The run's settings (what the roles resolve against)."""
        ...

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
        """One chat completion for ``role``: ``sampling`` is what :meth:`resolve_sampling` returned for the call, or
        a per-call override resolved here as the ``call`` layer (None: the role's own); ``key`` names
        the call for storage and replay; ``reply_model`` is the pydantic model of a JSON reply (its schema may be
        sent as ``response_format``); ``watch`` follows a streamed reply and may stop it early (an implementation
        that cannot stream never begins it: :mod:`tmas.llm.watch`); ``key.chain`` names the chain of calls it belongs to
        (kept together until :meth:`end_chain`). A failed call returns a :class:`Completion`
        whose ``error`` says why; a call cancelled after its server generated tokens for it raises its cancel with
        what they cost on it (:func:`spent_before`)."""
        ...

    def end_chain(self, chain: ChainKey) -> None:
        """``chain``'s calls (those whose key's ``chain_key`` it is) are over: what the model kept together for them
        (a pinned server slot it held: tmas.llm.lanes) is let go. A method ends each chain it names once its last
        call is done, also when the chain failed or was cancelled; a model that keeps nothing for chains ignores it."""
        ...

    async def embed(self, texts: Sequence[str], *, role: str = "embedding") -> list[list[float]]:
        """Embedding vectors of ``texts``, in order."""
        ...

    def resolve_sampling(
        self,
        role: str,
        *,
        preset: Sampling | None = None,
        method: Sampling | None = None,
        call: Sampling | None = None,
    ) -> ResolvedSampling:
        """The sampling a call of ``role`` sends, resolved once in the order :mod:`tmas.llm.sampling` documents
        (a method's ``preset`` and own ``method`` sampling and the ``call``'s override go where they belong)."""
        ...

    def context_window(self, role: str) -> int | None:
        """``role``'s context window in tokens where configured or reported, else None."""
        ...

    def model_name(self, role: str) -> str:
        """The model ``role`` asks for (``"default"`` when the endpoint names none)."""
        ...


class WrappedModel:
    """A :class:`ChatModel` around another, ``inner``: every member is ``inner``'s unless a subclass changes it (the
    store's replay, a caller's model under the run's settings)."""

    def __init__(self, inner: ChatModel) -> None:
        self.inner = inner

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
        # A per-call override is resolved by this model's own resolution, so a wrapper that changes the resolution
        # changes what ``inner`` is asked.
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.resolve_sampling(role, call=sampling)
        return await self.inner.chat(role, messages, key=key, sampling=sampling, reply_model=reply_model, watch=watch)

    def end_chain(self, chain: ChainKey) -> None:
        self.inner.end_chain(chain)

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
