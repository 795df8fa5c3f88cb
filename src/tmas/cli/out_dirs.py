"""Where a command writes a directory of output (a report): checked before the command spends anything, so a path
that cannot be one is said at once, not after a run and its grading."""

from __future__ import annotations

import os
from pathlib import Path

from tmas.errors import InputError


def check_out_dir(path: Path, flag: str, what: str) -> None:
    """:class:`InputError` naming ``flag`` and ``path`` where ``what`` cannot be written into ``path``: a file there
    or above it, or a nearest existing folder this process may not write in."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: a file, not a directory: {what} is written into a directory (choose another)")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{flag} {path}: {existing} is a file, not a directory (choose another)")
    if not path.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot create it in {existing}: permission denied")
