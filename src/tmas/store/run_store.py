"""The run store: one SQLite database (WAL) per run directory.

It holds the run's settings and code version, the problems, every LLM call, each method iteration's record and each
problem's result. A call is committed before its result is returned to the method that asked for it, so a run killed
at any moment loses no finished call; on resume the same calls are replayed from here instead of being sent again.

The methods are synchronous on purpose: each is one small local transaction (tens of microseconds under WAL with
``synchronous=NORMAL``), cheaper than a hop to a worker thread, and it keeps commit order equal to call order.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmas.errors import TmasError
from tmas.llm.types import (
    DOWNGRADES,
    CallKey,
    ChatRequest,
    Completion,
    DowngradeKind,
    ServerFindings,
    TokenLogprob,
    Usage,
)
from tmas.problems import Problem
from tmas.store.summaries import summarize_result
from tmas.store.texts import BLOBS_SCHEMA, Part, TextBlobs, blob_ids, join
from tmas.version import __version__

DB_NAME = "run.sqlite"
# 2: call texts stored once each, compressed, in ``blobs`` (see tmas.store.texts); schema 1 stores open, are
# migrated in place (their rows stay as they are) and read as before.
# 3: each result's summary (see tmas.store.summaries) in ``result_summaries``; older stores get theirs on their first
# writable open, and read-only their results are summarized as they are read.
SCHEMA_VERSION = 3
_READABLE_SCHEMAS = (1, 2, SCHEMA_VERSION)

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
_SUMMARIES_SCHEMA = """
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


@dataclass(frozen=True)
class GradeRow:
    """One grade: a candidate (``-1``: the selected answer) judged by one grader in one run (``None``: undecided)."""

    problem_id: str
    iteration: int
    candidate: int
    grader: str
    run: int
    answer: str | None
    verdict: bool | None
    detail: str = ""


class StoreError(TmasError):
    exit_code = 2


class RunStore:
    """Open (creating if needed) the store of ``run_dir``."""

    def __init__(self, run_dir: str | Path, *, create: bool = True, read_only: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        if (read_only or not create) and not self.path.is_file():
            raise StoreError(f"{self.run_dir}: not a run directory (no {DB_NAME})")
        if read_only:
            # For readers beside a live writer (the viewer): no schema, pragma or meta writes, and SQLite itself
            # refuses any write through this connection.
            self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout=10000")
            try:
                version = self.get_meta("schema_version")
            except sqlite3.Error:
                version = None  # created a moment ago, schema not written yet (or not a run store at all)
            if version not in _READABLE_SCHEMAS:
                self._db.close()
                raise StoreError(f"{self.path}: store schema {version} is not one this tmas reads {_READABLE_SCHEMAS}")
            self._shadow_missing_columns()
            # An older store has no summaries: an empty temporary table stands in, and its results are summarized
            # as they are read.
            if version != SCHEMA_VERSION:
                self._db.executescript(_SUMMARIES_SCHEMA.format(schema="temp."))
            self._texts = TextBlobs(self._db)
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL under WAL: a commit survives a killed process (only an OS crash can lose the last commits).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(_SCHEMA + BLOBS_SCHEMA + _SUMMARIES_SCHEMA.format(schema="") + _SUMMARIES_TRIGGER)
        self._add_missing_columns()
        self._texts = TextBlobs(self._db)
        version = self.get_meta("schema_version")
        if version is None:
            self.set_meta("schema_version", SCHEMA_VERSION)
            self.set_meta("tmas_version", __version__)
            self.set_meta("created_at", time.time())
        elif version in (1, 2):
            # The blobs table and text_parts column (schema 1) and the summaries table were just added.
            self._summarize_results()
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif version != SCHEMA_VERSION:
            raise StoreError(f"{self.path}: store schema {version} is not one this tmas reads {_READABLE_SCHEMAS}")

    def _add_missing_columns(self) -> None:
        """Columns added after schema 1, added in place to older stores (nullable, so old rows stay valid)."""
        have = {row[1] for row in self._db.execute("PRAGMA table_info(calls)")}
        if "logprobs" not in have:
            self._db.execute("ALTER TABLE calls ADD COLUMN logprobs TEXT")
        if "cached_prompt_tokens" not in have:
            # NULL in the rows of older stores: the server's prompt cache was not read then (counted as 0).
            self._db.execute("ALTER TABLE calls ADD COLUMN cached_prompt_tokens INTEGER")
        if "sampling_sources" not in have:
            # NULL in the rows of older stores: which source set each sampling field was not kept then.
            self._db.execute("ALTER TABLE calls ADD COLUMN sampling_sources TEXT")
        if "stopped_early" not in have:
            # NULL in the rows of older stores: no reply was stopped early then.
            self._db.execute("ALTER TABLE calls ADD COLUMN stopped_early TEXT")
        if "text_parts" not in have:
            # NULL in the rows of schema 1 stores: their texts are in the plain columns.
            self._db.execute("ALTER TABLE calls ADD COLUMN text_parts TEXT")
        for name in ("queued_s", "first_token_s"):
            if name not in have:
                # NULL in older rows: where a call's time went was not measured then.
                self._db.execute(f"ALTER TABLE calls ADD COLUMN {name} REAL")

    def _shadow_missing_columns(self) -> None:
        """Read-only, an older store cannot be altered: a temporary view named ``calls`` (temp names are looked up
        first) adds the later columns as NULL, so every query reads old and new stores alike."""
        have = {row[1] for row in self._db.execute("PRAGMA table_info(calls)")}
        missing = [name for name in _LATER_CALL_COLUMNS if name not in have]
        if have and missing:
            extra = ", ".join(f"NULL AS {name}" for name in missing)
            self._db.execute(f"CREATE TEMP VIEW calls AS SELECT *, {extra} FROM main.calls")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ meta
    def set_meta(self, key: str, value: Any) -> None:
        self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )

    def get_meta(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    # ------------------------------------------------------------------------------------------ problems
    def add_problems(self, problems: Iterable[Problem]) -> int:
        """Record the run's problems in one transaction, consuming ``problems`` one at a time (a file is streamed,
        not held); idempotent: problems already stored are kept as they are. If the iterable raises (a bad line),
        nothing is recorded. Returns how many were read."""
        count = 0
        with self._transaction():
            start = self._db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM problems").fetchone()[0]
            for offset, p in enumerate(problems):
                self._db.execute(
                    "INSERT OR IGNORE INTO problems (position, problem_id, question, answer, metadata)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (start + offset, p.problem_id, p.question, p.answer, json.dumps(p.metadata)),
                )
                count += 1
        return count

    def problems(self) -> list[Problem]:
        return list(self.iter_problems())

    def iter_problems(self, batch: int = 256) -> Iterator[Problem]:
        """The problems in file order, read ``batch`` at a time. Each batch is its own short query, so no read
        transaction stays open across a long run (one would stop WAL checkpoints and let the WAL file grow)."""
        last = -1
        while True:
            rows = self._db.execute(
                "SELECT position, problem_id, question, answer, metadata FROM problems WHERE position > ?"
                " ORDER BY position LIMIT ?",
                (last, batch),
            ).fetchall()
            for r in rows:
                yield Problem(problem_id=r[1], question=r[2], answer=r[3], metadata=json.loads(r[4]))
            if len(rows) < batch:
                return
            last = rows[-1][0]

    def problem_count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM problems").fetchone()[0])

    # ------------------------------------------------------------------------------------------ calls
    def record_call(self, completion: Completion, request: ChatRequest) -> int:
        """Commit a finished or failed call, its texts as parts (see tmas.store.texts); returns its row id."""
        c = completion
        with self._transaction():
            texts = {
                "messages": [[m.role, self._texts.put(m.content)] for m in request.messages],
                "content": self._texts.put(c.content),
                "reasoning": self._texts.put(c.reasoning, split=False),
                "logprobs": None
                if c.logprobs is None
                else self._texts.put(json.dumps([t.model_dump() for t in c.logprobs]), split=False),
            }
            return self._insert_call(c, request, json.dumps(texts, ensure_ascii=False))

    def _insert_call(self, c: Completion, request: ChatRequest, text_parts: str) -> int:
        u, k = c.usage, c.key
        cursor = self._db.execute(
            "INSERT INTO calls (request_hash, sample, problem_id, iteration, role, endpoint, model, messages,"
            " sampling, content, reasoning, prompt_tokens, completion_tokens, reasoning_tokens, usage_estimated,"
            " finish_reason, max_tokens_sent, latency_s, attempts, error, created_at, error_cause, retry_causes,"
            " logprobs, cached_prompt_tokens, sampling_sources, stopped_early, text_parts, queued_s, first_token_s)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                c.request_hash,
                k.sample,
                k.problem_id,
                k.iteration,
                k.role,
                c.endpoint,
                c.model,
                "",
                request.sampling.model_dump_json(),
                "",
                "",
                u.prompt_tokens,
                u.completion_tokens,
                u.reasoning_tokens,
                int(u.estimated),
                c.finish_reason,
                c.max_tokens_sent,
                c.latency_s,
                c.attempts,
                c.error,
                time.time(),
                c.error_cause,
                json.dumps(c.retry_causes),
                None,
                u.cached_prompt_tokens,
                json.dumps(request.sampling_sources, sort_keys=True),
                c.stopped_early,
                text_parts,
                c.queued_s,
                c.first_token_s,
            ),
        )
        return int(cursor.lastrowid or 0)

    def lookup_call(self, request_hash: str, sample: int, *, stopped_early: bool = False) -> Completion | None:
        """The finished call for this request and sample index, if any. Failed calls are not replayed, nor are
        replies a watch stopped early unless ``stopped_early`` (the caller watches again: tmas.llm.watch)."""
        row = self._db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE request_hash = ? AND sample = ? AND error IS NULL"
            " AND (? OR stopped_early IS NULL) ORDER BY id LIMIT 1",
            (request_hash, sample, stopped_early),
        ).fetchone()
        return None if row is None else self._completion(row)

    def calls(self, problem_id: str | None = None) -> Iterator[Completion]:
        query = f"SELECT {_CALL_COLUMNS} FROM calls"
        args: tuple[Any, ...] = ()
        if problem_id is not None:
            query += " WHERE problem_id = ?"
            args = (problem_id,)
        for row in self._db.execute(query + " ORDER BY id", args):
            yield self._completion(row)

    def problems_with_calls(self) -> set[str]:
        """The problems with at least one finished call stored (what a resumed run replays)."""
        rows = self._db.execute("SELECT DISTINCT problem_id FROM calls WHERE error IS NULL")
        return {row[0] for row in rows}

    def call(self, call_id: int) -> Completion | None:
        row = self._db.execute(f"SELECT {_CALL_COLUMNS} FROM calls WHERE id = ?", (call_id,)).fetchone()
        return None if row is None else self._completion(row)

    def call_sampling(self, call_id: int) -> dict[str, Any]:
        row = self._db.execute("SELECT sampling FROM calls WHERE id = ?", (call_id,)).fetchone()
        return {} if row is None else dict(json.loads(row[0]))

    def call_sampling_sources(self, call_id: int) -> dict[str, str] | None:
        """Which source set each field of the call's sampling (see tmas.llm.sampling); None for calls stored
        before sources were kept."""
        row = self._db.execute("SELECT sampling_sources FROM calls WHERE id = ?", (call_id,)).fetchone()
        return None if row is None or row[0] is None else dict(json.loads(row[0]))

    def role_costs(self) -> dict[str, dict[str, int]]:
        """Calls, failed calls and tokens per agent role, over the whole run."""
        rows = self._db.execute(
            "SELECT role, COUNT(*), COALESCE(SUM(error IS NOT NULL), 0), COALESCE(SUM(prompt_tokens), 0),"
            " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cached_prompt_tokens), 0) FROM calls"
            " GROUP BY role ORDER BY role"
        )
        return {
            r[0]: {
                "calls": r[1],
                "failed": r[2],
                "prompt_tokens": r[3],
                "completion_tokens": r[4],
                "cached_prompt_tokens": r[5],
            }
            for r in rows
        }

    def change_marker(self) -> str:
        """Changes whenever a call, an iteration or a result is written: what a live viewer polls."""
        row = self._db.execute(
            "SELECT (SELECT COALESCE(MAX(id), 0) FROM calls), (SELECT COUNT(*) FROM iterations),"
            " (SELECT COUNT(*) FROM results), (SELECT COALESCE(MAX(finished_at), 0) FROM results)"
        ).fetchone()
        return "-".join(str(v) for v in row)

    def call_messages(self, call_id: int) -> list[dict[str, str]]:
        row = self._db.execute("SELECT messages, text_parts FROM calls WHERE id = ?", (call_id,)).fetchone()
        if row is None:
            return []
        if row[1] is None:
            return list(json.loads(row[0]))
        messages: list[tuple[str, list[Part]]] = json.loads(row[1])["messages"]
        texts = self._texts.load(i for _, parts in messages for i in blob_ids(parts))
        return [{"role": role, "content": join(parts, texts)} for role, parts in messages]

    def call_counts(self) -> dict[str, int]:
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(error IS NOT NULL), 0), COALESCE(SUM(prompt_tokens), 0),"
            " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(reasoning_tokens), 0),"
            " COALESCE(SUM(finish_reason = 'length'), 0), COALESCE(SUM(cached_prompt_tokens), 0) FROM calls"
        ).fetchone()
        return {
            "calls": row[0],
            "failed": row[1],
            "prompt_tokens": row[2],
            "completion_tokens": row[3],
            "reasoning_tokens": row[4],
            "truncated": row[5],
            "cached_prompt_tokens": row[6],
        }

    def record_downgrade(self, kind: DowngradeKind, endpoint: str, role: str, message: str) -> None:
        """Record, once per endpoint and kind, that its server refused what the client asked and the run went on
        without it (:data:`DOWNGRADES` says what each kind is)."""
        recorded = self.downgrades(kind)
        if endpoint not in recorded:
            recorded[endpoint] = {"role": role, "message": message, "at": time.time()}
            self.set_meta(f"{kind}_downgrades", recorded)

    def record_server(self, findings: ServerFindings) -> None:
        """Record what a server said of itself when probed (its kind, context window, ``n``), per URL."""
        servers = dict(self.get_meta("servers") or {})
        servers[findings.url] = findings.model_dump(mode="json")
        self.set_meta("servers", servers)

    def servers(self) -> dict[str, dict[str, Any]]:
        """URL -> what its server said of itself when the run probed it."""
        return dict(self.get_meta("servers") or {})

    def downgrades(self, kind: str) -> dict[str, dict[str, Any]]:
        """Endpoint URL -> the first refusal of this kind (role, server message, time), over the run (runs stored by
        earlier versions kept them under ``KIND_fallbacks``)."""
        stored = self.get_meta(f"{kind}_downgrades") or self.get_meta(f"{kind}_fallbacks")
        return dict(stored or {})

    def downgrade_messages(self) -> dict[str, dict[str, str]]:
        """Kind -> endpoint URL -> the server's message, for each kind of downgrade the run made."""
        found = {
            kind: {url: str(f.get("message", "")) for url, f in self.downgrades(kind).items()} for kind in DOWNGRADES
        }
        return {kind: urls for kind, urls in found.items() if urls}

    def record_notice(self, kind: str, message: str) -> None:
        """Record the one-line notice ``kind`` once in the run (the first message of each kind is kept)."""
        notices = self.get_meta("notices") or {}
        if kind not in notices:
            notices[kind] = {"message": message, "at": time.time()}
            self.set_meta("notices", notices)

    def notices(self) -> dict[str, str]:
        """Kind -> the run's one-line notice of that kind, in the order they were first raised."""
        return {kind: str(entry["message"]) for kind, entry in (self.get_meta("notices") or {}).items()}

    def replies_by_role(self) -> dict[str, tuple[int, int]]:
        """Successful calls per role over the whole run, and how many of them were cut at max_tokens."""
        rows = self._db.execute(
            "SELECT role, COUNT(*), COALESCE(SUM(finish_reason = 'length'), 0) FROM calls"
            " WHERE error IS NULL GROUP BY role ORDER BY role"
        ).fetchall()
        return {role: (int(n), int(cut)) for role, n, cut in rows}

    def call_causes(self) -> dict[str, dict[str, int]]:
        """Failed calls by cause (``failed``) and retried attempts by cause (``retried``), over the whole run."""
        failed: dict[str, int] = {}
        for cause, count in self._db.execute(
            "SELECT COALESCE(error_cause, 'unknown'), COUNT(*) FROM calls WHERE error IS NOT NULL GROUP BY 1"
        ):
            failed[cause] = count
        retried: dict[str, int] = {}
        # Most calls have no retry: only the others are read and decoded.
        for (raw,) in self._db.execute("SELECT retry_causes FROM calls WHERE retry_causes != '[]'"):
            for cause in json.loads(raw):
                retried[cause] = retried.get(cause, 0) + 1
        return {"failed": dict(sorted(failed.items())), "retried": dict(sorted(retried.items()))}

    def call_waits(self) -> dict[str, list[float]]:
        """Where the finished calls' time went, where measured: ``queued`` (waiting inside tmas for a slot) and
        ``first_token`` (from sending to the server's first chunk: its queue and the prompt's prefill)."""
        rows = self._db.execute(
            "SELECT queued_s, first_token_s FROM calls WHERE error IS NULL AND first_token_s IS NOT NULL"
        ).fetchall()
        return {
            "queued": [float(q) for q, _ in rows if q is not None],
            "first_token": [float(f) for _, f in rows],
        }

    # ------------------------------------------------------------------------------------------ method state
    def save_iteration(self, problem_id: str, iteration: int, record: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO iterations (problem_id, iteration, record) VALUES (?, ?, ?)"
            " ON CONFLICT(problem_id, iteration) DO UPDATE SET record = excluded.record",
            (problem_id, iteration, json.dumps(record, ensure_ascii=False)),
        )

    def problems_with_iterations(self) -> set[str]:
        """The problems with at least one iteration record stored."""
        return {row[0] for row in self._db.execute("SELECT DISTINCT problem_id FROM iterations")}

    def iterations(self, problem_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT record FROM iterations WHERE problem_id = ? ORDER BY iteration", (problem_id,)
        ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def save_result(self, problem_id: str, status: str, record: dict[str, Any]) -> None:
        """Store the problem's result and its summary (one transaction: a reader never sees one without the other)."""
        with self._transaction():
            self._write_result(problem_id, status, json.dumps(record, ensure_ascii=False), time.time(), record)

    def _write_result(
        self, problem_id: str, status: str, record_json: str | None, finished_at: float, record: dict[str, Any]
    ) -> None:
        """Upsert a result (``record_json`` None: only its summary, the result being stored already)."""
        if record_json is not None:
            self._db.execute(
                "INSERT INTO results (problem_id, status, record, finished_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(problem_id) DO UPDATE SET status = excluded.status, record = excluded.record,"
                " finished_at = excluded.finished_at",
                (problem_id, status, record_json, finished_at),
            )
        self._db.execute(
            "INSERT INTO result_summaries (problem_id, finished_at, summary) VALUES (?, ?, ?)"
            " ON CONFLICT(problem_id) DO UPDATE SET finished_at = excluded.finished_at, summary = excluded.summary",
            (problem_id, finished_at, json.dumps(summarize_result(record), ensure_ascii=False)),
        )

    def _summarize_results(self) -> None:
        """Write the summary of every result that has none (a store of an older schema), one result at a time."""
        with self._transaction():
            missing = self._db.execute(
                "SELECT problem_id FROM results WHERE problem_id NOT IN (SELECT problem_id FROM result_summaries)"
            ).fetchall()
            for (pid,) in missing:
                status, record, at = self._db.execute(
                    "SELECT status, record, finished_at FROM results WHERE problem_id = ?", (pid,)
                ).fetchone()
                self._write_result(pid, status, None, at, json.loads(record))

    def result_stamps(self) -> dict[str, float]:
        """Problem id -> when its result was written, for every result (read from the summaries where stored)."""
        stamps = dict(self._db.execute("SELECT problem_id, finished_at FROM result_summaries").fetchall())
        for pid in self._unsummarized(stamps):
            stamps[pid] = self._db.execute("SELECT finished_at FROM results WHERE problem_id = ?", (pid,)).fetchone()[0]
        return stamps

    def result_summaries(
        self, problem_ids: Collection[str] | None = None
    ) -> Iterator[tuple[str, float, dict[str, Any]]]:
        """(problem id, when written, summary) of the given results (all with None), in no particular order. A
        result without a stored summary (a store of an older schema, read-only) is read in full and summarized."""
        wanted = None if problem_ids is None else set(problem_ids)
        summarized = set()
        for pid, at, summary in self._db.execute("SELECT problem_id, finished_at, summary FROM result_summaries"):
            summarized.add(pid)
            if wanted is None or pid in wanted:
                yield pid, at, json.loads(summary)
        for pid in self._unsummarized(summarized):
            if wanted is None or pid in wanted:
                at, record = self._db.execute(
                    "SELECT finished_at, record FROM results WHERE problem_id = ?", (pid,)
                ).fetchone()
                yield pid, at, summarize_result(json.loads(record))

    def _unsummarized(self, summarized: Collection[str]) -> list[str]:
        """The results without a stored summary (read from the results' index alone, never their records)."""
        return [pid for (pid,) in self._db.execute("SELECT problem_id FROM results") if pid not in summarized]

    def result(self, problem_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT record FROM results WHERE problem_id = ?", (problem_id,)).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def finished_problem_ids(self, fingerprint: str | None = None) -> set[str]:
        """Problems with a result of status done (with ``fingerprint``: only those solved with it)."""
        if fingerprint is None:
            rows = self._db.execute("SELECT problem_id FROM results WHERE status = 'done'").fetchall()
        else:
            rows = self._db.execute(
                "SELECT problem_id FROM results WHERE status = 'done' AND json_extract(record, '$.fingerprint') = ?",
                (fingerprint,),
            ).fetchall()
        return {r[0] for r in rows}

    def results(self) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT r.record FROM results r JOIN problems p USING (problem_id) ORDER BY p.position"
        ).fetchall()
        return [json.loads(r[0]) for r in rows]

    # ------------------------------------------------------------------------------------------ grades
    def save_grades(self, rows: list[GradeRow]) -> None:
        """Store grades (replacing earlier ones with the same key) in one transaction."""
        with self._transaction():
            for r in rows:
                self._db.execute(
                    "INSERT INTO grades (problem_id, iteration, candidate, grader, run, answer, verdict, detail,"
                    " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(problem_id, iteration, candidate, grader, run) DO UPDATE SET"
                    " answer = excluded.answer, verdict = excluded.verdict, detail = excluded.detail,"
                    " created_at = excluded.created_at",
                    (
                        r.problem_id,
                        r.iteration,
                        r.candidate,
                        r.grader,
                        r.run,
                        r.answer,
                        None if r.verdict is None else int(r.verdict),
                        r.detail,
                        time.time(),
                    ),
                )

    def grades(self, grader: str | None = None) -> list[GradeRow]:
        query = "SELECT problem_id, iteration, candidate, grader, run, answer, verdict, detail FROM grades"
        args: tuple[Any, ...] = ()
        if grader is not None:
            query += " WHERE grader = ?"
            args = (grader,)
        return [
            GradeRow(r[0], r[1], r[2], r[3], r[4], r[5], None if r[6] is None else bool(r[6]), r[7])
            for r in self._db.execute(query + " ORDER BY problem_id, iteration, candidate, grader, run", args)
        ]

    def delete_grades(self, grader: str | None = None) -> None:
        if grader is None:
            self._db.execute("DELETE FROM grades")
        else:
            self._db.execute("DELETE FROM grades WHERE grader = ?", (grader,))

    # ------------------------------------------------------------------------------------------ helpers
    def _completion(self, row: tuple[Any, ...]) -> Completion:
        content, reasoning, logprobs = row[8], row[9], row[21]
        if row[24] is not None:
            parts = json.loads(row[24])
            texts = self._texts.load(i for key in _REPLY_TEXTS for i in blob_ids(parts[key] or ()))
            content, reasoning = join(parts["content"], texts), join(parts["reasoning"], texts)
            logprobs = None if parts["logprobs"] is None else join(parts["logprobs"], texts)
        return Completion(
            call_id=row[0],
            request_hash=row[1],
            key=CallKey(sample=row[2], problem_id=row[3], iteration=row[4], role=row[5]),
            endpoint=row[6],
            model=row[7],
            content=content,
            reasoning=reasoning,
            usage=Usage(
                prompt_tokens=row[10],
                completion_tokens=row[11],
                reasoning_tokens=row[12],
                cached_prompt_tokens=row[22] or 0,
                estimated=bool(row[13]),
            ),
            finish_reason=row[14],
            max_tokens_sent=row[15],
            latency_s=row[16],
            attempts=row[17],
            error=row[18],
            error_cause=row[19],
            retry_causes=json.loads(row[20]),
            logprobs=None if logprobs is None else [TokenLogprob.model_validate(t) for t in json.loads(logprobs)],
            stopped_early=row[23],
            queued_s=row[25],
            first_token_s=row[26],
        )

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


# Columns of the calls table added after schema 1 (nullable): older stores get them on open.
_LATER_CALL_COLUMNS = (
    "logprobs",
    "cached_prompt_tokens",
    "sampling_sources",
    "stopped_early",
    "text_parts",
    "queued_s",
    "first_token_s",
)
# The texts of a reply in text_parts (the call's messages are read only by call_messages).
_REPLY_TEXTS = ("content", "reasoning", "logprobs")
_CALL_COLUMNS = (
    "id, request_hash, sample, problem_id, iteration, role, endpoint, model, content, reasoning, prompt_tokens,"
    " completion_tokens, reasoning_tokens, usage_estimated, finish_reason, max_tokens_sent, latency_s, attempts,"
    " error, error_cause, retry_causes, logprobs, cached_prompt_tokens, stopped_early, text_parts, queued_s,"
    " first_token_s"
)
