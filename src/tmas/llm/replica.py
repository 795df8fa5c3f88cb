"""One server of an endpoint, as the client has come to know it: what it said of itself when probed, what it has shown
it refuses, and the small requests that ask it about itself (its model card, whether it is alive, how many tokens a
prompt is).

Every server answers ``GET /health`` while it serves (what each one's answer says: :mod:`tmas.llm.vitals`) and counts
a prompt's tokens at ``POST /tokenize``: vLLM takes chat ``messages`` (``vllm/entrypoints/serve/tokenize``), SGLang a
``prompt`` string, not messages (``python/sglang/srt/entrypoints/http_server.py``, ``openai_v1_tokenize``),
llama-server ``content``, the chat template applied first by ``POST /apply-template``. A gateway in front (LiteLLM,
most Kubernetes routers) has none of them. Their context window: ``max_model_len`` in vLLM's and SGLang's model cards,
``default_generation_settings.n_ctx`` in llama-server's ``GET /props`` (its model card's ``n_ctx_train`` is the
training window, not the server's).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from tmas.errors import LLMError
from tmas.llm import failures
from tmas.llm.failures import error_message
from tmas.llm.lanes import SlotQueue
from tmas.llm.server_kind import server_kind
from tmas.llm.types import Message, Reasoning, ServerFindings, ServerKind
from tmas.llm.vitals import Vitals

# Tokens a chat template adds around each message (role markers, separators), counted where only the texts are.
MESSAGE_TEMPLATE_TOKENS = 4
# How a replica answered its probe (tmas.llm.replica.probe).
ProbeAnswer = Literal["answered", "loading", "none"]


@dataclass
class Replica:
    url: str
    # The model its calls ask for: what it shows (its window, where its replies put reasoning) is that model's.
    model: str | None = None
    # Calls routed to it and not finished (waiting for a cap, in flight or between retries): what routing balances.
    load: int = 0
    # The server's context window as known (stated, or learnt from a context refusal); a role's configured window
    # is its route's (tmas.llm.routes), not this, since every role at the URL and model shares the replica.
    context_length: int | None = None
    # The window a context refusal taught (tmas.llm.refusals.Refusals.shrunk): it bounds calls even of a role
    # whose configured window takes the place of the one the server stated.
    refused_context: int | None = None
    # The window the server itself stated (its model card, /props), whatever the endpoint's setting says.
    reported_context: int | None = None
    # Which engine serves it, as its model card said (read once, with the context window).
    server_kind: ServerKind | None = None
    probed: bool = False
    # Where its replies put reasoning, from the first reply that showed it (None: not yet seen).
    reasoning: Reasoning | None = None
    # What it refused, once seen: a response_format, streaming, n > 1.
    structured_refused: bool = False
    stream_refused: bool = False
    samples_refused: bool = False
    # Sampling fields it refused -> the name it asked for instead, or None where the field is left out.
    renamed: dict[str, str | None] = field(default_factory=dict)
    # Calls that start together wait for the one probe instead of going out unchecked.
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # When its probe first heard it was still loading its model (time.monotonic()); None: never heard so.
    loading_since: float | None = None
    # When its model card was last asked for while it was loading (time.monotonic()).
    polled_at: float = -math.inf
    # The last call to it found no server listening: calls go to the replicas that answer while any does.
    unreachable: bool = False
    # When a call last found no server listening there (time.monotonic()).
    refused_at: float = -math.inf
    # Why it is out of routing, where it is: "dead" (its /health failed) or "no_progress" (a call waited on it past
    # progress_timeout_s while it showed no progress: tmas.llm.vitals); since when (time.monotonic()).
    down: str | None = None
    down_at: float = 0.0
    # Its health and progress as this client has seen them.
    vitals: Vitals = field(default_factory=Vitals)
    # pin_slots: one call at a time per server slot, a chain's calls together (tmas.llm.lanes), by the slot's index.
    slot_queues: dict[int, SlotQueue] = field(default_factory=dict)

    @property
    def loading(self) -> bool:
        """Its probe heard it still loading its model, and it has not answered since."""
        return self.loading_since is not None and not self.probed

    @property
    def avoided(self) -> bool:
        """Out of routing: calls go to it only when every replica is."""
        return self.unreachable or self.down is not None or self.loading

    def leave(self, cause: str) -> None:
        """Take it out of routing for ``cause`` (kept from the first time until it is back)."""
        if self.down is None:
            self.down, self.down_at = cause, time.monotonic()

    def unavailable(self) -> None:
        """It answered a call 503, as a server answers while it loads its model (llama-server opens its port at once,
        so one restarted answers so where it served before): its model card is asked again before its next call,
        which then goes elsewhere while it loads (tmas.llm.refusals.Refusals.probe). One still loading since its first
        probe keeps the time it was first heard loading."""
        if self.probed:
            self.probed, self.loading_since = False, None

    def refused(self) -> None:
        """A call found no server listening there: out of routing until it answers a request sent since."""
        self.unreachable, self.refused_at = True, time.monotonic()

    def back(self, sent_at: float | None = None) -> None:
        """It answered (a look at it now, or a request sent at ``sent_at``): back in routing. An answer to a request
        sent before it last refused a connection leaves it out for that: a server shutting down finishes the requests
        it holds while it takes no new ones."""
        if sent_at is None or sent_at >= self.refused_at:
            self.unreachable = False
        self.down = None

    @property
    def root(self) -> str:
        """The server's address without the OpenAI prefix: where /health, /tokenize and /props live."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    def findings(self, serves_n: bool | None) -> ServerFindings:
        return ServerFindings(
            url=self.url,
            model=self.model,
            server_kind=self.server_kind,
            context_length=self.context_length,
            serves_n=serves_n,
            reasoning=self.reasoning,
        )

    def adapted(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the fields this server refused renamed as it asked, or left out."""
        for name, replacement in self.renamed.items():
            if name in body:
                value = body.pop(name)
                if replacement is not None:
                    body[replacement] = value
        return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_json(
    session: aiohttp.ClientSession, url: str, api_key: str | None, timeout_s: float, body: Any = None
) -> tuple[int, Any] | None:
    """The status a GET (or, with ``body``, a POST) of ``url`` answers with, and its JSON where the status is 200
    (else None); None when no answer came (or a 200 that is not JSON)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, failures.CONNECT_TIMEOUT_S))
    try:
        if body is None:
            request = session.get(url, headers=auth_headers(api_key), timeout=timeout)
        else:
            request = session.post(url, json=body, headers=auth_headers(api_key), timeout=timeout)
        async with request as resp:
            if resp.status != 200:
                return resp.status, None
            return 200, await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def get_json(
    session: aiohttp.ClientSession, url: str, api_key: str | None, timeout_s: float, body: Any = None
) -> Any:
    """The JSON a GET (or, with ``body``, a POST) of ``url`` answers with status 200; None for anything else."""
    answer = await fetch_json(session, url, api_key, timeout_s, body)
    return answer[1] if answer is not None else None


async def probe(session: aiohttp.ClientSession, replica: Replica, api_key: str | None) -> ProbeAnswer:
    """Read the replica's model card (and llama-server's /props): "answered" once it did; "loading" while it answers
    503 (a proxy in front of a replica not ready yet) or, llama-server, a card without its model's ``meta``: until
    its model is loaded it answers every other route 503 ("Loading model") but lets its model list through with
    ``meta`` null (tools/server/server-http.cpp middleware_server_state, server-context.cpp get_models); "none" for
    anything else (no answer yet, a key refused): the caller asks again later rather than taking silence for an
    answer."""
    answer = await fetch_json(session, f"{replica.url}/models", api_key, 10.0)
    models = answer[1] if answer is not None else None
    if not isinstance(models, dict):
        return "loading" if answer is not None and answer[0] == 503 else "none"
    if still_loading(models):
        return "loading"
    replica.server_kind = server_kind(models)
    replica.reported_context = context_length(models)
    if replica.reported_context is None and replica.server_kind == "llama-server":
        props = await get_json(session, f"{replica.root}/props", api_key, 10.0)
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        replica.reported_context = n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None
    if replica.context_length is None:
        replica.context_length = replica.reported_context
    replica.probed = True
    return "answered"


async def count_prompt(
    session: aiohttp.ClientSession, replica: Replica, api_key: str | None, model: str, messages: Sequence[Message]
) -> int | None:
    """The prompt's tokens as the server counts them (its own /tokenize), or None where it cannot say. SGLang's (and
    any server's that takes no messages) counts the messages' texts, and each message's template tokens are added."""
    chat = [m.model_dump() for m in messages]
    url = f"{replica.root}/tokenize"
    if replica.server_kind == "llama-server":
        templated = await get_json(session, f"{replica.root}/apply-template", api_key, 30.0, {"messages": chat})
        prompt = templated.get("prompt") if isinstance(templated, dict) else None
        if not isinstance(prompt, str):
            return None
        return _count(await get_json(session, url, api_key, 30.0, {"content": prompt}))
    if replica.server_kind != "sglang":
        count = _count(await get_json(session, url, api_key, 30.0, {"model": model, "messages": chat}))
        if count is not None:
            return count
    text = "\n".join(m.content for m in messages)
    count = _count(await get_json(session, url, api_key, 30.0, {"model": model, "prompt": text}))
    return None if count is None else count + MESSAGE_TEMPLATE_TOKENS * len(messages)


def _count(reply: Any) -> int | None:
    if not isinstance(reply, dict):
        return None
    if isinstance(reply.get("count"), int):
        return int(reply["count"])
    tokens = reply.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None


def still_loading(models: dict[str, Any]) -> bool:
    """Whether a ``/v1/models`` reply is llama-server's while it loads its model: its card's ``meta`` null."""
    if server_kind(models) != "llama-server":
        return False
    cards = models.get("data")
    card = cards[0] if isinstance(cards, list) and cards else None
    return isinstance(card, dict) and "meta" in card and card["meta"] is None


def model_names(models: Any) -> list[str]:
    """The model names a ``/v1/models`` reply lists, each once: every card's ``id`` and the ``aliases`` llama-server
    lists beside it (its ``--alias``; it answers calls naming any of them). vLLM's card also holds ``root``, the
    path its weights were read from, which is no name it answers."""
    cards = models.get("data") if isinstance(models, dict) else None
    names: list[str] = []
    for card in cards if isinstance(cards, list) else []:
        if not isinstance(card, dict):
            continue
        aliases = card.get("aliases")
        for name in [card.get("id"), *(aliases if isinstance(aliases, list) else [])]:
            if isinstance(name, str) and name and name not in names:
                names.append(name)
    return names


def context_length(models: Any) -> int | None:
    """The context window a /v1/models reply reports (vLLM's and SGLang's ``max_model_len``, or another name)."""
    for model in models.get("data", []) if isinstance(models, dict) else []:
        if not isinstance(model, dict):
            continue
        for name in ("max_model_len", "context_length", "context_window"):
            if isinstance(model.get(name), int):
                return int(model[name])
    return None


class NoConnection(LLMError):
    """No connection could be made to a server (nothing listens at its port, an unknown host): its message is why,
    in the system's words (:func:`connect_failure`)."""


def connect_failure(exc: aiohttp.ClientConnectorError) -> str:
    """Why no connection was made: ``connection refused`` for a port nobody listens at, else the system's words."""
    error = exc.os_error
    return "connection refused" if isinstance(error, ConnectionRefusedError) else str(error)


async def list_models(url: str, api_key: str | None = None) -> list[str]:
    """The model names served at ``url`` (:func:`model_names`; raises :class:`LLMError` with the reason when it does
    not answer or its TLS handshake fails, :class:`NoConnection` when no connection could be made)."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{url}/models", headers=auth_headers(api_key), timeout=aiohttp.ClientTimeout(total=10)
            ) as resp,
        ):
            text = await resp.text(errors="replace")
            if resp.status != 200:
                raise LLMError(f"HTTP {resp.status}: {error_message(text)}")
            try:
                data = json.loads(text)
            except ValueError:  # a proxy's page, a web server that is no API
                raise LLMError(f"HTTP 200, but not a JSON list of models: {error_message(text)}") from None
    except aiohttp.ClientSSLError as exc:
        raise LLMError(failures.tls_failure(exc)) from None
    except aiohttp.ClientConnectorError as exc:
        raise NoConnection(connect_failure(exc)) from None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise LLMError(f"{type(exc).__name__}: {exc}") from None
    return model_names(data)
