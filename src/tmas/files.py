"""Files put in place whole: one writer for every file tmas replaces (a pool's, credits, a router, a sweep's manifest,
an export, the model cache), so that none is ever found empty, torn or missing after a crash or a power loss; and a
folder written whole (a converted checkpoint) synced before it is renamed into place.

The new contents go to a hidden file beside the target (same folder, so the rename cannot cross file systems), are
flushed and synced to disk, then renamed over the target, and the folder is synced so that the rename itself
survives a power loss. A write that fails part way (an error, a full disk) removes its hidden file and leaves the
target as it was.

And where a command keeps a directory of output (a run, a sweep, a served request's runs, a report):
:func:`check_out_dir`, before the command spends anything, so a path that cannot be one is said at once in one line
naming it, not after an estimate, a run or its grading in the system's words about a path that does not exist.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal, overload

from tmas.errors import InputError


def sync_dir(folder: Path) -> None:
    """Sync ``folder``'s entries to disk: the renames and creations in it survive a power loss. Where the platform
    or file system cannot sync a folder (Windows, some network file systems), nothing more can be done: the write
    itself stands."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_tree(folder: Path) -> None:
    """Sync every file under ``folder`` and every folder's entries, deepest first: a folder written by another
    library (a converted checkpoint) before it is renamed into place whole."""
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_symlink():
            continue
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            sync_dir(path)
    sync_dir(folder)


@overload
def replacing(path: Path, mode: Literal["w"] = "w") -> contextlib.AbstractContextManager[IO[str]]: ...


@overload
def replacing(path: Path, mode: Literal["wb"]) -> contextlib.AbstractContextManager[IO[bytes]]: ...


def replacing(path: Path, mode: Literal["w", "wb"] = "w") -> contextlib.AbstractContextManager[IO[str] | IO[bytes]]:
    """A file to write ``path``'s new contents to (UTF-8 text with ``mode`` "w", bytes with "wb"); they replace
    ``path`` when the block ends, durably (see the module's docstring), and never where the block raised."""
    return _replacing(path, mode)


@contextlib.contextmanager
def _replacing(path: Path, mode: Literal["w", "wb"]) -> Iterator[IO[str] | IO[bytes]]:
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with part.open(mode, encoding="utf-8" if mode == "w" else None) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        part.replace(path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path``'s contents with ``data`` (text as UTF-8), durably and whole (see the module's docstring)."""
    if isinstance(data, str):
        with replacing(path, "w") as text:
            text.write(data)
    else:
        with replacing(path, "wb") as raw:
            raw.write(data)


def check_out_dir(path: Path, kept: str, flag: str | None = None) -> None:
    """:class:`InputError` naming ``path`` (after the ``flag`` that gave it, where one did) where ``kept`` ("a run is
    kept in a directory") cannot be: a file there or above it, or a nearest existing folder this process may not
    write in."""
    named = f"{flag} {path}" if flag else str(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{named}: a file, not a directory: {kept} (choose another)")
    check_creatable(path, flag)


def check_creatable(path: Path, flag: str | None = None) -> None:
    """:class:`InputError` naming ``path`` (after the ``flag`` that gave it, where one did) where it cannot be made:
    a file above it, or a nearest existing folder this process may not write in."""
    named = f"{flag} {path}" if flag else str(path)
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{named}: {existing} is a file, not a directory (choose another)")
    if not path.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{named}: cannot create it in {existing}: permission denied")
