"""The evaluation harness's grades of candidates (tmas.grading.grades): one row per grader and judge run."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from tmas.store.database import transaction


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


def _row(r: Any) -> GradeRow:
    return GradeRow(r[0], r[1], r[2], r[3], r[4], r[5], None if r[6] is None else bool(r[6]), r[7])


class GradeTable:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def save(self, rows: list[GradeRow]) -> None:
        """Store grades (replacing earlier ones with the same key) in one transaction."""
        with transaction(self._db):
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

    def read(self, grader: str | None = None, problem_id: str | None = None) -> list[GradeRow]:
        """The stored grades, of one grader and of one problem where given."""
        query = "SELECT problem_id, iteration, candidate, grader, run, answer, verdict, detail FROM grades"
        where = [(column, value) for column, value in (("grader", grader), ("problem_id", problem_id)) if value]
        if where:
            query += " WHERE " + " AND ".join(f"{column} = ?" for column, _ in where)
        args = tuple(value for _, value in where)
        return [
            _row(r) for r in self._db.execute(query + " ORDER BY problem_id, iteration, candidate, grader, run", args)
        ]

    def last_runs(self) -> list[GradeRow]:
        """Per grader, one of its rows of its highest run: how many runs a grader stored (``Grader.stored_runs``)
        without reading every row."""
        query = (
            "SELECT problem_id, iteration, candidate, grader, MAX(run), answer, verdict, detail FROM grades"
            " GROUP BY grader ORDER BY grader"
        )
        return [_row(r) for r in self._db.execute(query)]

    def delete(self, grader: str | None = None) -> None:
        if grader is None:
            self._db.execute("DELETE FROM grades")
        else:
            self._db.execute("DELETE FROM grades WHERE grader = ?", (grader,))
