"""Pages only for requests addressed to this viewer by a name of its own: a web page elsewhere whose domain is made
to resolve to 127.0.0.1 (DNS rebinding) would otherwise read every prompt and reply the viewer shows."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
# Listening on every address: the user chose to be reached by any name.
WILDCARDS = frozenset({"0.0.0.0", "::", "[::]"})


def host_name(header: str) -> str:
    """The name in a Host header, without its port (an IPv6 address keeps its brackets)."""
    if header.startswith("["):
        return header[: header.find("]") + 1].lower()
    return header.split(":", 1)[0].lower()


class HostCheck:
    """Answers 421 to a request whose Host names neither a loopback address nor the address listened on."""

    def __init__(self, app: ASGIApp, listening_on: str) -> None:
        self.app = app
        name = f"[{listening_on}]" if ":" in listening_on and not listening_on.startswith("[") else listening_on
        self.anyone = name.lower() in WILDCARDS
        self.names = LOOPBACK_NAMES | {name.lower()}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.anyone:
            header = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
            if host_name(header) not in self.names:
                body = b"this viewer answers requests addressed to its own address only\n"
                headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": 421, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
