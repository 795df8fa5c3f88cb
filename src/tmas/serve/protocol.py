"""The OpenAI chat-completions protocol as the proxy speaks it: the request body, the model name, the replies.

A model name is ``<method>/<upstream model>`` (``tmas/Qwen/Qwen3-4B``: the first slash splits). Method parameters
ride in the body's ``tmas`` object (``extra_body={"tmas": {...}}`` with the official client). The last user message
is the problem; the messages before it are its context.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from tmas.agents.templates import TaggedText, render
from tmas.llm.types import Usage
from tmas.serve.api_errors import ApiError
from tmas.store.records import ProblemResult

# OpenAI's limit on stop sequences.
MAX_STOP = 4
# How deep a request body may nest: no field of a chat request comes near it, and a deeper body would exhaust the
# recursion of the JSON decoder, or of the encoders that fingerprint and store the request, as a 500.
MAX_DEPTH = 64

# vLLM's 400 for stream_options (other than null or empty) in a request without "stream": true.
STREAM_OPTIONS_ALONE = "Stream options can only be defined when `stream=True`."

# Where a reply's reasoning goes, in a stream's deltas and in a whole message: vLLM names the field "reasoning" (since
# it renamed it), its older releases, SGLang, llama-server and DeepSeek's API "reasoning_content". Clients read one
# or the other, so the proxy sends the same text under both.
REASONING_FIELDS = ("reasoning_content", "reasoning")


def with_reasoning(fields: dict[str, Any], text: str) -> dict[str, Any]:
    """``fields`` (a delta or a message) with ``text`` as its reasoning, under every name clients read."""
    return {**fields, **dict.fromkeys(REASONING_FIELDS, text)}


class ChatMessageIn(BaseModel):
    # Clients add fields we have no use for (name, tool_calls, ...): they are ignored, not refused.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, where: str) -> str:
        """The content as text; of a list of parts only text parts are accepted."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", "invalid_value", "messages")
            texts.append(part["text"])
        return "\n".join(texts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # A last chunk with the whole reply's usage and no choices (every chunk before it carries "usage": null).
    include_usage: bool | None = None
    # vLLM's usage so far in every chunk: refused (ChatBody.read), as a run's usage is summed once it has ended.
    continuous_usage_stats: bool | None = None


def _no_tool_call(value: object) -> bool:
    return value in (None, "none", "auto")


# OpenAI's request fields whose meaning a method's reply cannot carry, each with what says "nothing asked" and why it
# is refused otherwise: the reply is a method's selected solution, as plain text. A request asking one of them gets a
# 400 naming the field rather than a reply that silently lacks what it asked for.
REFUSED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        'the reply is a method\'s selected solution, never constrained to JSON: send none or {"type": "text"}',
    ),
    "logprobs": (lambda v: v in (None, False), "a method's reply is chosen among many calls: it has no logprobs"),
    "top_logprobs": (lambda v: v in (None, 0), "a method's reply is chosen among many calls: it has no logprobs"),
    "tools": (lambda v: not v, "a method answers in text and calls no tools"),
    "tool_choice": (_no_tool_call, "a method answers in text and calls no tools"),
    "functions": (lambda v: not v, "a method answers in text and calls no functions"),
    "function_call": (_no_tool_call, "a method answers in text and calls no functions"),
    "logit_bias": (lambda v: not v, "not sent to a method's calls; leave it out"),
    "frequency_penalty": (
        lambda v: v in (None, 0),
        "not sent to a method's calls; presence_penalty or repetition_penalty are",
    ),
    "modalities": (lambda v: v in (None, ["text"]), 'a method answers in text only: send none or ["text"]'),
    "audio": (lambda v: v is None, "a method answers in text only"),
    "web_search_options": (lambda v: v is None, "a method's calls search nothing: they answer from the model alone"),
}
# The inference servers' own ways to constrain a reply, sent at the top level (OpenAI's client: extra_body): vLLM's
# guided_* fields and structured_outputs, SGLang's regex and ebnf, llama-server's grammar and json_schema. A method's
# reply is its selected solution, whose calls are never so constrained, so each is refused as response_format is.
_UNCONSTRAINED = "the reply is a method's selected solution, never constrained to a schema, grammar, regex or choice"
_CONSTRAINTS = [
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
    "grammar",
]
REFUSED_FIELDS |= dict.fromkeys(_CONSTRAINTS, (lambda v: not v, _UNCONSTRAINED))
# An empty schema asks for any JSON value: still JSON.
REFUSED_FIELDS["json_schema"] = (lambda v: v is None, _UNCONSTRAINED)
# vLLM's own generation fields that shape the reply: none is sent to a method's calls (a stop token or a minimum
# length would cut or stretch every agent's reasoning, as stop would), and the reply is one selected solution.
REFUSED_FIELDS |= {
    "stop_token_ids": (lambda v: not v, "a method's calls are never cut at a token: use stop, which ends the reply"),
    "min_tokens": (lambda v: not v, "not sent to a method's calls, whose reply is one of many; leave it out"),
    "ignore_eos": (lambda v: not v, "not sent to a method's calls, which end where the model ends them"),
    "best_of": (lambda v: v in (None, 1), "a method already samples many candidates and selects one"),
    "use_beam_search": (lambda v: not v, "a method already samples many candidates and selects one"),
    "prompt_logprobs": (lambda v: v is None, "a method's reply is chosen among many calls: it has no logprobs"),
    "allowed_token_ids": (lambda v: not v, "a method's calls are never constrained to tokens"),
    "bad_words": (lambda v: not v, "a method's calls are never constrained to tokens"),
    "skip_special_tokens": (lambda v: v in (None, True), "a method's calls are read without special tokens"),
    "thinking_token_budget": (lambda v: v is None, "not sent to a method's calls: reasoning_effort is"),
}
# Sampling fields of the servers' own (llama-server's, SGLang's) that no method's call is sent, each a 400 rather than
# a request served as if it had not asked: what is sent in their place is named.
REFUSED_FIELDS |= {
    "n_predict": (lambda v: v is None, "not sent to a method's calls: max_tokens is"),
    "repeat_penalty": (lambda v: v is None, "not sent to a method's calls: repetition_penalty is"),
    "no_stop_trim": (lambda v: not v, "stop ends the reply: include_stop_str_in_output keeps the sequence"),
    "typical_p": (lambda v: v in (None, 1), "not sent to a method's calls: top_p, top_k and min_p are"),
    "mirostat": (lambda v: not v, "not sent to a method's calls: top_p, top_k and min_p are"),
    "dynatemp_range": (lambda v: not v, "not sent to a method's calls: temperature is"),
    "top_n_sigma": (lambda v: v in (None, -1), "not sent to a method's calls: top_p, top_k and min_p are"),
    "xtc_probability": (lambda v: not v, "not sent to a method's calls: top_p, top_k and min_p are"),
    "dry_multiplier": (lambda v: not v, "not sent to a method's calls: presence_penalty and repetition_penalty are"),
}


def refused_field(data: dict[str, Any]) -> ApiError | None:
    """The 400 for the first field of a request body that asks what a method's reply cannot carry; None if none."""
    for name, (asks_nothing, why) in REFUSED_FIELDS.items():
        if not asks_nothing(data.get(name)):
            return ApiError(400, f"{name} is not supported by tmas serve: {why}", "unsupported_parameter", name)
    return None


# OpenAI's request fields that shape no reply (who asks, where the exchange is kept or billed, how a prompt cache is
# keyed, whether tools, which are refused, would run in parallel), and vLLM's request id: accepted, left unused.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "request_id",
    }
)


def unknown_fields(data: dict[str, Any], known: Iterable[str]) -> ApiError | None:
    """The 400 naming the fields of a request body that the proxy neither reads (``known``) nor refuses by name nor
    ignores (:data:`IGNORED_FIELDS`), as OpenAI refuses an unrecognized argument; None if none. Such a field would
    reach no upstream call (vLLM's ``truncate_prompt_tokens``, ``length_penalty``, ...): served without it, the
    request would not be served as asked. One sent as null asks nothing."""
    read = {*known, *REFUSED_FIELDS, *IGNORED_FIELDS}
    names = sorted(name for name, value in data.items() if value is not None and name not in read)
    if not names:
        return None
    one = len(names) == 1
    said = f"{', '.join(names)} {'is' if one else 'are'} not supported by tmas serve"
    why = f"a field it does not know reaches no method's call, so {'it' if one else 'they'} would change nothing"
    return ApiError(400, f"{said}: {why}; leave {'it' if one else 'them'} out", "unsupported_parameter", names[0])


# The request's fields sent as they are with every upstream call of its run, under either --client-sampling.
PASSED_ON = ("reasoning_effort", "verbosity")
# The request's sampling fields that become every upstream call's defaults under the same name (max_tokens aside).
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty")


class ChatBody(BaseModel):
    """A ``/v1/chat/completions`` body. A field asking what a method's reply cannot carry (``REFUSED_FIELDS``) is
    refused, and so is a field the proxy does not know (:func:`unknown_fields`), but for OpenAI's that shape no reply
    (``IGNORED_FIELDS``), which are left unused."""

    # Unknown fields are refused by :meth:`read`, held as :attr:`refusal` (a stored run's retry still resumes).
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Read at the top level of a chat request by vLLM and SGLang (OpenAI's client sends them there from extra_body);
    # bounds as tmas.config.Sampling's. presence_penalty is OpenAI's own.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = None
    # Where the reply's content ends (OpenAI's up to 4 sequences): applied to the reply, never to the method's own
    # calls, whose reasoning a client's stop sequence (lm-eval's default "\n\n") would cut at its first paragraph.
    stop: str | list[str] | None = None
    # vLLM's field: the stop sequence that ended the reply stays at its end.
    include_stop_str_in_output: bool | None = None
    n: int | None = Field(default=None, ge=1)
    # Keyword arguments of the upstream's chat template (vLLM's, SGLang's and llama-server's field: {"enable_thinking":
    # false} for Qwen3), sent with every upstream call of the run.
    chat_template_kwargs: dict[str, Any] | None = None
    # How much a reasoning model thinks (OpenAI's field, read by vLLM and SGLang too): sent with every upstream call.
    reasoning_effort: str | None = Field(default=None, min_length=1)
    # How long a reply is (OpenAI's field for its GPT-5 models): sent with every upstream call, as reasoning_effort.
    verbosity: str | None = Field(default=None, min_length=1)
    # vLLM's field: false leaves the reasoning (here, the run's progress) out of the reply.
    include_reasoning: bool | None = None
    # Method parameters (extra_body={"tmas": {...}}), validated by the method's own model.
    tmas: dict[str, Any] = Field(default_factory=dict)
    # The 400 for a field the body asks that a method's reply cannot carry (REFUSED_FIELDS), or that the proxy does
    # not know, held by :meth:`read` for the proxy to answer with unless the request's run is stored already (made
    # before the field was refused).
    _refusal: ApiError | None = PrivateAttr(default=None)

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_not_streamed(cls, value: object) -> object:
        return False if value is None else value  # null as OpenAI reads it

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def shows_reasoning(self) -> bool:
        """Whether the reply carries the run's progress as its reasoning (``include_reasoning``, true unless sent
        false)."""
        return self.include_reasoning is not False

    @property
    def refusal(self) -> ApiError | None:
        """The 400 for the first field of the body that asks what a method's reply cannot carry; None if none."""
        return self._refusal

    @classmethod
    def parse(cls, raw: bytes) -> ChatBody:
        """The body; a 400 for a field it asks that a method's reply cannot carry, as for any other bad value."""
        body = cls.read(raw)
        if body.refusal is not None:
            raise body.refusal
        return body

    @classmethod
    def read(cls, raw: bytes) -> ChatBody:
        """The body, its :attr:`refusal` held rather than raised (every other bad value is a 400 here)."""
        too_deep = ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels", "invalid_json")
        try:
            data = json.loads(raw, parse_constant=_not_a_number, parse_float=_finite)
        except RecursionError:
            raise too_deep from None
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        if nesting(data) > MAX_DEPTH:
            raise too_deep
        if data.get("stream_options") and not data.get("stream"):
            # vLLM's check, in its words: options of a stream for a request that asks for no stream.
            raise ApiError(400, STREAM_OPTIONS_ALONE, "invalid_value", "stream_options")
        try:
            body = cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ApiError(400, f"bad value for {loc!r}: {err['msg']}", "invalid_value", loc or None) from None
        stops = body.stop_sequences()
        if len(stops) > MAX_STOP or not all(stops):
            raise ApiError(400, f"stop: at most {MAX_STOP} non-empty sequences", "invalid_value", "stop")
        if body.stream_options is not None and body.stream_options.continuous_usage_stats:
            message = (
                "stream_options.continuous_usage_stats is not supported by tmas serve: a run's usage is summed once it"
                " has ended (include_usage sends it in the stream's last chunk)"
            )
            raise ApiError(400, message, "unsupported_parameter", "stream_options")
        if body.n not in (None, 1):
            raise ApiError(
                400, "only n=1 is supported (a method already samples many candidates)", "invalid_value", "n"
            )
        body._refusal = refused_field(data) or unknown_fields(data, cls.model_fields)
        return body

    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def reply_text(self, text: str) -> str:
        """The reply's content: ``text`` ended at the first stop sequence (kept when the request says so)."""
        return cut_at_stop(text, self.stop_sequences(), keep=bool(self.include_stop_str_in_output))

    def sampling_overrides(self) -> dict[str, Any]:
        """The body's sampling fields, as settings keys: they become every upstream call's defaults."""
        out: dict[str, Any] = {}
        for name in DEFAULT_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None:
            out["max_tokens"] = limit
        return out

    def question(self) -> tuple[str, list[dict[str, str]]]:
        """The problem text (context included) and the context messages before the last user message."""
        last = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=None)
        if last is None:
            raise ApiError(400, "the messages hold no user message (the problem)", "invalid_value", "messages")
        after = self.messages[last + 1 :]
        if after:
            # A method answers the last user message: a tool's result or an assistant's start after it would be
            # dropped unread, so it is refused instead.
            raise ApiError(
                400,
                f"messages[{last + 1}] ({after[0].role}) follows the last user message: a method answers that message,"
                " so nothing may follow it",
                "invalid_value",
                "messages",
            )
        problem = self.messages[last].text(f"messages[{last}]")
        if not problem.strip():
            message = f"messages[{last}]: the problem (last user message) is empty"
            raise ApiError(400, message, "invalid_value", "messages")
        context = [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(self.messages[:last])]
        # Problem text is data handed to the template, never template syntax. It is kept as written (TaggedText):
        # the question is the run's problem, and the method's templates make its tags inert where they insert it.
        laid = [{**m, "content": TaggedText(m["content"])} for m in context]
        return render("serve_question.j2", problem=TaggedText(problem), context=laid), context

    def fingerprint(self) -> str:
        """Same for the same question asked the same way: how a retried request finds its unfinished run."""
        question, _ = self.question()
        data: dict[str, Any] = {
            "model": self.model,
            "question": question,
            "tmas": self.tmas,
            "sampling": self.sampling_overrides(),
            "seed": self.seed,
        }
        if self.chat_template_kwargs is not None:
            data["chat_template_kwargs"] = self.chat_template_kwargs
        for name in PASSED_ON:
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


def _not_a_number(name: str) -> float:
    """Python's decoder reads NaN and Infinity, which JSON has not: refused, as they would reach no server intact."""
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    """A JSON number as a float; one past a float's range (1e400) is refused rather than read as infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a number's range")
    return value


def nesting(value: object) -> int:
    """How deep ``value`` (decoded JSON) nests: 0 for a scalar, 1 for a flat list or object; counted without
    recursion, so any depth is counted."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def finish_reason(result: ProblemResult, reply: str) -> str:
    """The reply's ``finish_reason``: "length" where it is a candidate's whole text and that candidate's call was cut
    at max_tokens (a client then reads the reply as cut short), else "stop" (it ended, or a stop sequence cut it)."""
    if not reply or reply != result.text:
        return "stop"
    cut = any(c.finish_reason == "length" and c.text == reply for r in result.iterations for c in r.candidates)
    return "length" if cut else "stop"


def cut_at_stop(text: str, stops: list[str], *, keep: bool = False) -> str:
    """``text`` up to the first of ``stops`` (the sequence excluded, as an OpenAI server ends a reply; with ``keep``
    included, as vLLM's ``include_stop_str_in_output`` asks)."""
    ends = [(i, i + len(stop) if keep else i) for stop in stops if (i := text.find(stop)) >= 0]
    return text[: min(ends)[1]] if ends else text


def split_model(name: str, methods: set[str], upstreams: list[str]) -> tuple[str, str]:
    """``"tmas/m"`` -> ``("tmas", "m")``; an unknown method or upstream model is a 404, as OpenAI answers."""
    method, sep, upstream = name.partition("/")
    if not sep or not upstream:
        raise ApiError(
            404, f"model {name!r}: expected <method>/<upstream model>, e.g. tmas/{upstreams[0]}", "model_not_found"
        )
    if method not in methods:
        raise ApiError(
            404, f"model {name!r}: unknown method {method!r} (known: {', '.join(sorted(methods))})", "model_not_found"
        )
    if upstream not in upstreams:
        raise ApiError(
            404,
            f"model {name!r}: unknown upstream model {upstream!r} (known: {', '.join(upstreams)})",
            "model_not_found",
        )
    return method, upstream


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        # Summed over the upstream calls, as the upstream servers reported their prompt-cache hits.
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def completion_body(
    run_id: str,
    model: str,
    created: int,
    text: str,
    finish: str,
    usage: Usage,
    extension: dict[str, Any],
    reasoning: str = "",
) -> dict[str, Any]:
    """A whole reply; ``reasoning`` (the run's progress, as a stream sends it) rides under every reasoning field
    name when there is some."""
    message = {"role": "assistant", "content": text}
    if reasoning:
        message = with_reasoning(message, reasoning)
    return {
        "id": run_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage_body(usage),
        # What a plain OpenAI client ignores and a tmas-aware one may read: the run, the extracted answer.
        "tmas": extension,
    }


def chunk_body(
    run_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    *,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    with_usage: bool = False,
    progress: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; with ``delta`` None it is the final usage chunk (no choices). ``with_usage``:
    the stream reports usage (``stream_options.include_usage``), so a chunk without it says "usage": null."""
    body: dict[str, Any] = {
        "id": run_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    if usage is not None or with_usage:
        body["usage"] = None if usage is None else usage_body(usage)
    if progress is not None:
        body["tmas_progress"] = progress
    return body
