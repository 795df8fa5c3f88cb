"""The proxy's Prometheus metrics (``GET /metrics``), in a registry of its own per app.

A per-app :class:`CollectorRegistry`, never the process-wide one: two proxies in one process (tests, a benchmark)
must not count into each other's figures nor collide on registration.

Names follow Prometheus' conventions: the ``tmas_`` prefix, ``_total`` on counters, base units (seconds, tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tmas.llm.types import Completion

# What the request counter says of a request whose model named no known method (a bad body, an unknown method):
# one value, so that clients cannot grow the label set without bound.
UNKNOWN_METHOD = "unknown"
# The status of a request whose client went away before its reply (nginx's convention; nothing is sent).
CLIENT_CLOSED = 499
# The cause of an upstream call that succeeded.
CALL_OK = "ok"

# Request latencies run from a replayed one-call CoT (milliseconds) to TMAS on a thinking model (an hour or more).
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
# One upstream call: a short verification to a long thinking reply.
CALL_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
QUEUE_BUCKETS_S = (0.0, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
TOKEN_KINDS = ("prompt", "cached", "completion", "reasoning")


class ServeMetrics:
    """Every figure ``/metrics`` shows. ``queued`` and ``in_flight`` are read at each scrape."""

    def __init__(self, *, queued: Callable[[], int], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tmas_requests", "Chat completion requests answered, by method and HTTP status.", ["method", "status"],
            registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "tmas_request_duration_seconds",
            "Time from a chat completion request's arrival to the end of its reply (queue wait included).",
            ["method"],
            buckets=REQUEST_BUCKETS_S,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "tmas_queue_wait_seconds",
            "Time a request waited for a problem slot before its run started (0 when one was free).",
            buckets=QUEUE_BUCKETS_S,
            registry=r,
        )
        queue = Gauge("tmas_queue_depth", "Requests waiting for a problem slot now.", registry=r)
        queue.set_function(lambda: float(queued()))
        active = Gauge("tmas_problems_in_flight", "Requests' runs being solved now.", registry=r)
        active.set_function(lambda: float(in_flight()))
        self.upstream_calls = Counter(
            "tmas_upstream_calls",
            "Upstream calls that ended, by agent role and cause of failure ('ok' when it succeeded).",
            ["role", "cause"],
            registry=r,
        )
        self.upstream_retries = Counter(
            "tmas_upstream_retries",
            "Upstream attempts that failed and were retried, by cause of failure.",
            ["cause"],
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "tmas_upstream_call_duration_seconds",
            "Time of one upstream call, its retries included, by agent role.",
            ["role"],
            buckets=CALL_BUCKETS_S,
            registry=r,
        )
        self.tokens = Counter(
            "tmas_upstream_tokens",
            "Tokens of the upstream calls as the upstream reported them, by kind (cached and reasoning tokens are"
            " part of the prompt and completion tokens).",
            ["kind"],
            registry=r,
        )
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind=kind)  # every kind shows from the start, at 0

    # ------------------------------------------------------------------------------------------- recording
    def request_done(self, method: str, status: int, seconds: float) -> None:
        self.requests.labels(method=method, status=str(status)).inc()
        self.request_seconds.labels(method=method).observe(seconds)

    def admitted(self, waited_s: float) -> None:
        self.queue_wait_seconds.observe(waited_s)

    def call_done(self, completion: Completion) -> None:
        """One upstream call made durable by a run (a call replayed from the store is not one)."""
        role = completion.key.role
        cause = CALL_OK if completion.ok else (completion.error_cause or "error")
        self.upstream_calls.labels(role=role, cause=cause).inc()
        for cause in completion.retry_causes:
            self.upstream_retries.labels(cause=cause).inc()
        self.upstream_seconds.labels(role=role).observe(completion.latency_s)
        usage = completion.usage
        counts = {
            "prompt": usage.prompt_tokens,
            "cached": usage.cached_prompt_tokens,
            "completion": usage.completion_tokens,
            "reasoning": usage.reasoning_tokens,
        }
        for kind, count in counts.items():
            if count:
                self.tokens.labels(kind=kind).inc(count)

    # ------------------------------------------------------------------------------------------- the page
    def page(self) -> tuple[bytes, str]:
        """The text exposition format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
