"""The proxy and the viewer on loopback, each in a thread of its own, for tests and benchmarks (serve extra)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import uvicorn

from tmas.config import Settings
from tmas.serve.launch import ServeOptions, serve

T = TypeVar("T")


def free_port() -> int:
    """A port free now, for a server in another process that must be told its port. It is let go before that
    server binds it, so another process may take it meanwhile: a server in this process binds port 0 instead
    (:class:`ProxyThread`, :class:`AppThread`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bound_port(server: uvicorn.Server | None) -> int | None:
    """The port a started uvicorn server listens on (it was given port 0); None before it has started."""
    if server is None or not server.started:
        return None
    return int(server.servers[0].sockets[0].getsockname()[1])


def wait_until(check: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll ``check`` until it returns something true (which is returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class ProxyThread:
    """``tmas serve`` (the real launch code) in a thread; ``url`` is its base URL."""

    def __init__(self, settings: Settings, options: ServeOptions, *, start_s: float = 20.0) -> None:
        """``start_s``: how long it may take to answer ``/health`` (a model loaded in process takes longer)."""
        options.port = 0  # the kernel picks a free port as it binds; ``url`` and ``options.port`` name it once started
        self.options = options
        self.start_s = start_s
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._main, args=(settings,), daemon=True)

    def _main(self, settings: Settings) -> None:
        def keep(server: uvicorn.Server) -> None:
            self._server = server

        try:
            asyncio.run(serve(settings, self.options, on_start=keep))
        except BaseException as exc:
            self._failure.append(exc)

    def __enter__(self) -> ProxyThread:
        self._thread.start()

        def up() -> bool:
            if self._failure:
                raise self._failure[0]
            port = _bound_port(self._server)
            if port is None:
                return False
            self.url, self.options.port = f"http://127.0.0.1:{port}", port
            return _answers(f"{self.url}/health")

        wait_until(up, self.start_s, what="the proxy to start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=20)


class AppThread:
    """Any ASGI app (the viewer) served by uvicorn in a thread."""

    def __init__(self, app: Any) -> None:
        # Port 0: the kernel picks a free port as the server binds it; ``url`` names it once started.
        self.url = ""
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> AppThread:
        self._thread.start()
        port = wait_until(lambda: _bound_port(self._server), what="the viewer to start")
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=20)
