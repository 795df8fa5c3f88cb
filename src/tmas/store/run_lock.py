"""One process at a time runs a run: two that resumed one directory at once would each solve its unfinished problems
and send their calls twice, and a second one refused only once it starts solving would already have written its own
setup over the running one's. So the lock is taken before a run's store is written at all (:func:`tmas.runner.
prepare_run`), held by the store it opens until that store is closed (:meth:`tmas.store.run_store.RunStore.hold`),
and taken by :func:`tmas.runner.run_problems` where its store does not hold it yet. Readers (the viewer, a report, an
export) take no lock.

The lock is an advisory ``flock`` on ``.run.lock`` in the run directory, so it goes with the process however it
ends (a kill included) and a stale file holds nothing. The file names the holder's process id, and what it is doing
where its taker said (a pool's build store is locked by the command writing the pool), for the message.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from tmas.errors import InputError

LOCK_NAME = ".run.lock"


class LockHeld(InputError):
    """The lock is held (by another process, or by this one for another call): its holder's process id and what it
    said it is doing (empty where it said nothing)."""

    def __init__(self, message: str, pid: str, doing: str) -> None:
        super().__init__(message)
        self.pid = pid
        self.doing = doing


class RunLock:
    """The lock of the run in ``run_dir``, taken by :meth:`acquire` and let go by :meth:`release` (or the block).
    ``doing`` (a command, say) is written beside the process id for another taker's message."""

    def __init__(self, run_dir: Path, doing: str = "") -> None:
        self.run_dir = run_dir
        self.doing = doing
        self._handle: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._handle is not None

    def acquire(self) -> None:
        """Take the lock; :class:`LockHeld` at once where another process holds it."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock to take
            return
        handle = (self.run_dir / LOCK_NAME).open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            pid, _, doing = handle.read().strip().partition(" ")
            handle.close()
            if pid == str(os.getpid()):
                # Taken again by the process holding it: a second run of this directory in it (two API calls at
                # once, say) while the first one goes on.
                running_it = "this process is running this run already (an earlier call on it has not ended)"
                message = f"{self.run_dir}: {running_it}; wait for that call to end before running it again"
            else:
                running_it = f"another tmas process (pid {pid or 'unknown'}) is running this run"
                message = f"{self.run_dir}: {running_it}; wait for it to end or stop it"
            raise LockHeld(message, pid or "unknown", doing.strip()) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {self.doing}".strip())
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            import fcntl

            # Let go before closing: a child forked meanwhile shares the open file, and would hold it on.
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def running(run_dir: Path) -> Iterator[None]:
    """Hold the run's lock while the block runs; :class:`LockHeld` at once where another process holds it."""
    with RunLock(run_dir):
        yield
