"""Figures over the run's calls: counts, tokens and failures per role, retry causes, where the time went."""

from __future__ import annotations

import json
import sqlite3

# A failed call that was asked again later (a resume asks every call that failed once more: the store never replays a
# failure): the same request, sample and iteration stored again after it. That attempt is the run's history: it spent
# what the server generated for it, but it is no failure of the run, whose call is the later one.
_ASKED_AGAIN = (
    "(error IS NOT NULL AND EXISTS (SELECT 1 FROM calls later WHERE later.request_hash = calls.request_hash"
    " AND later.sample = calls.sample AND later.iteration IS calls.iteration AND later.id > calls.id))"
)
# A failed call the run was left with: failed, and never asked again.
_FAILED = f"(error IS NOT NULL AND NOT {_ASKED_AGAIN})"


class CallStats:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def by_role(self) -> dict[str, dict[str, int]]:
        """Calls, failed calls (``failed``: never asked again; ``asked_again``: failed, then asked again) and tokens
        per agent role, over the whole run: every stored call counts as a call and for its tokens."""
        rows = self._db.execute(
            f"SELECT role, COUNT(*), COALESCE(SUM({_FAILED}), 0), COALESCE(SUM({_ASKED_AGAIN}), 0),"
            " COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),"
            " COALESCE(SUM(cached_prompt_tokens), 0) FROM calls GROUP BY role ORDER BY role"
        )
        return {
            r[0]: {
                "calls": r[1],
                "failed": r[2],
                "asked_again": r[3],
                "prompt_tokens": r[4],
                "completion_tokens": r[5],
                "cached_prompt_tokens": r[6],
            }
            for r in rows
        }

    def totals(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, int]:
        """Calls, failed calls (as :meth:`by_role` counts them), tokens and calls cut at max_tokens, over the whole run:
        of the calls :meth:`causes` names by ``role`` and ``other_roles``."""
        where, args = _role_filter(role, other_roles)
        row = self._db.execute(
            f"SELECT COUNT(*), COALESCE(SUM({_FAILED}), 0), COALESCE(SUM({_ASKED_AGAIN}), 0),"
            " COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(reasoning_tokens), 0),"
            " COALESCE(SUM(finish_reason = 'length'), 0), COALESCE(SUM(cached_prompt_tokens), 0) FROM calls"
            f" WHERE TRUE{where}",
            args,
        ).fetchone()
        return {
            "calls": row[0],
            "failed": row[1],
            "asked_again": row[2],
            "prompt_tokens": row[3],
            "completion_tokens": row[4],
            "reasoning_tokens": row[5],
            "truncated": row[6],
            "cached_prompt_tokens": row[7],
        }

    def by_problem(
        self, role: str | None = None, *, other_roles: bool = False, problem_id: str | None = None
    ) -> dict[str, dict[str, int]]:
        """Calls, failed calls and tokens per problem (of ``problem_id`` alone where given), counted as :meth:`by_role`
        counts them: of the calls :meth:`causes` names by ``role`` and ``other_roles``."""
        where, args = _role_filter(role, other_roles)
        if problem_id is not None:
            where, args = f"{where} AND problem_id = ?", (*args, problem_id)
        rows = self._db.execute(
            f"SELECT problem_id, COUNT(*), COALESCE(SUM({_FAILED}), 0), COALESCE(SUM({_ASKED_AGAIN}), 0),"
            " COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) FROM calls"
            f" WHERE TRUE{where} GROUP BY problem_id",
            args,
        )
        return {
            str(r[0]): {
                "calls": r[1],
                "failed": r[2],
                "asked_again": r[3],
                "prompt_tokens": r[4],
                "completion_tokens": r[5],
            }
            for r in rows
        }

    def problems(self, role: str | None = None, *, other_roles: bool = False) -> set[str]:
        """The problems with a call stored, answered or failed: of the calls :meth:`causes` names by ``role`` and
        ``other_roles``."""
        where, args = _role_filter(role, other_roles)
        return {str(r[0]) for r in self._db.execute(f"SELECT DISTINCT problem_id FROM calls WHERE TRUE{where}", args)}

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
        """Failed calls by cause (``failed``: never asked again; ``asked_again``: failed, then asked again) and retried
        attempts by cause (``retried``), over the whole run: of every role, of ``role`` alone, or with ``other_roles``
        of every role but ``role`` (the method's calls, the judge's apart)."""
        where, args = _role_filter(role, other_roles)
        failed: dict[str, int] = {}
        asked_again: dict[str, int] = {}
        for cause, again, count in self._db.execute(
            f"SELECT COALESCE(error_cause, 'unknown'), {_ASKED_AGAIN}, COUNT(*) FROM calls"
            f" WHERE error IS NOT NULL{where} GROUP BY 1, 2",
            args,
        ):
            (asked_again if again else failed)[cause] = count
        retried: dict[str, int] = {}
        # Most calls have no retry: only the others are read and decoded.
        for (raw,) in self._db.execute(f"SELECT retry_causes FROM calls WHERE retry_causes != '[]'{where}", args):
            for cause in json.loads(raw):
                retried[cause] = retried.get(cause, 0) + 1
        return {
            "failed": dict(sorted(failed.items())),
            "asked_again": dict(sorted(asked_again.items())),
            "retried": dict(sorted(retried.items())),
        }

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
