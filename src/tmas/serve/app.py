"""The proxy's HTTP side (Starlette): ``/v1/chat/completions``, ``/v1/models``, ``/health``.

Every reply that is not a success is OpenAI's error JSON with the matching status code; no traceback leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tmas.serve.api_errors import ApiError
from tmas.serve.jobs import Job, ServedRuns
from tmas.serve.observed_store import Progress
from tmas.serve.protocol import ChatBody, chunk_body, completion_body, split_model

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
    ) -> None:
        self.runs = runs
        self.methods = methods
        self.upstreams = upstreams
        self.token = token
        self.max_body_bytes = max_body_bytes

    def build(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ],
            exception_handlers={HTTPException: _http_error, Exception: _server_error},
        )

    # --------------------------------------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "active_problems": len(self.runs.active)})

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return exc.response()
        data = [
            {"id": f"{m}/{u}", "object": "model", "created": 0, "owned_by": "tmas"}
            for m in self.methods
            for u in self.upstreams
        ]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        try:
            self._authorize(request)
            body = ChatBody.parse(await self._read_body(request))
            method, upstream = split_model(body.model, set(self.methods), self.upstreams)
            job = self.runs.open(body, method, upstream)
        except ApiError as exc:
            return exc.response()
        log.info("request %s: %s (%s)", job.run_id, body.model, "stream" if body.stream else "no stream")
        queue = job.follow()
        watcher = asyncio.create_task(_watch_disconnect(request, job, queue))
        if body.stream:
            return StreamingResponse(
                self._stream(job, queue, watcher, body.model),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            while await queue.get() is not None:
                pass
            result = job.outcome()
        except ApiError as exc:
            return exc.response()
        except asyncio.CancelledError:
            # Only a server shutting down cancels a handler (a client going away is the watcher's business).
            message = "the server is shutting down; send the request again to resume its run"
            return ApiError(503, message, "server_shutting_down").response()
        finally:
            watcher.cancel()
            job.unfollow(queue, disconnected=False)
        extension = {"run_id": job.run_id, "answer": result.answer, "iterations": len(result.iterations)}
        extension["calls"] = result.calls
        return JSONResponse(completion_body(job.run_id, body.model, job.created, result.text, result.usage, extension))

    async def _stream(
        self, job: Job, queue: asyncio.Queue[Progress | None], watcher: asyncio.Task[None], model: str
    ) -> AsyncIterator[str]:
        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        created = job.created
        try:
            yield sse(chunk_body(job.run_id, model, created, {"role": "assistant", "content": ""}))
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if event is None:
                    break
                delta = {"reasoning_content": event.line() + "\n"}
                yield sse(chunk_body(job.run_id, model, created, delta, progress=event.model_dump()))
            try:
                result = job.outcome()
            except ApiError as exc:
                yield sse(exc.body())
            else:
                yield sse(chunk_body(job.run_id, model, created, {"content": result.text}))
                done = {"run_id": job.run_id, "answer": result.answer, "iterations": len(result.iterations)}
                yield sse(chunk_body(job.run_id, model, created, {}, finish_reason="stop", progress=done))
                yield sse(chunk_body(job.run_id, model, created, None, usage=result.usage))
            yield "data: [DONE]\n\n"
        finally:
            # Ended normally or the client went away (the watcher has then cancelled the run already).
            watcher.cancel()
            job.unfollow(queue, disconnected=False)

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


async def _watch_disconnect(request: Request, job: Job, queue: asyncio.Queue[Progress | None]) -> None:
    """Wait for the client to go away; then stop following the run (the last follower cancels it)."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                log.info("request %s: client disconnected; its run stays resumable", job.run_id)
                job.unfollow(queue, disconnected=True)
                queue.put_nowait(None)
                return


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return ApiError(exc.status_code, str(exc.detail), codes.get(exc.status_code, "http_error")).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return ApiError(500, "internal server error", "server_error").response()
