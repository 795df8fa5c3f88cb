"""An in-process :class:`tmas.llm.model.ChatModel` for unit tests of logic (methods, agents, judges, experience
building): no HTTP, no server, the same replies the simulated server gives.

It answers with the simulator's script (rules by role and pattern, then the default responder of each role), so a
test scripts it exactly as it scripts :class:`tmas.testing.SimServer`, and it records every call it was asked for
(role, key, messages, resolved sampling, reply model) and every chain ended, for the test to assert on. Its calls are
numbered in order (``call_id``), as a run store numbers the calls it records, so a record that cites a call can be
followed to it.
Tests of what crosses the wire (request bodies, retries, faults, streaming, the store) keep using the simulated
server.

A call's reply depends on its request body as the simulator's does (the default verifier's random scores come from
a hash of it), and the body is the one the HTTP client would send: a reply model goes as a ``response_format`` where
the client would send it (:meth:`ScriptedModel.schema`), so a request answers alike in process and on the simulator.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tmas.config import Sampling, Settings
from tmas.llm.failures import from_status
from tmas.llm.model import QuotaSpent
from tmas.llm.reasoning import reply_place, split_reasoning
from tmas.llm.refusals import requested_schema, schema_goes
from tmas.llm.sampling import ResolvedSampling, resolve_role
from tmas.llm.types import CallKey, ChainKey, ChatRequest, Completion, Message, TokenLogprob, Usage
from tmas.llm.watch import TraceWatch
from tmas.testing.personas import persona_of
from tmas.testing.responders import SimRequest, count_tokens
from tmas.testing.script import Rule, SimScript
from tmas.testing.scripted_replies import RuleBook, embed_text, scripted_logprobs, scripted_text
from tmas.testing.sim_faults import rule_error


@dataclass(frozen=True)
class ScriptedCall:
    """One call the scripted model answered."""

    role: str
    key: CallKey
    messages: list[Message]
    # The sampling the call resolved to (what would be sent), and which source set each of its fields.
    sampling: Sampling
    sources: dict[str, str]
    reply_model: type[BaseModel] | None
    body: dict[str, Any]
    # What the call returned (a failed completion for a scripted fault).
    reply: Completion


@dataclass
class ScriptedModel:
    """``ScriptedModel(SimScript(rules=[Rule(role="verifier", replies=[...])]))``; ``calls`` lists what was asked."""

    script: SimScript = field(default_factory=SimScript)
    settings: Settings = field(default_factory=Settings)
    calls: list[ScriptedCall] = field(default_factory=list)
    # The texts of each embedding request, in order.
    embedded: list[list[str]] = field(default_factory=list)
    # The chains ended (ChatModel.end_chain), in order: with each call's ``key.chain``, what a test asserts a
    # method's chains by.
    ended_chains: list[ChainKey] = field(default_factory=list)
    _rules: RuleBook | None = field(default=None, repr=False)
    # Where each model's replies at each endpoint put reasoning, as the HTTP client learns it from the first reply it
    # reads: (URL, model) -> place (one URL may serve several models, each thinking its own way).
    _reasoning: dict[tuple[str, str], str] = field(default_factory=dict, repr=False)

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
        override = self.settings.roles.get(role)
        if override is not None and override.context_length is not None:
            return override.context_length
        return self.settings.endpoint.context_length

    def model_name(self, role: str) -> str:
        override = self.settings.roles.get(role)
        return (override.model if override is not None else None) or self.settings.endpoint.model or "default"

    def calls_of(self, role: str) -> list[ScriptedCall]:
        return [call for call in self.calls if call.role == role]

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
        # Replies come whole, as an unstreamed call's: a ``watch`` is never begun (tmas.llm.watch).
        # Calls gathered together are all asked before any is answered, as a server gets them: each was sent at the
        # spend before any of them (so a token budget stops parallel calls as a run against an endpoint does).
        await asyncio.sleep(0)
        key = key or CallKey(role=role)
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.resolve_sampling(role, call=sampling)
        schema = self.schema(role, sampling.sampling, reply_model)
        request = ChatRequest.build(self.model_name(role), messages, sampling, schema)
        reply = self._answer(role, key, messages, request)
        body = request.body(structured=True)
        self.calls.append(
            ScriptedCall(role, key, list(messages), sampling.sampling, sampling.sources, reply_model, body, reply)
        )
        return reply

    def schema(self, role: str, sampling: Sampling, reply_model: type[BaseModel] | None) -> dict[str, Any] | None:
        """The ``response_format`` the HTTP client sends for ``reply_model`` (:mod:`tmas.llm.refusals`): none where
        structured output is off or log-probabilities are asked for; always with ``json_schema``; with ``auto``
        once the endpoint's replies are known to keep reasoning out of the content (configured, or learnt from the
        first reply)."""
        endpoint = self._endpoint(role)
        mode = endpoint["structured_output"]
        schema = requested_schema(mode, sampling, reply_model)
        place = endpoint["reasoning"]
        if place == "auto":
            place = self._reasoning.get((endpoint["url"], self.model_name(role)))
        return schema if schema is not None and schema_goes(mode, place) else None

    def _endpoint(self, role: str) -> dict[str, Any]:
        """The structured output mode, reasoning place and (first) address of the endpoint ``role`` calls: its own
        fields where the role sets them, the default endpoint's elsewhere (as :class:`tmas.llm.routes.Routes`)."""
        default = self.settings.endpoint
        override = self.settings.roles.get(role)
        urls = (override.base_url if override is not None else None) or default.base_url
        return {
            "structured_output": (override.structured_output if override is not None else None)
            or default.structured_output,
            "reasoning": (override.reasoning if override is not None else None) or default.reasoning,
            "url": urls[0] if urls else "",
        }

    def _saw_reasoning(self, role: str, content: str, reasoning: str | None, finish_reason: str) -> None:
        """Where a reply put its reasoning (a field of its own, as the simulator sends it, or a think block in the
        content of a reply that finished), learnt as the HTTP client learns it (:func:`tmas.llm.reasoning.reply_place`,
        :meth:`tmas.llm.refusals.Refusals.saw_reasoning`)."""
        at = (self._endpoint(role)["url"], self.model_name(role))
        place = reply_place(content, reasoning, finish_reason)
        if place is None or self._reasoning.get(at) == "inline":
            return
        if place == "none":
            self._reasoning.setdefault(at, "none")
        else:
            self._reasoning[at] = place

    def _answer(self, role: str, key: CallKey, messages: Sequence[Message], request: ChatRequest) -> Completion:
        body = request.body(structured=True)
        request_hash = request.request_hash(key)
        texts = [m.content for m in messages]
        prompt_tokens = sum(count_tokens(t) for t in texts) + 4 * len(texts)
        if self._rules is None or self._rules.rules is not self.script.rules:
            self._rules = RuleBook(self.script)  # a script replaced between calls starts its rules afresh
        rule, used = self._rules.pick(role, texts)
        call_id = len(self.calls) + 1
        if rule is not None and rule.fault is not None and rule.fault not in ("truncate", "garbage"):
            # Faults that replace the reply end the call as the HTTP client ends it after its retries.
            return _failed(key, request, call_id, f"scripted {rule.fault}", rule.fault)
        if rule is not None and rule.error_status is not None and rule.fault is None:
            return self._refused(role, key, request, rule, rule.error_status, call_id)
        seed = request.sampling.seed
        sim = SimRequest(role, key.problem_id or None, [m.model_dump() for m in messages], body, seed, self.script)
        fault = rule.fault if rule is not None else None
        text = scripted_text(sim, rule, used, fault=fault, max_tokens=request.sampling.max_tokens)
        self._saw_reasoning(role, text.content, text.reasoning, text.finish_reason)
        # Thinking is kept apart from the content as the HTTP client keeps it (reasoning field or <think> block).
        endpoint = self._endpoint(role)
        learnt = self._reasoning.get((endpoint["url"], self.model_name(role)))
        place = endpoint["reasoning"] if endpoint["reasoning"] != "auto" else learnt
        cut_inline = place == "inline" and text.finish_reason == "length"
        content, reasoning = split_reasoning(text.content, text.reasoning, cut_inline=cut_inline)
        logprobs = scripted_logprobs(self.script, body, rule, text.content, persona_of(self.script), text.reasoning)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=text.completion_tokens)
        if rule is not None and rule.usage is not None:
            usage = Usage(
                prompt_tokens=rule.usage.prompt_tokens,
                completion_tokens=rule.usage.completion_tokens,
                reasoning_tokens=rule.usage.reasoning_tokens,
                cached_prompt_tokens=rule.usage.cached_tokens or 0,
            )
        return Completion(
            key=key,
            request_hash=request_hash,
            call_id=call_id,
            endpoint="scripted",
            model=request.model,
            content=content,
            reasoning=reasoning,
            usage=usage,
            finish_reason=text.finish_reason,
            # An empty payload is none, as the HTTP client reads it.
            logprobs=[TokenLogprob.model_validate(p) for p in logprobs] if logprobs else None,
        )

    def _refused(
        self, role: str, key: CallKey, request: ChatRequest, rule: Rule, status: int, call_id: int
    ) -> Completion:
        """A rule's ``error_status`` without a fault: the simulator refuses the request with that status and body
        before any generation, and the call fails as the HTTP client fails it on that refusal (after its retries
        where it retries one; a spent quota raises :class:`tmas.llm.model.QuotaSpent`, ending the run)."""
        body = rule.error_page or json.dumps(rule_error(persona_of(self.script).name, rule, status))
        failure = from_status(status, body, request.body(structured=True))
        if failure.cause == "quota":
            raise QuotaSpent(f"endpoint {self._endpoint(role)['url']} refused role {role!r}: {failure}")
        return _failed(key, request, call_id, str(failure), failure.cause)

    def end_chain(self, chain: ChainKey) -> None:
        self.ended_chains.append(chain)

    async def embed(self, texts: Sequence[str], *, role: str = "embedding") -> list[list[float]]:
        self.embedded.append(list(texts))
        return [embed_text(text, self.script.embedding_dim) for text in texts]


def _failed(key: CallKey, request: ChatRequest, call_id: int, error: str, cause: str) -> Completion:
    """Call ``call_id``, of ``request``, failed for ``cause`` with nothing generated."""
    return Completion(
        key=key,
        request_hash=request.request_hash(key),
        call_id=call_id,
        model=request.model,
        error=error,
        error_cause=cause,
    )
