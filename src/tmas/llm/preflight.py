"""Before a run sends its first call: does anything answer where its roles' calls go?

Five mistakes a new user makes first cost nothing to find out beforehand: an endpoint nobody listens at (a server
not started, a wrong port), an ``https://`` one whose TLS handshake fails (a certificate not trusted, a plain-HTTP
server), a base URL without its ``/v1`` (every OpenAI-compatible server, vLLM, SGLang,
llama-server and OpenAI itself, answers under ``/v1``; a URL without it gets a 404 on every call), one with the
``/chat/completions`` tmas adds to it (the chat address copied whole) and a model name a vLLM server does not serve.
Left to the calls, the first is a run that retries for many seconds before it says so and the others runs whose
every problem fails.
Here each is one line naming the URL, within seconds. Anything else (a server still loading, a refused key, a
``/models`` route the server lacks) is left to the calls, which say what went wrong with each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from tmas.config import Settings
from tmas.errors import ConfigError
from tmas.llm.failures import tls_failure
from tmas.llm.model import EndpointUnreachable
from tmas.llm.replica import auth_headers, connect_failure, model_names
from tmas.llm.routes import DEFAULT_MODEL, Routes
from tmas.llm.server_kind import server_kind

# A refused connection is tried this many times, this far apart: a server just restarting gets a moment, a server
# that is not there is said to be so within about a second.
CONNECT_TRIES = 3
CONNECT_PAUSE_S = 0.5
# How long a probe waits for a connection and for the model card; a slow answer is not this check's business.
PROBE_TIMEOUT_S = 5.0
# What tmas adds to a base URL for a chat call: a base URL that already ends in it was copied from a server's docs.
CHAT_PATH = "/chat/completions"
# The replica sets that answered in this process, each with the model name asked of it (roles that share a URL may
# name different models): a command checks before it makes a run directory, and the run it then starts (or a sweep's
# next point, a proxy's next request) need not ask again.
_ANSWERED: set[tuple[tuple[str, ...], str | None]] = set()


async def check_endpoints(settings: Settings, roles: Iterable[str]) -> dict[str, list[str]]:
    """Raise :class:`EndpointUnreachable` when no replica of a role's endpoint accepts a connection, and
    :class:`ConfigError` when a base URL lacks the ``/v1`` its server answers under or ends in the
    ``/chat/completions`` tmas adds; each names the URL. A model answering in this process has no endpoint to
    check. What each URL asked now lists (URL -> names, none where it lists none or does not answer) is returned:
    :func:`served_models` takes it rather than ask again. A replica set that answered before in this process is not
    asked."""
    if settings.uses_in_process_model:
        return {}
    routes = Routes(settings)
    checked: set[tuple[tuple[str, ...], str | None]] = set()
    listed: dict[str, list[str]] = {}
    async with aiohttp.ClientSession() as session:
        for role in dict.fromkeys(roles):
            route = routes.route(role)
            urls = tuple(r.url for r in route.replicas)
            asked = (urls, route.endpoint.model)
            if asked in checked or asked in _ANSWERED:
                continue
            checked.add(asked)
            probes = await _models_replies(session, [(url, route.api_key) for url in urls])
            answers = [p[0] if isinstance(p, tuple) else p for p in probes]
            fix = _url_fix(settings, role)
            if all(isinstance(a, str) for a in answers):
                raise EndpointUnreachable(
                    f"cannot connect to {', '.join(urls)}{fix.whose}: {answers[0]}; {fix.unreachable}"
                    " ('tmas models --base-url URL' checks an endpoint)"
                )
            for url, status in zip(urls, answers, strict=True):
                mistake = await _misspelt(session, url, route.api_key, status, fix)
                if mistake is not None:
                    raise ConfigError(mistake)
            for url, probe in zip(urls, probes, strict=True):
                listed[url] = _served(probe)
                if isinstance(probe, tuple) and probe[0] == 200:
                    _check_served(url, probe[1], route.endpoint.model, role, settings)
            _ANSWERED.add(asked)
    return listed


async def served_models(
    settings: Settings, roles: Iterable[str], asked: Mapping[str, list[str]] | None = None
) -> dict[str, list[str]]:
    """URL -> the names of the models its server lists now (``GET /models``: :func:`tmas.llm.replica.model_names`),
    for each replica of ``roles``; asked anew on every call (a server restarted since may serve another model), never
    from what answered before, but for the URLs in ``asked``: what :func:`check_endpoints` was told just now. A URL
    that lists none, or answers otherwise (no ``/models`` route, not started), is left out: what it serves is unknown,
    and the calls say more."""
    if settings.uses_in_process_model or settings.uses_local_model:
        return {}
    routes = Routes(settings)
    keys = {replica.url: route.api_key for route in map(routes.route, roles) for replica in route.replicas}
    told = asked or {}
    urls = [url for url in keys if url not in told]
    async with aiohttp.ClientSession() as session:
        probes = await _models_replies(session, [(url, keys[url]) for url in urls])
    probed = dict(zip(urls, map(_served, probes), strict=True))
    return {url: names for url in keys if (names := told[url] if url in told else probed[url])}


def _served(probe: tuple[int, Any] | str) -> list[str]:
    """The model names a ``GET /models`` answer lists: none unless it answered 200."""
    return model_names(probe[1]) if isinstance(probe, tuple) and probe[0] == 200 else []


def _check_served(url: str, models: Any, model: str | None, role: str, settings: Settings) -> None:
    """A vLLM server answers a model it does not serve with a 404 for every call: said here, naming the models it
    does serve. An endpoint that names no model asks for ``"default"`` (:mod:`tmas.llm.routes`), which vLLM serves
    only under that name. Other servers are not asked: llama-server answers whatever model a call names, and what
    another server lists need not be all it answers."""
    if server_kind(models) != "vllm":
        return
    served = model_names(models)
    if served and (model or DEFAULT_MODEL) not in served:
        whose = "" if role == "solution" else f" (the model of role {role!r})"
        asked = f"no model {model!r}" if model is not None else f"no model {DEFAULT_MODEL!r}, which tmas asks for"
        named = "" if model is not None else " when none is named"
        own = settings.roles.get(role)
        # A role's own model is set in its table: --model would change every other role's.
        fix = (
            f'set model = "{served[0]}" in [roles.{role}]'
            if own is not None and own.model is not None
            else f"give --model {served[0]}"
        )
        raise ConfigError(
            f"{url} serves {asked}{named}{whose}: it serves {', '.join(served)}; {fix}"
            " ('tmas models' lists each endpoint's)"
        )


async def _models_status(session: aiohttp.ClientSession, url: str, api_key: str | None) -> int | str:
    """The status ``GET url/models`` answers with, or why no connection could be made."""
    reply = await _models_reply(session, url, api_key)
    return reply[0] if isinstance(reply, tuple) else reply


async def _models_replies(
    session: aiohttp.ClientSession, asked: list[tuple[str, str | None]]
) -> list[tuple[int, Any] | str]:
    """:func:`_models_reply` of each (URL, key), asked together; the first error raised is raised once all are in."""
    replies = await asyncio.gather(*(_models_reply(session, url, key) for url, key in asked), return_exceptions=True)
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return [reply for reply in replies if not isinstance(reply, BaseException)]


async def _models_reply(session: aiohttp.ClientSession, url: str, api_key: str | None) -> tuple[int, Any] | str:
    """The status ``GET url/models`` answers with and its JSON body (None where it is none), or why no connection
    could be made; :class:`ConfigError` where its TLS handshake fails, which no second try mends."""
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    reason = ""
    for attempt in range(CONNECT_TRIES):
        if attempt:
            await asyncio.sleep(CONNECT_PAUSE_S)
        try:
            async with session.get(f"{url}/models", headers=auth_headers(api_key), timeout=timeout) as resp:
                try:
                    body = await resp.json(content_type=None)
                except ValueError:
                    body = None
                return resp.status, body
        except aiohttp.ClientSSLError as exc:
            raise ConfigError(f"{url}: {tls_failure(exc)}") from None
        except aiohttp.ClientConnectorError as exc:
            reason = connect_failure(exc)
        except (aiohttp.ClientError, TimeoutError):
            return 0, None  # connected, or slow: the calls will say more
    return reason


def unreachable_fix(role: str | None = None) -> str:
    """What to do about a base URL no connection could be made to, as the check before a run and ``tmas models`` say
    it; ``role``: the role whose own ``base_url`` it is (None: the endpoint's)."""
    return _UrlFix(role).unreachable


async def base_url_fix(url: str, api_key: str | None, role: str | None = None) -> str | None:
    """Where ``url`` answered HTTP 404 for its model card but the base URL is merely misspelt: what is wrong and what
    to give instead, in words (as the check before a run says it); None otherwise (``tmas models``). ``role``: the
    role whose own ``base_url`` it is (None: the endpoint's)."""
    async with aiohttp.ClientSession() as session:
        return await _misspelt(session, url, api_key, 404, _UrlFix(role))


async def _misspelt(
    session: aiohttp.ClientSession, url: str, api_key: str | None, status: int | str, fix: _UrlFix
) -> str | None:
    """What is wrong with the base URL ``url`` and where to correct it, when it is merely misspelt: it ends in the
    ``/chat/completions`` tmas adds, or its model card answered ``status`` 404 and the same server answers under
    ``url/v1``; None otherwise. The one wording of both, for the check before a run and for ``tmas models``."""
    if url.endswith(CHAT_PATH):
        return (
            f"{url}{fix.whose}: the base URL ends in {CHAT_PATH}, which tmas adds to it;"
            f" {fix.give(url.removesuffix(CHAT_PATH))}"
        )
    if status == 404 and not url.endswith("/v1") and await _models_status(session, f"{url}/v1", api_key) == 200:
        return (
            f"{url}/models answered HTTP 404 and {url}/v1/models answers{fix.whose}: the base URL lacks its /v1;"
            f" {fix.give(url + '/v1')}"
        )
    return None


@dataclass(frozen=True)
class _UrlFix:
    """Where a wrong base URL of a role's calls is set: the role's own ``[roles.NAME]`` table, or the endpoint
    (``--base-url``, which would move every role's calls and so is no fix for a role's own URL)."""

    role: str | None

    @property
    def whose(self) -> str:
        return "" if self.role is None else f" (the base_url of [roles.{self.role}])"

    @property
    def unreachable(self) -> str:
        where = "--base-url" if self.role is None else f"base_url in [roles.{self.role}]"
        return f"start the server there or correct {where}"

    def give(self, url: str) -> str:
        return f"give --base-url {url}" if self.role is None else f'set base_url = "{url}" in [roles.{self.role}]'


def _url_fix(settings: Settings, role: str) -> _UrlFix:
    own = settings.roles.get(role)
    return _UrlFix(role if own is not None and own.base_url is not None else None)
