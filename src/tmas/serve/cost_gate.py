"""The proxy's cost gate: a request whose run could make more upstream calls than the server allows is refused before
anything runs, in one line saying how many and how to ask for fewer. The same estimate as ``tmas solve``'s gate
(:mod:`tmas.planning.estimate`); a request that gives no parameters runs the method's question defaults (TMAS's
``quick`` preset), well under the default cap."""

from __future__ import annotations

import logging
from typing import Any

from tmas.config import Settings
from tmas.methods import create_method
from tmas.planning.estimate import estimate_point
from tmas.serve.api_errors import ApiError

log = logging.getLogger("tmas.serve")


def check_request_cost(method: str, params: dict[str, Any], settings: Settings, cap: int) -> None:
    """Raise a 400 when the run of ``method`` with ``params`` could make more than ``cap`` upstream calls (a method
    that states no count goes ahead, logged)."""
    point = estimate_point(method, create_method(method, params, embedded=settings.uses_local_model), settings, 1, None)
    if not point.calls.known:
        log.info("method %s states no calls per problem: its requests are not capped", method)
        return
    if point.most_calls > cap:
        raise ApiError(
            400,
            f"this request's run could make {point.most_calls:,} upstream calls (method {method!r}, parameters"
            f" {params or '{}'}); this server answers requests of at most {cap:,} (tmas serve --max-request-calls):"
            " ask for fewer calls in the request's tmas object",
            "cost_limit",
            "tmas",
        )
