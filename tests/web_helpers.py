"""Servers for the proxy and viewer tests: each runs in a thread of its own, on a free loopback port."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import uvicorn

from tmas.config import Settings
from tmas.serve.launch import ServeOptions, serve
from tmas.view.runs import RunRef, discover


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ref_for(paths: list[Path], run_dir: Path) -> RunRef | None:
    """The viewer's ref (URL key) of ``run_dir`` among ``paths``."""
    return next((r for r in discover(paths) if r.path.resolve() == run_dir.resolve()), None)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_until(check: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class ProxyThread:
    """``tmas serve`` (the real launch code) in a thread; ``url`` is its base URL."""

    def __init__(self, settings: Settings, options: ServeOptions) -> None:
        options.port = free_port()
        self.options = options
        self.url = f"http://127.0.0.1:{options.port}"
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
            try:
                return get(f"{self.url}/health")[0] == 200
            except OSError:
                return False

        wait_until(up, what="the proxy to start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=20)


class AppThread:
    """Any ASGI app served by uvicorn in a thread (the viewer)."""

    def __init__(self, app: Any) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> AppThread:
        self._thread.start()
        wait_until(lambda: self._server.started, what="the viewer to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=20)
