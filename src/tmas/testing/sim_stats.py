"""What the simulated server counts and logs: its counters, its request log and the spans of problems in flight.

Requests are handled on the server's loop thread while tests read the figures from theirs: a lock guards every
structure here, so :class:`SimRecorder`'s methods are safe from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, NamedTuple

from pydantic import BaseModel


class SimStats(BaseModel):
    """Counters since start or the last reset."""

    total_requests: int = 0  # chat completions + embeddings received
    completed: int = 0  # answered with a 200 and a well-formed body (garbage/truncate faults included)
    errors: int = 0  # rejected as invalid (bad JSON, context too long, ...), not counting injected faults
    in_flight: int = 0
    max_in_flight: int = 0
    # Problems (X-Tmas-Problem) in flight at once, most ever: a problem is in flight from its first chat request's
    # arrival to the end of its latest answer so far, so the pauses between its calls count as in flight too.
    max_problems_in_flight: int = 0
    # llama-server's `id_slot`: the most requests in flight at once that named one slot (a real server would queue
    # the extra ones inside itself, where the client's timeouts run).
    max_in_flight_per_slot: int = 0
    by_role: dict[str, int] = {}
    faults: dict[str, int] = {}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Of completion_tokens, the reasoning (reported by the personas as each server does, or hidden by OpenAI).
    reasoning_tokens: int = 0
    # Of prompt_tokens, those served from this replica's prefix cache (SimScript.prefix_cache_tokens).
    cached_prompt_tokens: int = 0
    # Request fields the persona's server does not know and ignored, by name (vLLM logs them).
    ignored_fields: dict[str, int] = {}
    # Requests whose client went before their end (a stream closed part way, a prompt still in prefill, an unstreamed
    # reply still generating): a real server aborts them, quietly; they are not completed.
    disconnected: int = 0
    # SimScript.max_running: chat requests generating now, waiting now for a turn, the most ever waiting at once,
    # how many had to wait at all, and how many left the queue because their client closed the connection
    # (the server aborts them: they are neither completed nor answered).
    running: int = 0
    waiting: int = 0
    max_waiting: int = 0
    queued: int = 0
    aborted: int = 0
    # /v1/models requests received (what a client asks before its calls: whether the server answers, what it serves).
    models_requests: int = 0
    # Requests refused for a missing or wrong API key (SimScript.api_key); /v1/models requests answered 503 while the
    # model was "loading" (SimScript.models_unavailable), and requests to the other routes refused so meanwhile.
    unauthorized: int = 0
    models_unavailable: int = 0
    refused_while_loading: int = 0
    # Distinct client connections (by the client's address and port) that carried chat requests.
    connections: int = 0
    # The engine's progress counters, as its /metrics shows them: prompt tokens of the requests it began generating,
    # and tokens generated, counted as they stream out (an unstreamed reply's when it is answered), plus the work it
    # does on other sequences meanwhile (a request's latency, a preempted stream's pause: one token each few ms).
    # A wedged engine's stand still.
    engine_prompt_tokens: int = 0
    engine_generated_tokens: int = 0
    # Chat requests held now at the script's gate (SimScript.hold_after).
    held: int = 0


class LoggedRequest(BaseModel):
    """One entry of the request log."""

    endpoint: str  # "chat" or "embeddings"
    role: str
    problem_id: str | None
    body: dict[str, Any]
    received_at: float  # time.time()
    # The Authorization header as received (tests prove a key was sent without it reaching any artefact).
    authorization: str | None = None
    # Every other request header, by its lower-cased name (e.g. a router's session key).
    headers: dict[str, str] = {}


class LogEntry(NamedTuple):
    """A request log entry as kept on the hot path; turned into :class:`LoggedRequest` only when someone reads it."""

    endpoint: str
    role: str
    problem_id: str | None
    body: dict[str, Any]
    received_at: float
    authorization: str | None
    headers: dict[str, str]


class SimRecorder:
    """The server's counters, request log, problem spans and slots in use, behind one lock."""

    def __init__(self, log_limit: int) -> None:
        self._lock = threading.Lock()
        self._log: deque[LogEntry] = deque(maxlen=log_limit)
        self._stats = SimStats()
        # Problem id -> [first arrival, latest answer's end, chat requests open] (time.monotonic()).
        self._spans: dict[str, list[float]] = {}
        # id_slot -> requests naming it now in flight; a request's id -> the slot it named, until it is answered.
        self._slots: dict[str, int] = {}
        self._request_slots: dict[int, str] = {}
        self._peers: set[object] = set()

    # ---- reading and resetting -------------------------------------------------------------------

    def stats(self) -> SimStats:
        with self._lock:
            return self._stats.model_copy(
                update={
                    "by_role": dict(self._stats.by_role),
                    "faults": dict(self._stats.faults),
                    "ignored_fields": dict(self._stats.ignored_fields),
                    "max_problems_in_flight": self._most_problems_at_once(),
                }
            )

    def requests(self, last: int | None = None) -> list[LoggedRequest]:
        with self._lock:
            entries = list(self._log)
        if last is not None:
            entries = entries[-last:] if last > 0 else []
        return [LoggedRequest.model_construct(**entry._asdict()) for entry in entries]

    def reset(self) -> None:
        """Clear the counters, the log and the spans; requests in flight (running, waiting) stay counted as such."""
        with self._lock:
            old = self._stats
            self._stats = SimStats(
                in_flight=old.in_flight,
                max_in_flight=old.in_flight,
                running=old.running,
                waiting=old.waiting,
                max_waiting=old.waiting,
                # A server's counters count from its start, whatever a test resets.
                engine_prompt_tokens=old.engine_prompt_tokens,
                engine_generated_tokens=old.engine_generated_tokens,
                held=old.held,
            )
            self._log.clear()
            self._spans.clear()
            self._peers.clear()

    def resize_log(self, limit: int) -> None:
        with self._lock:
            if self._log.maxlen != limit:
                self._log = deque(self._log, maxlen=limit)

    def _most_problems_at_once(self) -> int:
        """The most problem spans that overlap (called under the lock). A span still open ends now."""
        now = time.monotonic()
        # At equal times an end sorts before a start: a problem answered as the next one arrives is not overlapping.
        events = sorted(
            [(start, 1) for start, _, _ in self._spans.values()]
            + [(end if open_ == 0 else now, -1) for _, end, open_ in self._spans.values()]
        )
        most = running = 0
        for _, step in events:
            running += step
            most = max(most, running)
        return most

    # ---- recording (from the server's loop thread) -----------------------------------------------

    def log(self, entry: LogEntry) -> None:
        with self._lock:
            self._log.append(entry)

    def connection(self, peer: object) -> None:
        """A chat request arrived on the connection from ``peer`` (the client's address and port)."""
        with self._lock:
            if peer not in self._peers:
                self._peers.add(peer)
                self._stats.connections = len(self._peers)

    def enter(self, role: str) -> None:
        with self._lock:
            stats = self._stats
            stats.total_requests += 1
            stats.in_flight += 1
            if stats.in_flight > stats.max_in_flight:
                stats.max_in_flight = stats.in_flight
            stats.by_role[role] = stats.by_role.get(role, 0) + 1

    def leave(self) -> None:
        with self._lock:
            self._stats.in_flight -= 1

    def problem_enter(self, problem: str | None) -> None:
        if problem is None:
            return
        with self._lock:
            span = self._spans.setdefault(problem, [time.monotonic(), 0.0, 0])
            span[2] += 1

    def problem_leave(self, problem: str | None) -> None:
        if problem is None:
            return
        with self._lock:
            span = self._spans.get(problem)
            if span is not None:  # (a reset between arrival and answer dropped it)
                span[1] = time.monotonic()
                span[2] -= 1

    def slot_enter(self, request_id: int, slot: Any) -> None:
        if slot is None:
            return
        with self._lock:
            self._request_slots[request_id] = slot = str(slot)
            self._slots[slot] = self._slots.get(slot, 0) + 1
            self._stats.max_in_flight_per_slot = max(self._stats.max_in_flight_per_slot, self._slots[slot])

    def slot_leave(self, request_id: int) -> None:
        with self._lock:
            slot = self._request_slots.pop(request_id, None)
            if slot is not None:
                self._slots[slot] -= 1

    def count_fault(self, kind: str) -> None:
        with self._lock:
            self._stats.faults[kind] = self._stats.faults.get(kind, 0) + 1

    def hold(self, change: int) -> None:
        """One more (+1) or one fewer (-1) chat request held at the gate."""
        with self._lock:
            self._stats.held += change

    def count_disconnect(self) -> None:
        with self._lock:
            self._stats.disconnected += 1

    def queue_state(self, running: int, waiting: int, *, entered_queue: bool = False, aborted: bool = False) -> None:
        """The run queue's counts now; ``entered_queue``: one more request had to wait; ``aborted``: one left it."""
        with self._lock:
            stats = self._stats
            stats.running, stats.waiting = running, waiting
            stats.max_waiting = max(stats.max_waiting, waiting)
            stats.queued += entered_queue
            stats.aborted += aborted

    def count_unauthorized(self) -> None:
        with self._lock:
            self._stats.unauthorized += 1

    def count_models_request(self) -> None:
        with self._lock:
            self._stats.models_requests += 1

    def count_models_unavailable(self) -> None:
        with self._lock:
            self._stats.models_unavailable += 1

    def count_refused_while_loading(self) -> None:
        with self._lock:
            self._stats.refused_while_loading += 1

    def count_error(self) -> None:
        with self._lock:
            self._stats.errors += 1

    def count_ignored(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._stats.ignored_fields[name] = self._stats.ignored_fields.get(name, 0) + 1

    def prefilled(self, tokens: int) -> None:
        """The engine began generating a request of ``tokens`` prompt tokens."""
        with self._lock:
            self._stats.engine_prompt_tokens += tokens

    def generated(self, tokens: int) -> None:
        """The engine generated ``tokens`` more tokens."""
        with self._lock:
            self._stats.engine_generated_tokens += tokens

    def count_done(self, prompt_tokens: int, completion_tokens: int, reasoning: int = 0, cached: int = 0) -> None:
        with self._lock:
            stats = self._stats
            stats.completed += 1
            stats.prompt_tokens += prompt_tokens
            stats.completion_tokens += completion_tokens
            stats.reasoning_tokens += reasoning
            stats.cached_prompt_tokens += cached
