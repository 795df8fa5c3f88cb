"""A simulated OpenAI-compatible server on loopback, for tests and benchmarks.

``SimServer`` runs the aiohttp app (tmas.testing.sim_routes) on its own event loop in a daemon thread, so synchronous
and async tests alike talk real HTTP to it. ``python -m tmas.testing.sim_server`` serves the same app from the
command line.

All request handling happens on the server's loop thread; the recorder (tmas.testing.sim_stats) guards what other
threads read, so methods such as ``stats()`` are safe to call from the test thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web

from tmas.testing.personas import PERSONAS
from tmas.testing.script import SimScript
from tmas.testing.sim_routes import SimApp
from tmas.testing.sim_stats import LoggedRequest, SimStats

__all__ = ["LoggedRequest", "SimApp", "SimServer", "SimStats", "main"]

_SHUTDOWN_TIMEOUT_S = 0.25  # hung "timeout" faults must not hold up stop()


# ---- running it ---------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    # Bound in the caller's thread so "address in use" surfaces right there, and port 0 resolves at once.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


# aiohttp's own idle keep-alive timeout, kept where none is asked for.
_AIOHTTP_KEEPALIVE_S = 75.0


async def _start_site(app: SimApp, sock: socket.socket, keepalive_timeout: float | None = None) -> web.AppRunner:
    # No access log (it costs more than the request itself); cancel handlers whose client went away so a hung
    # "timeout" fault does not linger after the client gave up.
    runner = web.AppRunner(
        app.build(),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        keepalive_timeout=_AIOHTTP_KEEPALIVE_S if keepalive_timeout is None else keepalive_timeout,
    )
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    return runner


async def _stop_sites(runner: web.AppRunner) -> None:
    for site in list(runner.sites):
        await site.stop()  # closes the listening socket only: the connections open go on


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class SimServer:
    """The simulator in a background thread: ``with SimServer(script) as sim: ... sim.base_url ...``.

    ``keepalive_timeout``: seconds an idle keep-alive connection stays open before the server closes it (None:
    aiohttp's 75). The servers' own: uvicorn under vLLM (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5) and SGLang (5), and
    cpp-httplib under llama-server (``CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND``, 5). ``keepalive_max_requests``: the
    server closes a connection after answering that many requests on it (cpp-httplib's
    ``CPPHTTPLIB_KEEPALIVE_MAX_COUNT``); None: no limit, as uvicorn. With these a test reproduces a client reusing a
    connection the server has just closed."""

    def __init__(
        self,
        script: SimScript | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        keepalive_timeout: float | None = None,
        keepalive_max_requests: int | None = None,
    ) -> None:
        self.app = SimApp(script, keepalive_max_requests=keepalive_max_requests)
        self.keepalive_timeout = keepalive_timeout
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._start_lock = threading.Lock()

    @property
    def url(self) -> str:
        """Root URL, for the control endpoints (``/_sim/...``, ``/health``)."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL, ending in ``/v1``."""
        return f"{self.url}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> SimServer:
        """Start serving; returns once the socket is listening. Idempotent."""
        with self._start_lock:
            if self.running:
                return self
            sock = _bind(self.host, self.port)
            self.port = sock.getsockname()[1]
            ready = threading.Event()
            failure: list[BaseException] = []
            self._thread = threading.Thread(
                target=self._run, args=(sock, ready, failure), name=f"tmas-sim-{self.port}", daemon=True
            )
            self._thread.start()
            ready.wait()
            if failure:
                self._thread.join()
                self._thread = None
                raise RuntimeError(f"simulated server failed to start: {failure[0]}") from failure[0]
            return self

    def _run(self, sock: socket.socket, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = loop.run_until_complete(_start_site(self.app, sock, self.keepalive_timeout))
        except BaseException as exc:
            failure.append(exc)
            sock.close()
            loop.close()
            ready.set()
            return
        self._loop, self._runner = loop, runner
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self._loop = self._runner = None

    def stop(self) -> None:
        """Stop serving and join the thread (requests still hanging are cancelled). Idempotent."""
        with self._start_lock:
            thread, loop = self._thread, self._loop
            if thread is None:
                return
            if thread is threading.current_thread():
                raise RuntimeError("SimServer.stop() called from its own server thread")
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed under us
                    loop.call_soon_threadsafe(loop.stop)
            thread.join()
            self._thread = None

    def stop_listening(self) -> None:
        """Take no new connection and go on serving the requests in flight, as a server shutting down does: uvicorn
        (under vLLM and SGLang) closes its sockets and then waits for the requests it holds (``uvicorn/server.py``,
        ``Server.shutdown``). New connections are refused until :meth:`stop` and :meth:`start`."""
        loop, runner = self._loop, self._runner
        if loop is None or runner is None:
            return
        asyncio.run_coroutine_threadsafe(_stop_sites(runner), loop).result()

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> SimServer:
        # start() and stop() block briefly on the server thread: keep the caller's event loop free meanwhile.
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    # ---- control (safe from any thread) ----------------------------------------------------------

    @property
    def script(self) -> SimScript:
        return self.app.script

    def set_script(self, script: SimScript) -> None:
        self.app.set_script(script)

    def reset(self) -> None:
        self.app.reset()

    def stats(self) -> SimStats:
        return self.app.stats()

    @property
    def requests(self) -> list[LoggedRequest]:
        """A snapshot of the request log, oldest first."""
        return self.app.requests()

    def chat_bodies(self, role: str | None = None) -> list[dict[str, Any]]:
        """The bodies of the chat completions received (of ``role`` only, when given), oldest first: what tests
        assert to prove configuration reached the wire. The log keeps the last ``SimScript.log_limit`` requests."""
        return [r.body for r in self.app.requests() if r.endpoint == "chat" and (role is None or r.role == role)]

    def embedding_bodies(self) -> list[dict[str, Any]]:
        """The bodies of the embeddings requests received, oldest first (as :meth:`chat_bodies`)."""
        return [r.body for r in self.app.requests() if r.endpoint == "embeddings"]


# ---- command line -------------------------------------------------------------------------------


async def _serve_forever(app: SimApp, host: str, port: int, keepalive_timeout: float | None = None) -> None:
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    runner = await _start_site(app, sock, keepalive_timeout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"http://{_url_host(host)}:{bound_port}/v1", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tmas.testing.sim_server",
        description="Serve a simulated OpenAI-compatible endpoint until SIGINT/SIGTERM.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default 8000)")
    parser.add_argument("--script", type=Path, help="SimScript as a JSON file")
    parser.add_argument("--latency", type=float, help="fixed seconds per call (overrides the script)")
    parser.add_argument("--seed", type=int, help="fault / sampling seed (overrides the script)")
    parser.add_argument(
        "--persona",
        choices=list(PERSONAS),
        help="answer in this server's shapes (overrides the script)",
    )
    parser.add_argument(
        "--keepalive-timeout", type=float, help="seconds an idle keep-alive connection stays open (default 75)"
    )
    args = parser.parse_args(argv)

    try:
        data: dict[str, Any] = json.loads(args.script.read_text()) if args.script else {}
        if args.latency is not None:
            data["latency_s"] = args.latency
        if args.seed is not None:
            data["seed"] = args.seed
        if args.persona is not None:
            data["persona"] = args.persona
        script = SimScript.model_validate(data)
        app = SimApp(script)
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        print(f"error: bad script: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_forever(app, args.host, args.port, args.keepalive_timeout))
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
