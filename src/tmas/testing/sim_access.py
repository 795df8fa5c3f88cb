"""Who may call the simulated server (``SimScript.api_key``) and whether its model is loaded yet
(``SimScript.models_unavailable``), each answered as the persona's server answers it.

The control routes (``/_sim/...``) are never guarded.
"""

from __future__ import annotations

from aiohttp import web


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token if scheme == "Bearer" else None


def auth_refusal(persona: str, path: str, header: str | None, key: str) -> web.Response | None:
    """The 401 a request to ``path`` with this Authorization ``header`` meets when the server was started with the
    API key ``key``, or None where it passes."""
    if path.startswith("/_sim/"):
        return None
    if persona in ("vllm", "sim"):
        # vllm/entrypoints/openai/api_server.py AuthenticationMiddleware: only paths under /v1 are guarded
        # (/health, /tokenize, /metrics stay open); the scheme is matched without regard to case.
        if not path.startswith("/v1"):
            return None
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() == "bearer" and token == key:
            return None
        return web.json_response({"error": "Unauthorized"}, status=401)
    if persona == "sglang":
        # python/sglang/srt/utils add_api_key_middleware: every path but /health* and /metrics, the same body.
        if path.startswith(("/health", "/metrics")) or _bearer(header) == key:
            return None
        return web.json_response({"error": "Unauthorized"}, status=401)
    if persona == "llama-server":
        # tools/server/server.cpp middleware_validate_api_key: public endpoints pass; the rest need "Bearer KEY".
        if path in ("/", "/health", "/v1/health", "/models", "/v1/models", "/api/tags") or _bearer(header) == key:
            return None
        error = {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
        return web.json_response({"error": error}, status=401)
    # OpenAI (not read from a source: the API's invalid_api_key error), every route but the simulator's /health.
    if path == "/health" or _bearer(header) == key:
        return None
    error = {"message": "Incorrect API key provided.", "type": "invalid_request_error", "param": None}
    return web.json_response({"error": {**error, "code": "invalid_api_key"}}, status=401)


def loading_response(persona: str) -> web.Response:
    """A request while the replica is still loading its model: 503 in the persona's error shape."""
    if persona == "llama-server":
        # tools/server/server-http.cpp middleware_server_state: every route, "Loading model", unavailable_error.
        error = {"code": 503, "message": "Loading model", "type": "unavailable_error"}
        return web.json_response({"error": error}, status=503)
    if persona == "sglang":
        body = {"object": "error", "message": "The server is not ready yet.", "type": "ServiceUnavailableError"}
        return web.json_response({**body, "param": None, "code": 503}, status=503)
    error = {"message": "The server is not ready yet.", "type": "ServiceUnavailableError", "param": None}
    return web.json_response({"error": {**error, "code": 503}}, status=503)
