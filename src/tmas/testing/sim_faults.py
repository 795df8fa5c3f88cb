"""The simulated server's faults: which one a request draws, and the response that replaces or breaks its reply."""

from __future__ import annotations

import asyncio
import random
from http import HTTPStatus
from typing import Any

from aiohttp import web

from tmas.testing.replies import sse
from tmas.testing.script import FaultKind, Rule

_FAULT_STATUS: dict[str, tuple[int, str, str]] = {
    "http_500": (500, "InternalServerError", "Simulated internal server error."),
    "http_503": (503, "ServiceUnavailableError", "Simulated overload: the server is not ready."),
    "http_429": (429, "RateLimitError", "Simulated rate limit: too many requests."),
    "http_400": (400, "BadRequestError", "Simulated bad request."),
    "http_401": (401, "AuthenticationError", "Simulated: invalid API key."),
}
# The faults an embeddings request can meet (truncate and garbage mean nothing for a vector).
EMBEDDING_FAULTS = frozenset(
    {
        "http_500",
        "http_503",
        "http_429",
        "http_400",
        "timeout",
        "drop",
        "malformed",
        "stall",
        "freeze",
        "cut",
        "stream_error",
    }
)
# A stream's faults on a reply sent whole: a stalled server hangs, a cut connection drops, an error is a 500.
_UNSTREAMED: dict[FaultKind, FaultKind] = {
    "stall": "timeout",
    "freeze": "timeout",
    "cut": "drop",
    "stream_error": "http_500",
    "cut_after_finish": "drop",
}
# The error event vLLM and SGLang send inside a stream when generation fails.
_STREAM_ERROR = {
    "error": {"message": "Simulated error mid-generation.", "type": "InternalServerError", "param": None, "code": 500}
}
_MALFORMED_BODY = '{"id": "chatcmpl-sim", "choices": ['


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body."""
    payload = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(payload, status=status, headers=headers)


def draw_fault(rng: random.Random, cumulative: list[tuple[FaultKind, float]]) -> FaultKind | None:
    """The random fault one uniform draw picks from ``FaultRates.cumulative()`` (None: none, or no rates at all)."""
    if not cumulative:
        return None  # no draw at all: a fault-free script costs nothing here
    r = rng.random()
    for kind, bound in cumulative:
        if r < bound:
            return kind
    return None


async def fault_response(
    request: web.Request, fault: FaultKind, hang_s: float, stream: bool = False
) -> web.StreamResponse | None:
    """The response for faults that replace the answer altogether; ``None`` for those that alter it."""
    if not stream:
        fault = _UNSTREAMED.get(fault, fault)
    if fault in _FAULT_STATUS:
        status, kind, message = _FAULT_STATUS[fault]
        headers = {"Retry-After": "0"} if status == 429 else None
        return error_response(status, message, kind, headers)
    if fault == "drop":
        # Close the socket under the client: it sees a disconnect, never a status line. The empty
        # response returned afterwards fails to write, which aiohttp takes as a client disconnect.
        if request.transport is not None:
            request.transport.close()
        return web.Response()
    if fault == "malformed" and not stream:
        # (A stream instead gets one broken event and no [DONE]: see faulty_events.)
        return web.Response(status=200, text=_MALFORMED_BODY, content_type="application/json")
    if fault == "timeout":
        await asyncio.sleep(hang_s)  # then answer normally, as a very slow server would
    return None


def _error_type(status: int) -> str:
    # vLLM names an error by its HTTP status (engine/protocol.py ErrorInfo.type: "BadRequestError", "NotFoundError",
    # "InternalServerError", ...).
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return phrase if phrase.endswith("Error") else f"{phrase}Error"


def status_error(persona: str, status: int, message: str) -> dict[str, Any]:
    """An error body carrying ``status`` in the persona's shape: the body of an HTTP error, and the payload of an
    error event inside a stream (where the status line went out as 200 already)."""
    if persona == "sglang":
        # serving_chat.py: an abort carrying an HTTP status mid-stream is sent as
        # create_streaming_error_response(message, status.name, status.value): the flat ErrorResponse under "error".
        flat = {"object": "error", "message": message, "type": HTTPStatus(status).name, "param": None}
        return {"error": {**flat, "code": status}}
    if persona == "llama-server":
        # server-common.cpp format_error_response: code, message and a type named for the error kind.
        kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
        kinds |= {404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}
        return {"error": {"code": status, "message": message, "type": kinds.get(status, "server_error")}}
    if persona == "openai":
        return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    # vLLM (chat_completion/serving.py create_streaming_error_response): ErrorResponse(error=ErrorInfo(...)).
    return {"error": {"message": message, "type": _error_type(status), "param": None, "code": status}}


# SGLang's scheduler, its waiting queue full (scheduler.py _abort_on_queued_limit): the request ends with an abort
# carrying HTTP 503 and this message.
QUEUE_FULL = "The request queue is full."
# SGLang's scheduler, a request running past SGLANG_REQ_RUNNING_TIMEOUT (scheduler.py _abort_on_running_timeout): the
# request ends part way with an abort carrying HTTP 503 and this message (a rule's fault "stream_error" with
# error_status 503 and this error_message sends it so, in SGLang's error-event shape).
RUNNING_TIMEOUT = "Request running timeout reached."


def rule_error(persona: str, rule: Rule, status: int, *, event: bool = False) -> dict[str, Any]:
    """The body of a rule's error with ``status``: its ``error_body`` verbatim, else the persona's shape with its
    ``error_message`` (as an error event in a stream where ``event``: SGLang sends its flat error whole)."""
    if rule.error_body is not None:
        return rule.error_body
    said = rule.error_message or f"Simulated error ({status}){' mid-generation' if rule.fault else ''}."
    error = status_error(persona, status, said)
    return error if event or persona != "sglang" else error["error"]


def faulty_events(
    events: list[tuple[bytes, int]], fault: FaultKind | None, error: dict[str, Any] | None = None, head: int = 2
) -> list[tuple[bytes, int]]:
    """A stream's events as ``fault`` breaks them: one broken event and no [DONE], or an error event after the first
    ``head`` events (``error``: its payload, else the simulator's own 500)."""
    if fault == "malformed":
        return [events[0], (b"data: " + _MALFORMED_BODY.encode() + b"\n\n", 0)]
    if fault == "stream_error":
        return [*events[:head], (sse(error or _STREAM_ERROR), 0), (b"data: [DONE]\n\n", 0)]
    return events


def _first_finish(events: list[tuple[bytes, int]]) -> int:
    """The position of the first event that finishes a choice (its finish_reason is not null)."""
    for i, (data, _) in enumerate(events):
        if b'"finish_reason": "' in data:
            return i
    return len(events) - 1


# The faults that break a stream part way, after its head (stream_head).
PART_WAY: frozenset[FaultKind] = frozenset({"stall", "freeze", "cut", "stream_error"})


def stream_head(fault: FaultKind | None, events: list[tuple[bytes, int]], after_tokens: int | None = None) -> int:
    """How many events go out before a fault that breaks the stream part way: the opening chunk and the first delta,
    or (``after_tokens``) the deltas up to that many tokens (no finish or usage chunk after them); for
    "cut_after_finish", up to the first choice's finish. Without such a fault, all but the last."""
    if fault == "cut_after_finish":
        return _first_finish(events) + 1
    if fault not in PART_WAY:
        return len(events) - 1
    if after_tokens is None:
        return 2
    head, streamed = 1, 0  # the opening chunk goes out in any case
    for _, tokens in events[1:]:
        if streamed + tokens > after_tokens or (tokens == 0 and streamed > 0):
            break
        streamed += tokens
        head += 1
    return head
