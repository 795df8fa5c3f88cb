"""JSON schemas enforced inside the in-process engine, as a server enforces ``response_format``: at each step a
constrained request may draw only the tokens its schema allows there.

The grammars are llguidance's (the engine vLLM, SGLang and llama.cpp can use for structured outputs): a schema is
compiled once into a matcher, each constrained request gets a copy of it, and :class:`SchemaMask`, the first of the
engine's logits processors (:func:`tmas.llm.hf_sampling.sampling_processors`), does per step, for the requests that
draw a token in it:

1. each constrained request's matcher consumes the tokens the request drew since the last step (read from the
   engine's request state, where every drawn token is by then);
2. the matcher writes the request's allowed tokens into one row of a bitmask (32 tokens a 32-bit word); once the
   schema's value is complete only the model's end token is allowed, so the reply ends there. The rows are filled
   on a worker thread, in parallel on llguidance's own threads, while the engine runs the step's forward pass (the
   engine prepares the processors' arguments before it): on a GPU the fill hides behind the forward pass;
3. every token not allowed gets a score of minus infinity, before temperature, the filters and the draw (waiting
   for the fill where it is not done yet).

JSON is written without free whitespace (``", "`` between items, ``": "`` after keys): a small model left free
whitespace can fill its reply with blank lines, as llama-server bounds its own grammar's whitespace for that reason.

A matcher that fails (a token it cannot take, which the mask should have made impossible) leaves its request
unconstrained from there on and is counted (:attr:`SchemaMask.failed`); the reply's parser then reads it as it reads
any unconstrained reply.

Step 1 needs every token of the last step in the request's state, which holds when the engine prepares a step after
the previous one ended; an engine that prepares the next step while one runs (transformers' asynchronous batching,
which comes with its CUDA graphs) does not, and there :class:`tmas.llm.hf_engine.HFEngine` constrains nothing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

# How llguidance writes JSON here (see the module docstring).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # A keyword it does not implement is left out of the grammar rather than failing it.
    "lenient": True,
}
# Text whose tokens llguidance must read back as the tokenizer does (spaces, a newline, quotes, a non-ASCII letter).
TOKENIZER_CHECK = ' {"analysis": "x \u00e9",\n  "score": 7}'
# Schemas whose compiled matcher is kept.
SCHEMAS_KEPT = 256


def schema_text(response_format: dict[str, Any] | None) -> str | None:
    """The JSON schema of an OpenAI-shaped ``response_format`` (``json_schema`` type) as text, its properties in their
    order (the order the reply writes them in): what a request carries to the engine, and its compiled matcher's key.
    None where it holds none."""
    if not response_format or response_format.get("type") != "json_schema":
        return None
    schema = response_format.get("json_schema", {}).get("schema")
    return json.dumps(schema) if isinstance(schema, dict) else None


def generated(state: Any) -> list[int]:
    """The tokens a request has drawn so far; a request the engine moved out of its cache and back holds the ones
    from before that among its prompt (as transformers 5.17's ``RequestState.to_generation_output`` reads them)."""
    true_initial = int(getattr(state, "_true_initial_tokens", 0) or 0)
    if true_initial:
        return [*state.initial_tokens[true_initial:], *state.generated_tokens]
    return list(state.generated_tokens)


def allowed_of(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The boolean (rows, ``vocab``) of a (rows, words) int32 bitmask: token t is allowed where bit t % 32 of word
    t // 32 is set; tokens past the mask's words are not."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    if allowed.size(1) >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.size(1)), value=False)


def tokenizer_json(tokenizer: Any) -> str:
    """The fast tokenizer's JSON as llguidance reads it. A byte-level vocabulary (its pre-tokenizer ``ByteLevel``:
    a space is stored as "Ġ") gets the byte-level decoder alone: the tokenizer transformers converts from a GGUF
    decodes through ``ByteFallback`` first, which llguidance takes for a SentencePiece vocabulary, reading "Ġ" as
    text."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    if "ByteLevel" in json.dumps(data.get("pre_tokenizer")):
        data["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    return json.dumps(data)


class Grammars:
    """llguidance's view of the model's tokenizer, and a compiled matcher per schema (copied for each request)."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: Sequence[int]) -> None:
        import llguidance

        self._llguidance = llguidance
        self.words = -(-vocab_size // 32)
        # Once a schema's value is complete, the reply ends with the model's own end token.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=end_ids[0])
        sample = tokenizer.encode(TOKENIZER_CHECK, add_special_tokens=False)
        if self.tokenizer.decode_str(sample) != tokenizer.decode(sample):
            raise ValueError("llguidance reads the model's tokens as other text than its tokenizer does")
        self.executor = llguidance.LLExecutor()
        self._compiled: dict[str, Any] = {}
        self._lock = threading.Lock()

    def compile(self, schema: str) -> Any:
        """``schema``'s compiled matcher (its text as :func:`schema_text` writes it), kept for the next request;
        raises ValueError where llguidance cannot compile it."""
        with self._lock:
            template = self._compiled.get(schema)
            if template is None:
                grammar = self._llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=cast(Any, JSON_OPTIONS))
                template = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
                if template.is_error():
                    raise ValueError(f"llguidance cannot compile the reply schema: {template.get_error()}")
                if len(self._compiled) >= SCHEMAS_KEPT:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[schema] = template
            return template

    def matcher(self, schema: str) -> Any:
        """A fresh matcher of ``schema`` for one request (a copy of the compiled one)."""
        return self.compile(schema).deep_copy()


class SchemaMask(ContinuousBatchingLogitsProcessor):
    """The first logits processor: each constrained request's scores masked to what its schema allows (see the module
    docstring). ``schema_of(request_id)`` gives the schema text of a request in the engine, or None."""

    def __init__(self, grammars: Grammars, schema_of: Callable[[str], str | None]) -> None:
        self.grammars = grammars
        self.schema_of = schema_of
        self.supported_kwargs = {}
        self.ignored_kwargs = ()
        # Request id -> (its matcher, how many of its tokens it has consumed); used by the engine's thread only.
        self._matchers: dict[str, tuple[Any, int]] = {}
        # This step's constrained rows (their indices among the step's score rows) and their bitmasks, being filled
        # by the worker.
        self._mask: Future[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tmas-schema-mask")
        # How many requests' matchers failed; those requests went on unconstrained.
        self.failed = 0

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        # A step that never reached its scores (it failed) may have left its fill running: it ends before the
        # matchers move on.
        self._settle()
        rows: list[tuple[Any, int]] = []
        for index, request in enumerate(requests_with_new_token):
            matcher = self._advanced(request.state)
            if matcher is not None:
                rows.append((matcher, index))
        # A request that has left the engine (finished or cancelled) has no schema any more: its matcher goes. Those
        # drawing a token in this step are still there.
        drawing = {request.state.request_id for request in requests_with_new_token}
        for request_id in [r for r in self._matchers if r not in drawing and self.schema_of(r) is None]:
            del self._matchers[request_id]
        # Nothing travels in the engine's per-request argument: the mask is this processor's own.
        unused = torch.zeros(len(requests_with_new_token), dtype=torch.int32)
        if rows:
            # Filled beside the step's forward pass (llguidance releases the GIL), awaited where the scores come.
            self._mask = self._worker.submit(self._fill, rows)
        return unused

    def _fill(self, rows: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The constrained rows' indices among the step's score rows, and one bitmask row for each, in that order."""
        import llguidance.torch as lltorch

        mask = torch.empty((len(rows), self.grammars.words), dtype=torch.int32)
        lltorch.fill_next_token_bitmask_par(
            self.grammars.executor, [(matcher, i) for i, (matcher, _) in enumerate(rows)], mask
        )
        return torch.tensor([index for _, index in rows]), mask

    def _settle(self) -> None:
        pending, self._mask = self._mask, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result()

    def _advanced(self, state: Any) -> Any:
        """The request's matcher, fed the tokens drawn since the last step; None for an unconstrained request."""
        request_id = state.request_id
        held = self._matchers.get(request_id)
        if held is None:
            schema = self.schema_of(request_id)
            if schema is None:
                return None
            try:
                held = (self.grammars.matcher(schema), 0)
            except ValueError:  # compiled before the request was sent (HFEngine.schema_error): not expected
                self.failed += 1
                held = (None, 0)
        matcher, consumed = held
        if matcher is None:
            self._matchers[request_id] = held
            return None
        tokens = generated(state)
        if len(tokens) > consumed and not matcher.consume_tokens(tokens[consumed:]):
            self.failed += 1
            self._matchers[request_id] = (None, len(tokens))
            return None
        self._matchers[request_id] = (matcher, len(tokens))
        return matcher

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        pending, self._mask = self._mask, None
        if pending is None:
            return scores
        # Only the constrained requests' rows are touched: a step's scores may also hold rows past its requests that
        # draw a token (a prompt still being read), which the engine discards.
        rows, mask = (t.to(scores.device) for t in pending.result())
        allowed = allowed_of(mask, scores.size(-1))
        kept = scores.index_select(0, rows).masked_fill(~allowed, -torch.inf)
        masked: Any = scores.index_copy(0, rows, kept)
        return masked  # type: ignore[no-any-return]
