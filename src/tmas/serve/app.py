"""The proxy's HTTP side (Starlette): ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/stats``, ``/metrics``.

Every reply that is not a success is OpenAI's error JSON with the matching status code; no traceback leaves.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from tmas.methods.base import ProblemResult
from tmas.serve.api_errors import ApiError
from tmas.serve.client_sampling import greedy_notice
from tmas.serve.jobs import Job, ServedRuns, Waiting
from tmas.serve.metrics import CLIENT_CLOSED, UNKNOWN_METHOD, ServeMetrics
from tmas.serve.observed_store import Progress
from tmas.serve.protocol import (
    ChatBody,
    chunk_body,
    completion_body,
    finish_reason,
    split_model,
    with_reasoning,
)

log = logging.getLogger("tmas.serve")

# An idle stream sends an SSE comment this often, so proxies in between keep the connection open.
KEEPALIVE_S = 15.0


class ServeApp:
    """The routes over :class:`ServedRuns`; ``token`` (when set) is required as ``Authorization: Bearer``."""

    def __init__(
        self,
        runs: ServedRuns,
        *,
        methods: list[str],
        upstreams: list[str],
        token: str | None,
        max_body_bytes: int,
        metrics: ServeMetrics,
    ) -> None:
        self.runs = runs
        self.metrics = metrics
        self.methods = methods
        self.upstreams = upstreams
        self.token = token
        self.max_body_bytes = max_body_bytes

    def build(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/stats", self.stats, methods=["GET"]),
                Route("/metrics", self.metrics_page, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                # The official client's models.retrieve; a model name holds a slash (tmas/Qwen/Qwen3-4B).
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ],
            exception_handlers={HTTPException: _http_error, Exception: _server_error},
        )

    # --------------------------------------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        admission = self.runs.admission
        return JSONResponse({"status": "ok", "active_problems": len(self.runs.active), "queued": admission.queued})

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return exc.response()
        data = [_model_entry(f"{m}/{u}") for m in self.methods for u in self.upstreams]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One model of the list, as OpenAI answers ``GET /v1/models/{model}``; an unknown one is a 404."""
        try:
            self._authorize(request)
            name = request.path_params["model"]
            split_model(name, set(self.methods), self.upstreams)
        except ApiError as exc:
            return exc.response()
        return JSONResponse(_model_entry(name))

    async def stats(self, request: Request) -> Response:
        """What a load test or a dashboard reads: the slots and the queue, now and since start."""
        admission = self.runs.admission
        return JSONResponse(
            {
                "active_problems": len(self.runs.active),
                "max_problems": admission.slots,
                "queued": admission.queued,
                "max_queue": admission.queue_size,
                "peak_queued": admission.peak_queued,
                "rejected": admission.rejected,
            }
        )

    async def metrics_page(self, request: Request) -> Response:
        """Prometheus' text format; no token needed, like /stats (it shows counts, never a prompt or a key)."""
        page, content_type = self.metrics.page()
        return Response(page, media_type=content_type)

    async def chat(self, request: Request) -> Response:
        arrived = time.monotonic()
        label = UNKNOWN_METHOD
        try:
            self._authorize(request)
            body = ChatBody.read(await self._read_body(request))
            method, upstream = split_model(body.model, set(self.methods), self.upstreams)
            label = method
            entry = self.runs.enter(body, method, upstream)
        except ApiError as exc:
            self.metrics.request_done(label, exc.status, time.monotonic() - arrived)
            return exc.response()
        gone = asyncio.create_task(_disconnected(request))
        if body.stream:
            # The run it joined or started has it as a client from now on, not only once its body begins: were the
            # run's other client to go meanwhile, the run would be cancelled under it (or its reply taken by a twin).
            following = _follow(entry, gone) if isinstance(entry, Job) else None
            # The stream counts itself once it ends (its status: 200, or the error it ended with).
            return _RunStream(
                self._stream(entry, following, gone, body, method, lambda status: self._done(method, status, arrived)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        response = await self._reply(entry, gone, body, method, lambda status: self._done(method, status, arrived))
        if not isinstance(response, _Reply):
            self._done(method, response.status_code, arrived)  # a reply of a run counts itself once sent (_Reply)
        return response

    def _done(self, method: str, status: int, arrived: float) -> None:
        self.metrics.request_done(method, status, time.monotonic() - arrived)

    async def _reply(
        self,
        entry: Job | Waiting,
        gone: asyncio.Task[None],
        body: ChatBody,
        method: str,
        counted: Callable[[int], None],
    ) -> Response:
        """The reply to a request without a stream, once its run has ended; once sent, its run is told so, and
        ``counted`` is told the status its client had (:class:`_Reply`)."""
        ended: Job | None = None  # the run whose outcome this reply is
        handed = False  # the reply is made: its client follows the run until it is sent (_Reply)
        try:
            if isinstance(entry, Waiting):
                turn = _Turn(self.runs, entry, gone)
                while not await turn.wait(None):
                    pass
                job = turn.job()
                if job is None:
                    return Response(status_code=CLIENT_CLOSED)  # nobody reads it: the client is gone
                self.metrics.admitted(turn.waited_s)
            else:
                job = _started(entry, body.model, body.stream, waited_s=None)
                self.metrics.admitted(0.0)
            queue = _follow(job, gone)
            while await queue.get() is not None:
                pass
            ended = job
            result = job.outcome()
        except ApiError as exc:
            if gone.done() and not gone.cancelled():
                return Response(status_code=CLIENT_CLOSED)  # its run was cancelled as its client went away
            if ended is None:
                return exc.response()
            handed = True
            replied = BackgroundTask(self.runs.replied, ended)
            return _Reply(exc.body(), gone, counted, status_code=exc.status, background=replied)
        except asyncio.CancelledError:
            # Only a server shutting down cancels a handler (a client going away is the watcher's business).
            return _shutting_down().response()
        else:
            extension = self._extension(job, result, body, method)
            extension["calls"] = result.calls
            text = body.reply_text(result.text)
            finish = finish_reason(result, text)
            # The progress a stream would have sent, as the message's reasoning (unless the request asks none).
            reasoning = "".join(event.line() + "\n" for event in job.events) if body.shows_reasoning else ""
            reply = completion_body(
                job.run_id, body.model, job.created, text, finish, result.usage, extension, reasoning
            )
            handed = True
            return _Reply(reply, gone, counted, status_code=200, background=BackgroundTask(self.runs.replied, job))
        finally:
            if not handed:
                gone.cancel()

    def _extension(self, job: Job, result: ProblemResult, body: ChatBody, method: str) -> dict[str, Any]:
        """What a tmas-aware client may read beside the reply: the run, the extracted answer, the notices."""
        notices = list(result.notices)
        greedy = greedy_notice(method, body, self.runs.client_sampling)
        if greedy is not None:
            log.warning("request %s: %s", job.run_id, greedy)
            notices.append(greedy)
        out: dict[str, Any] = {"run_id": job.run_id, "answer": result.answer, "iterations": len(result.iterations)}
        if notices:
            out["notices"] = notices
        return out

    async def _stream(
        self,
        entry: Job | Waiting,
        following: asyncio.Queue[Progress | None] | None,
        gone: asyncio.Task[None],
        body: ChatBody,
        method: str,
        ended: Callable[[int], None],
    ) -> AsyncIterator[str]:
        """The stream of ``entry``'s run: ``following`` it already (a run it joined or started), or waiting for its
        turn."""
        model = body.model
        status = 200  # what the stream's end says: 200, the status of the error it ended with, or the client gone
        sent = False  # the server took the stream's last event: the client has its end, whenever it goes
        try:
            if isinstance(entry, Waiting):
                # The stream is open while the request waits its turn: comments keep it so, and say why it waits.
                turn = _Turn(self.runs, entry, gone)
                yield f": queued, {self.runs.admission.queued} waiting\n\n"
                while not await turn.wait(KEEPALIVE_S):
                    yield ": keepalive (queued)\n\n"
                try:
                    started = turn.job()
                except ApiError as exc:
                    status = exc.status
                    yield _sse(exc.body())
                    yield "data: [DONE]\n\n"
                    return
                if started is None:
                    return
                job = started
                self.metrics.admitted(turn.waited_s)
                queue = _follow(job, gone)
            else:
                job = _started(entry, model, True, waited_s=None)
                self.metrics.admitted(0.0)
                queue = following if following is not None else _follow(job, gone)
            created = job.created
            usage = body.include_usage
            yield _sse(chunk_body(job.run_id, model, created, {"role": "assistant", "content": ""}, with_usage=usage))
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if event is None:
                    break
                # Without reasoning (include_reasoning false) the chunk still carries the progress as tmas_progress.
                delta = with_reasoning({}, event.line() + "\n") if body.shows_reasoning else {}
                yield _sse(chunk_body(job.run_id, model, created, delta, with_usage=usage, progress=event.model_dump()))
            try:
                result = job.outcome()
            except ApiError as exc:
                status = exc.status
                yield _sse(exc.body())
            else:
                text = body.reply_text(result.text)
                yield _sse(chunk_body(job.run_id, model, created, {"content": text}, with_usage=usage))
                done = self._extension(job, result, body, method)
                finish = finish_reason(result, text)
                end = chunk_body(job.run_id, model, created, {}, finish_reason=finish, with_usage=usage, progress=done)
                yield _sse(end)
                if usage:
                    yield _sse(chunk_body(job.run_id, model, created, None, usage=result.usage))
            yield "data: [DONE]\n\n"
            # Resumed only once the client has read the end (a stream resumes its body only after each send).
            sent = True
            await self.runs.replied(job)
        except (asyncio.CancelledError, GeneratorExit):
            status = CLIENT_CLOSED  # cut short: the client went away (or the server is stopping)
            raise
        finally:
            # Ended normally or the client went away before its end (the watcher has then cancelled the run already);
            # a client that goes as soon as it has read [DONE] had its reply.
            if not sent and gone.done() and not gone.cancelled():
                status = CLIENT_CLOSED
            gone.cancel()
            ended(status)

    # --------------------------------------------------------------------------------------------- checks
    def _authorize(self, request: Request) -> None:
        if self.token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(401, "missing bearer token (Authorization: Bearer ...)", "invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise ApiError(401, "incorrect bearer token", "invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        too_big = ApiError(413, f"request body larger than {self.max_body_bytes} bytes", "request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


def _model_entry(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tmas"}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _RunStream(StreamingResponse):
    """A run's event stream. Only a server shutting down cancels its handler (a client going away ends the stream
    instead): the stream then ends with the error a request without a stream gets (503 ``server_shutting_down``)
    and ``[DONE]``, rather than cut off without a word."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await super().__call__(scope, receive, sending)
        except asyncio.CancelledError:
            stopping = _shutting_down()
            if not started:
                await stopping.response()(scope, receive, send)
                return
            end = _sse(stopping.body()) + "data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": end.encode(), "more_body": False})


class _Reply(JSONResponse):
    """An ended run's reply without a stream (its result, or the error it ended with): its client follows the run
    until the reply is sent (its run told so first) or the client has gone, so that no request without a seed takes
    the run's reply meanwhile (Job.handing). ``ended`` is told its status once its body is sent, or
    :data:`CLIENT_CLOSED` when its client went away before having it, as a stream is counted."""

    def __init__(
        self,
        content: Any,
        gone: asyncio.Task[None],
        ended: Callable[[int], None],
        *,
        status_code: int,
        background: BackgroundTask,
    ) -> None:
        super().__init__(content, status_code=status_code, background=background)
        self.gone = gone
        self.ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = CLIENT_CLOSED
        # A server speaking ASGI's HTTP spec 2.4 fails a send to a client that has gone; an older one drops it, so
        # there a body sent after its client was seen going never reached it.
        raises = _spec(scope) >= (2, 4)

        async def sending(message: Message) -> None:
            nonlocal status
            await send(message)
            if message["type"] == "http.response.body" and (raises or not _gone(self.gone)):
                status = self.status_code

        try:
            await super().__call__(scope, receive, sending)
        finally:
            self.gone.cancel()
            self.ended(status)


def _spec(scope: Scope) -> tuple[int, ...]:
    """The ASGI HTTP spec version the server speaks."""
    version = str(scope.get("asgi", {}).get("spec_version", "2.0"))
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def _gone(gone: asyncio.Task[None]) -> bool:
    """Whether the client has been seen going away (rather than its watcher stopped as its reply ended)."""
    return gone.done() and not gone.cancelled()


class _Turn:
    """A queued request waiting for its slot, or for its client to go away (it then leaves the queue)."""

    def __init__(self, runs: ServedRuns, waiting: Waiting, gone: asyncio.Task[None]) -> None:
        self.gone = gone
        self.since = time.monotonic()
        self.model = waiting.body.model
        self.stream = waiting.body.stream
        self.waited_s = 0.0
        self.admit = asyncio.create_task(runs.admit(waiting))

    async def wait(self, tick_s: float | None) -> bool:
        """True once admitted or the client is gone; False after ``tick_s`` with neither."""
        try:
            await asyncio.wait({self.admit, self.gone}, timeout=tick_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._abandon()  # the server is shutting down
            raise
        if self.admit.done():
            return True
        if self.gone.done():
            self.admit.cancel()  # leaves the queue; its place is never run
            log.info("a queued request (%s) left: its client disconnected", self.model)
            return True
        return False

    def _abandon(self) -> None:
        """Out of the queue; a run already started for it is cancelled (nobody follows it)."""
        if not self.admit.done():
            self.admit.cancel()
        elif not self.admit.cancelled() and self.admit.exception() is None:
            job = self.admit.result()
            job.unfollow(job.follow(), disconnected=True)

    def job(self) -> Job | None:
        """The job once admitted; None when the client went away first (a 503 when the server stopped the wait)."""
        if self.admit.cancelled():
            if self.gone.done():
                return None
            raise _shutting_down()
        # Admitted even if the client has just gone: following the run then cancels it at once.
        self.waited_s = time.monotonic() - self.since
        return _started(self.admit.result(), self.model, self.stream, waited_s=self.waited_s)


def _shutting_down() -> ApiError:
    message = "the server is shutting down; send the request again to resume its run"
    return ApiError(503, message, "server_shutting_down")


def _started(job: Job, model: str, stream: bool, *, waited_s: float | None) -> Job:
    waited = "" if waited_s is None else f", after {waited_s:.1f} s in the queue"
    log.info("request %s: %s (%s%s)", job.run_id, model, "stream" if stream else "no stream", waited)
    return job


def _follow(job: Job, gone: asyncio.Task[None]) -> asyncio.Queue[Progress | None]:
    """Follow ``job``'s progress until its end or until the client goes away (the last one leaving cancels it)."""
    queue = job.follow()

    def left(task: asyncio.Task[None]) -> None:
        if task.cancelled():  # the reply ended: stop following, the run goes on for others or is done
            job.unfollow(queue, disconnected=False)
            return
        log.info("request %s: client disconnected; its run stays resumable", job.run_id)
        job.unfollow(queue, disconnected=True)
        queue.put_nowait(None)

    gone.add_done_callback(left)
    return queue


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return ApiError(exc.status_code, str(exc.detail), codes.get(exc.status_code, "http_error")).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return ApiError(500, "internal server error", "server_error").response()
