"""Each iteration's record, as the method emitted it (one row per problem and iteration)."""

from __future__ import annotations

import sqlite3

from tmas.store.records import IterationRecord, read_iteration


class IterationTable:
    def __init__(self, db: sqlite3.Connection, origin: str = "") -> None:
        self._db = db
        # The run directory, for a record that cannot be read.
        self._origin = origin

    def save(self, record: IterationRecord) -> None:
        self._db.execute(
            "INSERT INTO iterations (problem_id, iteration, record) VALUES (?, ?, ?)"
            " ON CONFLICT(problem_id, iteration) DO UPDATE SET record = excluded.record",
            (record.problem_id, record.iteration, record.model_dump_json()),
        )

    def problem_ids(self) -> set[str]:
        """The problems with at least one iteration record stored."""
        return {row[0] for row in self._db.execute("SELECT DISTINCT problem_id FROM iterations")}

    def of(self, problem_id: str) -> list[IterationRecord]:
        rows = self._db.execute(
            "SELECT iteration, record FROM iterations WHERE problem_id = ? ORDER BY iteration", (problem_id,)
        ).fetchall()
        return [read_iteration(record, f"{self._origin}: problem {problem_id!r}, iteration {t}") for t, record in rows]
