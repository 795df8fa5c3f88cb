"""Each problem's result record and its summary (see tmas.store.summaries), written in one transaction."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Collection, Iterator

from tmas.store.database import transaction
from tmas.store.records import RUNNING, ProblemResult, read_result
from tmas.store.summaries import summarize_result


class ResultTable:
    def __init__(self, db: sqlite3.Connection, origin: str = "") -> None:
        self._db = db
        # The run directory, for a record that cannot be read.
        self._origin = origin

    def save(self, result: ProblemResult) -> None:
        """Store the problem's result and its summary (one transaction: a reader never sees one without the other).
        The problem's iteration records are then the result's: those of an earlier solve that went further (a run
        resumed with fewer iterations or a tighter budget) go, so nothing read from them counts iterations the
        result does not have."""
        with transaction(self._db):
            self._write_result(result, time.time(), stored=False)
            kept = [r.iteration for r in result.iterations]
            self._db.execute(
                f"DELETE FROM iterations WHERE problem_id = ? AND iteration NOT IN ({', '.join('?' * len(kept))})",
                (result.problem_id, *kept),
            )

    def _write_result(self, result: ProblemResult, finished_at: float, *, stored: bool) -> None:
        """Upsert a result (``stored``: only its summary, the result being stored already)."""
        if not stored:
            self._db.execute(
                "INSERT INTO results (problem_id, status, record, finished_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(problem_id) DO UPDATE SET status = excluded.status, record = excluded.record,"
                " finished_at = excluded.finished_at",
                (result.problem_id, result.status, result.model_dump_json(), finished_at),
            )
        self._db.execute(
            "INSERT INTO result_summaries (problem_id, finished_at, summary) VALUES (?, ?, ?)"
            " ON CONFLICT(problem_id) DO UPDATE SET finished_at = excluded.finished_at, summary = excluded.summary",
            (result.problem_id, finished_at, json.dumps(summarize_result(result), ensure_ascii=False)),
        )

    def summarize_missing(self) -> None:
        """Write the summary of every result that has none (a store of an older schema), one result at a time."""
        with transaction(self._db):
            missing = self._db.execute(
                "SELECT problem_id FROM results WHERE problem_id NOT IN (SELECT problem_id FROM result_summaries)"
            ).fetchall()
            for (pid,) in missing:
                record, at = self._db.execute(
                    "SELECT record, finished_at FROM results WHERE problem_id = ?", (pid,)
                ).fetchone()
                self._write_result(read_result(record, self._where(pid)), at, stored=True)

    def stamps(self) -> dict[str, float]:
        """Problem id -> when its result was written, for every result (read from the summaries where stored)."""
        stamps = dict(self._db.execute("SELECT problem_id, finished_at FROM result_summaries").fetchall())
        for pid in self._unsummarized(stamps):
            stamps[pid] = self._db.execute("SELECT finished_at FROM results WHERE problem_id = ?", (pid,)).fetchone()[0]
        return stamps

    def summaries(self, problem_ids: Collection[str] | None = None) -> Iterator[tuple[str, float, ProblemResult]]:
        """(problem id, when written, summary) of the given results (all with None), in no particular order. A
        result without a stored summary (a store of an older schema, read-only) is read in full and summarized."""
        wanted = None if problem_ids is None else set(problem_ids)
        summarized = set()
        for pid, at, summary in self._db.execute("SELECT problem_id, finished_at, summary FROM result_summaries"):
            summarized.add(pid)
            if wanted is None or pid in wanted:
                yield pid, at, read_result(summary, self._where(pid, "summary"))
        for pid in self._unsummarized(summarized):
            if wanted is None or pid in wanted:
                at, record = self._db.execute(
                    "SELECT finished_at, record FROM results WHERE problem_id = ?", (pid,)
                ).fetchone()
                yield pid, at, ProblemResult.model_validate(summarize_result(read_result(record, self._where(pid))))

    def _unsummarized(self, summarized: Collection[str]) -> list[str]:
        """The results without a stored summary (read from the results' index alone, never their records)."""
        return [pid for (pid,) in self._db.execute("SELECT problem_id FROM results") if pid not in summarized]

    def get(self, problem_id: str) -> ProblemResult | None:
        row = self._db.execute("SELECT record FROM results WHERE problem_id = ?", (problem_id,)).fetchone()
        return None if row is None else read_result(row[0], self._where(problem_id))

    def status_counts(self) -> dict[str, int]:
        """Results by status, and as ``running`` the problems with iteration records and no result yet (read from
        the tables' indices alone, never a record)."""
        counts = dict(self._db.execute("SELECT status, COUNT(*) FROM results GROUP BY status").fetchall())
        (running,) = self._db.execute(
            "SELECT COUNT(DISTINCT problem_id) FROM iterations WHERE problem_id NOT IN (SELECT problem_id FROM results)"
        ).fetchone()
        return {**counts, **({RUNNING: running} if running else {})}

    def finished_ids(self, fingerprint: str | None = None) -> set[str]:
        """Problems with a result of status done (with ``fingerprint``: only those solved with it)."""
        if fingerprint is None:
            rows = self._db.execute("SELECT problem_id FROM results WHERE status = 'done'").fetchall()
        else:
            rows = self._read_json(
                "SELECT problem_id FROM results WHERE status = 'done' AND json_extract(record, '$.fingerprint') = ?",
                fingerprint,
            )
        return {r[0] for r in rows}

    def settled_ids(self, fingerprint: str) -> set[str]:
        """Problems finished with ``fingerprint`` and without a call that failed (after its retries): those a
        resumed run leaves as they are. A finished problem with a failed call is solved again, replaying its
        replied calls and asking only the failed ones (and what depends on them)."""
        rows = self._read_json(
            "SELECT problem_id FROM results WHERE status = 'done' AND json_extract(record, '$.fingerprint') = ?"
            " AND COALESCE(json_extract(record, '$.failed_calls'), 0) = 0",
            fingerprint,
        )
        return {r[0] for r in rows}

    def _read_json(self, query: str, *args: object) -> list[tuple[str]]:
        """The rows of a query that reads into the records (SQLite's JSON functions): a record edited into something
        that is not JSON is named as a reader of the record names it, not in SQLite's words ("malformed JSON")."""
        try:
            return self._db.execute(query, args).fetchall()
        except sqlite3.OperationalError:
            bad = self._db.execute("SELECT problem_id, record FROM results WHERE NOT json_valid(record) LIMIT 1")
            for pid, record in bad.fetchall():
                read_result(record, self._where(pid))
            raise

    def in_order(self) -> list[ProblemResult]:
        rows = self._db.execute(
            "SELECT r.problem_id, r.record FROM results r JOIN problems p USING (problem_id) ORDER BY p.position"
        ).fetchall()
        return [read_result(record, self._where(pid)) for pid, record in rows]

    def _where(self, problem_id: str, what: str = "result") -> str:
        return f"{self._origin}: the {what} of problem {problem_id!r}"
