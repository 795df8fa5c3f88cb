"""Each iteration's record, as the method emitted it (one row per problem and iteration)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any


class IterationTable:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def save(self, problem_id: str, iteration: int, record: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO iterations (problem_id, iteration, record) VALUES (?, ?, ?)"
            " ON CONFLICT(problem_id, iteration) DO UPDATE SET record = excluded.record",
            (problem_id, iteration, json.dumps(record, ensure_ascii=False)),
        )

    def problem_ids(self) -> set[str]:
        """The problems with at least one iteration record stored."""
        return {row[0] for row in self._db.execute("SELECT DISTINCT problem_id FROM iterations")}

    def of(self, problem_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT record FROM iterations WHERE problem_id = ? ORDER BY iteration", (problem_id,)
        ).fetchall()
        return [json.loads(r[0]) for r in rows]
