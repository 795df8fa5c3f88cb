"""What each server has shown it refuses or needs, and the request body built to fit it.

One record per replica (:class:`tmas.llm.replica.Replica`) holds it: a ``response_format`` it refused, streaming,
``n`` > 1, sampling fields it refused or names otherwise, its context window, and where its replies put reasoning.
Each adaptation is recorded once per endpoint and model in the run (:data:`tmas.llm.types.DOWNGRADES`), with what the
server said.

**Structured outputs never forbid thinking.** A ``json_schema`` grammar constrains a reply from its first token
unless the server separates reasoning (vLLM and SGLang apply the grammar after the reasoning only when started with a
``--reasoning-parser``). So under ``structured_output = "auto"`` a schema goes to a replica only once one of its replies
showed where reasoning goes: in a field of its own, or nowhere (the model does not think). A replica whose model
thinks inside its content gets none, and that is recorded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp
from pydantic import BaseModel

from tmas.config import Sampling
from tmas.llm.batching import Sample, refuses_n, serves_samples
from tmas.llm.failures import ContextRefusal, Failure
from tmas.llm.model import ClientStats
from tmas.llm.replay import CallStore
from tmas.llm.replica import MESSAGE_TEMPLATE_TOKENS, Replica, count_prompt, probe
from tmas.llm.routes import Route
from tmas.llm.schema import grammar_fit, response_format
from tmas.llm.types import CallKey, ChatRequest, Completion, DowngradeKind, Reasoning, ServerFindings

# Room left for the chat template's own tokens when max_tokens is lowered to fit the context window.
CONTEXT_MARGIN_TOKENS = 32
# Context refusals a call shrinks its max_tokens for, at most (tmas.llm.refusals.Refusals.shrunk).
MAX_SHRINKS = 2
# Estimates (characters per token) err low on math text: a prompt estimated is taken this much larger.
ESTIMATE_SAFETY = 1.1
# Seconds between two probes of a replica that says it is still loading its model (Refusals.probe).
LOADING_POLL_S = 0.5


@dataclass
class Shrinks:
    """One call's shrinks of max_tokens after context refusals: how many, and the prompt the last one assumed."""

    done: int = 0
    prompt: int | None = None


def prompt_estimate(route: Route, request: ChatRequest) -> int:
    """The prompt's tokens as the client counts them: each message's text (with the endpoint's tokenizer where it
    has one, else estimated, and then taken larger) and its template's tokens."""
    counter = route.counter
    prompt = sum(counter.count(m.content) + MESSAGE_TEMPLATE_TOKENS for m in request.messages)
    return prompt if counter.exact else int(prompt * ESTIMATE_SAFETY)


# The length from which n identical choices at a temperature above 0 mean a server that ignores per-choice randomness.
IDENTICAL_CHOICES_MIN_CHARS = 400
# llama-server reads the repetition penalty as ``repeat_penalty`` (tools/server/server-task.cpp, params_from_json).
_LLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}


class DowngradeLog(Protocol):
    """Where the client records what an endpoint refused and the run went on without (:data:`DOWNGRADES`), and what
    each server said of itself when probed (implemented by the run store)."""

    def record_downgrade(
        self, kind: DowngradeKind, endpoint: str, role: str, message: str, model: str | None = None
    ) -> None: ...

    def record_server(self, findings: ServerFindings) -> None: ...

    def servers(self) -> dict[str, dict[str, dict[str, Any]]]:
        """URL -> model -> what was recorded of its server serving that model (a resumed run starts from it)."""
        ...


@runtime_checkable
class RecordsDowngrades(Protocol):
    """A model of one's own that can adapt what it is asked, and says so in a run's log while the run is on it (the
    in-process model: :meth:`tmas.llm.hf_model.HFChatModel.downgrades_into`)."""

    def downgrades_into(self, log: DowngradeLog) -> AbstractContextManager[None]: ...


class RunCallStore(CallStore, DowngradeLog, Protocol):
    """A store calls are replayed from and downgrades recorded in (the run store)."""


def requested_schema(
    structured_output: str, sampling: Sampling, reply_model: type[BaseModel] | None
) -> dict[str, Any] | None:
    """The ``response_format`` a call of ``reply_model`` asks for under the endpoint's ``structured_output`` mode
    (whether it goes is :func:`schema_goes`): none for a plain reply, with the mode off, or where log-probabilities
    are asked for."""
    if reply_model is None or structured_output == "off":
        return None
    if sampling.extra_body.get("logprobs"):
        # Scores read from token log-probabilities stay unconstrained: llama-server was seen reporting
        # log-probabilities of tokens other than the ones its grammar let through (a code fence first, where
        # the constrained output began with "{"), so an expected score read from them would be wrong.
        return None
    return response_format(reply_model)


def reasoning_of(route: Route, replica: Replica) -> Reasoning | None:
    """Where ``replica``'s replies put reasoning, for a call of ``route``'s role: inline once a reply showed it so
    (a grammar would forbid that thinking, whatever a setting says); else as the role's endpoint says (``reasoning``
    other than "auto"); else as the replies showed or a run recorded (None: not known yet). The replica is shared by
    every role at its URL and model, so a role's own setting is read from its route, not kept on the replica."""
    if replica.reasoning == "inline":
        return "inline"
    said = route.endpoint.reasoning
    return replica.reasoning if said == "auto" else said


def schema_goes(structured_output: str, reasoning: str | None, *, refused: bool = False) -> bool:
    """Whether an asked-for schema is sent to a server: always under ``json_schema``; under ``auto`` once its replies
    showed the reasoning kept out of the content (``reasoning``: "separate" or "none"), unless it refused one."""
    if structured_output == "json_schema":
        return True
    return not refused and reasoning in ("separate", "none")


class Refusals:
    """The client's knowledge of what its servers refuse and need: the bodies built from it, the adaptations made to
    a refusal, and their records."""

    def __init__(self, stats: ClientStats, log: DowngradeLog | None) -> None:
        self.stats = stats
        self.log = log

    # ------------------------------------------------------------------------------------------ the body
    @staticmethod
    def response_format(route: Route, sampling: Sampling, reply_model: type[BaseModel] | None) -> dict[str, Any] | None:
        return requested_schema(route.endpoint.structured_output, sampling, reply_model)

    @staticmethod
    def sends_schema(route: Route, replica: Replica, request: ChatRequest) -> bool:
        if request.response_format is None:
            return False
        reasoning = reasoning_of(route, replica)
        return schema_goes(route.endpoint.structured_output, reasoning, refused=replica.structured_refused)

    def body(
        self, route: Route, replica: Replica, request: ChatRequest, max_tokens: int | None, n: int
    ) -> dict[str, Any]:
        """The request body for ``replica``: its refused fields renamed or left out, ``n``, streaming."""
        body = request.body(max_tokens, structured=self.sends_schema(route, replica, request))
        if replica.server_kind == "llama-server":
            body = {_LLAMA_NAMES.get(name, name): value for name, value in body.items()}
            if "response_format" in body:
                body["response_format"] = grammar_fit(body["response_format"])
        body = replica.adapted(body)
        if n > 1:
            body["n"] = n
        mode = route.endpoint.stream
        if mode == "on" or (mode == "auto" and not replica.stream_refused):
            # Any stream_options of the user's (extra_body: continuous_usage_stats) go with include_usage.
            given = body.get("stream_options")
            options = {**(given if isinstance(given, dict) else {}), "include_usage": True}
            body = {**body, "stream": True, "stream_options": options}
        return body

    def fit_context(self, route: Route, replica: Replica, request: ChatRequest, max_tokens: int | None) -> int | None:
        """max_tokens lowered so prompt + completion fit the known context window, instead of failing the call: the
        role's own ``context_length`` (else the window the server stated), or the one a context refusal taught where
        smaller."""
        known = [c for c in (route.endpoint.context_length or replica.context_length, replica.refused_context) if c]
        if not known:
            return max_tokens
        context = min(known)
        # Checked even without max_tokens: a prompt that cannot fit is refused here rather than sent.
        prompt = prompt_estimate(route, request)
        room = self.room(context, prompt)
        if room < 1:
            message = f"prompt of about {prompt} tokens does not fit the context window of {context} tokens"
            raise Failure(message, "context", retry=False)
        return None if max_tokens is None else min(max_tokens, room)

    @staticmethod
    def room(context: int, prompt: int) -> int:
        return context - prompt - CONTEXT_MARGIN_TOKENS

    async def shrunk(
        self,
        session: aiohttp.ClientSession,
        route: Route,
        replica: Replica,
        request: ChatRequest,
        failure: Failure,
        shrinks: Shrinks,
    ) -> int | None:
        """The max_tokens that fits what a context refusal said, counted in ``shrinks``; None when the prompt alone
        does not fit (the failure's message then names both numbers) or the numbers cannot be had.

        The window is the refusal's (else what the replica's server said), or the role's own where smaller; the
        prompt the refusal's where it states it. Where it states a bound at most (today's vLLM) or nothing, the first
        shrink counts the prompt with the endpoint's tokenizer, else at the server's /tokenize, else takes the
        client's estimate (never below the bound); a second refusal means that count was short, and the second shrink
        takes a prompt no BPE tokenizer can exceed (a token per byte of its texts) where the window holds it, else
        twice the first count, else half way to the window."""
        refusal = failure.context
        assert refusal is not None
        if refusal.completion_cap is not None:
            shrinks.done += 1
            return refusal.completion_cap
        server = refusal.context or replica.reported_context or replica.context_length
        if server is not None:
            replica.context_length = replica.refused_context = server
        # The role's own window (its route's, never the replica's: other roles share the replica) bounds it too.
        known = [c for c in (server, route.endpoint.context_length) if c]
        if not known:
            return None
        context = min(known)
        prompt, stated = refusal.prompt, True
        if prompt is None:
            stated = False
            prompt = await self._prompt_guess(session, route, replica, request, refusal, shrinks, context)
        room = self.room(context, prompt)
        if room < 1:
            about = "" if stated else "about "
            failure.args = (f"prompt of {about}{prompt} tokens does not fit the context window of {context} tokens "
                            f"({failure})",)  # fmt: skip
            return None
        shrinks.done += 1
        shrinks.prompt = prompt
        return room

    async def _prompt_guess(
        self,
        session: aiohttp.ClientSession,
        route: Route,
        replica: Replica,
        request: ChatRequest,
        refusal: ContextRefusal,
        shrinks: Shrinks,
        context: int,
    ) -> int:
        """The prompt's tokens to shrink by where the refusal did not state them (see :meth:`shrunk`)."""
        bound = refusal.prompt_at_least or 0
        if shrinks.done == 0:
            counted = prompt_estimate(route, request) if route.counter.exact else None
            if counted is None:
                counted = await count_prompt(session, replica, route.api_key, route.model, request.messages)
            return max(bound, counted if counted is not None else prompt_estimate(route, request))
        first = max(bound, shrinks.prompt or 0)
        most = sum(len(m.content.encode()) + MESSAGE_TEMPLATE_TOKENS for m in request.messages)
        for guess in (most, 2 * first, (first + context - CONTEXT_MARGIN_TOKENS) // 2):
            if self.room(context, max(bound, guess)) >= 1:
                return max(bound, guess)
        return max(bound, first + 1)

    # ------------------------------------------------------------------------------------------ refusals
    def adapt(self, failure: Failure, route: Route, replica: Replica, key: CallKey, sent: dict[str, Any]) -> bool:
        """Whether the call may go again at once after ``failure``, adapted to what the server refused (remembered
        for the replica and recorded); False where it cannot (the endpoint's setting insists on what was refused)."""
        if failure.cause in ("structured_output", "stream"):
            setting = getattr(route.endpoint, failure.cause)
            if setting in ("json_schema", "on"):
                what = "streaming" if failure.cause == "stream" else "response_format"
                failure.args = (f"server refused {what} ({failure.cause} = {setting!r}): {failure}",)
                return False
            if failure.cause == "stream":
                self.stream_refused(replica, key.role, str(failure))
            else:
                replica.structured_refused = True
                self.downgraded("structured_output", replica, key.role, str(failure))
            return True
        if failure.refused_field is not None and failure.refused_field[0] in sent:
            # A sampling field this model refuses (OpenAI's reasoning models: max_tokens under another name,
            # temperature and top_p only at their defaults; top_k unknown): sent again at once without it, or under
            # the name the server asked for, and so for the rest of the run; recorded. (A call sent before another
            # learnt the same refusal just goes again: the field is no longer in its body.)
            name, replacement = failure.refused_field
            replica.renamed[name] = replacement
            self.downgraded("sampling", replica, key.role, str(failure))
            return True
        return False

    def stream_refused(self, replica: Replica, role: str, message: str) -> None:
        replica.stream_refused = True
        self.downgraded("stream", replica, role, message)

    def saw_reasoning(self, replica: Replica, role: str, place: Reasoning | None) -> None:
        """A reply showed where this replica's replies put reasoning (None: it showed nothing, being cut before its
        end: tmas.llm.reasoning.reply_place); an inline one stops schemas going to it."""
        if place is None or replica.reasoning == "inline":
            return
        if place == "inline":
            replica.reasoning = "inline"
            message = (
                "the model thinks inside its reply (the server runs no reasoning parser): a grammar from the first "
                "token would forbid its thinking, so its calls go without response_format"
            )
            self.downgraded("structured_output", replica, role, message)
        elif place == "separate" and replica.reasoning != "separate":
            replica.reasoning = "separate"
        elif replica.reasoning is None:
            replica.reasoning = "none"
        else:
            return
        # Recorded, so that a resumed run sends schemas from its first call on as this one does from now on.
        if self.log is not None:
            self.log.record_server(replica.findings(serves_samples([replica.server_kind])))

    def downgraded(self, kind: DowngradeKind, replica: Replica, role: str, message: str) -> None:
        """Record, once per endpoint, model and kind, what the run goes on without (tmas.llm.types.DOWNGRADES): a
        server that serves several models (a router, a hosted API) may refuse a field for one and take it for
        another, and the adaptation holds for the refusing model's replica alone."""
        model = replica.model or ""
        seen = self.stats.downgrades.setdefault(kind, {}).setdefault(replica.url, {})
        if model in seen:
            return
        seen[model] = message
        if self.log is not None:
            self.log.record_downgrade(kind, replica.url, role, message, replica.model)

    # ------------------------------------------------------------------------------------------ n
    def batches(self, route: Route) -> bool | None:
        """Whether alike calls of ``route`` go as one request with ``n`` (``batch_samples``); None while "auto"
        waits for the servers' probes."""
        endpoint = route.endpoint
        if endpoint.batch_samples == "off" or endpoint.pin_slots or any(r.samples_refused for r in route.replicas):
            return False
        if endpoint.batch_samples == "on":
            return True
        # Decided by the replicas that answered once the others are out for loading their model.
        ready = [r for r in route.replicas if not r.loading]
        if not ready or not all(r.probed for r in ready):
            return None
        return serves_samples(r.server_kind for r in ready)

    def kept(self, route: Route, lead: Sample, done: list[Completion], n: int) -> list[Completion] | None:
        """The completions of a request for ``n`` choices to hand out; None when the server refused ``n`` (every
        sample then goes alone). A server that ignores ``n`` (one choice) or gives ``n`` identical choices at a
        temperature above 0 (SGLang with deterministic inference samples every choice with the request's seed) has
        the choices it owes asked one request each, each with its own seed, from then on."""
        role = lead.key.role
        if not done[0].ok and refuses_n(done[0]):
            self._samples_refused(route, done[0].endpoint, role, done[0].error or "")
            return None
        # A request that failed otherwise (a bad request, an unknown model, retries spent) fails its samples alike
        # and says nothing of n: its one failed completion is no reply of fewer choices.
        if done[0].ok and len(done) < n and not {"cut", "abort"} & set(done[0].retry_causes):
            self._samples_refused(
                route, done[0].endpoint, role, f"asked for n = {n} choices, the reply held {len(done)}"
            )
        temperature = lead.request.sampling.temperature
        alike = {(c.content, c.reasoning) for c in done}
        # Short replies may agree by chance (every sample boxing the same number); long ones at a temperature above 0
        # agree only when the server sampled every choice alike.
        long_enough = min(len(c.content) + len(c.reasoning) for c in done) >= IDENTICAL_CHOICES_MIN_CHARS
        # vLLM samples choice i with seed + i: only another server can give identical choices.
        kinds = {r.server_kind for r in route.replicas}
        if (
            len(done) > 1
            and kinds != {"vllm"}
            and all(c.ok for c in done)
            and len(alike) == 1
            and long_enough
            and temperature != 0
        ):
            message = f"gave {len(done)} identical choices for n = {n} at temperature {temperature}"
            self._samples_refused(route, done[0].endpoint, role, message)
            # The first sample keeps one choice; the server's work on the others is charged to it.
            first = done[0]
            for other in done[1:]:
                first.usage = first.usage + other.usage
            return [first]
        return done

    def _samples_refused(self, route: Route, url: str, role: str, message: str) -> None:
        for replica in route.replicas:
            replica.samples_refused = True
        refusing = next((r for r in route.replicas if r.url == url), route.replicas[0])
        self.downgraded("batch_samples", refusing, role, message)

    @staticmethod
    def poll_due(replica: Replica) -> bool:
        """Whether a replica loading its model may be asked for its model card again (:data:`LOADING_POLL_S`)."""
        return time.monotonic() - replica.polled_at >= LOADING_POLL_S

    async def probe(
        self,
        session: aiohttp.ClientSession,
        route: Route,
        replica: Replica,
        elsewhere: Callable[[], bool] = lambda: False,
    ) -> None:
        """Ask the replica about itself once it answers (with the endpoint's key), and record what it said; until it
        answers, each call asks again (a key refused, no server there yet). While it says it is still loading its
        model (it is then out of routing: :attr:`Replica.loading`), the call goes elsewhere where ``elsewhere()``
        says another replica can take it, asking the model card at most once per :data:`LOADING_POLL_S`; where none
        can, the call waits rather than meet that refusal on every attempt: asked again every :data:`LOADING_POLL_S`,
        for the endpoint's ``timeout_s`` at most since the replica was first heard loading (then calls go as they
        come, and their retries meet what the server answers)."""
        if replica.probed:
            return
        async with replica.probe_lock:
            while not replica.probed:
                if replica.loading and elsewhere() and not self.poll_due(replica):
                    return
                answer = await probe(session, replica, route.api_key)
                if answer == "answered" and self.log is not None:
                    self.log.record_server(replica.findings(serves_samples([replica.server_kind])))
                if answer != "loading":
                    return
                now = replica.polled_at = time.monotonic()
                if replica.loading_since is None:
                    replica.loading_since = now
                if elsewhere() or now - replica.loading_since >= route.endpoint.timeout_s:
                    return
                await asyncio.sleep(LOADING_POLL_S)
