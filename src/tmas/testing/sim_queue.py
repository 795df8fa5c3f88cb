"""The simulated server's run queue (``SimScript.max_running``): at most that many chat requests generate at once,
the others wait their turn in arrival order, as in a serving engine's scheduler or llama-server's slots.

Only the server's loop thread enters and leaves the queue; the counts go to the recorder after every change, so
tests read them from any thread (``SimStats.running``, ``waiting``, ``queued``, ``aborted``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from tmas.testing.sim_stats import SimRecorder


class RunQueue:
    """A FIFO limit on requests generating at once; ``limit`` None lets every request run at once (still counted)."""

    def __init__(self, recorder: SimRecorder) -> None:
        self._recorder = recorder
        self._running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _report(self, *, entered_queue: bool = False, aborted: bool = False) -> None:
        self._recorder.queue_state(self._running, len(self._waiters), entered_queue=entered_queue, aborted=aborted)

    def full(self, limit: int | None, max_waiting: int | None) -> bool:
        """Whether a request arriving now would wait behind ``max_waiting`` others already (SimScript.max_queued)."""
        if limit is None or max_waiting is None:
            return False
        waits = bool(self._waiters) or self._running >= limit
        return waits and len(self._waiters) >= max_waiting

    async def enter(self, limit: int | None) -> None:
        """Wait for a turn to generate. A request whose client goes away meanwhile is cancelled by the server
        (handler cancellation): it leaves the queue, counted as aborted, and never runs."""
        self.loop = asyncio.get_running_loop()
        if not self._waiters and (limit is None or self._running < limit):
            self._running += 1
            self._report()
            return
        turn: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(turn)
        self._report(entered_queue=True)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                # Its turn came just as it was cancelled: pass the turn on.
                self._running -= 1
                self.grant(limit)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(turn)
            self._report(aborted=True)
            raise

    def leave(self, limit: int | None) -> None:
        """A running request is done (answered, failed or cut off): the longest-waiting request takes its turn."""
        self._running -= 1
        self.grant(limit)
        self._report()

    def grant(self, limit: int | None) -> None:
        """Start waiting requests while there is room under ``limit`` (also after a script raised the limit)."""
        while self._waiters and (limit is None or self._running < limit):
            turn = self._waiters.popleft()
            if turn.done():  # cancelled while waiting; its handler removes nothing more
                continue
            self._running += 1
            turn.set_result(None)
        self._report()
