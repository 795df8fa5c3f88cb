"""Typed messages, requests and results of the LLM layer."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tmas.config import LATER_SAMPLING_FIELDS, SENT_SAMPLING_FIELDS, Sampling

if TYPE_CHECKING:
    from tmas.llm.sampling import ResolvedSampling


class Message(BaseModel):
    model_config = ConfigDict(frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str


def user(content: str) -> Message:
    return Message(role="user", content=content)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    # Prompt tokens the server took from its prompt cache instead of computing them (OpenAI's and vLLM's
    # usage.prompt_tokens_details.cached_tokens, llama-server's timings.cache_n); 0 when it did not say.
    cached_prompt_tokens: int = 0
    # True when the server reported no usage and the counts were estimated (not tokenizer-exact).
    estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cached_prompt_share(self) -> float | None:
        """The share of prompt tokens the server took from its prompt cache (None without prompt tokens)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else None

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens + other.cached_prompt_tokens,
            estimated=self.estimated or other.estimated,
        )


def cached_share_text(usage: Usage) -> str:
    """`` (N cached, P%)`` after a prompt token count, or nothing when the server reported no cached tokens."""
    share = usage.cached_prompt_share
    if not usage.cached_prompt_tokens or share is None:
        return ""
    return f" ({usage.cached_prompt_tokens:,} cached, {share:.0%})"


# What a server may refuse that a run goes on without, recorded once per endpoint (the run store's downgrades), and
# what the run did instead.
DowngradeKind = Literal["structured_output", "stream", "batch_samples", "sampling"]
DOWNGRADES: dict[str, str] = {
    "structured_output": "refused response_format, or its model thinks inline; its calls went on as plain text",
    "stream": "could not stream; its calls went unstreamed, timeout_s bounding each whole reply",
    "batch_samples": "refused n > 1, ignored it or gave identical choices; its samples went one request each",
    "sampling": "refused a sampling field; its calls went on without it, or under the name it asked for",
}


# Where a server puts a reply's reasoning, as its replies showed: in a field of its own (it runs a reasoning parser),
# inline in the content (``<think>`` blocks: no parser), or nowhere (the model does not think).
Reasoning = Literal["separate", "inline", "none"]
# Which engine serves an endpoint (tmas.llm.server_kind).
ServerKind = Literal["vllm", "sglang", "llama-server"]


class ServerFindings(BaseModel):
    """What a replica's probe found, recorded in the run: of one model at one URL (a router or a hosted API serves
    several there, each with its own context window and its own place for reasoning)."""

    url: str
    model: str | None = None
    server_kind: ServerKind | None = None
    context_length: int | None = None
    serves_n: bool | None = None
    reasoning: Reasoning | None = None


class ChainKey(BaseModel):
    """One chain of calls that build on each other (a TMAS candidate: its solution, verifications, summary): the
    problem, the iteration and the chain's index within it. The client keeps a chain's calls together: back to back
    on a pinned server slot, on one replica across replicas (:mod:`tmas.llm.lanes`)."""

    model_config = ConfigDict(frozen=True)

    problem_id: str
    iteration: int | None
    chain: int


@dataclass(frozen=True)
class Lane:
    """Which of a run's problem workers a call comes from: worker ``index`` of ``count`` (:mod:`tmas.llm.lanes`). On
    an endpoint with ``pin_slots`` a lane's calls keep to one server slot."""

    index: int
    count: int


class CallKey(BaseModel):
    """Identifies a call for caching and replay: the same request with the same sample index in the same iteration is
    the same call."""

    model_config = ConfigDict(frozen=True)

    problem_id: str = ""
    role: str
    # Distinguishes repeated identical requests (e.g. the N candidates of iteration 0 share one prompt).
    sample: int = 0
    iteration: int | None = None
    # The chain the call belongs to within its problem's iteration (a TMAS candidate's index); None for a call of
    # no chain. Where the call goes, never what it asks: no part of the request hash, nor of the run store's row, so
    # runs stored before it existed replay their calls.
    chain: int | None = None
    # The problem worker the call comes from (None: a call of no run's worker, e.g. a grader's), which an endpoint
    # with ``pin_slots`` keeps on one server slot. Where the call goes, as ``chain``: no part of the request hash or
    # of the run store's row.
    lane: Lane | None = None

    @property
    def chain_key(self) -> ChainKey | None:
        """The chain of this call, or None."""
        if self.chain is None:
            return None
        return ChainKey(problem_id=self.problem_id, iteration=self.iteration, chain=self.chain)


class ChatRequest(BaseModel):
    """What is sent, minus the endpoint: the role's model, messages and resolved sampling."""

    model: str
    messages: list[Message]
    sampling: Sampling
    # The ``response_format`` of a reply parsed by a pydantic model (see tmas.llm.schema). Not part of the request
    # hash: the parsers read the reply with or without it, so runs stored before it existed replay their calls.
    response_format: dict[str, Any] | None = None
    # Which source set each field of ``sampling`` (see tmas.llm.sampling): recorded with the call, not hashed.
    sampling_sources: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model: str,
        messages: Sequence[Message],
        sampling: ResolvedSampling,
        response_format: dict[str, Any] | None = None,
    ) -> ChatRequest:
        """The request of a call, as every :class:`tmas.llm.model.ChatModel` builds it (so all hash it alike)."""
        return cls(
            model=model,
            messages=list(messages),
            sampling=sampling.sampling,
            sampling_sources=sampling.sources,
            response_format=response_format,
        )

    def body(self, max_tokens: int | None = None, *, structured: bool = False) -> dict[str, Any]:
        """The request body; ``structured`` adds the ``response_format`` (where the request has one)."""
        s = self.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [m.model_dump() for m in self.messages],
        }
        for name in SENT_SAMPLING_FIELDS:
            value = getattr(s, name)
            if value is not None:
                body[name] = value
        effective = max_tokens if max_tokens is not None else s.max_tokens
        if effective is not None:
            body["max_tokens"] = effective
        if structured and self.response_format is not None:
            body["response_format"] = self.response_format
        # Last, so a response_format the user put in extra_body is the one sent.
        body.update(s.extra_body)
        return body

    def request_hash(self, key: CallKey) -> str:
        """Stable hash of what determines the reply; the endpoint URL is left out so replicas share a cache."""
        payload = {
            "problem": key.problem_id,
            "role": key.role,
            "model": self.model,
            "messages": [[m.role, m.content] for m in self.messages],
            "sampling": _hashed_sampling(self.sampling),
        }
        raw = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")
        return hashlib.sha256(raw).hexdigest()


def _hashed_sampling(sampling: Sampling) -> dict[str, Any]:
    # Fields added after runs were first stored are hashed only when set, so stored calls keep their hashes.
    dumped = sampling.model_dump(mode="json")
    for name in LATER_SAMPLING_FIELDS:
        if dumped.get(name) is None:
            dumped.pop(name, None)
    return dumped


class TopLogprob(BaseModel):
    token: str
    logprob: float


class TokenLogprob(BaseModel):
    """One generated token with its log-probability and the most likely alternatives at its position (OpenAI's
    ``choices[0].logprobs.content[i]``)."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        # Some servers send null where no alternatives were asked for.
        return [] if value is None else value


# Half a UTF-16 surrogate pair: a pair that arrived whole is one character in a Python string.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds half a surrogate pair: the one thing UTF-8 cannot encode. Asked of every reply, tens
    of thousands of tokens from a thinking model: ``isascii`` answers at once and the encoder runs at memory speed,
    where the regular expression walks the text a character at a time."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class Completion(BaseModel):
    """A finished (or failed) call, as stored in the run store."""

    key: CallKey
    # The hash of the request (ChatRequest.request_hash) a resume looks the call up by. The run's store sets it as it
    # records the call (tmas.llm.replay.StoreReplay), whatever the model answering put here, so a ChatModel of one's
    # own leaves it empty; the HTTP client fills it in for calls made without a store.
    request_hash: str = ""
    # Row id in the run store, once stored.
    call_id: int | None = None
    endpoint: str = ""
    model: str = ""
    # Final content only: what other agents see. Reasoning (reasoning_content or <think> blocks) is kept apart.
    content: str = ""
    reasoning: str = ""
    usage: Usage = Field(default_factory=Usage)
    finish_reason: str | None = None
    latency_s: float = 0.0
    attempts: int = 1
    # max_tokens actually sent, when it was lowered to fit the context window.
    max_tokens_sent: int | None = None
    error: str | None = None
    # Why it failed, in a word (e.g. "http_503", "timeout", "connection", "malformed"), when it did.
    error_cause: str | None = None
    # The causes of the attempts that failed before the last one (retried transient failures), in order.
    retry_causes: list[str] = Field(default_factory=list)
    # Answered from the run store (replayed), not sent now.
    replayed: bool = False
    # Per-token log-probabilities of the content, when the request asked for them and the server sent them.
    logprobs: list[TokenLogprob] | None = None
    # Why the caller's watch stopped the reply while it streamed (tmas.llm.watch): the content is the part that
    # arrived and ``finish_reason`` the watch's; never an answer. None for a reply that ran to its end.
    stopped_early: str | None = None
    # Seconds the call waited inside tmas (its slot, the caps) before it was sent, and from sending to the server's
    # first chunk (its queue and the prompt's prefill): None where not measured (replayed from older runs).
    queued_s: float | None = None
    first_token_s: float | None = None
    # The seed the model drew the reply with where the call named none and the model says which (the in-process
    # model draws one per call): stored as the call's seed, so the reply can be drawn again. Not read back.
    drawn_seed: int | None = None

    @field_validator("content", "reasoning", "error")
    @classmethod
    def _whole_characters(cls, value: str | None) -> str | None:
        # A reply's JSON may escape half a UTF-16 pair (\ud800), which no store or later request can hold: it reads
        # as U+FFFD, as a byte no UTF-8 decoder can read does.
        if value is None or not has_lone_surrogate(value):
            return value
        return LONE_SURROGATE.sub("\ufffd", value)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"
