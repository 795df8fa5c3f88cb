"""Figures over the run's calls: counts, tokens and failures per role, retry causes, where the time went."""

from __future__ import annotations

import json
import sqlite3


class CallStats:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def by_role(self) -> dict[str, dict[str, int]]:
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

    def totals(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, int]:
        """Calls, failed calls, tokens and calls cut at max_tokens, over the whole run: of the calls :meth:`causes`
        names by ``role`` and ``other_roles``."""
        where, args = _role_filter(role, other_roles)
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(error IS NOT NULL), 0), COALESCE(SUM(prompt_tokens), 0),"
            " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(reasoning_tokens), 0),"
            " COALESCE(SUM(finish_reason = 'length'), 0), COALESCE(SUM(cached_prompt_tokens), 0) FROM calls"
            f" WHERE TRUE{where}",
            args,
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

    def sure_replays(self) -> dict[str, int]:
        """The answered calls a resume replays whatever its failed calls answer now, by problem: each problem's
        answered calls stored before its first call that failed and was never answered since. One stored after it
        may have been asked with what that failure left out (a summary, a later iteration), and a reply to it now
        changes its request: such calls are counted as still to send, so a resume's count of them is an upper
        bound."""
        return {problem: n for problem, (n, _, _) in self.sure_replay_usage().items()}

    def sure_replay_usage(self) -> dict[str, tuple[int, int, int]]:
        """The calls :meth:`sure_replays` counts, by problem, with their prompt and completion tokens: what a
        problem's token budget has spent once they are replayed."""
        rows = self._db.execute(
            "WITH standing AS (SELECT problem_id, MIN(id) AS first FROM calls f WHERE error IS NOT NULL"
            " AND NOT EXISTS (SELECT 1 FROM calls r WHERE r.request_hash = f.request_hash AND r.sample = f.sample"
            " AND r.error IS NULL) GROUP BY problem_id)"
            " SELECT c.problem_id, COUNT(*), COALESCE(SUM(c.prompt_tokens), 0), COALESCE(SUM(c.completion_tokens), 0)"
            " FROM calls c LEFT JOIN standing s ON s.problem_id IS c.problem_id"
            " WHERE c.error IS NULL AND (s.first IS NULL OR c.id < s.first) GROUP BY c.problem_id"
        ).fetchall()
        return {str(problem): (int(n), int(prompt), int(completion)) for problem, n, prompt, completion in rows}

    def replies(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, tuple[int, int]]:
        """Successful calls per role over the whole run, and how many of them were cut at max_tokens: of the roles
        :meth:`causes` names by ``role`` and ``other_roles``."""
        where, args = _role_filter(role, other_roles)
        rows = self._db.execute(
            "SELECT role, COUNT(*), COALESCE(SUM(finish_reason = 'length'), 0) FROM calls"
            f" WHERE error IS NULL{where} GROUP BY role ORDER BY role",
            args,
        ).fetchall()
        return {role: (int(n), int(cut)) for role, n, cut in rows}

    def causes(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, dict[str, int]]:
        """Failed calls by cause (``failed``) and retried attempts by cause (``retried``), over the whole run: of every
        role, of ``role`` alone, or with ``other_roles`` of every role but ``role`` (the method's calls, the judge's
        apart)."""
        where, args = _role_filter(role, other_roles)
        failed: dict[str, int] = {}
        for cause, count in self._db.execute(
            f"SELECT COALESCE(error_cause, 'unknown'), COUNT(*) FROM calls WHERE error IS NOT NULL{where} GROUP BY 1",
            args,
        ):
            failed[cause] = count
        retried: dict[str, int] = {}
        # Most calls have no retry: only the others are read and decoded.
        for (raw,) in self._db.execute(f"SELECT retry_causes FROM calls WHERE retry_causes != '[]'{where}", args):
            for cause in json.loads(raw):
                retried[cause] = retried.get(cause, 0) + 1
        return {"failed": dict(sorted(failed.items())), "retried": dict(sorted(retried.items()))}

    def waits(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, list[float]]:
        """Where the finished calls' time went, where measured: ``queued`` (waiting inside tmas for a slot) and
        ``first_token`` (from sending to the server's first chunk: its queue and the prompt's prefill); of the calls
        :meth:`causes` names by ``role`` and ``other_roles``."""
        where, args = _role_filter(role, other_roles)
        rows = self._db.execute(
            f"SELECT queued_s, first_token_s FROM calls WHERE error IS NULL AND first_token_s IS NOT NULL{where}", args
        ).fetchall()
        return {
            "queued": [float(q) for q, _ in rows if q is not None],
            "first_token": [float(f) for _, f in rows],
        }


def _role_filter(role: str | None, other_roles: bool) -> tuple[str, tuple[str, ...]]:
    """The condition (to follow a WHERE clause) and its argument naming the calls of ``role``, or of every other role
    with ``other_roles``; nothing without a role."""
    if role is None:
        return "", ()
    return (" AND role != ?" if other_roles else " AND role = ?"), (role,)
