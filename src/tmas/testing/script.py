"""The simulator's script: what the fake server answers, how slowly, and which faults it injects.

A script is plain data (pydantic, unknown keys rejected) so tests and benchmarks can build it in Python or
load it from JSON (``POST /_sim/script``, ``--script FILE.json``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

FaultKind = Literal[
    "http_500",
    "http_503",
    "http_429",
    "http_400",
    # A key the server refuses: every call is answered so until its operator fixes the key.
    "http_401",
    "timeout",
    "drop",
    "malformed",
    "truncate",
    "garbage",
    # A streamed reply sends its first part, then nothing for ``hang_s``, then the rest (unstreamed: as "timeout"). So
    # pauses a stream that vLLM preempts (vllm/v1/core/sched/scheduler.py, _preempt_request: its KV cache freed, the
    # request put back at the head of the waiting queue and its tokens computed again once it is rescheduled); the
    # engine works on meanwhile, and its progress counters move (/metrics).
    "stall",
    # As "stall", but the engine makes no progress during the pause (its counters stand still): a wedge mid-generation.
    "freeze",
    # A streamed reply sends its first part, then closes the connection without its end (unstreamed: as "drop").
    "cut",
    # A streamed reply sends its first part, then an error event and [DONE], as vLLM and SGLang do on an internal
    # error met mid-generation (unstreamed: as "http_500"). With a rule's ``error_status``, the event carries that
    # status in the persona's shape (unstreamed: that status).
    "stream_error",
    # A streamed reply of several choices goes out until the first choice has finished (its finish_reason sent),
    # then the connection closes, the other choices unfinished (unstreamed: as "drop").
    "cut_after_finish",
    # The server aborts the request part way: each choice stops half way with finish_reason "abort", streamed or not.
    "abort",
]

# The wording of a context refusal (SimScript.context_wording, tmas.testing.context_limits).
ContextWording = Literal["persona", "output_tokens", "too_large", "passed", "legacy", "generic", "decoder_prompt"]

# Whose reply shapes the simulator answers in (tmas.testing.personas): its own ("sim"), or a real server's.
PersonaName = Literal["sim", "vllm", "sglang", "llama-server", "openai"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FaultRates(_Strict):
    """Per-request probability of each random fault (drawn only when no rule matched)."""

    http_500: float = Field(default=0.0, ge=0.0, le=1.0)
    http_503: float = Field(default=0.0, ge=0.0, le=1.0)
    http_429: float = Field(default=0.0, ge=0.0, le=1.0)
    timeout: float = Field(default=0.0, ge=0.0, le=1.0)
    drop: float = Field(default=0.0, ge=0.0, le=1.0)
    malformed: float = Field(default=0.0, ge=0.0, le=1.0)
    truncate: float = Field(default=0.0, ge=0.0, le=1.0)
    garbage: float = Field(default=0.0, ge=0.0, le=1.0)
    stall: float = Field(default=0.0, ge=0.0, le=1.0)
    cut: float = Field(default=0.0, ge=0.0, le=1.0)
    stream_error: float = Field(default=0.0, ge=0.0, le=1.0)
    cut_after_finish: float = Field(default=0.0, ge=0.0, le=1.0)
    abort: float = Field(default=0.0, ge=0.0, le=1.0)
    freeze: float = Field(default=0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _total_at_most_one(self) -> FaultRates:
        # One uniform draw picks at most one fault per request, so the rates must fit in [0, 1] together.
        if self.total() > 1.0 + 1e-9:
            raise ValueError(f"fault rates sum to {self.total():g}, more than 1")
        return self

    def total(self) -> float:
        return sum(float(getattr(self, kind)) for kind in _RANDOM_KINDS)

    def cumulative(self) -> list[tuple[FaultKind, float]]:
        """``[(kind, upper bound of its slice of [0, 1)), ...]`` for the kinds with a non-zero rate."""
        out: list[tuple[FaultKind, float]] = []
        acc = 0.0
        for kind in _RANDOM_KINDS:
            rate = float(getattr(self, kind))
            if rate > 0.0:
                acc += rate
                out.append((kind, acc))
        return out


# Fixed order so a seed gives the same fault sequence whatever order the JSON keys came in.
_RANDOM_KINDS: tuple[FaultKind, ...] = (
    "http_500",
    "http_503",
    "http_429",
    "timeout",
    "drop",
    "malformed",
    "truncate",
    "garbage",
    "stall",
    "cut",
    "stream_error",
    "cut_after_finish",
    "abort",
    # Last, so that a seed draws the same faults of the kinds before it as when it was not there.
    "freeze",
)


class ScriptedUsage(_Strict):
    """The ``usage`` a rule's replies report (``reasoning_tokens`` goes in ``completion_tokens_details``)."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    reasoning_tokens: int = Field(default=0, ge=0)
    # Prompt tokens served from the prompt cache, reported where ``cached_in`` says: OpenAI's and vLLM's
    # ``usage.prompt_tokens_details.cached_tokens``, or llama-server's ``timings.cache_n``.
    cached_tokens: int | None = Field(default=None, ge=0)
    cached_in: Literal["usage", "timings"] = "usage"


class Rule(_Strict):
    """Scripted behaviour for requests matching ``role`` and ``pattern`` (``None`` matches anything)."""

    role: str | None = None
    pattern: str | None = None
    replies: list[str] = Field(default_factory=list)
    # OpenAI's ``choices[0].logprobs.content`` list, sent verbatim when the request asks for logprobs (instead of
    # the server's own payload, in which every content token is certain).
    logprobs: list[dict[str, Any]] | None = None
    fault: FaultKind | None = None
    # With fault "stream_error": the HTTP status the error carries (a 4xx for a request the server refuses part way),
    # in the persona's error-event shape. None: the simulator's own 500 event. Without a fault: the request is refused
    # with that HTTP status before any generation, streamed or not (OpenAI's 429 for a rate limit or a spent quota);
    # in process (ScriptedModel) the call fails as the HTTP client fails it on that refusal.
    error_status: int | None = Field(default=None, ge=400, le=599)
    # The error's message with ``error_status`` (None: a message of the simulator's own).
    error_message: str | None = None
    # The error's whole body with ``error_status``, sent verbatim (OpenAI's ``{"error": {"message", "type", "param",
    # "code"}}``, e.g. code ``insufficient_quota``), as the reply or as the stream's error event. None: the persona's
    # shape carrying ``error_message``.
    error_body: dict[str, Any] | None = None
    # An HTML page sent instead, as a proxy in front of the server answers with ``error_status`` (nginx's "502 Bad
    # Gateway" while the server restarts, its "504 Gateway Time-out" for a request the server kept past the proxy's
    # read timeout): a refusal before any generation, streamed or not.
    error_page: str | None = None
    # With a fault that breaks a stream part way ("stall", "freeze", "cut", "stream_error"): the tokens that stream
    # before it (the events up to that many). None: the opening chunk and the first delta.
    fault_after_tokens: int | None = Field(default=None, ge=0)
    times: int | None = Field(default=None, ge=0)
    latency_s: float | None = Field(default=None, ge=0.0)
    finish_reason: str | None = None
    reasoning: str | None = None
    # Token counts reported for this rule's replies instead of counted ones, so budget tests can work by hand.
    usage: ScriptedUsage | None = None

    # Compiled once per rule, not per request.
    _regex: re.Pattern[str] | None = PrivateAttr(default=None)

    @field_validator("pattern")
    @classmethod
    def _pattern_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value, re.S)
            except re.error as exc:
                raise ValueError(f"bad regex {value!r}: {exc}") from exc
        return value

    def model_post_init(self, context: Any, /) -> None:
        self._regex = re.compile(self.pattern, re.S) if self.pattern is not None else None

    @property
    def regex(self) -> re.Pattern[str] | None:
        return self._regex


class LongReplies(_Strict):
    """Thinking-model reply lengths (tmas.testing.long_replies): every reply of the listed roles carries reasoning of a
    log-normal length clipped to [reasoning_min_tokens, reasoning_max_tokens] and an answer padded to a uniform length
    in [answer_min_tokens, answer_max_tokens], both sliced from a generated corpus, and streams in deltas of
    ``chunk_tokens`` (paced by the script's ``latency_per_token_s``)."""

    reasoning_median_tokens: int = Field(default=6_000, ge=1)
    reasoning_sigma: float = Field(default=0.9, ge=0.0)
    reasoning_min_tokens: int = Field(default=2_000, ge=0)
    reasoning_max_tokens: int = Field(default=60_000, ge=0)
    answer_min_tokens: int = Field(default=300, ge=0)
    answer_max_tokens: int = Field(default=2_000, ge=0)
    chunk_tokens: int = Field(default=2_000, ge=1)
    # Share of the corpus's sentences drawn from a small pool of stock phrases ("Wait, let me check that again."):
    # how repetitive the text is, so how well zstd compresses it. The default is calibrated on real model replies
    # (docs/performance.md, "The paper's scale rehearsed").
    repeat_share: float = Field(default=0.78, ge=0.0, le=1.0)
    corpus_tokens: int = Field(default=400_000, ge=1)
    # Roles that get long replies (None: every role).
    roles: list[str] | None = None

    @model_validator(mode="after")
    def _ranges(self) -> LongReplies:
        if self.reasoning_min_tokens > self.reasoning_max_tokens:
            raise ValueError("long_replies: reasoning_min_tokens is above reasoning_max_tokens")
        if self.answer_min_tokens > self.answer_max_tokens:
            raise ValueError("long_replies: answer_min_tokens is above answer_max_tokens")
        if self.corpus_tokens <= self.reasoning_max_tokens + self.answer_max_tokens:
            raise ValueError("long_replies: corpus_tokens must exceed the longest reasoning and answer together")
        return self

    def covers(self, role: str) -> bool:
        return self.roles is None or role in self.roles


class SimScript(_Strict):
    """Everything the simulated server does. Replace it live with ``SimServer.set_script``."""

    model: str = "sim-model"
    # Other models served at the same URL, as a hosted API or a gateway serves several: answered as ``model`` is, but
    # never as a reasoning model (a chat model beside a reasoning one, each with its own restrictions): their replies
    # hold no thinking, in a field or in think tags.
    also_serves: list[str] = Field(default_factory=list)
    # The other names llama-server's model card lists in its ``aliases`` (its ``--alias``): the llama-server persona
    # answers any name a call gives, these too.
    aliases: list[str] = Field(default_factory=list)
    context_length: int = Field(default=32768, ge=1)
    latency_s: float = Field(default=0.0, ge=0.0)
    latency_per_token_s: float = Field(default=0.0, ge=0.0)
    usage: bool = True
    reasoning: bool = False
    think_tags: bool = False
    # With think_tags: the chat template opens the think block in the prompt (DeepSeek-R1 distills, Qwen3.5), so a
    # reply holds its thinking and the closing tag only, and one cut inside its thinking holds no tag at all.
    think_in_prompt: bool = False
    # Whether the server answers ``logprobs: true`` with a payload (False: a server that ignores the request).
    logprobs: bool = True
    # "reject": answer any request carrying a ``response_format`` with a 400, as a server without structured-output
    # support does.
    response_format: Literal["accept", "reject"] = "accept"
    # A request with ``stream: true``: "accept" streams the reply; "refuse" answers with a 400 naming ``stream``;
    # "ignore" answers with a whole JSON reply, as servers that cannot stream do.
    stream: Literal["accept", "refuse", "ignore"] = "accept"
    faults: FaultRates = Field(default_factory=FaultRates)
    rules: list[Rule] = Field(default_factory=list)
    seed: int = 0
    hang_s: float = Field(default=3600.0, ge=0.0)
    accuracy: float = Field(default=1.0, ge=0.0, le=1.0)
    embedding_dim: int = Field(default=256, ge=1)
    # The most inputs one embeddings request may carry, as hosted APIs cap it (OpenAI: 2,048); None: no cap.
    max_embedding_inputs: int | None = Field(default=None, ge=1)
    log_limit: int = Field(default=100000, ge=0)
    # The server whose shapes the replies take: where reasoning and cached tokens go, what it does with unknown
    # fields, n and its /v1/models (tmas.testing.personas). "sim" is the simulator's own, unchanged.
    persona: PersonaName = "sim"
    # The server flag that adds cached prompt tokens to usage: vLLM's --enable-prompt-tokens-details, SGLang's
    # --enable-cache-report (both off by default). llama-server and OpenAI always report them.
    cache_report: bool = False
    # Prompt tokens this replica's prefix cache holds (0: no cache); None: the persona's default capacity.
    prefix_cache_tokens: int | None = Field(default=None, ge=0)
    # llama-server's slots (-np): each keeps its last prompt cached, and n may not exceed them.
    slots: int = Field(default=4, ge=1)
    # Thinking-length replies (None: the responders' short ones, with the short fake reasoning where asked).
    long_replies: LongReplies | None = None
    # Log each chat request's prompt digest, seed and n instead of its body (tmas.testing.long_replies.request_digest):
    # a log of a whole paper-scale run stays small.
    log_digests: bool = False
    # The most chat requests generating at once (a server's batch, or llama-server's slots); the others wait in
    # arrival order before their first chunk, shown as the persona's server shows it (tmas.testing.personas,
    # ``Persona.headers_at``). None: all at once, as before.
    max_running: int | None = Field(default=None, ge=1)
    # With ``max_running``: the most requests waiting for a turn (SGLang's --max-queued-requests); one more is refused
    # at once, as SGLang's scheduler aborts it (_abort_on_queued_limit: status 503, "The request queue is full."): a
    # streamed request gets an HTTP 200 stream whose first event is that error, then [DONE]; one sent whole an HTTP
    # 503. None: no limit.
    max_queued: int | None = Field(default=None, ge=0)
    # /health: "ok" answers 200; "hang" answers nothing for ``hang_s`` then closes the connection; "error" answers
    # 503, as a replica whose engine died does.
    health: Literal["ok", "hang", "error"] = "ok"
    # A wedged engine: it accepts chat requests (a vLLM stream gets its headers) and never answers them, its progress
    # counters stand still, and /health answers as the persona's server answers then: vLLM 200 (an error flag only),
    # SGLang 503 after ``health_check_timeout_s``, llama-server 200 while its /metrics and /slots wait for the main loop
    # (for ``hang_s``). Setting it back to False lets the waiting requests go on.
    wedged: bool = False
    # A gate for tests: the server goes on with the first ``hold_after`` chat requests it receives under this script
    # and holds the later ones silent (``SimStats.held``) until the script is replaced or reset, so a test stops a run
    # at a known point (a kill while it waits, a page read while it is unfinished) without racing it. None: no gate.
    hold_after: int | None = Field(default=None, ge=0)
    # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: how long its /health waits for output of a wedged scheduler before 503.
    health_check_timeout_s: float = Field(default=20.0, ge=0.0)
    # The server's token counting routes (/tokenize, /v1/tokenize, /apply-template); False: a gateway in front that has
    # none (LiteLLM, most Kubernetes routers), where they answer 404.
    tokenize: bool = True
    # The metrics route: vLLM's always there; SGLang's with --enable-metrics (False: 404); llama-server's with --metrics
    # (False: its 501 "This server does not support metrics endpoint").
    metrics: bool = True
    # Whether usage reports reasoning tokens where the persona's server counts them. False: vLLM's chat completions
    # before 2026-08 (PR 45802 added completion_tokens_details.reasoning_tokens with a reasoning parser), and SGLang
    # where its scheduler counted none (reasoning_tokens 0).
    reports_reasoning_tokens: bool = True
    # Older SGLang (usage_processor.py summing meta_info cached_tokens over every response): with n choices, the cached
    # tokens reported are the first choice's plus the whole prompt for each other one (their prompt found cached).
    cached_summed_over_choices: bool = False
    # The wording (and condition) of a context refusal (tmas.testing.context_limits): "persona", the persona's
    # server today ("sim": "legacy"); or one of vLLM's over its releases: "output_tokens" (today's), "passed",
    # "too_large", "legacy"; or "generic", a 400 that names the context window and no numbers.
    context_wording: ContextWording = "persona"
    # SGLang ("sglang" only): the tokens its KV cache pool holds, where fewer than the context window (a long-context
    # model on a small GPU). Its scheduler then bounds a request by the smaller of the two, L: a prompt of L - 6 tokens
    # or more is refused ("Input length (N tokens) exceeds the maximum allowed length (L - 6 tokens)"; a 400, or
    # streamed an error event with code 400 on an HTTP 200 stream), and a reply is cut (finish_reason "length") where
    # prompt and reply reach L - 2, whatever max_tokens asked. Its model card still states the context window. None: no
    # such bound beyond the window's own checks.
    kv_pool_tokens: int | None = Field(default=None, ge=8)
    # The server's API key (vLLM's --api-key, SGLang's --api-key, llama-server's --api-key): requests to its guarded
    # routes without "Authorization: Bearer KEY" get the persona's 401 (tmas.testing.sim_access). None: open.
    api_key: str | None = None
    # The replica is loading its model until that many /v1/models requests have been answered while loading: 503, or
    # llama-server's 200 with its card's meta null; meanwhile every other route answers 503 (llama-server's
    # tools/server/server-http.cpp middleware_server_state refuses every route but its model list with "Loading
    # model" until the model is loaded; a proxy in front of a replica not ready yet too).
    models_unavailable: int = Field(default=0, ge=0)
    # llama-server builds before its HTTP layer moved to server-http.cpp ("llama-server" only): a streamed request
    # gets its 200 headers before its task runs, so a refusal met then (a prompt over n_ctx) comes inside the stream,
    # as an SSE line of the field "error" (server_sent_event(sink, "error", ...): ``error: {code, message, type,
    # n_prompt_tokens, n_ctx}``), then ``data: [DONE]``.
    sse_error_field: bool = False
    # SGLang's --enable-deterministic-inference: None keeps the simulator's own seeding (a request's seed gives its
    # reply); False: the "sglang" persona ignores ``seed`` (each request samples afresh); True: the seed is honoured
    # and every choice of an n > 1 request is sampled with it, so the n choices come out identical. Other personas
    # ignore this field.
    deterministic: bool | None = None
