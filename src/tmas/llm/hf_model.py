"""A Hugging Face model answering in this process: :class:`tmas.llm.model.ChatModel` over transformers'
continuous-batching engine (:mod:`tmas.llm.hf_engine`), on a GPU or a CPU, with no server to build or start.

``hf.model`` (``--hf-model DIR_OR_GGUF``, or a known embedded model's name) with no endpoint configured makes
:func:`tmas.llm.factory.open_model` open it: the checkpoint is found or converted once (:mod:`tmas.llm.hf_checkpoint`),
loaded, and the engine started for as long as the model is open; closed, it stays loaded for the next open of the
same model in the process (:mod:`tmas.llm.hf_kept`). The store's replay wraps it as it wraps the HTTP
client, so a run on it resumes and replays like a run on any endpoint.

What a call sends, the engine gets: the chat template's tokens of the messages (``extra_body.chat_template_kwargs``
passed to the template), and per sample its temperature (0: greedy), top_p, top_k, min_p, seed (each sample its own
stream: :mod:`tmas.llm.hf_sampling`), max_tokens (lowered to fit the context window, as the client lowers it; the
window is at most what one request can hold in the engine's KV cache) and stop strings. Alike calls that arrive
together (the k samples of a prompt) go as one request with children, as the HTTP client sends them with ``n``
(:mod:`tmas.llm.batching`): the prompt is computed once, the first sample carries the prompt tokens and the others
none. Token counts are the engine's own: the prompt's tokens, every token generated
(its end token included), the thinking split off a reply that thinks inline (its ``<think>`` block, or everything
before ``</think>`` where the chat template opened the block in the prompt) counted with the model's tokenizer as
``reasoning_tokens``, and the prompt tokens reused from the KV cache as ``cached_prompt_tokens``. A call cancelled
part way keeps what it generated, as a cancelled call on an endpoint does (:func:`tmas.llm.model.leave_spent`), and a
sample cancelled alone has its tokens put on a sibling's completion (:mod:`tmas.llm.batching`).

What it does not do, and says so: a repetition or presence penalty, or another ``extra_body`` field, fails the call
with a one-line error naming the field (``logprobs`` and ``top_logprobs`` are accepted and no log-probabilities come
back, as from a server that sends none, so confidence measures and online stopping have nothing to read); a
watched call is not streamed to its watch; there are no embeddings.

A reply model's JSON schema constrains the reply as ``response_format`` does on a server (:mod:`tmas.llm.hf_grammar`),
under the same ``structured_output`` rule: not where log-probabilities are asked for, and under ``auto`` only where
the model does not think inside its content (``endpoint.reasoning``; an embedded model does not; else learnt from the
first finished reply). A schema asked for and not followed (the model thinks inline, or the engine follows none) is
recorded in each run the model serves as a server's refusal is: a ``structured_output`` downgrade of the endpoint
``in-process``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from pydantic import BaseModel

from tmas.config import Sampling, Settings
from tmas.errors import ConfigError, LLMError
from tmas.llm import hf_kept
from tmas.llm.batching import Sample, SampleBatcher, handed_out
from tmas.llm.hf_checkpoint import checkpoint, checkpoint_name
from tmas.llm.hf_engine import EngineError, EngineReply, HFEngine, resolve_options
from tmas.llm.hf_grammar import schema_text
from tmas.llm.hf_sampling import RequestSampling
from tmas.llm.model import CANCELLED, leave_spent
from tmas.llm.reasoning import reply_place, split_reasoning, thinking_off
from tmas.llm.refusals import DowngradeLog, requested_schema, schema_goes
from tmas.llm.sampling import ResolvedSampling, resolve_role
from tmas.llm.types import CallKey, ChainKey, ChatRequest, Completion, Message, Reasoning, Usage
from tmas.llm.watch import TraceWatch
from tmas.llm.weights import KNOWN_MODELS

ENDPOINT = "in-process"
# extra_body keys read here; any other is refused.
TEMPLATE_KWARGS = "chat_template_kwargs"
# Why a model seen thinking inside its replies gets no schema (a grammar from the first token would forbid it).
THINKS_INLINE = (
    "the model thinks inside its reply: a grammar from the first token would forbid its thinking, so its calls went on"
    " as plain text"
)
# Asked by confidence measures; accepted, and no log-probabilities come back.
NO_LOGPROBS = frozenset({"logprobs", "top_logprobs"})


class HFChatModel:
    """The in-process model of ``settings.hf`` over a started :class:`HFEngine`; open it with :func:`open_hf_model`."""

    def __init__(
        self, settings: Settings, engine: HFEngine, name: str, downgrade_log: DowngradeLog | None = None
    ) -> None:
        self._settings = settings
        self.engine = engine
        self.name = name
        # Where a schema asked for and not followed is recorded (tmas.llm.types.DOWNGRADES): each run the model
        # serves, once a run (the flag: already told).
        self._logs: dict[DowngradeLog, bool] = {} if downgrade_log is None else {downgrade_log: False}
        self._cap = asyncio.Semaphore(settings.concurrency)
        self._batcher = SampleBatcher(self._send_samples)
        # Where the model's replies put reasoning: endpoint.reasoning where given (an embedded model: none), else
        # from the first finished reply (None: not yet seen).
        said = settings.endpoint.reasoning
        self._reasoning: Reasoning | None = None
        if said != "auto":
            self._reasoning = said
        elif settings.hf.model in KNOWN_MODELS:
            self._reasoning = "none"

    @property
    def settings(self) -> Settings:
        return self._settings

    def resolve_sampling(
        self,
        role: str,
        *,
        preset: Sampling | None = None,
        method: Sampling | None = None,
        call: Sampling | None = None,
    ) -> ResolvedSampling:
        return resolve_role(self._settings, role, preset=preset, method=method, call=call)

    def context_window(self, role: str) -> int | None:
        return self._window()[0]

    def _window(self) -> tuple[int | None, str]:
        """The tokens a request may hold, prompt and reply (``endpoint.context_length``, else the model's positions,
        at most what one request can hold in the engine's KV cache), and what sets it, for a refusal."""
        window = self._settings.endpoint.context_length or self.engine.context_window
        cap = self.engine.request_capacity
        if cap is not None and (window is None or cap < window):
            return cap, f"one request holds at most {cap} tokens in the in-process engine's KV cache (hf.cache_tokens)"
        return window, f"the model's context window is {window}"

    def model_name(self, role: str) -> str:
        return self.name

    def end_chain(self, chain: ChainKey) -> None:
        """Nothing is kept for a chain: the engine's KV cache shares prefixes across all requests."""

    async def embed(self, texts: Sequence[str], *, role: str = "embedding") -> list[list[float]]:
        raise LLMError(f"the in-process model {self.name} gives no embeddings: configure an embedder")

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
        """One chat completion (see :meth:`tmas.llm.model.ChatModel.chat`); a failed call returns a completion whose
        ``error`` says why."""
        key = key or CallKey(role=role)
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.resolve_sampling(role, call=sampling)
        asked = requested_schema(self._settings.endpoint.structured_output, sampling.sampling, reply_model)
        request = ChatRequest.build(self.name, messages, sampling, asked)
        refused = unsupported(request.sampling)
        if refused is not None:
            return self._failed(request, key, refused, "unsupported")
        async with self._cap:
            completion = await self._batcher.submit(request, key, "")
            if completion is None:
                [completion] = await self._generate(request, [key], schema=self._schema(asked, role))
        return completion

    def _schema(self, asked: dict[str, Any] | None, role: str) -> str | None:
        """The schema text a call's samples follow: the one asked for, unless the model thinks inline (as for a
        server under ``structured_output``: tmas.llm.refusals.schema_goes) or the engine cannot follow it; a schema
        not followed for either reason is recorded as the run's ``structured_output`` downgrade."""
        schema = schema_text(asked)
        if schema is None:
            return None
        if not schema_goes(self._settings.endpoint.structured_output, self._reasoning):
            if self._reasoning == "inline":
                self._downgrade(role, THINKS_INLINE)
            return None
        error = self.engine.schema_error(schema)
        if error is not None:
            self._downgrade(role, f"{error}; its calls went on as plain text")
            return None
        return schema

    @contextmanager
    def downgrades_into(self, log: DowngradeLog) -> Iterator[None]:
        """While inside, a schema not followed is recorded in ``log`` too (a run on a model opened once for several
        runs, each with its own store: :func:`tmas.llm.factory.open_model` joins it)."""
        self._logs[log] = False
        try:
            yield
        finally:
            del self._logs[log]

    def _downgrade(self, role: str, message: str) -> None:
        for log, told in self._logs.items():
            if not told:
                log.record_downgrade("structured_output", ENDPOINT, role, message)
                self._logs[log] = True

    async def _send_samples(self, samples: list[Sample]) -> list[Completion | None]:
        """Alike calls that came together: one request with children (tmas.llm.batching); a sample whose caller
        gives up leaves the engine at once, its siblings going on."""
        first = samples[0].request
        schema = self._schema(first.response_format, samples[0].key.role)
        callers = [s.future for s in samples]
        done = await self._generate(first, [s.key for s in samples], [s.request for s in samples], schema, callers)
        return handed_out(done, samples)

    async def _generate(
        self,
        request: ChatRequest,
        keys: list[CallKey],
        requests: list[ChatRequest] | None = None,
        schema: str | None = None,
        callers: Sequence[asyncio.Future[Any]] = (),
    ) -> list[Completion]:
        """The completions of ``keys``, samples of ``request`` (each with the seed of its own request, where given),
        following ``schema`` where given; a sample whose caller's future of ``callers`` is cancelled is cancelled in
        the engine alone, and its completion, which no one reads, is a failed one of cause ``cancelled`` with what it
        generated (tmas.llm.batching puts that on a sibling's). Cancelled, it leaves what the samples generated on
        its cancel (tmas.llm.model.leave_spent)."""
        started = time.monotonic()
        extra = request.sampling.extra_body
        try:
            template = extra.get(TEMPLATE_KWARGS)
            prompt = self.engine.prompt_ids([m.model_dump() for m in request.messages], template)
        except Exception as exc:  # a template that cannot render these messages fails the call, not the run
            return [self._failed(request, keys[0], f"chat template: {exc}", "template")]
        window, bound = self._window()
        wanted = request.sampling.max_tokens
        max_tokens = wanted if wanted is not None else (window or len(prompt) + 1) - len(prompt)
        if window is not None:
            if len(prompt) >= window:
                message = f"the prompt has {len(prompt)} tokens; {bound}"
                return [self._failed(request, keys[0], message, "context")]
            max_tokens = min(max_tokens, window - len(prompt))
        asked = requests or [request]
        samples = [request_sampling(r.sampling, schema) for r in asked]
        off = thinking_off(extra)
        so_far: list[EngineReply] = []
        try:
            replies = await self.engine.generate(
                prompt, samples, max_tokens, request.sampling.stop or (), callers, so_far
            )
        except EngineError as exc:
            return [self._failed(request, keys[0], str(exc), "engine")]
        except asyncio.CancelledError as cancel:
            # As a cancelled call's stream on an endpoint: its generated tokens count, its prompt does not.
            usage = sum((self._usage(r, 0, self._split(r, off)[1]) for r in so_far), Usage())
            if usage.completion_tokens:
                spent = Completion(
                    key=keys[0], endpoint=ENDPOINT, model=self.name, error=CANCELLED, error_cause="cancelled",
                    usage=usage, latency_s=time.monotonic() - started,
                )  # fmt: skip
                leave_spent(cancel, spent)
            raise
        latency = time.monotonic() - started
        for reply in replies:
            place = reply_place(reply.text, None, reply.finish_reason)
            if place is not None and not (place == "none" and off):
                self._saw_reasoning(place)
        lowered = max_tokens if max_tokens != wanted else None
        done = [
            self._completion(key, reply, len(prompt) if i == 0 else 0, latency, lowered, off)
            for i, (key, reply) in enumerate(zip(keys, replies, strict=True))
        ]
        for completion, sent, drawn in zip(done, asked, samples, strict=True):
            if sent.sampling.seed is None:
                # A call that named no seed was drawn with a fresh one: stored with the call, its reply can be drawn
                # again.
                completion.drawn_seed = drawn.seed
        return done

    def _saw_reasoning(self, place: Reasoning | None) -> None:
        """Where the model's replies put reasoning (tmas.llm.reasoning.reply_place): inline, once seen, for good."""
        if place is not None and self._reasoning != "inline":
            self._reasoning = place

    def _split(self, reply: EngineReply, off: bool) -> tuple[str, str]:
        """The reply's (content, reasoning); ``off``: the request turned the model's thinking off
        (tmas.llm.reasoning.thinking_off). A reply cut before its end by a model thinking inline is all thinking."""
        cut_inline = self._reasoning == "inline" and reply.finish_reason in ("length", "cancelled") and not off
        return split_reasoning(reply.text, cut_inline=cut_inline)

    def _usage(self, reply: EngineReply, prompt_tokens: int, reasoning: str) -> Usage:
        """What ``reply`` cost, ``reasoning`` its thinking (:meth:`_split`)."""
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(reply.tokens),
            # The thinking split off the reply, counted as the HTTP client counts a server's that reports none.
            reasoning_tokens=min(self.engine.count(reasoning), len(reply.tokens)),
            cached_prompt_tokens=reply.cached_prompt_tokens if prompt_tokens else 0,
        )

    def _completion(
        self, key: CallKey, reply: EngineReply, prompt_tokens: int, latency: float, lowered: int | None, off: bool
    ) -> Completion:
        """A sample's completion; a sample whose caller gave up (finish reason "cancelled") fails with what it
        generated."""
        content, reasoning = self._split(reply, off)
        usage = self._usage(reply, prompt_tokens, reasoning)
        if reply.finish_reason == "cancelled":
            return Completion(
                key=key, endpoint=ENDPOINT, model=self.name, error="its caller gave up", error_cause="cancelled",
                usage=usage, latency_s=latency,
            )  # fmt: skip
        return Completion(
            key=key,
            endpoint=ENDPOINT,
            model=self.name,
            content=content,
            reasoning=reasoning,
            usage=usage,
            finish_reason=reply.finish_reason,
            latency_s=latency,
            max_tokens_sent=lowered,
        )

    def _failed(self, request: ChatRequest, key: CallKey, error: str, cause: str) -> Completion:
        return Completion(key=key, endpoint=ENDPOINT, model=request.model, error=error, error_cause=cause)


def unsupported(sampling: Sampling) -> str | None:
    """Why the engine cannot honour ``sampling`` (one line naming the field), or None."""
    if sampling.repetition_penalty not in (None, 1.0):
        return "repetition_penalty is not supported by the in-process model"
    if sampling.presence_penalty not in (None, 0.0):
        return "presence_penalty is not supported by the in-process model"
    for name in sampling.extra_body:
        if name != TEMPLATE_KWARGS and name not in NO_LOGPROBS:
            return f"extra_body.{name} is not supported by the in-process model"
    return None


def request_sampling(sampling: Sampling, schema: str | None = None) -> RequestSampling:
    """A call's sampling as the engine draws it: unset fields filter nothing; no seed draws a fresh one; ``schema``
    (a JSON schema's text) constrains the reply."""
    seed = sampling.seed
    return RequestSampling(
        temperature=sampling.temperature if sampling.temperature is not None else 1.0,
        top_k=sampling.top_k if sampling.top_k is not None and sampling.top_k > 0 else 0,
        top_p=sampling.top_p if sampling.top_p is not None else 1.0,
        min_p=sampling.min_p if sampling.min_p is not None else 0.0,
        seed=seed if seed is not None else _fresh_seed(),
        schema=schema,
    )


def _fresh_seed() -> int:
    import secrets

    return secrets.randbits(63)


@asynccontextmanager
async def open_hf_model(settings: Settings, downgrade_log: DowngradeLog | None = None) -> AsyncIterator[HFChatModel]:
    """The in-process model of ``settings.hf``: converted where needed, loaded and started, stopped on leaving; a
    schema it cannot follow is recorded in ``downgrade_log`` (the run's store)."""
    hf = settings.hf
    if hf.model is None:
        raise ConfigError("no in-process model configured: set hf.model (--hf-model)")
    own = [role for role, override in settings.roles.items() if override.base_url]
    if own:
        raise ConfigError(f"roles {', '.join(own)} name an endpoint; the in-process model answers every role")
    options = resolve_options(
        hf.device,
        hf.dtype,
        attn_implementation=hf.attn_implementation,
        block_size=hf.block_size,
        cache_tokens=hf.cache_tokens,
        max_batch_tokens=hf.max_batch_tokens,
        threads=hf.threads,
    )
    spec = hf.model
    folder = await asyncio.to_thread(checkpoint, spec, dtype=options.dtype, tokenizer=hf.tokenizer)
    # The same model closed before in this process is still loaded (tmas.llm.hf_kept): only started again.
    key = hf_kept.key_of(folder, options)
    engine = hf_kept.take(key)
    if engine is None:
        engine = await asyncio.to_thread(HFEngine.load, folder, options)
    await asyncio.to_thread(engine.start)
    try:
        yield HFChatModel(settings, engine, checkpoint_name(spec), downgrade_log)
    finally:
        await asyncio.to_thread(engine.stop)
        hf_kept.keep(key, engine)
