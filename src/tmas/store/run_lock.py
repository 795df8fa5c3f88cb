"""One process at a time runs a run: two that resumed one directory at once would each solve its unfinished problems
and send their calls twice. Readers (the viewer, a report, an export) take no lock.

The lock is an advisory ``flock`` on ``.run.lock`` in the run directory, so it goes with the process however it
ends (a kill included) and a stale file holds nothing. The file names the holder's process id for the message.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tmas.errors import InputError

LOCK_NAME = ".run.lock"


@contextmanager
def running(run_dir: Path) -> Iterator[None]:
    """Hold the run's lock while the block runs; :class:`InputError` at once where another process holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock to take
        yield
        return
    path = run_dir / LOCK_NAME
    with path.open("a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise InputError(
                f"{run_dir}: another tmas process (pid {holder}) is running this run; wait for it to end or stop it"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
