"""Pages only for requests addressed to this viewer by a name of its own: a web page elsewhere whose domain is made
to resolve to 127.0.0.1 (DNS rebinding) would otherwise read every prompt and reply the viewer shows."""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
# Listening on every address: reached by any of the machine's addresses, which it cannot list, so any address is
# its own; a name other than a loopback one is not (a rebinding page's domain would be, as every address includes
# loopback): to be reached by a name, listen on that name.
WILDCARDS = frozenset({"0.0.0.0", "::", "[::]"})
REFUSED = b"this viewer answers requests addressed to its own address only (--host NAME to be reached by NAME)\n"


def is_address(name: str) -> bool:
    """Whether a Host name is an IP address (an IPv6 one in brackets), not a domain name."""
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") and name.endswith("]") else name)
    except ValueError:
        return False
    return True


def host_name(header: str) -> str:
    """The name in a Host header, without its port (an IPv6 address keeps its brackets)."""
    if header.startswith("["):
        return header[: header.find("]") + 1].lower()
    return header.split(":", 1)[0].lower()


class HostCheck:
    """Answers 421 to a request whose Host names neither a loopback address nor the address listened on (listening
    on every address: nor any IP address)."""

    def __init__(self, app: ASGIApp, listening_on: str) -> None:
        self.app = app
        name = f"[{listening_on}]" if ":" in listening_on and not listening_on.startswith("[") else listening_on
        self.any_address = name.lower() in WILDCARDS
        self.names = LOOPBACK_NAMES | {name.lower()}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
            name = host_name(header)
            if name not in self.names and not (self.any_address and is_address(name)):
                body = REFUSED
                headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": 421, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
