"""One writer of a pool at a time. ``tmas pool build`` and ``tmas pool prune`` each read the pool, work (calls to the
judge and the summarizer), then save the pool as they have it as its next version: two at once would each save
their own, the later losing what the earlier added or removed. So both hold one lock, that of the pool's build store
``POOL.build/`` (:mod:`tmas.store.run_lock`), from before they read the pool (and before their first call) to after
they save it; a second is refused at once in one line naming the command holding it. Readers (a run retrieving from
the pool, ``tmas pool show`` and ``search``, a prune's ``--dry-run``) take no lock: one that a save overlaps reads
the pool again (:meth:`tmas.memory.pool.Pool.open`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tmas.errors import InputError
from tmas.store.run_lock import LockHeld, RunLock


def build_dir_for(pool: Path) -> Path:
    """Where a pool's build store lives: beside it, ``POOL.build/``."""
    pool = pool.resolve()  # "." and "/" have no name of their own
    if not pool.name:
        raise InputError(f"-o {pool}: give the pool a directory of its own")
    return pool.with_name(pool.name + ".build")


@contextmanager
def writing(pool: Path, command: str) -> Iterator[Path]:
    """Hold the lock of the pool's writers while the block runs, as ``command`` (named in another's refusal); yields
    the build store's folder (made if missing). :class:`InputError` at once where another process holds it."""
    build_dir = build_dir_for(pool)
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(build_dir, doing=command)
    try:
        lock.acquire()
    except LockHeld as held:
        holder = held.doing or "another tmas process"
        raise InputError(
            f"{pool}: {holder} (pid {held.pid}) is writing this pool; wait for it to end or stop it"
        ) from None
    try:
        yield build_dir
    finally:
        lock.release()
