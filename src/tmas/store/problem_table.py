"""The run's problems, in file order."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator

from tmas.problems import Problem
from tmas.store.database import transaction
from tmas.store.records import stored_json


class ProblemTable:
    def __init__(self, db: sqlite3.Connection, origin: str = "") -> None:
        self._db = db
        # The run directory, for a problem that cannot be read.
        self._origin = origin

    def add(self, problems: Iterable[Problem]) -> int:
        """Record the run's problems in one transaction, consuming ``problems`` one at a time (a file is streamed,
        not held); idempotent: problems already stored are kept as they are. If the iterable raises (a bad line),
        nothing is recorded. Returns how many were read."""
        count = 0
        with transaction(self._db):
            start = self._db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM problems").fetchone()[0]
            for offset, p in enumerate(problems):
                self._db.execute(
                    "INSERT OR IGNORE INTO problems (position, problem_id, question, answer, metadata)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (start + offset, p.problem_id, p.question, p.answer, json.dumps(p.metadata)),
                )
                count += 1
        return count

    def iterate(self, batch: int = 256) -> Iterator[Problem]:
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
                yield self._problem(r[1], r[2], r[3], r[4])
            if len(rows) < batch:
                return
            last = rows[-1][0]

    def get(self, problem_id: str) -> Problem | None:
        """The problem ``problem_id``, or None where the run has none of that id."""
        r = self._db.execute(
            "SELECT problem_id, question, answer, metadata FROM problems WHERE problem_id = ?", (problem_id,)
        ).fetchone()
        return None if r is None else self._problem(*r)

    def _problem(self, problem_id: str, question: str, answer: str | None, metadata: str) -> Problem:
        where = f"{self._origin}: problem {problem_id!r}: its stored metadata"
        return Problem(problem_id=problem_id, question=question, answer=answer, metadata=stored_json(metadata, where))

    def any_labeled(self) -> bool:
        """Whether any problem has a reference answer (one short query: none is read)."""
        return bool(self._db.execute("SELECT EXISTS (SELECT 1 FROM problems WHERE answer IS NOT NULL)").fetchone()[0])

    def count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM problems").fetchone()[0])
