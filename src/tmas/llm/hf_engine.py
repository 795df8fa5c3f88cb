"""transformers' continuous-batching engine driven from asyncio: a prompt's samples in, their tokens out.

One :class:`HFEngine` holds a model, its tokenizer and a ``ContinuousBatchingManager`` (transformers 5.17: a paged
KV cache; requests join and leave the running batch as they come, in a thread of the engine's own). Each
:meth:`HFEngine.generate` submits one request for a prompt; more samples of the same prompt go as its children,
which the engine forks from it once the prompt is computed, so the prompt is computed once (what ``n`` does on an
OpenAI-compatible server). Each sample draws from its own seeded stream (:mod:`tmas.llm.hf_sampling`).

- A prompt that shares whole KV blocks with one computed before (the same system text and problem, a candidate its
  verifier reads again) reuses them: the engine's prefix sharing. The tokens reused are reported per request.
- Stop strings: a request with stop strings streams its tokens; the first time the text of a sample holds one, that
  sample is cancelled in the engine (its siblings go on) and its reply ends before the stop string, as servers end
  theirs.
- A caller that is cancelled (an asyncio cancel: a run stopped, a budget spent, a sibling failed) cancels its
  requests in the engine, which frees their blocks at its next step. A sample's own caller given with it
  (:meth:`HFEngine.generate`'s ``callers``) that is cancelled alone cancels that sample alone, its siblings going on:
  at the engine's next step, or, for a sample not yet forked from its prompt's request (or that request while its
  children are still to be forked from it), at the step after the fork.
- A sample whose sampling carries a JSON schema draws only what the schema allows (:mod:`tmas.llm.hf_grammar`).

The request ids the engine gives a request's children (``<id>__child#<i>``) and the queue a request goes into are
transformers 5.17's (``continuous_api.py``: ``ContinuousBatchProcessor.update_batch`` and
``ContinuousBatchingManager.add_request``), pinned by the ``hf`` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tmas.errors import LLMError, LocalModelError
from tmas.llm.hf_grammar import Grammars
from tmas.llm.hf_sampling import Filter, RequestSampling, RequestTable, sampling_processors

# transformers names a request's children so (continuous_api.py, ContinuousBatchProcessor.update_batch).
CHILD_SUFFIX = "__child#"
# How long the engine's thread may take to build its cache and batch processor.
START_TIMEOUT_S = 600.0
# Requests the engine keeps a record of (HFEngine.submitted), the latest.
SUBMITTED_KEPT = 1000
# Stop strings are looked for in the decoded text of this many last tokens more than the longest stop string holds
# bytes (a token stands for one byte at least: an emoji or a rare character takes several).
STOP_WINDOW_EXTRA = 8


class EngineError(LLMError):
    """The engine failed a request (its own error message), or stopped."""


@dataclass(frozen=True)
class EngineOptions:
    """How the engine is built (tmas.config.InProcessModel, resolved)."""

    device: str = "cpu"
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    block_size: int = 32
    # None: the engine sizes the cache from free GPU memory.
    cache_tokens: int | None = None
    max_batch_tokens: int | None = None
    threads: int | None = None


@dataclass(frozen=True)
class Submitted:
    """What one request asked of the engine: its prompt's tokens, each sample's sampling (the first the request's,
    the others its children's), the most tokens each may generate and its stop strings."""

    request_id: str
    prompt: tuple[int, ...]
    samples: tuple[RequestSampling, ...]
    max_new_tokens: int
    stop: tuple[str, ...]


@dataclass
class EngineReply:
    """One sample's reply: every token generated (the end token included), its text (without end token or stop
    string), why it ended ("stop": an end token or a stop string; "length": ``max_new_tokens``) and the prompt tokens
    its request took from the KV cache instead of computing them."""

    tokens: list[int]
    text: str
    finish_reason: str
    cached_prompt_tokens: int = 0


def resolve_options(device: str, dtype: str, **rest: Any) -> EngineOptions:
    """``device`` and ``dtype`` "auto" made concrete (cuda and bfloat16 where torch sees a GPU, else cpu and
    float32), and a CPU's cache and batch sizes set (the engine sizes them from GPU memory only)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if not device.startswith("cuda"):
        rest["cache_tokens"] = rest.get("cache_tokens") or 32768
        rest["max_batch_tokens"] = rest.get("max_batch_tokens") or 256
    return EngineOptions(device=device, dtype=dtype, **rest)


class HFEngine:
    """``HFEngine.load(checkpoint, options)``, then :meth:`start`, :meth:`generate` from any event loop, and
    :meth:`stop`; started again after a stop, it takes requests as before."""

    def __init__(self, model: Any, tokenizer: Any, options: EngineOptions) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.table = RequestTable()
        self.stop_ids = stop_token_ids(model, tokenizer)
        # What constrains replies to JSON schemas; None where the engine cannot (set by start()).
        self.grammars: Grammars | None = None
        self.no_grammar = "the in-process engine is not started"
        # The most tokens (prompt and reply) one request can hold in the started engine's KV cache (set by start()).
        self.request_capacity: int | None = None
        self._manager: Any = None
        self._ids = itertools.count()
        # Request id -> prompt tokens its request took from the cache (written by the engine's thread).
        self._reused: dict[str, int] = {}
        self._reused_lock = threading.Lock()
        # Samples whose callers gave up, each cancelled in the engine at its first step that holds it forked
        # (_watch_cancels); written by the event loop's thread, read by the engine's.
        self._dropping: set[str] = set()
        self._dropping_lock = threading.Lock()
        # The latest requests, in the order they were submitted.
        self.submitted: deque[Submitted] = deque(maxlen=SUBMITTED_KEPT)

    @classmethod
    def load(cls, checkpoint: Path, options: EngineOptions) -> HFEngine:
        """The checkpoint's model (in ``options.dtype`` on ``options.device``) and tokenizer; blocking."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if options.threads:
            torch.set_num_threads(options.threads)
        # No weights, an unknown architecture, a damaged file, no tokenizer: transformers' errors span lines. The
        # tokenizer first: it is the quick one to read, and a model without its chat template cannot take a call.
        with loading("tokenizer", checkpoint):
            # Spelled out: transformers ignores the clean-up for byte-level BPE anyway, and says so at every load of a
            # tokenizer converted from a GGUF that sets it.
            tokenizer = AutoTokenizer.from_pretrained(checkpoint, clean_up_tokenization_spaces=False)
        if not getattr(tokenizer, "chat_template", None):
            raise LocalModelError(
                f"the tokenizer in {checkpoint} has no chat template (no chat_template.jinja, none in"
                f" tokenizer_config.json): every call goes through it"
            )
        with loading("model", checkpoint):
            model: Any = AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=getattr(torch, options.dtype), attn_implementation=options.attn_implementation
            )
            model = model.to(options.device).eval()
        return cls(model, tokenizer, options)

    @property
    def context_window(self) -> int | None:
        """The model's positions (``max_position_embeddings``)."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) else None

    @property
    def vocab_size(self) -> int:
        """The number of scores the model gives each token (its output layer's rows)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def schema_error(self, schema: str) -> str | None:
        """Why ``schema`` cannot constrain a reply here (this engine follows none, or llguidance cannot compile it),
        or None; compiling it here keeps the engine's thread from doing so."""
        if self.grammars is None:
            return self.no_grammar
        try:
            self.grammars.compile(schema)
        except ValueError as exc:
            return str(exc)
        return None

    @property
    def running(self) -> bool:
        return self._manager is not None and self._manager.is_running()

    # ------------------------------------------------------------------------------------------- start and stop
    def start(self) -> None:
        """Build the manager with this module's sampling and start its thread; blocking until its cache exists."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList,
        )
        from transformers.generation.logits_process import LogitsProcessorList

        o = self.options
        # An engine started again (tmas.llm.hf_kept) forgets the requests its last run left behind when it stopped.
        self.table = RequestTable()
        with self._reused_lock:
            self._reused.clear()
        with self._dropping_lock:
            self._dropping.clear()
        # Greedy in the engine: the sampling is the processors' (tmas.llm.hf_sampling), per request.
        generation = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False, eos_token_id=self.stop_ids, max_new_tokens=1
        )
        config = ContinuousBatchingConfig(
            block_size=o.block_size,
            num_blocks=-(-o.cache_tokens // o.block_size) if o.cache_tokens else None,
            max_batch_tokens=o.max_batch_tokens,
            allow_block_sharing=True,
            # Headroom for the processors' vocabulary-sized tensors, as the engine leaves for its own.
            max_memory_percent=0.8,
        )
        manager = self.model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        resolved = manager.continuous_batching_config
        ahead = any(resolved.cuda_graph_booleans) or resolved.use_async_batching
        # A step prepared while the one before runs cannot know that step's tokens: no schema can be followed then
        # (tmas.llm.hf_grammar).
        self.grammars = None
        if ahead:
            self.no_grammar = "the in-process engine follows no schema with CUDA graphs or asynchronous batching"
        else:
            try:
                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.stop_ids)
            except (ImportError, ValueError) as exc:
                why = "llguidance is not installed (tmas[hf] has it)" if isinstance(exc, ImportError) else exc
                self.no_grammar = f"the in-process engine follows no schema: {why}"
        processors = sampling_processors(self.table, self.grammars)
        if ahead:
            # Captured graphs replay every operation whatever the values, and an asynchronous step prepares the
            # next step's values before this one runs: no filter may be skipped then.
            for processor in processors:
                if isinstance(processor, Filter):
                    processor.always = True
        listed = ContinuousBatchingLogitsProcessorList(LogitsProcessorList(processors))
        # One int32 argument per request per processor (the engine counts them only for its own converted ones).
        listed.tensors_required = len(processors)
        manager.logit_processor = listed
        manager.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while manager.batch_processor is None:
            error = manager.background_thread_status.fatal_error
            if error is not None or not manager.is_running():
                raise LocalModelError(f"the in-process engine did not start: {error or 'its thread ended'}")
            if time.monotonic() > deadline:
                manager.stop(block=False)
                raise LocalModelError(f"the in-process engine did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        self.request_capacity = request_capacity(manager.batch_processor.cache)
        self._watch_prefix_reuse(manager.batch_processor.cache)
        self._watch_cancels(manager.batch_processor.scheduler)
        self._manager = manager

    def _watch_prefix_reuse(self, cache: Any) -> None:
        """Record what each request's prompt takes from the cache as the engine looks it up (the engine keeps a
        total only)."""
        search = cache.search_prefix_match

        def recorded(request_id: str, prompt_ids: list[int]) -> int:
            found = int(search(request_id, prompt_ids))
            with self._reused_lock:
                self._reused[request_id] = found
            return found

        cache.search_prefix_match = recorded

    def _watch_cancels(self, scheduler: Any) -> None:
        """Cancel the dropped samples the engine holds forked (:meth:`_drop`), and forget a cancelled request's
        sampling once the engine has dropped it (it draws tokens until then); run by the engine's thread at the start
        of each step."""
        clear = scheduler.clear_cancelled_requests

        def cleared() -> list[Any]:
            with self._dropping_lock:
                for request_id in list(self._dropping):
                    state = _held_request(scheduler, request_id)
                    # A request with children still to fork keeps them from being made if cancelled now; a child is
                    # in neither table before its fork.
                    if state is not None and getattr(state, "num_children", None) == 0:
                        scheduler.set_request_cancellation(request_id)
                        self._dropping.discard(request_id)
            with scheduler._cancellation_lock:
                asked = list(scheduler._requests_to_cancel)
            states: list[Any] = clear()
            for request_id in asked:
                self.table.remove(request_id)
            return states

        scheduler.clear_cancelled_requests = cleared

    def stop(self) -> None:
        """Stop the engine's thread, failing what is still in it; blocking."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.stop(block=True, timeout=60, hard_stop=True)

    # ----------------------------------------------------------------------------------------------- requests
    def prompt_ids(
        self, messages: Sequence[dict[str, str]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """The chat template's tokens of ``messages`` with the assistant's turn opened."""
        encoded = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
        )
        ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
        return [int(token) for token in ids]

    async def generate(
        self,
        prompt: Sequence[int],
        samples: Sequence[RequestSampling],
        max_new_tokens: int,
        stop: Sequence[str] = (),
        callers: Sequence[asyncio.Future[Any]] = (),
    ) -> list[EngineReply | None]:
        """One reply per sampling of ``samples``, all continuing ``prompt``, in order. Raises :class:`EngineError`
        where the engine fails them; a cancel cancels them in the engine. ``callers``, where given, holds one future
        per sample, the one its caller awaits: a sample whose future is cancelled is cancelled in the engine alone
        (its siblings go on) and its reply is None."""
        manager = self._manager
        if manager is None or (refusal := manager.background_thread_status.can_accept_new_requests()) is not None:
            raise EngineError(f"the in-process engine takes no requests: {refusal or 'it is not running'}")
        # A request the cache cannot hold would stop the engine's thread for every request ("No requests can be
        # scheduled"); its last token is never written to the cache.
        needed = len(prompt) + max_new_tokens - 1
        if self.request_capacity is not None and needed > self.request_capacity:
            raise EngineError(
                f"a request of {len(prompt)} prompt tokens and {max_new_tokens} new tokens needs {needed} tokens of"
                f" KV cache; one request holds at most {self.request_capacity} (hf.cache_tokens)"
            )
        loop = asyncio.get_running_loop()
        lead = f"tmas-{next(self._ids)}"
        ids = [lead, *(f"{lead}{CHILD_SUFFIX}{i}" for i in range(len(samples) - 1))]
        watches = [_ReplyWatch(self, rid, len(prompt), list(stop), loop.create_future()) for rid in ids]
        for rid, sampling in zip(ids, samples, strict=True):
            self.table.add(rid, sampling)
        for watch in watches:
            manager.register_result_handler(watch.request_id, watch.on_output)
        given = list(zip(callers, watches, strict=True)) if callers else []
        for caller, watch in given:
            caller.add_done_callback(watch.on_caller_done)
        try:
            self._submit(manager, lead, prompt, len(samples) - 1, max_new_tokens, streaming=bool(stop))
            self.submitted.append(Submitted(lead, tuple(prompt), tuple(samples), max_new_tokens, tuple(stop)))
            return list(await asyncio.gather(*(watch.future for watch in watches)))
        finally:
            for caller, watch in given:
                caller.remove_done_callback(watch.on_caller_done)
            for watch in watches:
                self._forget(manager, watch.request_id)
                with self._dropping_lock:
                    # Dropped and not yet cancelled in the engine: cancelled now.
                    waiting = watch.request_id in self._dropping
                    self._dropping.discard(watch.request_id)
                if watch.finished:
                    self.table.remove(watch.request_id)
                elif not watch.cancelled or waiting:
                    # Its sampling is forgotten once the engine has dropped it (_watch_cancels).
                    manager.cancel_request(watch.request_id)

    def cancel(self, request_id: str) -> None:
        """Cancel ``request_id`` in the engine (it stops drawing tokens at the engine's next step)."""
        manager = self._manager
        if manager is not None:
            manager.cancel_request(request_id)

    def _drop(self, request_id: str) -> None:
        """Cancel the sample ``request_id`` alone, at the engine's first step that holds it forked: a child before its
        fork is in no table of the engine yet, and its request with children still to fork would take them along."""
        with self._dropping_lock:
            self._dropping.add(request_id)

    @staticmethod
    def _submit(
        manager: Any, request_id: str, prompt: Sequence[int], children: int, max_new_tokens: int, *, streaming: bool
    ) -> None:
        """The request into the engine's queue, as ``add_request`` puts it, with its own number of children (the
        manager's is one for all requests)."""
        from transformers.generation.continuous_batching.requests import RequestState

        state = RequestState(
            request_id=request_id,
            initial_tokens=list(prompt),
            num_children=children,
            max_new_tokens=max_new_tokens,
            eos_token_id=manager.generation_config.eos_token_id,
            streaming=streaming,
        )
        manager.input_queue.put(state, block=True, timeout=10)
        manager._has_new_requests.set()

    def _forget(self, manager: Any, request_id: str) -> None:
        router = manager.output_router
        with router._lock:
            router.result_handlers.pop(request_id, None)
        with self._reused_lock:
            self._reused.pop(request_id, None)
        # A cancelled request may deliver an output or two before the engine drops it; with no handler left, the
        # engine puts them in its shared queue, which nothing else here reads.
        drain_queue(router.output_queue)

    def reused(self, request_id: str, prompt_tokens: int) -> int:
        """The prompt tokens ``request_id`` took from the cache: a child's whole prompt but its last token (it was
        forked from its parent's blocks); the engine computes at least one prompt token of every request."""
        if CHILD_SUFFIX in request_id:
            return max(0, prompt_tokens - 1)
        with self._reused_lock:
            found = self._reused.get(request_id, 0)
        return min(found, max(0, prompt_tokens - 1))

    def text(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def count(self, text: str) -> int:
        """The tokens of ``text`` under the model's tokenizer (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0


@contextlib.contextmanager
def loading(what: str, checkpoint: Path) -> Iterator[None]:
    """Reading the checkpoint's ``what`` (its model, its tokenizer): a failure is one line naming both (a missing
    package is left to say so itself)."""
    try:
        yield
    except ImportError:
        raise
    except Exception as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise LocalModelError(f"cannot load the {what} in {checkpoint}: {message}") from None


def request_capacity(cache: Any) -> int | None:
    """The most tokens one request can hold in the engine's paged ``cache``: the whole blocks it can take, with a
    block of tokens taking one block in each full-attention layer group (and in each sliding-window group up to its
    window), as the cache allocates them (``PagedAttentionCache.blocks_needed``). None where the cache does not say
    (a transformers release without that rule): the model's own window bounds requests then."""
    if not callable(getattr(cache, "blocks_needed", None)):
        return None
    low, high = 0, int(cache.num_blocks)
    while low < high:
        mid = (low + high + 1) // 2
        if cache.blocks_needed(mid, 0) <= cache.num_blocks:
            low = mid
        else:
            high = mid - 1
    return low * int(cache.block_size)


def drain_queue(q: queue.Queue[Any]) -> None:
    with contextlib.suppress(queue.Empty):
        while True:
            q.get_nowait()


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token that ends a turn: the tokenizer's end token and those the model's configs name."""
    ids: list[int] = []
    configs = (tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None))
    for value in (getattr(c, "eos_token_id", None) for c in configs):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token >= 0 and token not in ids:
                ids.append(token)
    return ids


def _held_request(scheduler: Any, request_id: str) -> Any:
    """The scheduler's state of ``request_id`` where it holds it (running or waiting); None where it does not, or
    where its version keeps no such tables: a dropped sample then runs on until its group ends, and is cancelled
    with it."""
    for name in ("active_requests", "waiting_requests"):
        table = getattr(scheduler, name, None)
        state = table.get(request_id) if isinstance(table, dict) else None
        if state is not None:
            return state
    return None


@dataclass
class _ReplyWatch:
    """Turns one request's outputs (delivered on the event loop) into its :class:`EngineReply`."""

    engine: HFEngine
    request_id: str
    prompt_tokens: int
    stop: list[str]
    future: asyncio.Future[EngineReply | None]
    # The engine finished the request; or it was cancelled there as its reply reached a stop string or its caller
    # gave up.
    finished: bool = False
    cancelled: bool = False
    _window: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._window = max((len(s.encode()) for s in self.stop), default=0) + STOP_WINDOW_EXTRA

    def on_caller_done(self, caller: asyncio.Future[Any]) -> None:
        """Its caller gave up: the sample leaves the engine and its reply is None."""
        if caller.cancelled() and not self.future.done():
            self.cancelled = True
            self.future.set_result(None)
            self.engine._drop(self.request_id)

    def on_output(self, output: Any) -> None:
        if self.future.done():
            return
        if output.error is not None:
            self.finished = True
            self.future.set_exception(EngineError(f"the in-process engine failed a request: {output.error}"))
            return
        tokens = list(output.generated_tokens)
        if self.stop and self._stopped(tokens[-self._window :]):
            self._finish(tokens)
            self.finished = output.is_finished()
            if not self.finished:
                # At once, not when its siblings end: a sample cut at a stop string frees its place in the batch.
                self.cancelled = True
                self.engine.cancel(self.request_id)
        elif output.is_finished():
            self.finished = True
            self._finish(tokens)

    def _stopped(self, tail: list[int]) -> bool:
        text = self.engine.text(tail)
        return any(s in text for s in self.stop)

    def _finish(self, tokens: list[int]) -> None:
        ended = bool(tokens) and tokens[-1] in self.engine.stop_ids
        text = self.engine.text(tokens[:-1] if ended else tokens)
        reason = "stop" if ended else "length"
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        reused = self.engine.reused(self.request_id, self.prompt_tokens)
        self.future.set_result(EngineReply(tokens=tokens, text=text, finish_reason=reason, cached_prompt_tokens=reused))
