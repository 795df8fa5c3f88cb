"""Reading JSON Lines files of objects (problem files, imported benchmarks, cases, build outputs): one reader, so
every such file is read alike and a bad line is named the same way; and writing them, whole or not at all."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tmas.errors import InputError
from tmas.files import replacing

_BOM = b"\xef\xbb\xbf"
# How files a reader of UTF-8 text cannot take begin, and what to do with them: read as text, their first line is
# only "not valid UTF-8", which says nothing of why.
_OTHER_FORMATS = (
    (b"\x1f\x8b", "a gzip-compressed file: decompress it first (gunzip)"),
    (b"PK\x03\x04", "a zip archive: extract its file first"),
    (b"\xff\xfe", "UTF-16 text (it begins with UTF-16's byte-order mark): save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text (it begins with UTF-16's byte-order mark): save it as UTF-8"),
    (b"PAR1", "a Parquet file: 'tmas data import' reads it named .parquet; else convert it to JSONL"),
)


def other_format(head: bytes) -> str | None:
    """What a file beginning with ``head`` is when it is no UTF-8 text (compressed, UTF-16, Parquet), else None."""
    return next((what for magic, what in _OTHER_FORMATS if head.startswith(magic)), None)


def read_objects(path: Path, *, lenient: bool = False) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """Each non-blank line's JSON object, with where it is (``file:line``) and its line number, streamed.

    The file is UTF-8, a leading byte-order mark allowed. A line that is not a JSON object raises
    :class:`tmas.errors.InputError` naming file and line; ``lenient`` skips it instead (for files a reader can do
    without, such as a build's credits).
    """
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot open: {exc.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            what = other_format(raw) if number == 1 else None
            if what is not None:
                # The whole file, not a line of it: an error even where bad lines are skipped.
                raise InputError(f"{where}: {what}")
            try:
                record = _object(raw.removeprefix(_BOM) if number == 1 else raw, where)
            except InputError:
                if lenient:
                    continue
                raise
            if record is not None:
                yield where, number, record


def write_jsonl(records: Iterable[dict[str, Any]], path: Path) -> int:
    """Write ``records`` to ``path`` as JSONL, one a line, and return their count. Written beside it, then put in its
    place: a write cut short leaves an earlier file as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with replacing(path) as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's fields, each named once: JSON leaves a repeated name's meaning open (json keeps the last)."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return record


def _object(raw: bytes, where: str) -> dict[str, Any] | None:
    """The line's object; None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not valid UTF-8 (byte {exc.start})") from None
    if not line.strip():
        return None
    # Without its line ending: an object cut short is then reported where it ends, not at column 1 past the end.
    line = line.rstrip("\r\n")
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:
        # {"answer": "2", ..., "answer": "3"}: which one the file means is not said.
        raise InputError(f"{where}: field {exc.key!r} is given twice in one object") from None
    except json.JSONDecodeError as exc:
        if line.startswith("\ufeff"):
            # json's own words ("decode using utf-8-sig") are advice to a Python programmer.
            raise InputError(
                f"{where}: a byte-order mark (U+FEFF) begins the line, where only the file's first line may have one"
                " (files joined together?): remove it"
            ) from None
        if "\r" in line and not raw.endswith(b"\n"):
            # Lines ended by CR alone (classic Mac OS) read as one line: json would say "Extra data" of the second.
            raise InputError(
                f"{where}: lines end in a carriage return alone (CR): save the file with LF or CRLF line ends"
            ) from None
        # Some of json's messages end in "at" already ("Unterminated string starting at").
        raise InputError(f"{where}: not valid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits; arrays nested past the stack
        raise InputError(f"{where}: JSON this reader does not take: {exc}") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    try:
        # Only a \u escape can put half a pair in the text (a UTF-8 line decoded holds none): most lines skip this.
        if "\\u" in line:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # A \u escape of half a UTF-16 pair: valid JSON, but no text that holds it can be stored or sent.
        raise InputError(f"{where}: a \\u escape of half a UTF-16 surrogate pair, which is no character") from None
    return record
