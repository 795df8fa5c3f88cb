"""Configuration: pydantic models, loaded from a TOML file, ``TMAS_*`` environment variables and CLI flags.

Precedence, lowest first: built-in defaults < TOML file < environment < CLI flags. Unknown keys and bad values
raise :class:`ConfigError` with a one-line message naming the key.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tmas.errors import ConfigError, InputError


class TokenCounts(Protocol):
    """What a budget reads of a call's usage (``tmas.llm.types.Usage`` has it): named here, not imported, so that
    the configuration stays below the LLM layer that uses it."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...


# The roles of no method: the grader's judge (tmas.grading, and the RL novelty judge), and the experience pool's
# summarizer and embedder (tmas.pool, tmas.memory). Each method declares its own agents' roles (``Method.traits``);
# ``[roles.NAME]`` tables are checked against both where settings meet the methods (tmas.methods.check_roles), so a
# method from another package brings its roles with it.
SERVICE_ROLES = ("judge", "summarizer", "embedding")


def _split_urls(value: Any) -> Any:
    """``"http://a,http://b"`` (as from an environment variable) -> a list of replicas. Text that holds no URL
    (``""``, blanks, ``","``) is refused: read as no endpoint, it would start the embedded local model. Leaving the
    key out is how a file asks for that model."""
    if isinstance(value, str):
        urls = [part.strip() for part in value.split(",") if part.strip()]
        if not urls:
            raise ValueError(f"{value!r} holds no URL: give one (several comma-separated), or leave the key out")
        return urls
    if value is not None and not (isinstance(value, list | tuple) and all(isinstance(url, str) for url in value)):
        # Said here: pydantic's own words ("should be a valid list") hide that one URL string is as good.
        raise ValueError(f"expected a URL string or a list of them, got {value!r}")
    return value


def _check_urls(urls: list[str]) -> list[str]:
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s) URL")
        problem = _url_problem(url)
        if problem is not None:
            raise ValueError(f"{url!r} {problem}")
    return [url.rstrip("/") for url in urls]


def _url_problem(url: str) -> str | None:
    """What makes an http(s) URL one no connection can be made to (said before the run, not by each call), or None."""
    if any(c.isspace() for c in url):
        return "holds a space"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (read for its check: a port that is no number, or out of range, raises)
    except ValueError as exc:  # an unclosed IPv6 bracket, a bad port
        return f"is not a valid URL ({exc})"
    if not parts.hostname:
        return "names no host"
    return None


# An HTTP header name (RFC 9110 token).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _check_header(name: str | None) -> str | None:
    if name is not None and not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an HTTP header name")
    return name


class Strict(BaseModel):
    """Base for config models: unknown keys are errors, values are validated on assignment too, and a number is
    finite (``inf`` or ``nan`` is no timeout, temperature or budget)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class Sampling(Strict):
    """Sampling parameters sent with a chat completion. ``None`` means: leave it to the server."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: list[str] | None = None
    # Accepted at the top level of a chat request by vLLM, SGLang and llama-server (which calls the repetition
    # penalty repeat_penalty: the client renames it there); OpenAI refuses top_k, min_p and repetition_penalty, and the
    # client then leaves them out (recorded). Unset, the server's default applies: vLLM and SGLang take the model's
    # generation_config.json (e.g. top_k 20 for Qwen3) unless started with --generation-config vllm.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Passed through verbatim in the request body (e.g. vLLM's chat_template_kwargs).
    extra_body: dict[str, Any] = Field(default_factory=dict)

    def merged(self, over: Sampling | None) -> Sampling:
        """This sampling with each field that ``over`` sets taking precedence; every other field is kept.

        A field ``over`` holds as None counts as unset: a full dump read back (stored settings, sweep points) marks
        every field as set, and TOML has no null, so None there is never a user's choice. ``extra_body`` merges key
        by key. The result's ``model_fields_set`` is this one's plus the fields taken from ``over``.
        """
        if over is None:
            return self
        update: dict[str, Any] = {}
        for key in over.model_fields_set:
            value = getattr(over, key)
            if key == "extra_body":
                if value:
                    update[key] = {**self.extra_body, **value}
            elif value is not None:
                update[key] = value
        # model_copy, not model_validate of a full dict: that would mark every field as set and let a later merge
        # of this result replace a route's temperature or max_tokens with None.
        return self.model_copy(update=update) if update else self


# The sampling fields a request carries at its top level where set, in this order.
SENT_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
)
# Fields added after runs were first stored: a call's hash includes them only when set (tmas.llm.types).
LATER_SAMPLING_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty")

# Request fields tmas sends from its own settings, each with the setting that sets it: "sampling." names a sampling
# field (of the table the extra_body is in), any other an endpoint field (of the endpoint or role the sampling is
# for); None: no setting, tmas builds it. extra_body goes on the body last, so such a key of it would replace what
# tmas sends while budgets, cost estimates, batching and the run's records go on reading the setting: it is refused.
SENT_BY_TMAS: dict[str, str | None] = {
    "model": "model",
    "messages": None,
    "stream": "stream",
    "n": "batch_samples",
    "id_slot": "pin_slots",
    "max_tokens": "sampling.max_tokens",
    "max_completion_tokens": "sampling.max_tokens",
    "repeat_penalty": "sampling.repetition_penalty",  # llama-server's name of it
    **{name: f"sampling.{name}" for name in SENT_SAMPLING_FIELDS},
}


# What tmas sends in an embeddings request besides its role's extra_body, which goes under them: such a key of it
# would be overwritten.
EMBEDDING_SENT_BY_TMAS: dict[str, str | None] = {"model": "model", "input": None}
# The embedding role's [roles.embedding] fields that only chat calls read: an embeddings request goes whole (never
# streamed, so no wait for a first chunk either), with no schema, reasoning, server slot or `n`, to the least loaded
# replica (no prefix routing, no session header), and no window or tokenizer counts its texts. Set there, each would
# look configured and do nothing; so would a chat sampling field of [roles.embedding.sampling].
EMBEDDING_UNREAD = (
    "context_length",
    "tokenizer",
    "stream",
    "queue_timeout_s",
    "structured_output",
    "reasoning",
    "pin_slots",
    "batch_samples",
    "routing",
    "routing_load_bound",
    "session_header",
)


def extra_body_refusal(sampling: Sampling, at: str, endpoint_at: str, *, embedding: bool = False) -> str | None:
    """Why ``sampling.extra_body`` (the sampling table at dotted key ``at``, for the endpoint at ``endpoint_at``)
    cannot be sent, in one line naming the key and the setting to use instead; None where it can. ``embedding``: the
    table is the embedding role's, whose extra_body goes in /v1/embeddings requests too."""
    sent = {**SENT_BY_TMAS, **EMBEDDING_SENT_BY_TMAS} if embedding else SENT_BY_TMAS
    for key in [key for key in sampling.extra_body if key in sent]:
        setting = sent[key]
        where = f"{at}.extra_body.{key}"
        if embedding and key not in EMBEDDING_SENT_BY_TMAS:
            return f"{where} is a field of chat requests, and tmas sends the embedding role none: leave it out"
        if setting is None:
            return f"{where} would replace the {key} tmas sends, and no setting sets it: leave it out"
        if setting.startswith("sampling."):
            instead = f"{at}.{setting.removeprefix('sampling.')}"
        else:
            instead = f"{endpoint_at}.{setting}"
        return f"{where} would replace the {key} tmas sends from its settings: set {instead} instead"
    return None


def check_extra_body(settings: Settings, source: str) -> None:
    """A one-line :class:`ConfigError` naming ``source`` (a file, the Python API) where the ``extra_body`` of
    ``[sampling]`` or of a ``[roles.NAME.sampling]`` sets a field tmas sends itself (:data:`SENT_BY_TMAS`).

    Checked where settings are given, not in :class:`Sampling`: runs stored before the check may hold such a key
    (``top_k`` went in extra_body before it was a setting), and they still resume, replay and report as they ran."""
    tables = [("sampling", "endpoint", settings.sampling, "")]
    tables += [
        (f"roles.{name}.sampling", f"roles.{name}", role.sampling, name) for name, role in settings.roles.items()
    ]
    for at, endpoint_at, sampling, role in tables:
        refusal = extra_body_refusal(sampling, at, endpoint_at, embedding=role == "embedding")
        if refusal is not None:
            raise ConfigError(f"{source}: {refusal}")


def embedding_role_refusal(role: RoleConfig, at: str) -> str | None:
    """Why the embedding role's table (at dotted key ``at``) cannot hold what it sets, in one line naming the key; None
    where it can. Its requests are embeddings requests: none of the fields only chat calls read
    (:data:`EMBEDDING_UNREAD`), and no sampling field but ``extra_body``, which is their body."""
    for name in EMBEDDING_UNREAD:
        if getattr(role, name) is not None:
            return f"{at}.{name} is read by chat calls only, and the embedding role makes none: leave it out"
    for name in Sampling.model_fields:
        if name != "extra_body" and getattr(role.sampling, name) is not None:
            return (
                f"{at}.sampling.{name} is a chat sampling field, and embeddings requests take none: only"
                f" {at}.sampling.extra_body goes in them (dimensions, encoding_format, ...)"
            )
    return None


def check_embedding_role(settings: Settings, source: str) -> None:
    """A one-line :class:`ConfigError` naming ``source`` (a file, the Python API) where ``[roles.embedding]`` sets
    what its embeddings requests never carry (:func:`embedding_role_refusal`). Checked where settings are given, as
    :func:`check_extra_body` is: a run stored with such a value still resumes and reports as it ran."""
    role = settings.roles.get("embedding")
    if role is not None and (refusal := embedding_role_refusal(role, "roles.embedding")) is not None:
        raise ConfigError(f"{source}: {refusal}")


def check_pinned_batches(settings: Settings, source: str, *, final: bool = True) -> None:
    """A one-line :class:`ConfigError` naming ``source`` and both keys where an endpoint (the default, or a role's as
    its own fields and the default's make it) has ``pin_slots`` on and ``batch_samples = "on"``: a pinned slot takes
    one call at a time, so its samples always go one request each (:meth:`tmas.llm.refusals.Refusals.batches`), and
    the "on" asked for would be ignored. Checked where settings are given, as :func:`check_extra_body` is. ``final``:
    the settings a run will have (not a config file's alone, which flags may yet give a ``base_url``), where the
    embedded llama-server, which pins every problem's calls to a slot (:mod:`tmas.llm.provision`), pins those of
    every role without a ``base_url`` of its own."""
    default = settings.endpoint
    embedded = final and settings.uses_local_model and settings.local.server == "llama-server"
    tables: list[tuple[str, RoleConfig | None]] = [("endpoint", None)]
    tables += [(f"roles.{name}", role) for name, role in settings.roles.items()]
    for at, role in tables:
        pin = role.pin_slots if role is not None else None
        batch = role.batch_samples if role is not None else None
        if (batch if batch is not None else default.batch_samples) != "on":
            continue
        batch_at = at if batch is not None else "endpoint"
        if pin if pin is not None else default.pin_slots:
            pin_at = at if pin is not None else "endpoint"
            raise ConfigError(
                f'{source}: {pin_at}.pin_slots = true and {batch_at}.batch_samples = "on" never go together (a pinned'
                ' slot takes one call at a time, each sample its own request): set batch_samples to "auto" or "off"'
            )
        if pin is None and embedded and not (role is not None and role.base_url):
            raise ConfigError(
                f'{source}: {batch_at}.batch_samples = "on" with the embedded llama-server, which pins each'
                " problem's calls to a slot (one call at a time, each sample its own request): set batch_samples to"
                ' "auto" or "off"'
            )


StructuredOutput = Literal["auto", "json_schema", "off"]
ReasoningPlace = Literal["auto", "separate", "inline", "none"]
StreamMode = Literal["auto", "on", "off"]
BatchSamples = Literal["auto", "on", "off"]
Routing = Literal["cache", "load"]


class Endpoint(Strict):
    """An OpenAI-compatible server (or several replicas of one model)."""

    base_url: list[str] = Field(default_factory=list)
    model: str | None = None
    # Name of the environment variable holding the API key; the key itself is never stored.
    api_key_env: str | None = None
    # Most calls in flight to each replica of this endpoint (0 = no per-endpoint cap). The roles that take the default
    # endpoint's share one cap at each URL; a role's own ([roles.NAME] max_in_flight) caps that role's calls only.
    max_in_flight: int = Field(default=0, ge=0)
    # Model context window in tokens; when unset it is read from /v1/models where the server reports it.
    context_length: int | None = Field(default=None, ge=1)
    # Path to a Hugging Face tokenizer.json for exact token counts when a server reports no usage.
    tokenizer: str | None = None
    # Whether chat replies are streamed (`stream: true`, usage asked for in the last chunk): a thinking model's reply
    # of tens of thousands of tokens takes longer than any sane wait for a whole reply, but its chunks keep coming.
    # "auto" streams until a server cannot (it refuses `stream` or answers with a plain JSON body), then sends that
    # server unstreamed calls for the rest of the run (recorded); "on" always streams (a refusal fails the call);
    # "off" never does.
    stream: StreamMode = "auto"
    # Seconds of silence in a streamed reply (before its first chunk, or between two chunks) after which the replica
    # is asked whether it still works (its /health and progress: progress_timeout_s), and how often it is asked again
    # while the silence lasts; for an unstreamed reply, the whole reply's limit.
    timeout_s: float = Field(default=600.0, gt=0)
    # Longest a whole call may take, from sending it (after tmas's own slots and caps) to its last byte (None: no
    # bound, the default and the `paper` preset's, since a 128K-token reply can take an hour). A call past it fails
    # with cause "deadline", not retried.
    deadline_s: float | None = Field(default=None, gt=0)
    # Longest wait for a streamed reply's first chunk while the server answers /health (a request queued behind
    # others, or preempted, is silent until its first token): None waits as long as the server lives, within
    # deadline_s. Past it the request is closed (the server aborts it) and sent again (cause "queue_timeout").
    queue_timeout_s: float | None = Field(default=None, gt=0)
    # Longest a call waiting for a chunk (its first, or the next after a pause past timeout_s) waits on a replica that
    # shows no progress: no chunk to any of this client's calls, its /metrics (or SGLang's /get_load) counters standing
    # still, or its /health failing (tmas.llm.vitals). Past it the call is closed and sent again, to another replica
    # where there is one (cause "no_progress" before the first chunk, "stall" after it), and the replica leaves routing
    # until it shows life. None: a silence is waited out as long as the replica answers /health.
    progress_timeout_s: float | None = Field(default=600.0, gt=0)
    # Whether calls whose reply is JSON send `response_format = {"type": "json_schema", ...}` (constrained decoding
    # on llama-server, vLLM, SGLang, OpenAI): "auto" sends it until the server rejects it once, then sends none for
    # the rest of the run (recorded); "json_schema" always sends it (a rejection fails the call); "off" never does.
    structured_output: StructuredOutput = "auto"
    # Where the server puts a thinking model's reasoning: "separate" (a reasoning parser runs: vLLM's and SGLang's
    # --reasoning-parser, llama-server's --reasoning-format), "inline" (<think> blocks in the content), "none" (the
    # model does not think). "auto" learns it from the server's first reply. structured_output = "auto" sends a schema
    # only where it is "separate" or "none", since a grammar on an inline thinker forbids its thinking. A role's own
    # ([roles.NAME] reasoning) holds for that role's calls, whichever role reached the server first.
    reasoning: ReasoningPlace = "auto"
    # llama-server only: with at least as many problems in flight as the endpoint has slots (max_in_flight times the
    # replicas), send each problem's calls to one slot (`id_slot`), one at a time, so that slot's prompt cache holds
    # that problem's shared prefixes (tmas.llm.lanes). On for the embedded model.
    pin_slots: bool = False
    # Whether calls alike but for their sample index (majority vote's k samples, TMAS's first solutions, a
    # candidate's verifications), sent together, go as one request with `n` = their count (tmas.llm.batching): the
    # server computes the shared prompt once. "auto": where /v1/models names the server vLLM or SGLang (`owned_by`),
    # off elsewhere (llama-server refuses n > 1, or more than its slots; docs/sampling_and_budgets.md says why OpenAI
    # too); "on": always, going on with one request per sample (a recorded downgrade) once a server refuses `n`;
    # "off": never.
    # "on" is refused with pin_slots, which sends each sample on its own (check_pinned_batches).
    batch_samples: BatchSamples = "auto"
    # How a call picks one of several replicas (tmas.llm.routing): "cache" sends it to the replica that served the
    # longest prefix of its prompt (a candidate's verifications and summary go where its solution went), unless that
    # replica's calls in flight reach `routing_load_bound` x the replicas' mean + 1; "load" sends every call to the
    # replica with the fewest calls in flight. Pinned slots keep their pinning; one URL has nothing to choose.
    routing: Routing = "cache"
    # 1.1: the spread the routing was measured against (the busiest replica within 10 % of the mean, in calls and
    # tokens: docs/performance.md). Larger keeps more calls on their cached prefix and lets the spread widen.
    routing_load_bound: float = Field(default=1.1, ge=1.0)
    # One URL that is a serving router in front of the replicas: the request header that carries each call's session
    # key (the same for a TMAS candidate's calls, else for a problem's, and on a resumed run), so the router keeps
    # them on one replica. "X-SMG-Routing-Key" for SGLang's model gateway (--policy consistent_hashing or manual),
    # "X-Session-Id" for the vLLM router (--policy consistent_hash), the name given to --session-key for vLLM
    # production-stack's session router. None: no header.
    session_header: str | None = None

    @field_validator("base_url", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("base_url")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        return _check_urls(value)

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        return _check_header(value)


class RoleConfig(Strict):
    """What one agent role overrides: its own endpoint fields and/or sampling. Unset fields inherit the default."""

    base_url: list[str] | None = None
    model: str | None = None
    api_key_env: str | None = None
    max_in_flight: int | None = Field(default=None, ge=0)
    context_length: int | None = Field(default=None, ge=1)
    tokenizer: str | None = None
    stream: StreamMode | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    deadline_s: float | None = Field(default=None, gt=0)
    queue_timeout_s: float | None = Field(default=None, gt=0)
    progress_timeout_s: float | None = Field(default=None, gt=0)
    structured_output: StructuredOutput | None = None
    reasoning: ReasoningPlace | None = None
    pin_slots: bool | None = None
    batch_samples: BatchSamples | None = None
    routing: Routing | None = None
    routing_load_bound: float | None = Field(default=None, ge=1.0)
    session_header: str | None = None
    sampling: Sampling = Field(default_factory=Sampling)

    @field_validator("base_url", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("base_url")
    @classmethod
    def _http_urls(cls, value: list[str] | None) -> list[str] | None:
        if value == []:
            # Unset (None) is what takes the default endpoint's URLs; no URL at all would fail the role's first call.
            raise ValueError("[] holds no URL: give one or several, or leave the key out for the default endpoint's")
        return None if value is None else _check_urls(value)

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        return _check_header(value)


class Retry(Strict):
    """Retries on connection errors, timeouts, 429 and 5xx: exponential backoff with full jitter."""

    max_attempts: int = Field(default=6, ge=1)
    backoff_base_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)


class LocalModel(Strict):
    """The embedded model, started when no endpoint is configured."""

    # A known model name (see ``tmas.llm.weights``) or a path to any GGUF file.
    model: str = "qwen2.5-coder-1.5b"
    server: Literal["llama-server", "llama-cpp-python"] = "llama-server"
    parallel: int = Field(default=4, ge=1)
    ctx_per_slot: int = Field(default=4096, ge=256)
    threads: int | None = Field(default=None, ge=1)
    startup_timeout_s: float = Field(default=300.0, gt=0)
    # Layers offloaded to the GPU (llama-server -ngl): a count, "auto" or "all". None: "all" when the installed
    # llama-server was built with a GPU backend, else 0.
    gpu_layers: Annotated[int, Field(ge=0)] | Literal["auto", "all"] | None = None
    # Servers of the model started side by side (each with `parallel` slots) and listed as replicas of the default
    # endpoint: on a GPU one server is bound by per-slot CPU work long before the GPU is busy.
    replicas: int = Field(default=1, ge=1)
    # MiB of host memory each llama-server may keep earlier prompts' KV state in (its --cache-ram; 0: none, -1: no
    # limit). None: an eighth of this machine's memory shared among the replicas, at most llama.cpp's own 8192.
    cache_ram_mib: int | None = Field(default=None, ge=-1)
    extra_args: list[str] = Field(default_factory=list)

    @property
    def slots(self) -> int:
        """Calls one server decodes together: ``parallel`` for llama-server; llama-cpp-python's server takes one request
        at a time and queues the rest."""
        return self.parallel if self.server == "llama-server" else 1


class InProcessModel(Strict):
    """A Hugging Face model answering every call in this process through transformers' continuous-batching engine
    (``--hf-model``; tmas.llm.hf_model), used when no endpoint is configured and a model is named here."""

    # A checkpoint folder, a GGUF file or a known embedded model name (a GGUF is dequantised once into the cache).
    model: str | None = None
    # A folder holding the model's saved tokenizer, used by a GGUF's conversion instead of converting the file's own.
    tokenizer: str | None = None
    # "auto": cuda where torch sees a GPU, else cpu.
    device: str = "auto"
    # Weights' dtype; "auto": bfloat16 on a GPU, float32 on a CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # transformers' attention implementation, run paged by the engine ("sdpa", "eager", "flash_attention_2", ...).
    attn_implementation: str = "sdpa"
    # Tokens per KV cache block: prompts share their common prefix in whole blocks.
    block_size: int = Field(default=32, ge=4)
    # KV cache size in tokens; None: what the GPU's free memory holds, or 32768 on a CPU.
    cache_tokens: int | None = Field(default=None, ge=64)
    # Most tokens one forward step processes; None: the engine's choice on a GPU, 256 on a CPU.
    max_batch_tokens: int | None = Field(default=None, ge=16)
    # Torch's CPU threads (None: torch's default).
    threads: int | None = Field(default=None, ge=1)


class MethodConfig(Strict):
    # TMAS is the default; on the embedded model it runs its small `local` preset unless told otherwise.
    name: str = "tmas"
    # Method-specific parameters, validated by the method's own model.
    params: dict[str, Any] = Field(default_factory=dict)


# Why a pooled budget without a token limit is refused (the CLI says it of its flags: ``check_token_flags``).
POOL_NEEDS_TOKENS = "budget.pool moves unused tokens between problems: it needs budget.tokens"


class Budget(Strict):
    """Equal-compute budget per problem, for any method (None = no limit).

    Checked before each chat call: once a problem has spent ``tokens`` or sent ``calls`` chat calls, its next call is
    refused and the method stops there with ``stopped_reason = "budget"``. ``count`` says which tokens are spent:
    ``completion`` (the default: what generation costs; prompt tokens are largely prefix-cache hits on vLLM and
    SGLang) or ``total`` (prompt + completion). Calls already in flight finish and count: a call budget counts them
    too and is never exceeded (a call that failed and that a resume asks again counts once, as its new call: what it
    generated still counts against a token budget); a token budget holds a call back while the calls in flight could
    spend what is left (each counted at its max_tokens), so it is passed by one call's tokens at most
    (``ProblemSession._admit``).

    ``pool`` (with ``tokens``): the run's budget is ``tokens`` per problem over all its problems, and what a finished
    problem left unused goes to problems still open (see ``tmas.methods.base.TokenBank``).
    """

    tokens: int | None = Field(default=None, ge=1)
    calls: int | None = Field(default=None, ge=1)
    count: Literal["completion", "total"] = "completion"
    pool: bool = False

    @model_validator(mode="after")
    def _pool_needs_tokens(self) -> Budget:
        if self.pool and self.tokens is None:
            raise ValueError(POOL_NEEDS_TOKENS)
        return self

    @property
    def limited(self) -> bool:
        return self.tokens is not None or self.calls is not None

    def spent(self, usage: TokenCounts) -> int:
        """The tokens of ``usage`` this budget counts."""
        return usage.completion_tokens + (usage.prompt_tokens if self.count == "total" else 0)

    def identity(self) -> dict[str, Any]:
        """What makes two budgets the same run: the limits set, and how tokens count when a token limit is set."""
        data = self.model_dump(exclude_none=True)
        if self.tokens is None:
            data.pop("count")
        if not self.pool:
            data.pop("pool")  # budgets made before pooling keep their identity
        return data


# The default sampling's built-in values; fields a config leaves out keep them.
DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.7, "max_tokens": 2048}


# Who set a field of [sampling] (see tmas.llm.sampling for the whole priority).
SamplingSource = Literal["config", "env", "flags"]


def legacy_sampling_sources(sampling: Sampling) -> dict[str, SamplingSource]:
    """Sources of a ``[sampling]`` whose settings recorded none (built in Python, or stored before sources were
    kept): a field set and away from its built-in default counts as ``config``; one at its default, as unset."""
    sources: dict[str, SamplingSource] = {}
    for name in Sampling.model_fields:
        value = getattr(sampling, name)
        if name == "extra_body":
            sources.update({f"extra_body.{key}": "config" for key in value})
        elif value is not None and value != DEFAULT_SAMPLING.get(name):
            sources[name] = "config"
    return sources


class Settings(Strict):
    """Everything a run needs to know. The default endpoint has no URL, which means: use the embedded model."""

    endpoint: Endpoint = Field(default_factory=Endpoint)
    sampling: Sampling = Field(default_factory=lambda: Sampling(**DEFAULT_SAMPLING))
    # Per agent role: ``[roles.NAME]``. Which names are known depends on the registered methods, which this layer
    # does not see: a run checks them (tmas.methods.check_roles), and so does every command as it reads its settings.
    roles: dict[str, RoleConfig] = Field(default_factory=dict)
    # Global cap on LLM calls in flight across all endpoints (the official code's --concurrency).
    concurrency: int = Field(default=64, ge=1)
    # Most problems being solved at once. None: what the solution role's endpoint serves at once (the embedded
    # server's slots times its replicas, or `max_in_flight` times the replicas where it is set), else `concurrency`;
    # never more than `concurrency`. Problems beyond it wait, so finished problems are written one after another.
    problems_in_flight: int | None = Field(default=None, ge=1)
    retry: Retry = Field(default_factory=Retry)
    local: LocalModel = Field(default_factory=LocalModel)
    hf: InProcessModel = Field(default_factory=InProcessModel)
    method: MethodConfig = Field(default_factory=MethodConfig)
    budget: Budget = Field(default_factory=Budget)
    seed: int = 0
    # Which source set each field of `sampling` ("extra_body.KEY" per key), so a method's preset fills only what no
    # one set, even where a user's value equals the built-in one. Recorded by load_settings and kept in the stored
    # settings; None (settings built in Python, or stored before it existed): see legacy_sampling_sources.
    sampling_sources: dict[str, SamplingSource] | None = None
    # A folder of prompt templates (NAME.j2) that replace the packaged ones of the same name (tmas.agents.overrides).
    prompts_dir: str | None = None

    @field_validator("sampling", mode="before")
    @classmethod
    def _over_defaults(cls, value: Any) -> Any:
        # A [sampling] table (or TMAS_TEMPERATURE, --temperature, a Sampling built in Python) that sets some fields
        # keeps the built-in defaults of the others: setting the temperature alone must not drop max_tokens and let
        # completions run unbounded.
        if isinstance(value, Sampling):
            value = value.model_dump(exclude_unset=True)
        return {**DEFAULT_SAMPLING, **value} if isinstance(value, dict) else value

    @property
    def uses_local_model(self) -> bool:
        """Whether the embedded llama-server model answers: no endpoint and no in-process model configured."""
        return not self.endpoint.base_url and not self.uses_in_process_model

    @property
    def uses_in_process_model(self) -> bool:
        """Whether a Hugging Face model answers in this process (``hf.model``): no endpoint configured."""
        return not self.endpoint.base_url and self.hf.model is not None


# Environment variables read on top of the TOML file: name -> dotted config key.
ENV_KEYS: dict[str, str] = {
    "TMAS_BASE_URL": "endpoint.base_url",
    "TMAS_MODEL": "endpoint.model",
    "TMAS_API_KEY_ENV": "endpoint.api_key_env",
    "TMAS_CONTEXT_LENGTH": "endpoint.context_length",
    "TMAS_STREAM": "endpoint.stream",
    "TMAS_TIMEOUT_S": "endpoint.timeout_s",
    "TMAS_DEADLINE_S": "endpoint.deadline_s",
    "TMAS_QUEUE_TIMEOUT_S": "endpoint.queue_timeout_s",
    "TMAS_PROGRESS_TIMEOUT_S": "endpoint.progress_timeout_s",
    "TMAS_STRUCTURED_OUTPUT": "endpoint.structured_output",
    "TMAS_REASONING": "endpoint.reasoning",
    "TMAS_PIN_SLOTS": "endpoint.pin_slots",
    "TMAS_BATCH_SAMPLES": "endpoint.batch_samples",
    "TMAS_CONCURRENCY": "concurrency",
    "TMAS_PROBLEMS_IN_FLIGHT": "problems_in_flight",
    "TMAS_LOCAL_MODEL": "local.model",
    "TMAS_LOCAL_SERVER": "local.server",
    "TMAS_HF_MODEL": "hf.model",
    "TMAS_TEMPERATURE": "sampling.temperature",
    "TMAS_TOP_P": "sampling.top_p",
    "TMAS_TOP_K": "sampling.top_k",
    "TMAS_MIN_P": "sampling.min_p",
    "TMAS_REPETITION_PENALTY": "sampling.repetition_penalty",
    "TMAS_PRESENCE_PENALTY": "sampling.presence_penalty",
    "TMAS_MAX_TOKENS": "sampling.max_tokens",
    "TMAS_SEED": "seed",
    "TMAS_BUDGET_TOKENS": "budget.tokens",
    "TMAS_BUDGET_CALLS": "budget.calls",
    "TMAS_BUDGET_COUNT": "budget.count",
    "TMAS_BUDGET_POOL": "budget.pool",
    "TMAS_PROMPTS_DIR": "prompts_dir",
}


# TMAS_ variables tmas reads that set no setting: the config file's path, the cache, the benchmarks' folder, the RL
# export's converter, tmas serve's limits, and switches of tmas's own tests.
OTHER_ENV = frozenset(
    {
        "TMAS_CONFIG",
        "TMAS_CACHE_DIR",
        "TMAS_BENCHMARKS_DIR",
        "TMAS_CONVERT_HF_TO_GGUF",
        "TMAS_SERVE_MAX_PROBLEMS",
        "TMAS_SERVE_MAX_QUEUE",
        "TMAS_SERVE_MAX_REQUEST_CALLS",
        "TMAS_SKIP_LOCAL_MODEL",
        "TMAS_VERL_PYTHON",
        "TMAS_DOCS_SCREENSHOTS",
    }
)
_log = logging.getLogger(__name__)
# Variables already named by warn_unknown_env: once a process, however often settings are read.
_warned: set[str] = set()


def warn_unknown_env(env: Mapping[str, str], named: set[str | None]) -> None:
    """A warning line for each ``TMAS_`` variable in ``env`` that tmas does not read (a typo such as
    ``TMAS_TEMPRATURE`` would otherwise be ignored without a word), naming the closest one it reads. Not an error:
    other tools may share the prefix. ``named``: the variables the settings name (``api_key_env``), which hold keys."""
    known = [*ENV_KEYS, *OTHER_ENV]
    for var in sorted(env):
        if not var.startswith("TMAS_") or var in ENV_KEYS or var in OTHER_ENV or var in named or var in _warned:
            continue
        _warned.add(var)
        close = difflib.get_close_matches(var, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        _log.warning("tmas: environment variable %s is not one tmas reads: ignored%s", var, hint)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {'.'.join(keys[:-1])!r} must be a table")
        node = child
    node[keys[-1]] = value


def validation_message(exc: ValidationError, source: str) -> str:
    """The first error of settings read from ``source`` (a file, the environment, a run's record), in one line."""
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        hint = _close_key(exc.title, [str(part) for part in err["loc"]])
        return f"{source}: unknown config key {loc!r}{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{source}: bad value for {loc!r}: {msg}"


def _close_key(title: str, loc: list[str]) -> str:
    """ " (did you mean 'sampling.temperature'?)" for the unknown settings key ``loc`` (a typo such as
    ``sampling.temprature``, ``[roles.verifier] modle``) where a key of its table is close; else nothing."""
    node: Any = Settings if title == Settings.__name__ else None
    for part in loc[:-1]:
        node = _table_model(node, part)
    if node is None or isinstance(node, tuple):
        return ""
    close = difflib.get_close_matches(loc[-1], list(node.model_fields), n=1)
    return f" (did you mean {'.'.join([*loc[:-1], close[0]])!r}?)" if close else ""


def _table_model(node: Any, key: str) -> Any:
    """The model of the table ``key`` under ``node`` (a model, or ``("table", model)``: a table of tables such as
    ``roles``, whose keys are the user's names); None where it holds no model."""
    if isinstance(node, tuple):
        return node[1]
    field = node.model_fields.get(key) if node is not None else None
    return _model_of(field.annotation) if field is not None else None


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is dict:
        value = _model_of(get_args(annotation)[1])
        return ("table", value) if value is not None else None
    models = [m for m in (_model_of(arg) for arg in get_args(annotation)) if m is not None]
    return models[0] if models else None


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """A TOML file's content; a missing or malformed file is a one-line :class:`ConfigError` naming it."""
    try:
        # A byte-order mark (a Windows editor's) is no TOML statement.
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except OSError as exc:  # a directory given for the file, a file it may not read
        raise ConfigError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def config_file(path: str | Path | None, environ: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """The config file :func:`load_settings` reads (``path``, else ``$TMAS_CONFIG``, else ``./tmas.toml`` where it
    exists; None: none), and what it is called where it is not found."""
    env = os.environ if environ is None else environ
    if path is not None:
        return Path(path), "config file"
    if env.get("TMAS_CONFIG"):
        return Path(env["TMAS_CONFIG"]), "config file named by TMAS_CONFIG"  # a file the command line does not show
    return (Path("tmas.toml") if Path("tmas.toml").is_file() else None), "config file"


def config_source(path: str | Path | None, environ: Mapping[str, str] | None = None) -> str:
    """How errors name the settings :func:`load_settings` reads from ``path``: the config file, else ``config``."""
    found, _ = config_file(path, environ)
    return str(found) if found is not None else "config"


def load_settings(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Build :class:`Settings` from a TOML file, ``TMAS_*`` variables and dotted-key ``overrides`` (CLI flags).

    With no ``path``, ``$TMAS_CONFIG`` and then ``./tmas.toml`` are used when they exist.
    """
    # Called from the Python API too (tmas.load_settings): a wrong kind is said in one line, not a TypeError deep in.
    if path is not None and not isinstance(path, str | os.PathLike):
        raise InputError(f"tmas.load_settings: path must be a path (str or pathlib.Path) (got {type(path).__name__})")
    if overrides is not None and not (isinstance(overrides, Mapping) and all(isinstance(k, str) for k in overrides)):
        raise InputError(
            "tmas.load_settings: overrides must be a mapping of dotted settings keys (str) to values"
            f" (got {type(overrides).__name__} {overrides!r:.60})"
        )
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    path, what = config_file(path, env)
    source = str(path) if path is not None else "config"
    if path is not None:
        data = read_toml(path, what)
    # Validate the file alone first so its errors name the file.
    try:
        given_settings = Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, source)) from None
    check_extra_body(given_settings, source)
    check_embedding_role(given_settings, source)
    check_pinned_batches(given_settings, source, final=False)
    sources = config_sampling_sources(data)
    given = {var: env[var] for var in ENV_KEYS if env.get(var)}
    _choose_model(data, {ENV_KEYS[var]: value for var, value in given.items()})
    for var, value in given.items():
        _set_dotted(data, ENV_KEYS[var], value)
        if ENV_KEYS[var].startswith("sampling."):
            sources[ENV_KEYS[var].removeprefix("sampling.")] = "env"
    if given:
        # Validated before the flags go on, so a bad variable is named as such.
        try:
            Settings.model_validate(data)
        except ValidationError as exc:
            # The variable that set the bad key where one did, else (a check across keys) every one given.
            key = ".".join(str(part) for part in exc.errors()[0]["loc"])
            named = [var for var in given if ENV_KEYS[var] == key] or list(given)
            raise ConfigError(validation_message(exc, f"environment ({', '.join(named)})")) from None
    data["sampling_sources"] = sources
    settings = _overridden(data, overrides or {})
    check_pinned_batches(settings, "settings")  # as the variables and flags leave them
    warn_unknown_env(env, {settings.endpoint.api_key_env, *(role.api_key_env for role in settings.roles.values())})
    return settings


def config_sampling_sources(data: Mapping[str, Any]) -> dict[str, SamplingSource]:
    """The sampling fields a configuration's ``[sampling]`` table gives, each from ``config``."""
    sources: dict[str, SamplingSource] = {}
    table = data.get("sampling")
    if isinstance(table, Mapping):
        for name, value in table.items():
            if name == "extra_body" and isinstance(value, Mapping):
                sources.update({f"extra_body.{key}": "config" for key in value})
            else:
                sources[name] = "config"
    return sources


def with_overrides(settings: Settings, overrides: dict[str, Any]) -> Settings:
    """``settings`` with dotted-key ``overrides`` (CLI flags; None = not given) put on top, e.g. on ``--resume``."""
    data = settings.model_dump(mode="json")
    if data.get("sampling_sources") is None and any(
        key.startswith("sampling.") and value is not None for key, value in overrides.items()
    ):
        # Flags are about to be recorded as such: what came before them is read as it was before sources existed.
        data["sampling_sources"] = legacy_sampling_sources(settings.sampling)
    return _overridden(data, overrides)


def with_method_params(settings: Settings, params: dict[str, Any] | None) -> Settings:
    """``settings`` with method ``params`` (``--param``, ``--iterations``, ablation flags) put over its own."""
    if params:
        settings.method.params = {**settings.method.params, **params}
    return settings


# The keys that each choose what answers the calls, the first set winning where one layer sets several: an endpoint,
# a model run in process, the embedded server's model.
MODEL_CHOICE = ("endpoint.base_url", "hf.model", "local.model")


def _choose_model(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Where ``overrides`` choose the model (:data:`MODEL_CHOICE`), drop the choice of the layers below them: a flag
    (or a ``TMAS_*`` variable) naming a local model runs it over a config file's endpoint, as a flag does over a run
    stored on an endpoint and resumed."""
    chosen = next((key for key in MODEL_CHOICE if overrides.get(key) is not None), None)
    if chosen is None:
        return
    for key in MODEL_CHOICE[: MODEL_CHOICE.index(chosen)]:
        table, name = key.split(".")
        if isinstance(data.get(table), dict):
            data[table].pop(name, None)


def _overridden(data: dict[str, Any], overrides: dict[str, Any]) -> Settings:
    _choose_model(data, overrides)
    for key, value in overrides.items():
        if value is not None:
            _set_dotted(data, key, value)
            if key.startswith("sampling.") and isinstance(data.get("sampling_sources"), dict):
                data["sampling_sources"][key.removeprefix("sampling.")] = "flags"
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise OverrideError(exc, [key for key, value in overrides.items() if value is not None]) from None


class OverrideError(ConfigError):
    """A bad value that dotted-key overrides set: ``keys`` are the overrides it is about (those under the key it
    names, else, for a check across keys, every one given), ``reason`` what is wrong. The CLI names the flags that set
    them (:func:`tmas.cli.options.flag_error`)."""

    def __init__(self, exc: ValidationError, given: list[str]) -> None:
        super().__init__(validation_message(exc, "overrides"))
        err = exc.errors()[0]
        key = ".".join(str(part) for part in err["loc"])
        self.keys = [k for k in given if k == key or k.startswith(f"{key}.") or key.startswith(f"{k}.")] or given
        self.reason = str(err["msg"]).removeprefix("Value error, ")
