"""The run store's database: its tables, the schema versions this tmas reads, and opening it, writable (creating
and migrating it) or read-only beside a live writer. Each part of the store (``tmas.store.run_store``) runs its own
queries on the one connection opened here; a write of several rows is one :func:`transaction`."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tmas.errors import TmasError
from tmas.store.texts import BLOBS_SCHEMA
from tmas.version import __version__

DB_NAME = "run.sqlite"
# 2: call texts stored once each, compressed, in ``blobs`` (see tmas.store.texts); schema 1 stores open, are
# migrated in place (their rows stay as they are) and read as before.
# 3: each result's summary (see tmas.store.summaries) in ``result_summaries``; older stores get theirs on their first
# writable open, and read-only their results are summarized as they are read.
SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, SCHEMA_VERSION)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS problems (
    position INTEGER NOT NULL,
    problem_id TEXT PRIMARY KEY,
    question TEXT NOT NULL,
    answer TEXT,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_hash TEXT NOT NULL,
    sample INTEGER NOT NULL,
    problem_id TEXT NOT NULL,
    iteration INTEGER,
    role TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    model TEXT NOT NULL,
    -- messages, content, reasoning and logprobs: the texts of schema 1 rows; rows since schema 2 keep them in
    -- text_parts (blob references, see tmas.store.texts) and leave these empty
    messages TEXT NOT NULL,
    sampling TEXT NOT NULL,
    content TEXT NOT NULL,
    reasoning TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    usage_estimated INTEGER NOT NULL,
    finish_reason TEXT,
    max_tokens_sent INTEGER,
    latency_s REAL NOT NULL,
    attempts INTEGER NOT NULL,
    error TEXT,
    created_at REAL NOT NULL,
    error_cause TEXT,
    retry_causes TEXT NOT NULL DEFAULT '[]',
    logprobs TEXT,
    cached_prompt_tokens INTEGER,
    sampling_sources TEXT,
    stopped_early TEXT,
    text_parts TEXT
);
CREATE INDEX IF NOT EXISTS calls_by_request ON calls (request_hash, sample);
CREATE INDEX IF NOT EXISTS calls_by_problem ON calls (problem_id, iteration);
CREATE TABLE IF NOT EXISTS iterations (
    problem_id TEXT NOT NULL,
    iteration INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (problem_id, iteration)
);
-- Grades of candidates by the evaluation harness (tmas.grading.grades): one row per grader and judge run.
-- candidate -1 is the iteration's selected answer; verdict NULL means undecided.
CREATE TABLE IF NOT EXISTS grades (
    problem_id TEXT NOT NULL,
    iteration INTEGER NOT NULL,
    candidate INTEGER NOT NULL,
    grader TEXT NOT NULL,
    run INTEGER NOT NULL,
    answer TEXT,
    verdict INTEGER,
    detail TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    PRIMARY KEY (problem_id, iteration, candidate, grader, run)
);
CREATE TABLE IF NOT EXISTS results (
    problem_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    record TEXT NOT NULL,
    finished_at REAL NOT NULL
);
"""
# Apart from the results, so reading a summary never walks the pages of its full record.
SUMMARIES_SCHEMA = """
CREATE TABLE IF NOT EXISTS {schema}result_summaries (
    problem_id TEXT PRIMARY KEY,
    finished_at REAL NOT NULL,
    summary TEXT NOT NULL
);
"""
# A deleted result takes its summary along: no summary outlives its result.
_SUMMARIES_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS result_summaries_follow AFTER DELETE ON results BEGIN
    DELETE FROM result_summaries WHERE problem_id = old.problem_id;
END;
"""


# Columns of the calls table added after schema 1 (nullable): older stores get them on open.
LATER_CALL_COLUMNS = (
    "logprobs",
    "cached_prompt_tokens",
    "sampling_sources",
    "stopped_early",
    "text_parts",
    "queued_s",
    "first_token_s",
)


class StoreError(TmasError):
    exit_code = 2


class UnknownSchema(StoreError):
    """A store whose recorded schema this tmas does not read (a newer tmas wrote it): it stays so, unlike a store
    created a moment ago whose schema is not written yet."""


class DamagedStore(StoreError):
    """A file SQLite cannot read as a database (truncated, overwritten, not a database): it stays so, unlike a store
    created a moment ago whose tables are not written yet."""


def meta_text(db: sqlite3.Connection, key: str) -> str | None:
    """The JSON text stored under ``key`` in the meta table, or None where there is none."""
    row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def read_meta(db: sqlite3.Connection, key: str) -> Any:
    text = meta_text(db, key)
    return None if text is None else json.loads(text)


def write_meta(db: sqlite3.Connection, key: str, value: Any) -> None:
    db.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, json.dumps(value)),
    )


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: committed at the end of the block, rolled back if it raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        # SQLite has rolled it back itself after some errors (a full disk, an I/O error): their own words are said,
        # not those of a rollback of no transaction.
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def open_read_only(path: Path) -> sqlite3.Connection:
    """For readers beside a live writer (the viewer): no schema, pragma or meta writes, and SQLite itself refuses
    any write through this connection. An older store reads as a current one (see :func:`_shadow_missing_columns`);
    it has no summaries, so an empty temporary table stands in and its results are summarized as they are read."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    db.execute("PRAGMA busy_timeout=10000")
    tables = _tables(db, path)
    version = _schema_version(db, path) if "meta" in tables else None  # None: its schema not written yet
    if version not in READABLE_SCHEMAS:
        db.close()
        error = StoreError if version is None else UnknownSchema
        raise error(_unknown_schema(path, version))
    _shadow_missing_columns(db)
    if version != SCHEMA_VERSION:
        db.executescript(SUMMARIES_SCHEMA.format(schema="temp."))
    return db


def open_writable(path: Path) -> tuple[sqlite3.Connection, bool]:
    """The store at ``path``, created or brought to the current schema; and whether its results still need their
    summaries (an older store: the caller writes them, then :func:`mark_current`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA busy_timeout=10000")
    # A damaged file, or another program's database, is said so, and nothing is written into the latter.
    tables = _tables(db, path)
    # A store of a schema this tmas does not know (a newer tmas's) is refused before anything is written into it.
    version = _schema_version(db, path) if tables else None
    if version is not None and version not in READABLE_SCHEMAS:
        db.close()
        raise UnknownSchema(_unknown_schema(path, version))
    db.execute("PRAGMA journal_mode=WAL")
    # NORMAL under WAL: a commit survives a killed process (only an OS crash can lose the last commits).
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA + BLOBS_SCHEMA + SUMMARIES_SCHEMA.format(schema="") + _SUMMARIES_TRIGGER)
    _add_missing_columns(db)
    version = read_meta(db, "schema_version")
    if version is None:
        write_meta(db, "schema_version", SCHEMA_VERSION)
        write_meta(db, "tmas_version", __version__)
        write_meta(db, "created_at", time.time())
        return db, False
    if version in (1, 2):
        # The blobs table and text_parts column (schema 1) and the summaries table were just added.
        return db, True
    return db, False


def _tables(db: sqlite3.Connection, path: Path) -> set[str]:
    """The tables of the store ``db`` opened at ``path`` (none in a new file); :class:`DamagedStore` for a damaged
    file, :class:`StoreError` (``db`` closed) for another program's database."""
    try:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:  # "database disk image is malformed", "file is not a database"
        db.close()
        raise DamagedStore(f"{path}: not a readable run store ({exc})") from None
    if tables and "meta" not in tables:
        db.close()
        raise StoreError(f"{path}: a database, but not a tmas run store (it has no meta table)")
    return tables


def _schema_version(db: sqlite3.Connection, path: Path) -> Any:
    """The schema version the store at ``path`` records (None: not written yet); :class:`DamagedStore` (``db``
    closed) for one edited into something that is not JSON."""
    try:
        return read_meta(db, "schema_version")
    except json.JSONDecodeError as exc:
        db.close()
        raise DamagedStore(f"{path}: not a readable run store (its schema version is not JSON: {exc.msg})") from None


def _unknown_schema(path: Path, version: Any) -> str:
    return f"{path}: store schema {version} is not one this tmas reads {READABLE_SCHEMAS}"


def mark_current(db: sqlite3.Connection) -> None:
    """An older store, migrated: it is now of the current schema."""
    write_meta(db, "schema_version", SCHEMA_VERSION)


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Columns added after schema 1, added in place to older stores (nullable, so old rows stay valid)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(calls)")}
    if "logprobs" not in have:
        db.execute("ALTER TABLE calls ADD COLUMN logprobs TEXT")
    if "cached_prompt_tokens" not in have:
        # NULL in the rows of older stores: the server's prompt cache was not read then (counted as 0).
        db.execute("ALTER TABLE calls ADD COLUMN cached_prompt_tokens INTEGER")
    if "sampling_sources" not in have:
        # NULL in the rows of older stores: which source set each sampling field was not kept then.
        db.execute("ALTER TABLE calls ADD COLUMN sampling_sources TEXT")
    if "stopped_early" not in have:
        # NULL in the rows of older stores: no reply was stopped early then.
        db.execute("ALTER TABLE calls ADD COLUMN stopped_early TEXT")
    if "text_parts" not in have:
        # NULL in the rows of schema 1 stores: their texts are in the plain columns.
        db.execute("ALTER TABLE calls ADD COLUMN text_parts TEXT")
    for name in ("queued_s", "first_token_s"):
        if name not in have:
            # NULL in older rows: where a call's time went was not measured then.
            db.execute(f"ALTER TABLE calls ADD COLUMN {name} REAL")


def _shadow_missing_columns(db: sqlite3.Connection) -> None:
    """Read-only, an older store cannot be altered: a temporary view named ``calls`` (temp names are looked up
    first) adds the later columns as NULL, so every query reads old and new stores alike."""
    have = {row[1] for row in db.execute("PRAGMA table_info(calls)")}
    missing = [name for name in LATER_CALL_COLUMNS if name not in have]
    if have and missing:
        extra = ", ".join(f"NULL AS {name}" for name in missing)
        db.execute(f"CREATE TEMP VIEW calls AS SELECT *, {extra} FROM main.calls")
