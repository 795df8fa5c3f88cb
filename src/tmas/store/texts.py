"""Call texts kept once each, by content hash, compressed with zstd: the run store's ``blobs`` table.

A prompt quotes the same problem, candidates, verification summaries and bank snapshots again and again, and the
samples of one request send the same messages. So a text is stored as *parts*: a list whose items are either a
blob id (a piece stored once, found again by its hash) or a short piece kept inline. Prompts and replies are cut
at tag lines (``<solution>``, ``</rollout>``...), the frames the prompt templates put around what they quote, so a
candidate quoted in many prompts is the same piece as the reply it came from and is stored once.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import threading
from collections.abc import Iterable

import zstandard

from tmas.store.records import UnreadableRecord

# One part: a blob id, or a piece short enough to keep inline (a blob row and its hash cost about this much).
Part = int | str
INLINE_BELOW = 64
# Level 3 (zstd's default): about zlib -6's ratio on prose at several times its speed (docs/performance.md).
ZSTD_LEVEL = 3

_TAG_LINE = re.compile(r"^[ \t]*</?[A-Za-z][^\n<>]*>[ \t]*$", re.MULTILINE)

BLOBS_SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (
    id INTEGER PRIMARY KEY,
    hash BLOB NOT NULL UNIQUE,
    -- zstd frame (BLOB), or the text itself (TEXT) where compression would not make it smaller
    data NOT NULL
);
"""


def pieces(text: str) -> list[str]:
    """``text`` cut into runs of tag lines and runs of other lines; ``"\\n".join(pieces(text)) == text``."""
    out: list[str] = []
    body_start, run_start, run_end = 0, -1, -1
    for m in _TAG_LINE.finditer(text):
        start, end = m.span()
        if run_end >= 0 and start == run_end + 1:
            run_end = end  # the next line is a tag line too: one run
            continue
        if run_end >= 0:
            out.append(text[run_start:run_end])
            body_start = run_end + 1
        if start > 0:
            out.append(text[body_start : start - 1])  # the lines before this tag line, without its newline
        run_start, run_end = start, end
    if run_end < 0:
        return [text]
    out.append(text[run_start:run_end])
    if run_end < len(text):
        out.append(text[run_end + 1 :])
    return out


class TextBlobs:
    """Writes and reads texts as parts over the store's connection (writes join the caller's transaction)."""

    def __init__(self, db: sqlite3.Connection, origin: str = "") -> None:
        self._db = db
        # The run directory, for a text that cannot be read.
        self._origin = origin
        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)  # only the writer's thread compresses
        self._local = threading.local()  # readers may share a read-only store across threads

    def put(self, text: str, *, split: bool = True) -> list[Part]:
        """Store ``text`` (cut at tag lines where ``split``); returns its parts."""
        return [self._put_piece(p) for p in (pieces(text) if split else [text])]

    def _put_piece(self, piece: str) -> Part:
        if len(piece) < INLINE_BELOW:
            return piece
        raw = piece.encode()
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        row = self._db.execute("SELECT id FROM blobs WHERE hash = ?", (digest,)).fetchone()
        if row is not None:
            return int(row[0])
        packed = self._compressor.compress(raw)
        data: bytes | str = packed if len(packed) < len(raw) else piece
        cursor = self._db.execute("INSERT INTO blobs (hash, data) VALUES (?, ?)", (digest, data))
        return int(cursor.lastrowid or 0)

    def load(self, ids: Iterable[int]) -> dict[int, str]:
        """The texts of these blob ids, by id."""
        wanted = sorted(set(ids))
        if not wanted:
            return {}
        decompressor: zstandard.ZstdDecompressor | None = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        out: dict[int, str] = {}
        # In chunks: SQLite limits the number of bound parameters.
        for i in range(0, len(wanted), 500):
            chunk = wanted[i : i + 500]
            query = f"SELECT id, data FROM blobs WHERE id IN ({','.join('?' * len(chunk))})"
            for blob_id, data in self._db.execute(query, chunk):
                out[blob_id] = data if isinstance(data, str) else self._text(blob_id, data, decompressor)
        if len(out) < len(wanted):
            missing = next(i for i in wanted if i not in out)
            raise UnreadableRecord(f"{self._origin}: stored text {missing} is missing (a call's texts name it)")
        return out

    def _text(self, blob_id: int, data: bytes, decompressor: zstandard.ZstdDecompressor) -> str:
        """A compressed text; one edited or damaged past decompressing is named by its blob."""
        try:
            return decompressor.decompress(data).decode()
        except (zstandard.ZstdError, UnicodeDecodeError) as exc:
            raise UnreadableRecord(
                f"{self._origin}: stored text {blob_id} cannot be read ({type(exc).__name__}: {exc})"
            ) from None


def join(parts: list[Part], texts: dict[int, str]) -> str:
    """The text of ``parts``, with ``texts`` holding (at least) their blobs."""
    return "\n".join(p if isinstance(p, str) else texts[p] for p in parts)


def blob_ids(parts: Iterable[Part]) -> list[int]:
    return [p for p in parts if isinstance(p, int)]
