"""Stopping cleanly on Ctrl-C (SIGINT) and SIGTERM (what ``timeout``, Slurm and Kubernetes send): the work in progress
is cancelled, so its calls are closed (the servers abort them), a local server the command started is stopped and
every finished call stays in the run's store; then the command says how to go on and exits 130 or 143.

:func:`run` is ``asyncio.run`` with both signals cancelling the work; it raises :class:`Stopped`, which a command
gives the line to continue with (:meth:`Stopped.saying`). Outside it, :func:`install` makes both signals raise a
``KeyboardInterrupt``-like :class:`Stopped` in the synchronous code around the runs.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

from tmas.cli.outcome import EXIT_INTERRUPTED, EXIT_TERMINATED, NOTHING_STARTED, stop_line

T = TypeVar("T")

NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

# Whether the command has begun work that keeps what it finishes (a run, a pilot, a grading: :func:`run` without
# ``keeps=False``); a stop before any says that nothing was started, not that finished work is kept.
_began = False


class Stopped(BaseException):
    """A signal stopped the command. A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` on
    the way out (a method's own error handling included) takes it for a failure."""

    def __init__(self, signum: int, next_step: str | None = None) -> None:
        super().__init__(signum)
        self.signum = signum
        self.next_step = next_step

    @property
    def exit_code(self) -> int:
        return EXIT_TERMINATED if self.signum == signal.SIGTERM else EXIT_INTERRUPTED

    def saying(self, next_step: str) -> Stopped:
        """The same stop, with what to do next (e.g. the resume command)."""
        return Stopped(self.signum, next_step)

    def line(self) -> str:
        name = NAMES.get(signal.Signals(self.signum), f"signal {self.signum}")
        if self.next_step:
            return stop_line(name, self.next_step)
        return stop_line(name, "finished work is kept" if _began else NOTHING_STARTED)


def install() -> None:
    """SIGTERM, and Ctrl-C where it is not ignored, raise :class:`Stopped` wherever the command is (:func:`run`
    handles them within its event loop); the command line's own handling of ``KeyboardInterrupt`` would end it
    silently. The command has begun no work yet (:meth:`Stopped.line`)."""
    global _began
    _began = False
    signal.signal(signal.SIGTERM, _raise_stopped)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_stopped)


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


class _Again(SystemExit):
    """A second signal while the work winds down: out of the event loop at once (a ``SystemExit``, which asyncio
    lets through its callbacks), then told as the first one is (:func:`run`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run(work: Coroutine[Any, Any, T], *, keeps: bool = True) -> T:
    """``asyncio.run(work)``; on SIGINT or SIGTERM the work is cancelled (its ``finally`` blocks and context managers
    run: calls closed, a local server stopped, stores closed) and :class:`Stopped` raised. A second signal while it
    winds down cuts the wind-down short (what it still awaits is cancelled again: a local server is killed at once)
    and raises :class:`Stopped` all the same, so the command still says what was kept and how to go on.
    ``keeps=False``: the work stores nothing (a probe of an endpoint), so a stop in or after it alone says that
    nothing was started."""
    global _began
    _began = _began or keeps
    try:
        return asyncio.run(_cancellable(work))
    except _Again as again:
        raise Stopped(again.signum) from None


async def _cancellable(work: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    got: list[int] = []

    def stop(signum: int) -> None:
        got.append(signum)
        if len(got) > 1:
            raise _Again(signum)
        task.cancel()

    # A signal the command was started ignoring (a background job's Ctrl-C) stays ignored.
    previous = {sig: signal.getsignal(sig) for sig in NAMES if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in previous:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await work
    except asyncio.CancelledError:
        if len(got) == 1:
            raise Stopped(got[0]) from None
        # After a second signal asyncio.run cancels the wind-down; its end is no error of its own (run says it).
        raise
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
