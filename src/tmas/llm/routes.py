"""Where each role's calls go: its endpoint resolved against the default one, the replicas behind it (shared by every
role that names the same URL and model, so what a server showed of that model is known to all of them; a gateway or
a hosted API serves several models at one URL, each refusing its own fields), and which replica takes a call."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tmas.config import Endpoint, Settings
from tmas.errors import ConfigError
from tmas.llm.lanes import call_affinity, pinned_slot
from tmas.llm.replica import Replica
from tmas.llm.routing import PrefixRouter
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, Message

# The model name a call asks for when its endpoint names none: llama-server and SGLang answer any name.
DEFAULT_MODEL = "default"


def key_problem(settings: Settings, role: str, origin: Callable[[str], str] | None = None) -> str | None:
    """Why a role's calls could not carry their API key, in one line, or None: its ``api_key_env`` (its
    ``[roles.NAME]`` table's, else the endpoint's) is empty, or the environment variable it names is unset or empty.
    ``origin`` says where a settings key was given (a config file, a flag, a ``TMAS_*`` variable); without it,
    ``config``."""
    override = settings.roles.get(role)
    key, var = "endpoint.api_key_env", settings.endpoint.api_key_env
    if override is not None and override.api_key_env is not None:
        key, var = f"roles.{role}.api_key_env", override.api_key_env
    if var is None:
        return None
    where = origin(key) if origin is not None else "config"
    if not var.strip():  # no variable: calls would go without a key, and a hosted API answer 401
        return f"{where}: {key} is empty: name the environment variable that holds the API key, or leave it out"
    value = os.environ.get(var)
    if value:
        return None
    state = "is not set" if value is None else "is empty"
    return f"{where}: {key} = {var!r} names an environment variable that {state}: set it to the API key"


def check_api_keys(settings: Settings, roles: Iterable[str], origin: Callable[[str], str] | None = None) -> None:
    """A one-line :class:`ConfigError` where a role of ``roles`` has no API key to send (:func:`key_problem`)."""
    for role in roles:
        problem = key_problem(settings, role, origin)
        if problem is not None:
            raise ConfigError(problem)


@dataclass
class Route:
    """A role's endpoint resolved against the default one: where to send (sampling is resolved per call)."""

    endpoint: Endpoint
    replicas: list[Replica]
    api_key: str | None
    counter: TokenCounter
    # Replica URL -> the cap on this role's calls in flight there (``max_in_flight``; None: no cap).
    caps: dict[str, asyncio.Semaphore | None] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.endpoint.model or DEFAULT_MODEL


@dataclass
class Routes:
    settings: Settings
    # URL -> model -> what a run recorded of that model's server before (a resumed run): where its replies put
    # reasoning.
    known: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    router: PrefixRouter = field(default_factory=PrefixRouter)
    # (URL, model) -> its replica. (URL, owner) -> the cap on calls in flight there, whatever the model: a role that
    # sets its own max_in_flight owns a cap on its calls (owner: the role); the roles that inherit the default
    # endpoint's share one (owner: "").
    _replicas: dict[tuple[str, str], Replica] = field(default_factory=dict)
    _caps: dict[tuple[str, str], asyncio.Semaphore | None] = field(default_factory=dict)
    _routes: dict[str, Route] = field(default_factory=dict)

    def route(self, role: str) -> Route:
        """The endpoint a role uses: its own endpoint fields where given, the default endpoint's elsewhere."""
        if role in self._routes:
            return self._routes[role]
        data = self.settings.endpoint.model_dump()
        override = self.settings.roles.get(role)
        if override is not None:
            for name in override.model_fields_set - {"sampling"}:
                value = getattr(override, name)
                if value is not None:
                    data[name] = value
        endpoint = Endpoint.model_validate(data)
        if not endpoint.base_url:
            raise ConfigError(f"role {role!r} has no base_url")
        problem = key_problem(self.settings, role)
        if problem is not None:
            raise ConfigError(problem)
        api_key = os.environ.get(endpoint.api_key_env) if endpoint.api_key_env else None
        replicas = []
        caps: dict[str, asyncio.Semaphore | None] = {}
        model = endpoint.model or DEFAULT_MODEL
        owner = role if override is not None and override.max_in_flight is not None else ""
        for url in endpoint.base_url:
            if (url, owner) not in self._caps:
                most = endpoint.max_in_flight
                self._caps[url, owner] = asyncio.Semaphore(most) if most else None
            caps[url] = self._caps[url, owner]
            if (url, model) not in self._replicas:
                # No window or reasoning setting of the role's: a role's context_length and reasoning hold for its
                # own calls (Route.endpoint; tmas.llm.refusals.reasoning_of), and the replica is shared by every role
                # at this URL and model; it holds what the server showed of itself, here as a run recorded it before
                # (a resumed run), of this model: another model at the URL may think elsewhere.
                replica = Replica(url=url, model=model)
                reasoning = self.known.get(url, {}).get(model, {}).get("reasoning")
                if reasoning in ("separate", "inline", "none"):
                    replica.reasoning = reasoning
                self._replicas[url, model] = replica
            replicas.append(self._replicas[url, model])
        route = Route(endpoint, replicas, api_key, TokenCounter(endpoint.tokenizer), caps)
        self._routes[role] = route
        return route

    def replicas(self) -> list[Replica]:
        """Every replica any role's calls went to so far."""
        return list(self._replicas.values())

    def pick(
        self, route: Route, messages: Sequence[Message], key: CallKey, shunned: frozenset[str] = frozenset()
    ) -> Replica:
        """The replica for a call (tmas.llm.routing): by its prompt's cached prefix with ``routing = "cache"``, else
        the least loaded; never one whose URL is in ``shunned`` while another is left. The caller counts the call in
        the replica's ``load`` until it ends."""
        replicas = self.candidates(route, shunned)
        if route.endpoint.routing == "load" or not messages:
            return self.router.least_loaded(replicas)
        affinity = call_affinity(key, self.settings.seed)
        return self.router.choose(messages, replicas, affinity, route.endpoint.routing_load_bound)

    @staticmethod
    def candidates(route: Route, shunned: frozenset[str] = frozenset()) -> list[Replica]:
        """The replicas a call may go to: those whose URL is not in ``shunned``, or every one where none is left."""
        return [r for r in route.replicas if r.url not in shunned] or route.replicas

    def ready_elsewhere(self, route: Route, replica: Replica, shunned: frozenset[str] = frozenset()) -> bool:
        """Whether a call may go to a replica other than ``replica`` that is in routing (tmas.llm.replica.Replica's
        ``avoided``), so that :meth:`pick` would choose it over one out of routing."""
        return any(r is not replica and not r.avoided for r in self.candidates(route, shunned))

    @staticmethod
    def pinned(route: Route, key: CallKey) -> tuple[int, int] | None:
        """(replica index, slot index) the call ``key`` is pinned to (its lane: tmas.llm.lanes), or None."""
        if not route.endpoint.pin_slots:
            return None
        return pinned_slot(key.lane, len(route.replicas), route.endpoint.max_in_flight)
