"""Server personas: how vLLM, SGLang, llama-server and OpenAI shape their chat replies, one description each.

The simulator (``SimScript.persona``) reads these descriptions instead of branching on the server's name: where the
reasoning goes, which usage fields appear and when, what happens to a field the server does not know, how many
choices it gives, how it streams, what its ``/v1/models`` says and how its prefix cache is laid out. "sim" is the
simulator's own shape, kept as it always was.

Each fact comes from the server's own source or reference, named in a comment beside it (vLLM:
``vllm/entrypoints/openai/chat_completion/{serving,protocol}.py`` and ``engine/protocol.py``; SGLang:
``python/sglang/srt/entrypoints/openai/{serving_chat,protocol,usage_processor,sse_utils}.py``; llama.cpp:
``tools/server/{server-task,server-common,server-context}.cpp``; OpenAI: the API reference of Create chat completion
and its streaming events, and the prompt caching and reasoning guides). Where a detail is not read from a source
the comment says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tmas.testing.script import PersonaName, SimScript


@dataclass(frozen=True)
class TokenCounts:
    """What a reply's usage reports, before a persona shapes it."""

    prompt: int
    completion: int
    reasoning: int
    # Prompt tokens served from the prefix cache; None when the replica has no cache to report from.
    cached: int | None
    # Whether the reply carried reasoning apart from its content (the server runs a reasoning parser).
    separate_reasoning: bool
    # The choices counted.
    choices: int = 1


UsageShape = Callable[[TokenCounts, SimScript, bool], dict[str, Any]]  # (counts, script, streamed) -> usage
ErrorShape = Callable[[int, str, str | None, str | None], dict[str, Any]]  # (status, message, param, code) -> body


def _totals(c: TokenCounts) -> dict[str, Any]:
    return {"prompt_tokens": c.prompt, "completion_tokens": c.completion, "total_tokens": c.prompt + c.completion}


def _sim_usage(c: TokenCounts, script: SimScript, streamed: bool) -> dict[str, Any]:
    usage = _totals(c)
    if (c.separate_reasoning or c.reasoning) and script.reports_reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": c.reasoning}
    if c.cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": c.cached}
    return usage


def _vllm_usage(c: TokenCounts, script: SimScript, streamed: bool) -> dict[str, Any]:
    # serving.py: prompt_tokens_details only with --enable-prompt-tokens-details (_make_prompt_tokens_details),
    # completion_tokens_details only when a reasoning parser runs (_include_reasoning_tokens_details; releases before
    # 2026-08, PR 45802, have none: reports_reasoning_tokens False). The plain reply is model_dump()ed (the nulls
    # stay); the final stream chunk drops them (exclude_none).
    reasoning = c.separate_reasoning and script.reports_reasoning_tokens
    usage: dict[str, Any] = {
        **_totals(c),
        "prompt_tokens_details": {"cached_tokens": c.cached} if script.cache_report and c.cached is not None else None,
        "completion_tokens_details": {"reasoning_tokens": c.reasoning} if reasoning else None,
    }
    return {k: v for k, v in usage.items() if v is not None} if streamed else usage


def _sglang_usage(c: TokenCounts, script: SimScript, streamed: bool) -> dict[str, Any]:
    # usage_processor.py: prompt_tokens_details only with --enable-cache-report and only when something was cached
    # (_details_if_cached), else null, counted over the first choice of each prompt (older releases summed it over
    # every choice, whose prompts the first one's prefill left cached); reasoning_tokens sits in usage itself
    # (protocol.py UsageInfo), not in completion_tokens_details, 0 where the scheduler counted none.
    cached = c.cached or 0
    if script.cached_summed_over_choices and c.choices > 1:
        cached += (c.choices - 1) * c.prompt
    return {
        **_totals(c),
        "prompt_tokens_details": {"cached_tokens": cached} if script.cache_report and cached > 0 else None,
        "reasoning_tokens": c.reasoning if script.reports_reasoning_tokens else 0,
    }


def _llama_usage(c: TokenCounts, script: SimScript, streamed: bool) -> dict[str, Any]:
    # server-task.cpp usage_json_oaicompat: cached_tokens always (the slot's reused prefix); no reasoning count.
    return {**_totals(c), "prompt_tokens_details": {"cached_tokens": c.cached or 0}}


def _openai_usage(c: TokenCounts, script: SimScript, streamed: bool) -> dict[str, Any]:
    # API reference, the chat completion object's usage: both details objects are always there.
    return {
        **_totals(c),
        "prompt_tokens_details": {"cached_tokens": c.cached or 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": c.reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _nested_error(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    # The simulator's and vLLM's (engine/protocol.py ErrorResponse): the HTTP status's name as the type.
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def _sglang_error(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    # protocol.py ErrorResponse: the fields at the top level, not under "error".
    return {"object": "error", "message": message, "type": "BadRequestError", "param": param, "code": status}


def _llama_error(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    # server-common.cpp format_error_response (ERROR_TYPE_INVALID_REQUEST).
    return {"error": {"code": status, "message": message, "type": "invalid_request_error"}}


def _openai_error(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def _sim_card(script: SimScript) -> dict[str, Any]:
    return {
        "id": script.model,
        "object": "model",
        "created": 0,
        "owned_by": "tmas-sim",
        "max_model_len": script.context_length,
    }


def _vllm_card(script: SimScript) -> dict[str, Any]:
    # engine/protocol.py ModelCard and ModelPermission.
    permission = {
        "id": "modelperm-sim",
        "object": "model_permission",
        "created": 0,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": script.model,
        "object": "model",
        "created": 0,
        "owned_by": "vllm",
        "root": script.model,
        "parent": None,
        "max_model_len": script.context_length,
        "permission": [permission],
    }


def _sglang_card(script: SimScript) -> dict[str, Any]:
    # protocol.py ModelCard.
    return {
        "id": script.model,
        "object": "model",
        "created": 0,
        "owned_by": "sglang",
        "root": script.model,
        "parent": None,
        "max_model_len": script.context_length,
    }


def _llama_card(script: SimScript) -> dict[str, Any]:
    # server-context.cpp model info: the context window is meta.n_ctx (per slot), not max_model_len. The model's
    # own figures are placeholders.
    meta = {
        "vocab_type": 2,
        "n_vocab": 151936,
        "n_ctx": script.context_length,
        "n_ctx_train": 262144,
        "n_embd": 2560,
        "n_params": 4022468096,
        "size": 2497280256,
    }
    return {
        "id": script.model,
        "aliases": list(script.aliases),
        "tags": [],
        "object": "model",
        "created": 0,
        "owned_by": "llamacpp",
        "meta": meta,
    }


def _openai_card(script: SimScript) -> dict[str, Any]:
    # API reference, the model object: id, object, created, owned_by (and nothing about the context window).
    return {"id": script.model, "object": "model", "created": 0, "owned_by": "system"}


def _llama_models_list(script: SimScript) -> dict[str, Any]:
    # server-context.cpp: the same body also carries an Ollama-style "models" list.
    return {
        "models": [
            {
                "name": script.model,
                "model": script.model,
                "modified_at": "",
                "size": "",
                "digest": "",
                "type": "model",
                "description": "",
                "tags": [""],
                "capabilities": ["completion"],
                "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""]},
            }
        ]
    }


# The request fields of OpenAI's Create chat completion (API reference).
OPENAI_CHAT_FIELDS = frozenset(
    {
        *("messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias"),
        *("logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls"),
        *("prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort"),
        *("response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream"),
        *("stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity"),
        "web_search_options",
    }
)
# chat_completion/protocol.py ChatCompletionRequest: the sampling and extra parameters beyond OpenAI's.
VLLM_EXTRA_FIELDS = frozenset(
    {
        *("use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids"),
        *("include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "bad_words"),
        *("spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids"),
        *("echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents"),
        *("chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "priority"),
        *("request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt"),
        *("kv_transfer_params", "vllm_xargs", "include_reasoning"),
    }
)
# protocol.py ChatCompletionRequest: SGLang's own fields.
SGLANG_EXTRA_FIELDS = frozenset(
    {
        *("top_k", "min_p", "min_tokens", "regex", "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex"),
        *("no_stop_trim", "ignore_eos", "continue_final_message", "skip_special_tokens", "lora_path"),
        *("session_id", "session_params", "separate_reasoning", "stream_reasoning", "chat_template_kwargs"),
        *("custom_logit_processor", "custom_params", "input_ids", "rid", "extra_key", "cache_salt", "priority"),
        *("return_hidden_states", "return_routed_experts", "return_cached_tokens_details", "return_token_ids"),
        *("return_prompt_token_ids", "return_meta_info", "reasoning", "routed_dp_rank", "data_parallel_rank"),
    }
)
# server-task.cpp params_from_json_cmpl and server-common.cpp's chat parsing: what llama-server reads. Its
# repetition penalty is "repeat_penalty" (with frequency_penalty and presence_penalty); "repetition_penalty", vLLM's
# and SGLang's name, is not read, so it is ignored (and counted).
LLAMA_EXTRA_FIELDS = frozenset(
    {
        *("id_slot", "cache_prompt", "n_predict", "n_keep", "n_discard", "n_probs", "n_cmpl", "n_indent"),
        *("top_k", "min_p", "typical_p", "top_n_sigma", "repeat_penalty", "repeat_last_n", "dynatemp_range"),
        *("dynatemp_exponent", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base"),
        *("dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau"),
        *("mirostat_eta", "min_keep", "ignore_eos", "samplers", "grammar", "grammar_lazy", "json_schema"),
        *("chat_template_kwargs", "reasoning_format", "thinking_forced_open", "parse_tool_calls"),
        *("add_generation_prompt", "timings_per_token", "return_tokens", "return_progress", "post_sampling_probs"),
        *("response_fields", "lora", "t_max_predict_ms", "n_cache_reuse", "reasoning_budget_tokens"),
    }
)


@dataclass(frozen=True)
class Persona:
    """One server's reply shapes, read by the simulator's handlers."""

    name: PersonaName
    # /v1/models: one model card, and other top-level fields of the list.
    model_card: Callable[[SimScript], dict[str, Any]]
    models_extra: Callable[[SimScript], dict[str, Any]] | None
    # ---- requests
    # Fields the server reads; any other is ignored (counted in SimStats.ignored_fields) or, with
    # rejects_unknown, refused. None: the simulator's own, which reads what it knows and counts nothing.
    known_fields: frozenset[str] | None
    rejects_unknown: bool
    # A request naming another model than the served one is refused (404) with this message ("{model}": the name
    # asked for); None: any name is answered.
    unknown_model: str | None
    # The most choices one request may ask for (None: no limit of its own), and the refusal's wording.
    max_n: Callable[[SimScript], int | None]
    n_refusal: str
    # response_format types accepted; None: whatever is sent.
    response_formats: frozenset[str] | None
    # A reasoning model's restrictions, applied when the script's model reasons (SimScript.reasoning): parameters
    # refused outright (with the refusal's last words), and parameters that take only their default (1).
    unsupported: dict[str, str]
    default_only: frozenset[str]
    error: ErrorShape
    # The reply's "model": the request's own (True) or the served name.
    echoes_model: bool
    # ---- replies
    # The message (and delta) field holding reasoning; None: hidden, only counted.
    reasoning_key: str | None
    message_extra: dict[str, Any]
    # A reply without content (one cut inside its thinking) says "content": null rather than "": "always", or only
    # where the reasoning went in a field of its own ("parsed": a reasoning parser ran); "never": always a string.
    null_content: Literal["always", "parsed", "never"]
    choice_extra: dict[str, Any]
    response_extra: dict[str, Any]
    logprobs_extra: dict[str, Any]
    # Per token: the UTF-8 bytes, and the token id (llama-server).
    logprob_bytes: bool
    logprob_ids: bool
    # The log-probabilities cover every generated token, the reasoning's before the content's, although the reasoning
    # goes in a field of its own; False: the content's alone.
    reasoning_logprobs: bool
    # top_logprobs when logprobs is asked for without it.
    default_top_logprobs: int
    usage: UsageShape
    # n > 1: the usage is that of the first choice alone (llama-server merges the choices of its child tasks and
    # keeps the first one's usage); in a stream each choice ends with its own usage chunk.
    usage_per_choice: bool
    # llama-server's "timings" (cache_n, prompt_n, ...): on the reply, and on the last chunk of a stream.
    timings: bool
    # ---- streaming
    first_delta: dict[str, Any]
    chunk_extra: dict[str, Any]
    stream_choice_extra: dict[str, Any]
    finish_choice_extra: dict[str, Any]
    # The finish_reason rides on the choice's last content delta rather than on a chunk of its own.
    finish_with_last_delta: bool
    # With include_usage every chunk carries "usage": null until the last (OpenAI).
    usage_null_in_chunks: bool
    # stream_options.continuous_usage_stats: every delta carries the usage so far.
    continuous_usage: bool
    # ---- prefix cache
    cache_block_tokens: int
    # Hits shorter than this are reported as none (OpenAI caches prompts of at least 1024 tokens).
    cache_min_tokens: int
    default_cache_tokens: int
    # One cached prompt per slot (llama-server) instead of LRU blocks.
    slot_cache: bool = False
    # ---- queueing (SimScript.max_running)
    # When a streamed request that must wait for a turn gets its response headers: "arrival" (at once, then no
    # chunk until its first token), "slot" (when a turn, llama-server's slot, takes it) or "first_chunk" (nothing
    # at all, not even headers, until its first chunk).
    headers_at: Literal["arrival", "slot", "first_chunk"] = "first_chunk"
    # ---- connections
    # Whether the server closes its side of the connection after a streamed reply although its headers offer
    # keep-alive. llama-server does (seen against the build tmas installs, with a raw socket: its streamed replies
    # carry "Keep-Alive: timeout=5, max=100" and no "Connection: close", and the socket reads EOF right after the last
    # chunk); a client that hands that connection to its next call writes into a closed socket.
    closes_after_stream: bool = False
    # ---- structured outputs
    # The largest bounded repetition the server's grammar takes (None: no limit). llama-server turns a JSON schema into
    # a GBNF grammar (common/json-schema-to-grammar.cpp: a string's maxLength N becomes ``char{0,N}``, an array's
    # maxItems N a first item and ``("," item){0,N-1}``), and its grammar parser refuses a repetition of 2000 or more
    # (src/llama-grammar.cpp, MAX_REPETITION_THRESHOLD): the request fails with ``grammar_refusal``.
    grammar_repetitions: int | None = None
    grammar_refusal: str = ""
    # How a server that cannot follow a schema refuses it (SimScript.response_format = "reject"; "{kind}": the
    # response_format's type, "{grammar_key}": SGLang's grammar cache key for it), and whether a streamed request
    # meets that refusal as an error event once its stream is open rather than as an HTTP error.
    schema_refusal: str = "response_format type {kind!r} is not supported by this server"
    schema_refusal_midstream: bool = False
    # ---- loading its model (SimScript.models_unavailable)
    # Whether its model list answers 200 while the model loads, each card's "meta" null until it is loaded, where
    # every other route answers 503. llama-server lets /models, /v1/models and /api/tags through its loading check
    # (server-http.cpp middleware_server_state: "allow the models endpoint to be accessed during loading") and fills
    # a card's meta only once ready (server-context.cpp get_models). False: the model list answers 503 as well.
    lists_models_while_loading: bool = False
    # ---- streaming, continued
    # Whether continuous_usage_stats counts only beside include_usage.
    continuous_needs_include: bool = True
    # The "code" of the refusal of another model's name (unknown_model); None: the status's number, as vLLM's error
    # bodies carry it.
    unknown_model_code: str | None = None
    # With n > 1 and a seed, choice i samples with the request's seed + i (so it is the reply the request gets alone
    # with that seed); False: with a seed the simulator derives from the request's and the index.
    choice_seed_plus_index: bool = False


def _any_n(script: SimScript) -> int | None:
    return None


def _slots(script: SimScript) -> int | None:
    return script.slots


SIM = Persona(
    name="sim",
    model_card=_sim_card,
    models_extra=None,
    known_fields=None,
    rejects_unknown=False,
    unknown_model=None,
    max_n=_any_n,
    n_refusal="",
    response_formats=None,
    unsupported={},
    default_only=frozenset(),
    error=_nested_error,
    echoes_model=False,
    reasoning_key="reasoning_content",
    message_extra={},
    null_content="never",
    choice_extra={},
    response_extra={},
    logprobs_extra={},
    logprob_bytes=False,
    logprob_ids=False,
    reasoning_logprobs=False,
    default_top_logprobs=0,
    usage=_sim_usage,
    usage_per_choice=False,
    timings=False,
    first_delta={"role": "assistant", "content": ""},
    chunk_extra={},
    stream_choice_extra={},
    finish_choice_extra={},
    finish_with_last_delta=False,
    usage_null_in_chunks=False,
    continuous_usage=False,
    cache_block_tokens=16,
    cache_min_tokens=0,
    default_cache_tokens=0,
)

VLLM = Persona(
    name="vllm",
    model_card=_vllm_card,
    models_extra=None,
    # engine/protocol.py OpenAIBaseModel: extra="allow", unknown fields logged ("present in the request but
    # ignored") and otherwise ignored.
    known_fields=OPENAI_CHAT_FIELDS | VLLM_EXTRA_FIELDS,
    rejects_unknown=False,
    # The model registry's check_model: a 404 whose body names the parameter and carries the status as its code.
    unknown_model="The model `{model}` does not exist.",
    max_n=_any_n,
    n_refusal="",
    # engine/protocol.py AnyResponseFormat.
    response_formats=frozenset({"text", "json_object", "json_schema", "structural_tag"}),
    unsupported={},
    default_only=frozenset(),
    error=_nested_error,
    echoes_model=False,
    # chat_completion/protocol.py ChatMessage.reasoning (older releases named it reasoning_content); the plain reply
    # is model_dump()ed, so the unset fields appear as null.
    reasoning_key="reasoning",
    message_extra={
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning": None,
    },
    # chat_completion/serving.py chat_completion_full_generator: with a reasoning parser the content is what
    # extract_reasoning gives, None for a reply that never closed its thinking (reasoning/qwen3_reasoning_parser.py,
    # basic_parsers.py) or closed it with nothing after; without one, the output's text as it is.
    null_content="parsed",
    choice_extra={"logprobs": None, "stop_reason": None, "token_ids": None},
    response_extra={
        "service_tier": None,
        "system_fingerprint": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    },
    logprobs_extra={},
    logprob_bytes=True,
    logprob_ids=False,
    # chat_completion/serving.py builds them from the output's token ids, the reasoning parser's split aside.
    reasoning_logprobs=True,
    default_top_logprobs=0,
    usage=_vllm_usage,
    usage_per_choice=False,
    timings=False,
    # serving.py chat_completion_stream_generator: a first chunk per choice with the role and empty content; chunks
    # are dumped with exclude_unset, so a choice carries the fields the server set.
    first_delta={"role": "assistant", "content": ""},
    chunk_extra={},
    stream_choice_extra={"logprobs": None},
    finish_choice_extra={"stop_reason": None},
    finish_with_last_delta=True,
    usage_null_in_chunks=False,
    continuous_usage=True,
    # --block-size 16, prefix caching on by default.
    cache_block_tokens=16,
    cache_min_tokens=0,
    # About the KV cache one 80 GB GPU holds for a 4B model in bf16 (36 layers x 8 KV heads x 128 x 2 x 2 bytes =
    # 144 KiB a token, some 60 GB free).
    default_cache_tokens=400_000,
    # chat_completion/serving.py returns a StreamingResponse over the chunk generator as soon as the request is
    # handed to the engine; Starlette's StreamingResponse sends the status line and headers before it asks the
    # generator for its first chunk, which waits for the engine's first output.
    headers_at="arrival",
    # v1/engine's input processor checks a request's structured output (_validate_params, _validate_structured_output)
    # as the request enters the engine, where it checks the prompt's length (context_limits._decoder_prompt): inside
    # the generator a stream iterates after its headers went out, so a streamed request meets the ValueError as an
    # error event with code 400. The xgrammar backend's wording (v1/structured_output/backend_xgrammar.py).
    schema_refusal="The provided JSON schema contains features not supported by xgrammar.",
    schema_refusal_midstream=True,
    # v1/engine/parallel_sampling.py ParentRequest: each child request copies the sampling parameters with n 1 and,
    # where a seed was given, seed + its index.
    choice_seed_plus_index=True,
)

SGLANG = Persona(
    name="sglang",
    model_card=_sglang_card,
    models_extra=None,
    # protocol.py ChatCompletionRequest is a plain pydantic model: fields it does not declare are dropped silently.
    known_fields=OPENAI_CHAT_FIELDS | SGLANG_EXTRA_FIELDS,
    rejects_unknown=False,
    unknown_model=None,
    max_n=_any_n,
    n_refusal="",
    response_formats=frozenset({"text", "json_object", "json_schema", "structural_tag"}),
    unsupported={},
    default_only=frozenset(),
    error=_sglang_error,
    # serving_chat.py builds replies with model=request.model.
    echoes_model=True,
    reasoning_key="reasoning_content",
    message_extra={"reasoning_content": None, "tool_calls": None},
    # serving_chat.py _build_chat_response: ChatMessage(content=text if text else None, ...), parser or not.
    null_content="always",
    choice_extra={"logprobs": None, "matched_stop": None},
    response_extra={"metadata": None},
    logprobs_extra={},
    logprob_bytes=True,
    logprob_ids=False,
    # serving_chat.py _process_response_logprobs: meta_info output_token_logprobs, every generated token.
    reasoning_logprobs=True,
    default_top_logprobs=0,
    usage=_sglang_usage,
    usage_per_choice=False,
    timings=False,
    # serving_chat.py (streaming): the handler awaits the generator's first chunk before it returns the
    # StreamingResponse, so a request still waiting for the scheduler gets nothing at all, not even headers
    # (headers_at keeps the default "first_chunk").
    # sse_utils.py: deltas omit unset fields; the finish comes in a chunk of its own per choice, after the content.
    first_delta={"role": "assistant", "content": ""},
    chunk_extra={},
    stream_choice_extra={"logprobs": None, "matched_stop": None},
    finish_choice_extra={},
    finish_with_last_delta=False,
    usage_null_in_chunks=False,
    continuous_usage=True,
    # entrypoints/openai/utils.py should_include_usage reads continuous_usage_stats whatever include_usage says
    # (vLLM's function of that name counts it only beside include_usage).
    continuous_needs_include=False,
    # The radix cache shares prefixes token by token (page size 1 by default).
    cache_block_tokens=1,
    cache_min_tokens=0,
    default_cache_tokens=400_000,
    # A grammar its backend cannot compile: the scheduler aborts the request with status 400 and
    # f"Invalid grammar request: {req.grammar_key=}" (managers/scheduler.py, the grammar queue; the key is ("json",
    # the schema as a JSON string)). The tokenizer manager raises that abort as a ValueError for a whole reply (an HTTP
    # 400 from serving_chat.py), but hands it to a stream, which sends it as an error event with code 400
    # (serving_chat.py, create_streaming_error_response) on the HTTP 200 its first chunk opened.
    schema_refusal="Invalid grammar request: req.grammar_key={grammar_key}",
    schema_refusal_midstream=True,
)

LLAMA_SERVER = Persona(
    name="llama-server",
    model_card=_llama_card,
    models_extra=_llama_models_list,
    # server-common.cpp copies the body's fields into the task's parameters; the ones it does not read do nothing.
    known_fields=OPENAI_CHAT_FIELDS | LLAMA_EXTRA_FIELDS,
    rejects_unknown=False,
    unknown_model=None,
    # server-task.cpp: n (n_cmpl) runs in parallel slots, at most as many as there are. Releases before December
    # 2025 refused any n other than 1 ("Only one completion choice is allowed").
    max_n=_slots,
    n_refusal="n_cmpl cannot be greater than the number of slots, please increase -np",
    response_formats=frozenset({"text", "json_object", "json_schema"}),
    unsupported={},
    default_only=frozenset(),
    error=_llama_error,
    echoes_model=True,
    # With --reasoning-format deepseek (or auto): reasoning_content, present only when there is some.
    reasoning_key="reasoning_content",
    message_extra={},
    # Not read from its source: kept as the simulator always sent it.
    null_content="never",
    choice_extra={},
    response_extra={"system_fingerprint": "b0-sim"},
    logprobs_extra={},
    logprob_bytes=True,
    logprob_ids=True,
    # server-context.cpp keeps a probability entry for every sampled token (slot.generated_token_probs) and
    # send_final_response hands them all to the reply (probs_output); the chat parser splits the reasoning off the
    # text only afterwards, so server-task.cpp to_json_oaicompat_chat gives the thinking's tokens first. Streamed,
    # each partial result puts its token's entry on the last delta it produced, a reasoning_content delta included.
    reasoning_logprobs=True,
    # server-common.cpp: logprobs without top_logprobs asks for 20.
    default_top_logprobs=20,
    usage=_llama_usage,
    usage_per_choice=True,
    timings=True,
    # server-task.cpp to_json_oaicompat_chat (partial): the first delta has the role and a null content; the
    # final result adds a chunk with the finish_reason and an empty delta, then the usage chunk.
    first_delta={"role": "assistant", "content": None},
    chunk_extra={"system_fingerprint": "b0-sim"},
    stream_choice_extra={},
    finish_choice_extra={},
    finish_with_last_delta=False,
    usage_null_in_chunks=False,
    continuous_usage=False,
    cache_block_tokens=1,
    cache_min_tokens=0,
    # Any positive capacity: each slot keeps its last prompt (cache_prompt, on by default).
    default_cache_tokens=1,
    slot_cache=True,
    closes_after_stream=True,
    grammar_repetitions=1999,
    grammar_refusal="Failed to initialize samplers: failed to parse grammar",
    # server-context.cpp: a streamed completion's response starts (server-http.cpp sends its headers) once the
    # first result of its task arrives, and a task waits in the queue while every slot is busy; observed: a second
    # request with the only slot busy got its headers when the slot freed.
    headers_at="slot",
    lists_models_while_loading=True,
    # server-task.h server_task::add_child: the i-th child task of an n > 1 request copies the parent's parameters
    # and, where the seed is not the default (random) one, adds i to it; the parent keeps the seed sent.
    choice_seed_plus_index=True,
)

OPENAI = Persona(
    name="openai",
    model_card=_openai_card,
    models_extra=None,
    # Any other field: 400 "Unrecognized request argument supplied: X".
    known_fields=OPENAI_CHAT_FIELDS,
    rejects_unknown=True,
    unknown_model="The model `{model}` does not exist or you do not have access to it.",
    unknown_model_code="model_not_found",
    max_n=_any_n,
    n_refusal="",
    response_formats=frozenset({"text", "json_object", "json_schema"}),
    # With reasoning, a reasoning model (o-series, gpt-5): max_tokens is refused for max_completion_tokens,
    # temperature and top_p take only 1 (the top_p wording follows temperature's), and logprobs are not available
    # (reasoning guide). Without, a chat model (gpt-4.1) that takes them all.
    unsupported={"max_tokens": " Use 'max_completion_tokens' instead.", "logprobs": "", "top_logprobs": ""},
    default_only=frozenset({"temperature", "top_p"}),
    error=_openai_error,
    echoes_model=False,
    # The chat API never returns a reasoning model's reasoning: only its count, in completion_tokens_details.
    reasoning_key=None,
    message_extra={"refusal": None, "annotations": []},
    # Not read from a reference: kept as the simulator always sent it.
    null_content="never",
    choice_extra={"logprobs": None},
    response_extra={"service_tier": "default", "system_fingerprint": None},
    logprobs_extra={"refusal": None},
    logprob_bytes=True,
    logprob_ids=False,
    # A reasoning model gives no log-probabilities at all.
    reasoning_logprobs=False,
    default_top_logprobs=0,
    usage=_openai_usage,
    usage_per_choice=False,
    timings=False,
    first_delta={"role": "assistant", "content": "", "refusal": None},
    chunk_extra={"service_tier": "default", "system_fingerprint": None},
    stream_choice_extra={"logprobs": None},
    finish_choice_extra={},
    finish_with_last_delta=False,
    usage_null_in_chunks=True,
    continuous_usage=False,
    # Prompt caching guide: prompts of 1024 tokens or more, hits in steps of 128 tokens.
    cache_block_tokens=128,
    cache_min_tokens=1024,
    default_cache_tokens=1_000_000,
)

PERSONAS: dict[str, Persona] = {p.name: p for p in (SIM, VLLM, SGLANG, LLAMA_SERVER, OPENAI)}


def schema_refusal(persona: Persona, response_format: Any) -> str:
    """The persona's refusal of ``response_format`` (the request's) under SimScript.response_format = "reject"."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    schema: Any = {"type": "object"}  # SGLang's stand-in for json_object (serving_chat.py)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
    return persona.schema_refusal.format(kind=kind, grammar_key=repr(("json", json.dumps(schema))))


def schema_repetitions(node: Any) -> int:
    """The largest bounded repetition llama-server's converter writes for a JSON schema (see
    :attr:`Persona.grammar_repetitions`): a string's maxLength, an array's maxItems less its first item."""
    if isinstance(node, list):
        return max((schema_repetitions(item) for item in node), default=0)
    if not isinstance(node, dict):
        return 0
    own = [node["maxLength"]] if isinstance(node.get("maxLength"), int) else []
    if isinstance(node.get("maxItems"), int):
        own.append(node["maxItems"] - 1)
    return max([*own, *(schema_repetitions(value) for value in node.values())], default=0)


def persona_of(script: SimScript) -> Persona:
    return PERSONAS[script.persona]


def cache_capacity(script: SimScript) -> int:
    """Prompt tokens the replica's prefix cache holds under ``script`` (0: none)."""
    p = persona_of(script)
    return p.default_cache_tokens if script.prefix_cache_tokens is None else script.prefix_cache_tokens
