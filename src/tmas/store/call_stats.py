"""Figures over the run's calls: counts, tokens and failures per role, retry causes, where the time went."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

from tmas.llm.types import Usage
from tmas.store.records import stored_json

# A failed call that was asked again (a resume asks every call that failed once more: the store never replays a
# failure) is the run's history: it spent what the server generated for it, but it is no failure of the run, whose
# call is the later one. Either the same request, sample and iteration was stored again after it; or, for a method's
# call (one of an iteration), a resume solved its problem again after it: a later call of that problem asked again a
# call that had failed, so that pass holds the problem's calls, and one whose request changed (its prompt held what
# the failure had left out: a summary of a verification that failed) was asked afresh, not asked again.
_FAILURES = (
    "SELECT id, problem_id, role, COALESCE(error_cause, 'unknown'), iteration IS NOT NULL,"
    " EXISTS (SELECT 1 FROM calls later WHERE later.request_hash = calls.request_hash AND later.sample = calls.sample"
    " AND later.iteration IS calls.iteration AND later.id > calls.id) FROM calls WHERE error IS NOT NULL"
)
# Per problem, the last method call that asked again a call that had failed.
_REASKS = (
    "SELECT later.problem_id, MAX(later.id) FROM calls f JOIN calls later ON later.request_hash = f.request_hash"
    " AND later.sample = f.sample AND later.iteration IS f.iteration AND later.id > f.id"
    " WHERE f.error IS NOT NULL AND f.iteration IS NOT NULL GROUP BY later.problem_id"
)


@dataclass(frozen=True)
class _Failure:
    call_id: int
    problem_id: str
    role: str
    cause: str
    asked_again: bool


@dataclass(frozen=True)
class Spent:
    """What some stored calls spent: how many there were, and their usage summed (a failed call's as stored: what its
    attempts generated, no prompt)."""

    calls: int = 0
    usage: Usage = field(default_factory=Usage)


class CallStats:
    def __init__(self, db: sqlite3.Connection, origin: str = "") -> None:
        self._db = db
        # The run directory, for a call that cannot be read.
        self._origin = origin

    def _failures(self, where: str = "", args: tuple[str, ...] = ()) -> list[_Failure]:
        """The failed calls (of those ``where`` names), each with whether it was asked again: read one by one, as
        a run holds few of them."""
        last = {problem: int(n) for problem, n in self._db.execute(_REASKS)}
        return [
            _Failure(int(i), problem, role, cause, bool(same) or (bool(of_iteration) and i < last.get(problem, 0)))
            for i, problem, role, cause, of_iteration, same in self._db.execute(_FAILURES + where, args)
        ]

    def by_role(self) -> dict[str, dict[str, int]]:
        """Calls, failed calls (``failed``: never asked again; ``asked_again``: failed, then asked again) and tokens
        per agent role, over the whole run: every stored call counts as a call and for its tokens."""
        rows = self._db.execute(
            "SELECT role, COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),"
            " COALESCE(SUM(cached_prompt_tokens), 0) FROM calls GROUP BY role ORDER BY role"
        )
        out = {
            r[0]: {
                "calls": r[1],
                "failed": 0,
                "asked_again": 0,
                "prompt_tokens": r[2],
                "completion_tokens": r[3],
                "cached_prompt_tokens": r[4],
            }
            for r in rows
        }
        for f in self._failures():
            out[f.role]["asked_again" if f.asked_again else "failed"] += 1
        return out

    def totals(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, int]:
        """Calls, failed calls (as :meth:`by_role` counts them), tokens and calls cut at max_tokens, over the whole run:
        of the calls :meth:`causes` names by ``role`` and ``other_roles``."""
        where, args = _role_filter(role, other_roles)
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),"
            " COALESCE(SUM(reasoning_tokens), 0), COALESCE(SUM(finish_reason = 'length'), 0),"
            f" COALESCE(SUM(cached_prompt_tokens), 0) FROM calls WHERE TRUE{where}",
            args,
        ).fetchone()
        failures = self._failures(where, args)
        again = sum(f.asked_again for f in failures)
        return {
            "calls": row[0],
            "failed": len(failures) - again,
            "asked_again": again,
            "prompt_tokens": row[1],
            "completion_tokens": row[2],
            "reasoning_tokens": row[3],
            "truncated": row[4],
            "cached_prompt_tokens": row[5],
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
            "SELECT problem_id, COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0)"
            f" FROM calls WHERE TRUE{where} GROUP BY problem_id",
            args,
        )
        out = {
            str(r[0]): {"calls": r[1], "failed": 0, "asked_again": 0, "prompt_tokens": r[2], "completion_tokens": r[3]}
            for r in rows
        }
        for f in self._failures(where, args):
            out[str(f.problem_id)]["asked_again" if f.asked_again else "failed"] += 1
        return out

    def by_iteration(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, dict[int | None, Spent]]:
        """Per problem and iteration (None: a call of no iteration), what its calls spent, counted as :meth:`totals`
        counts them: every stored call, answered, failed, cancelled or failed and asked again, of the calls
        :meth:`causes` names by ``role`` and ``other_roles``. Summed over a problem's iterations, its row of
        :meth:`by_problem`."""
        where, args = _role_filter(role, other_roles)
        rows = self._db.execute(
            "SELECT problem_id, iteration, COUNT(*), COALESCE(SUM(prompt_tokens), 0),"
            " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(reasoning_tokens), 0),"
            f" COALESCE(SUM(cached_prompt_tokens), 0) FROM calls WHERE TRUE{where} GROUP BY problem_id, iteration",
            args,
        )
        out: dict[str, dict[int | None, Spent]] = {}
        for problem, iteration, calls, prompt, completion, reasoning, cached in rows:
            usage = Usage(
                prompt_tokens=prompt,
                completion_tokens=completion,
                reasoning_tokens=reasoning,
                cached_prompt_tokens=cached,
            )
            out.setdefault(str(problem), {})[iteration] = Spent(int(calls), usage)
        return out

    def failed_spend(self, problem_id: str) -> Spent:
        """What the problem's method calls (those of an iteration: a judge's are of none) that failed spent: a
        resume asks each again and never replays it, so what the server generated for it is spent once and for
        all, as :meth:`totals` counts it."""
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),"
            " COALESCE(SUM(reasoning_tokens), 0), COALESCE(SUM(cached_prompt_tokens), 0) FROM calls"
            " WHERE problem_id = ? AND iteration IS NOT NULL AND error IS NOT NULL",
            (problem_id,),
        ).fetchone()
        usage = Usage(
            prompt_tokens=row[1], completion_tokens=row[2], reasoning_tokens=row[3], cached_prompt_tokens=row[4]
        )
        return Spent(int(row[0]), usage)

    def asked_again(self, problem_id: str) -> set[int]:
        """The ids of the problem's calls that failed and were asked again (as :meth:`by_role` counts them)."""
        return {f.call_id for f in self._failures(" AND problem_id = ?", (problem_id,)) if f.asked_again}

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

    def sure_replay_calls(self, problem_id: str) -> dict[int, tuple[int, Usage]]:
        """The problem's method calls (those of an iteration) that :meth:`sure_replays` counts, by id, each with its
        iteration and usage: the calls a resume replays before any new call of the problem could change what it asks.
        A request stored twice counts once, as the first, which a replay answers from."""
        rows = self._db.execute(
            "WITH standing AS (SELECT MIN(id) AS first FROM calls f WHERE problem_id = ? AND error IS NOT NULL"
            " AND NOT EXISTS (SELECT 1 FROM calls r WHERE r.request_hash = f.request_hash AND r.sample = f.sample"
            " AND r.error IS NULL))"
            " SELECT c.id, c.iteration, c.prompt_tokens, c.completion_tokens, c.reasoning_tokens,"
            " c.cached_prompt_tokens FROM calls c, standing s WHERE c.problem_id = ? AND c.iteration IS NOT NULL"
            " AND c.error IS NULL AND (s.first IS NULL OR c.id < s.first) AND c.id = (SELECT MIN(d.id) FROM calls d"
            " WHERE d.request_hash = c.request_hash AND d.sample = c.sample AND d.iteration IS c.iteration"
            " AND d.error IS NULL)",
            (problem_id, problem_id),
        ).fetchall()
        return {
            int(call_id): (
                int(iteration),
                Usage(
                    prompt_tokens=prompt or 0,
                    completion_tokens=completion or 0,
                    reasoning_tokens=reasoning or 0,
                    cached_prompt_tokens=cached or 0,
                ),
            )
            for call_id, iteration, prompt, completion, reasoning, cached in rows
        }

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
        for f in self._failures(where, args):
            into = asked_again if f.asked_again else failed
            into[f.cause] = into.get(f.cause, 0) + 1
        retried: dict[str, int] = {}
        # Most calls have no retry: only the others are read and decoded.
        query = f"SELECT id, retry_causes FROM calls WHERE retry_causes != '[]'{where}"
        for call_id, raw in self._db.execute(query, args).fetchall():
            for cause in stored_json(raw, f"{self._origin}: call {call_id}: its stored retry_causes"):
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
