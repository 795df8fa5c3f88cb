"""HTTP helpers of the proxy and viewer tests (the servers themselves are in tmas.testing.web_servers)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio.to_thread

from tmas.testing.web_servers import AppThread, ProxyThread, wait_until
from tmas.view.runs import RunRef, discover

__all__ = ["AppThread", "HeldRequests", "ProxyThread", "get", "post", "run_ref_for", "wait_until"]


class HeldRequests:
    """An ASGI app in front of ``app`` that holds every request whose path ends with ``suffix`` until ``release()``:
    ``arrived`` is set when the first one is held, so a test knows a page's request was made and not yet answered.
    As a context manager (entered inside the server's), it releases them on the way out, whatever happened."""

    def __init__(self, app: Any, suffix: str) -> None:
        self.app, self.suffix = app, suffix
        self.arrived, self.released = threading.Event(), threading.Event()

    def release(self) -> None:
        self.released.set()

    def __enter__(self) -> HeldRequests:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith(self.suffix) and not self.released.is_set():
            self.arrived.set()
            await anyio.to_thread.run_sync(self.released.wait)
        await self.app(scope, receive, send)


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
