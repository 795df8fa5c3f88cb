"""The problem slots of the proxy and the bounded first-come first-served queue in front of them.

A request that finds a free slot holds it at once; past the slots it waits in the queue, and only a full queue turns
it away (429 with ``Retry-After``). A slot freed goes to the longest waiting request. A waiter that goes away leaves
the queue; if a slot had already been handed to it, the slot goes on to the next one.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

from tmas.serve.api_errors import ApiError

# Retry-After bounds, in seconds: HTTP wants whole seconds, and past a minute a client had better give up than retry.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
# Weight of the newest slot hold in the mean hold time (an exponential moving average: recent runs count most).
_HOLD_WEIGHT = 0.2


class Admission:
    """``slots`` held at once at most, ``queue_size`` waiting at most, in arrival order."""

    def __init__(self, slots: int, queue_size: int) -> None:
        self.slots = slots
        self.queue_size = queue_size
        self.held = 0
        self.peak_queued = 0
        self.rejected = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._mean_hold_s: float | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def try_hold(self) -> bool:
        """Hold a free slot now when nobody is waiting for one (resumed runs at start-up do not queue)."""
        if self._closed or self._waiting or self.held >= self.slots:
            return False
        self.held += 1
        return True

    def enter(self) -> asyncio.Future[None] | None:
        """``None``: a slot is held now. Else the caller's place in the queue: a future done once it holds a slot.
        A full queue is a 429 whose ``Retry-After`` is about the time the queue takes to move one place."""
        if self.try_hold():
            return None
        if self._closed or len(self._waiting) >= self.queue_size:
            self.rejected += 1
            raise ApiError(
                429,
                f"{self.slots} problems in progress and {len(self._waiting)} requests waiting; retry later",
                "rate_limit_exceeded",
                headers={"Retry-After": str(self.retry_after_s())},
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self.peak_queued = max(self.peak_queued, len(self._waiting))
        return turn

    def leave(self, turn: asyncio.Future[None]) -> None:
        """A waiter gone (its client left, or it was cancelled): out of the queue; a slot handed to it goes on."""
        if turn in self._waiting:
            self._waiting.remove(turn)
        if turn.done() and not turn.cancelled():
            self.release()
        else:
            turn.cancel()

    def release(self, held_s: float | None = None) -> None:
        """A slot is free again (``held_s``: how long a run held it, for Retry-After); the next waiter gets it."""
        if held_s is not None:
            mean = self._mean_hold_s
            self._mean_hold_s = held_s if mean is None else mean + _HOLD_WEIGHT * (held_s - mean)
        self.held -= 1
        while self._waiting and not self._closed and self.held < self.slots:
            turn = self._waiting.popleft()
            if not turn.done():
                self.held += 1
                turn.set_result(None)

    def retry_after_s(self) -> int:
        """Seconds until a full queue has moved one place: the mean slot hold over the slots (one frees that often),
        rounded up, within 1-60 s; 1 s before any run has ended (nothing measured yet)."""
        if self._mean_hold_s is None:
            return RETRY_AFTER_MIN_S
        seconds = math.ceil(self._mean_hold_s / self.slots)
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, seconds))

    def close(self) -> None:
        """Shutting down: every waiter's place is cancelled, and nothing more is admitted."""
        self._closed = True
        while self._waiting:
            self._waiting.popleft().cancel()
