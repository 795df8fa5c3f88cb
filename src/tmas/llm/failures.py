"""What went wrong with a call, decided in one place: every failure the HTTP client meets (a status and its body, a
stream's error event, a broken connection, a silence) becomes one :class:`Failure`, with a cause word for counting and
whether sending it again can help. Every server wording the client recognises is here and nowhere else.

The wordings come from the servers' own source: vLLM ``vllm/entrypoints/openai/serving_engine.py`` (the context checks
of ``_validate_input`` and its successors in ``entrypoints/renderer.py``), SGLang
``python/sglang/srt/managers/tokenizer_manager.py`` (``_validate_one_request``), llama.cpp ``tools/server/server-
context.cpp`` (``exceed_context_size_error`` with ``n_prompt_tokens`` and ``n_ctx``), OpenAI's API reference.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

# The longest a connection may take to open (at most the endpoint's timeout_s): a server's kernel completes it at
# once however busy the server is, so a host that has not answered by then is gone (a machine down, a network cut:
# its packets vanish, and nothing refuses the connection). Such a failure counts as one that could not connect.
CONNECT_TIMEOUT_S = 30.0

# Statuses worth sending again: the server (or a proxy in front) was busy or broke, not the request.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# Statuses that say the server is too busy to take the request, whether as the reply's status or as the code of an
# error event that opens its stream: SGLang, its waiting queue full (--max-queued-requests), aborts the request with
# 503 "The request queue is full." (scheduler.py _abort_on_queued_limit), and a streamed request meets that as the
# first event of an HTTP 200 stream (serving_chat.py, create_streaming_error_response(message, "SERVICE_UNAVAILABLE",
# 503)). Such an event counts as the status would (cause ``http_503``), not as generation that broke.
OVERLOAD_STATUS = frozenset({429, 503})
# SGLang's limit on a request's running time (SGLANG_REQ_RUNNING_TIMEOUT, off by default): its scheduler aborts a
# request generating for longer with 503 "Request running timeout reached." (python/sglang/srt/managers/scheduler.py,
# _abort_on_running_timeout), which a streamed request meets as an error event part way through its reply and an
# unstreamed one as the reply's status (tokenizer_manager.py raises it as an HTTPException). A reply as long meets it
# again, so it is not the overload a 503 otherwise says: cause ``running_timeout``, sent again once per call
# (tmas.llm.retry), since a resampled reply may be shorter.
_RUNNING_TIMEOUT = re.compile(r"running timeout reached", re.I)
_RUNNING_LIMIT = "the server's limit on a request's running time: SGLANG_REQ_RUNNING_TIMEOUT"

# OpenAI's wording of a field a model refuses: "Unsupported parameter: 'max_tokens' ... Use 'max_completion_tokens'
# instead." and "Unsupported value: 'temperature' does not support 0.7 with this model. Only the default (1) value is
# supported."; and of a field it does not know at all: "Unrecognized request argument supplied: top_k". Only the
# sampling fields below are adapted; any other refusal fails the call.
_REFUSED_FIELD = re.compile(
    r"Unsupported (?:parameter|value): '(\w+)'(?:.*?Use '(\w+)' instead)?"
    r"|Unrecognized request arguments? supplied: (\w+)",
    re.S,
)
ADAPTABLE_FIELDS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "logprobs",
        "top_logprobs",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    }
)
# How servers without (full) structured-output support word their refusal of a response_format: llama-server
# ("response_format type not supported", grammar errors), vLLM/SGLang ("guided decoding", "xgrammar"), OpenAI.
_SCHEMA_REFUSAL = re.compile(r"response_format|json_schema|json schema|grammar|guided|structured output", re.I)
_SCHEMA_REFUSAL_STATUS = frozenset({400, 404, 415, 422, 500, 501})
# How a server that cannot stream refuses a streamed request (a 4xx or 501 whose message names the field).
_STREAM_REFUSAL = re.compile(r"\bstream", re.I)
_STREAM_REFUSAL_STATUS = frozenset({400, 404, 415, 422, 501})

# Context refusals. The window: vLLM "maximum context length is C tokens" (every version), SGLang "maximum context
# length of C tokens" and "the model's context length (C tokens)", vLLM's "the model's context length is only C tokens"
# and, for a max_tokens larger than the whole window, "cannot be greater than max_model_len=max_total_tokens=C"; vLLM's
# engine "The decoder prompt (length N) is longer than the maximum model length of C" (vllm/v1/engine/
# input_processor.py, _validate_model_input: a ValueError raised as the request enters the engine, so a streamed request
# meets it as an error event after its headers); SGLang's "max_completion_tokens is too large: M.This model supports at
# most C completion tokens." (python/sglang/srt/entrypoints/openai/serving_chat.py, _validate_request: a max_tokens
# over the window given by --context-length; C is that window); SGLang's scheduler "Input length (N tokens) exceeds the
# maximum allowed length (M tokens)" (python/sglang/srt/managers/utils.py, validate_input_length: M bounds the prompt
# by the smaller of the window and the KV cache pool, which the model card does not state; taken as the window, it
# leaves a reply the room the scheduler itself would leave it, less a few tokens).
_WINDOW = re.compile(
    r"(?:maximum context length (?:is|of)|context length is only)\s+(\d+)\s+tokens|context length \((\d+) tokens\)"
    r"|max_model_len=(?:max_total_tokens=)?(\d+)|maximum model length of (\d+)"
    r"|max_completion_tokens is too large: \d+\.\s*This model supports at most (\d+) completion tokens"
    r"|maximum allowed length \((\d+) tokens\)",
    re.I,
)
# The prompt's tokens, as each wording states them: vLLM "your request has N input tokens" (0.9 to 0.11), "(N in the
# messages, M in the completion)" (before 0.6), "The decoder prompt (length N)"; SGLang "N tokens from the input
# messages", "The input (N tokens)" and "Input length (N tokens)"; llama-server "request (N tokens)".
_PROMPT = re.compile(
    r"request has (\d+) input tokens|\((\d+) in the messages|(\d+) tokens from the input|The input \((\d+) tokens\)"
    r"|request \((\d+) tokens\)|prompt \(length (\d+)\)|Input length \((\d+) tokens\)",
    re.I,
)
# OpenAI's cap on a reply, not on the window: "max_tokens is too large: M. This model supports at most C completion
# tokens, whereas you provided M." The call goes again with max_tokens C.
_COMPLETION_CAP = re.compile(
    r"max_tokens is too large: \d+\.\s*This model supports at most (\d+) completion tokens", re.I
)
# Today's vLLM tokenizes a prompt only as far as the window less max_tokens, plus one, before it refuses
# (vllm/renderers/params.py): "your prompt contains at least N input tokens" and "You passed N input tokens" give that
# bound, not the prompt's size, which the client then asks the server's /tokenize for.
_PROMPT_AT_LEAST = re.compile(r"contains at least (\d+) input tokens|passed (\d+) input tokens", re.I)
# A 4xx error event mid-stream that names a fault of the engine, not of the request: CUDA and memory errors, vLLM's
# detokenizer's OverflowError ("out of range integral type conversion attempted"), a Python fault in the serving code
# (TypeError, AttributeError, IndexError wordings), a dead engine or scheduler.
_ENGINE_FAULT = re.compile(
    r"cuda|out of memory|\boom\b|nccl|illegal memory|device-side|cublas|triton|overflow|out of range|integral type"
    r"|nonetype|has no attribute|not subscriptable|index out of|engine ?core|engine (?:is )?dead|scheduler|internal",
    re.I,
)
# One that names the request: its fields, its prompt, its schema, a value it may not have.
_REQUEST_FAULT = re.compile(
    r"prompt|message|max_tokens|max_completion_tokens|schema|grammar|template|json|tool|invalid|must be|not supported"
    r"|unsupported|too (?:long|large|many)|exceed|parameter|argument|expected",
    re.I,
)
# A 400 that names the context without numbers we can read (another server, another version): still a context
# refusal, whose numbers the client then asks the server for (/tokenize, the model's card).
_NAMES_CONTEXT = re.compile(r"context (?:length|window|size)|too many tokens|exceeds? .*tokens", re.I)


@dataclass(frozen=True)
class ContextRefusal:
    """A server refused a call for the context window: its numbers where it stated them."""

    context: int | None = None
    prompt: int | None = None
    # A lower bound of the prompt's tokens, where the server stated no more than that.
    prompt_at_least: int | None = None
    # The most completion tokens the model gives whatever the prompt (OpenAI's output cap), where that was refused.
    completion_cap: int | None = None


class Failure(Exception):
    """One failed attempt of a call.

    ``cause``: a word for counting (``connect``, ``tls``, ``disconnected``, ``timeout``, ``stall``, ``dead``,
    ``no_progress``, ``cut``, ``malformed``, ``stream_error``, ``engine_fault``, ``abort``, ``http_503``,
    ``running_timeout``, ``context``,
    ``deadline``, ``structured_output``, ``stream``, ``sampling``, ...). ``retry``: whether the same request may
    succeed if sent again. ``connect``: no connection could be made at all (refused, unanswered, or its TLS handshake
    failed). ``context`` / ``refused_field``: what a refusal said, for the client to adapt."""

    def __init__(
        self,
        message: str,
        cause: str,
        *,
        retry: bool,
        retry_after: float | None = None,
        connect: bool = False,
        context: ContextRefusal | None = None,
        refused_field: tuple[str, str | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.retry = retry
        self.retry_after = retry_after
        self.connect = connect
        self.context = context
        self.refused_field = refused_field


def from_status(
    status: int, text: str, body: dict[str, Any], retry_after: str | None = None, *, url: str | None = None
) -> Failure:
    """The failure a non-200 reply to ``body`` (sent to ``url``, which the message names) means."""
    message = error_message(text)
    said = f"HTTP {status}{f' from {url}' if url else ''}: {message}"
    if status == 404 and url is not None and "/v1/" not in url:
        # Every OpenAI-compatible server answers under /v1: a base URL without it 404s on every call.
        said += " (the base URL has no /v1, under which OpenAI-compatible servers answer)"
    if body.get("stream") and status in _STREAM_REFUSAL_STATUS and _STREAM_REFUSAL.search(message):
        return Failure(said, "stream", retry=False)
    if "response_format" in body and status in _SCHEMA_REFUSAL_STATUS and _SCHEMA_REFUSAL.search(message):
        return Failure(said, "structured_output", retry=False)
    if status == 429 and _quota_spent(_error_object(text)):
        # OpenAI's 429 for an account out of credit: unlike a rate limit, no wait makes the same request succeed.
        return Failure(f"{said} (the account's quota is spent: not sent again)", "quota", retry=False)
    if status == 503 and _RUNNING_TIMEOUT.search(message):
        return Failure(f"{said} ({_RUNNING_LIMIT})", "running_timeout", retry=True)
    if status in RETRYABLE_STATUS:
        return Failure(said, f"http_{status}", retry=True, retry_after=_seconds(retry_after))
    if status == 400 or status == 413 or status == 422:
        refusal = context_refusal(message, _error_object(text))
        if refusal is not None:
            return Failure(said, "context", retry=False, context=refusal)
        field = refused_field(message)
        if field is not None:
            return Failure(said, "sampling", retry=False, refused_field=field)
    return Failure(said, f"http_{status}", retry=False)


def lasting(cause: str) -> bool:
    """Whether a failure of ``cause`` stays until the upstream or its configuration is fixed, however often a call is
    sent: a TLS handshake refused (``tls``), the account's quota spent (``quota``), streaming or a response_format
    refused where the endpoint's configuration requires it (``stream``, ``structured_output``: the client adapts
    otherwise), a 4xx status not worth sending again (a key refused, a model or route the upstream does not serve).
    Not a refusal of what one request asks (:func:`refuses_request`), which another request need not meet."""
    if cause in ("tls", "quota", "stream", "structured_output"):
        return True
    status = cause.removeprefix("http_")
    if refuses_request(cause) or not status.isdigit():
        return False
    return 400 <= int(status) < 500 and int(status) not in RETRYABLE_STATUS


def refuses_request(cause: str) -> bool:
    """Whether a failure of ``cause`` refuses what the request asks, as a status or as an error event in a stream
    (:func:`from_stream_event`): a prompt past the context window (``context``, the client's own check included), a
    sampling field or value the server does not take (``sampling``), another 400, 413 or 422. The same request sent
    again is refused again; another request need not be."""
    return cause in ("context", "sampling", "http_400", "http_413", "http_422")


def from_stream_event(error: Any, *, began: bool = False, body: dict[str, Any] | None = None) -> Failure:
    """The failure an ``{"error": ...}`` event in a stream means: vLLM and SGLang send one for an error met after the
    stream began, with the status it would have had (``code``); ``began``: whether reply text had streamed before it;
    ``body``: the request's.

    One whose status says the server is overloaded (:data:`OVERLOAD_STATUS`: SGLang's full queue) is that status's
    failure (cause ``http_503``), retried with backoff as the status is. Another 5xx one (or one without a status) is
    the server's, and retried (cause ``stream_error``). A 4xx one is told apart by what it says, since
    both servers give 400 to faults of their own: vLLM's serving code answers a ValueError, TypeError, RuntimeError or
    OverflowError met mid-stream with code 400 (vllm/entrypoints/serve/engine/serving.py, create_error_response), SGLang
    any ValueError (serving_chat.py, create_streaming_error_response). One that names the request (a parameter
    (vLLM's ``param``), the context window, the prompt, a schema) stays final; one that names the engine (CUDA, memory,
    an overflow, a Python fault), or says nothing of the request after reply text began, is an engine fault: cause
    ``engine_fault``, sent again once per call (tmas.llm.retry). One before any reply text that refuses the request's
    ``response_format`` in the words of :func:`from_status` is that refusal (cause ``structured_output``): vLLM checks
    a schema as the request enters its engine, after a stream's headers went out."""
    message = _text_of(error)
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) else None
    said = f"server error in stream: {message}"
    if status == 503 and _RUNNING_TIMEOUT.search(message):
        return Failure(f"{said} (HTTP 503, {_RUNNING_LIMIT})", "running_timeout", retry=True)
    if status in OVERLOAD_STATUS:
        return Failure(f"{said} (HTTP {status})", f"http_{status}", retry=True)
    if status is None or not 400 <= status < 500 or status in RETRYABLE_STATUS:
        return Failure(said, "stream_error", retry=True)
    refusal = context_refusal(message, error if isinstance(error, dict) else None)
    if refusal is not None:
        return Failure(said, "context", retry=False, context=refusal)
    if not began and body is not None and "response_format" in body and _SCHEMA_REFUSAL.search(message):
        return Failure(f"{said} (HTTP {status})", "structured_output", retry=False)
    param = error.get("param") if isinstance(error, dict) else None
    if not param and (_ENGINE_FAULT.search(message) or (began and not _REQUEST_FAULT.search(message))):
        return Failure(f"{said} (HTTP {status}, an engine fault)", "engine_fault", retry=True)
    return Failure(said, f"http_{status}", retry=False)


def from_exception(exc: BaseException, url: str, *, sent: bool) -> Failure:
    """The failure an exception from aiohttp means. ``sent``: whether any byte of a reply had come back.

    A connection closed before any byte of a reply (aiohttp's ``ServerDisconnectedError``, or a ``ClientOSError``
    while it wrote the request) is cause ``disconnected``: most often a pooled connection the server closed as it was
    reused (uvicorn, under vLLM and SGLang, and cpp-httplib, under llama-server, close one idle for 5 s; the client
    drops its own idle ones after 3 s), else a server that dropped the request before reading it."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return Failure(f"cannot connect to {url}: the host did not answer in time", "connect", retry=True, connect=True)
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are both TimeoutError and ClientError
        return Failure(f"no reply from {url} in time: {type(exc).__name__}", "timeout", retry=True)
    if isinstance(exc, aiohttp.ClientSSLError):
        return Failure(f"{url}: {tls_failure(exc)}", "tls", retry=False, connect=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Failure(f"cannot connect to {url}: {exc.os_error}", "connect", retry=True, connect=True)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError) and not sent:
        # aiohttp says "Server disconnected", or "Can not write request body" where the close came while it wrote.
        return Failure(f"{url} closed the connection before answering: {exc}", "disconnected", retry=True)
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError) and sent:
        return Failure(f"reply from {url} cut: {type(exc).__name__}: {exc}", "cut", retry=True)
    return Failure(f"connection to {url} failed: {type(exc).__name__}: {exc}", "connection", retry=True)


def tls_failure(exc: aiohttp.ClientSSLError) -> str:
    """Why a TLS handshake failed, in the system's words (OpenSSL's, without its code and source line: "certificate
    verify failed: self-signed certificate"), and what a user can do: no attempt sent again can succeed. A
    certificate refused is trusted through ``SSL_CERT_FILE``, which Python's default context (aiohttp's) reads the
    CAs it trusts from; any other failure (OpenSSL's "wrong version number": a plain-HTTP server) is most often an
    ``https://`` URL of a server that speaks plain HTTP."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        error, fix = exc.certificate_error, _TRUST_FIX
    else:
        error, fix = exc.os_error, "give the URL with http:// if the server speaks plain HTTP"
    said = _OPENSSL_WORDS.sub("", str(error)).strip().rstrip(".") or type(error).__name__
    return f"TLS handshake failed: {said}; {fix}"


_TRUST_FIX = (
    "trust the server's certificate by pointing the SSL_CERT_FILE environment variable at the PEM file of its CA"
    " (of the certificate itself where it is self-signed)"
)


# OpenSSL's code before its words ("[SSL: CERTIFICATE_VERIFY_FAILED] ") and its source line after ("(_ssl.c:1006)").
_OPENSSL_WORDS = re.compile(r"^\[[^\]]*\]\s*|\s*\(_ssl\.c:\d+\)$")


def context_refusal(message: str, error: dict[str, Any] | None = None) -> ContextRefusal | None:
    """The context refusal ``message`` (and the error object it came in) states, or None when it is none."""
    if isinstance(error, dict) and error.get("type") == "exceed_context_size_error":
        # llama-server: the numbers are fields of the error object, the prompt alone exceeds the window.
        return ContextRefusal(context=_int(error.get("n_ctx")), prompt=_int(error.get("n_prompt_tokens")))
    cap = _COMPLETION_CAP.search(message)
    if cap is not None:
        return ContextRefusal(completion_cap=int(cap.group(1)))
    window = _WINDOW.search(message)
    prompt = _PROMPT.search(message)
    at_least = _PROMPT_AT_LEAST.search(message)
    if window is None and prompt is None and at_least is None and not _NAMES_CONTEXT.search(message):
        return None
    return ContextRefusal(
        context=_first_number(window),
        prompt=_first_number(prompt),
        prompt_at_least=_first_number(at_least),
    )


def _first_number(match: re.Match[str] | None) -> int | None:
    return next((int(g) for g in match.groups() if g), None) if match else None


def refused_field(message: str) -> tuple[str, str | None] | None:
    """(the sampling field a server refused, the name it asked for instead or None), where its message says so."""
    match = _REFUSED_FIELD.search(message)
    if match is None:
        return None
    name = match.group(1) or match.group(3)
    if name not in ADAPTABLE_FIELDS:
        return None
    return name, match.group(2)


def error_message(text: str) -> str:
    """The server's own error message where it sent one in OpenAI's (or SGLang's flat) shape, else the body's start
    on one line: of an HTML page (a proxy's or web server's, such as nginx's "502 Bad Gateway"), its title."""
    try:
        data = json.loads(text)
    except ValueError:
        if _HTML.search(text):
            heading = _HTML_HEADING.search(text)
            said = _one_line(_TAG.sub(" ", next(g for g in heading.groups() if g is not None) if heading else text))
            return f"{said[:200] or '(no text)'} (an HTML page, not an API error: a proxy or web server answered)"
        return _one_line(text)[:300] or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
        if data.get("message"):
            return str(data["message"])[:300]
    return text.strip()[:300]


# An HTML page (a proxy's error page), its title or first heading, and its tags.
_HTML = re.compile(r"<\s*(?:!doctype\s+html|html|head|body|title)\b", re.I)
_HTML_HEADING = re.compile(r"<title[^>]*>(.*?)</title>|<h1[^>]*>(.*?)</h1>", re.I | re.S)
_TAG = re.compile(r"<[^>]*>")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error_object(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, dict) else data if isinstance(data, dict) else None


def _quota_spent(error: dict[str, Any] | None) -> bool:
    """Whether an error object says the account's quota is spent (OpenAI: code and type ``insufficient_quota``)."""
    return error is not None and "insufficient_quota" in (error.get("code"), error.get("type"))


def _text_of(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
