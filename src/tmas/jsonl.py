"""JSON Lines files of objects (problem files, case files, imported rows), read one way everywhere.

A file may start with a UTF-8 byte-order mark, as some Windows editors and spreadsheet exports write it; blank lines
are skipped. A line that is not UTF-8, not JSON or not a JSON object is an :class:`InputError` naming file and line.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tmas.errors import InputError


def read_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each object of the file at ``path`` with its line number, read one line at a time."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot open: {exc.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{where}: not valid UTF-8 (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON: {exc.msg} at column {exc.colno}") from None
            if not isinstance(record, dict):
                raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield number, record
