"""HTTP helpers of the proxy and viewer tests (the servers themselves are in tmas.testing.web_servers)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tmas.testing.web_servers import AppThread, ProxyThread, wait_until
from tmas.view.runs import RunRef, discover

__all__ = ["AppThread", "ProxyThread", "get", "post", "run_ref_for", "wait_until"]


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
