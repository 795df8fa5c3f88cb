"""The run store: one SQLite database (WAL) per run directory.

It holds the run's settings and code version, the problems, every LLM call, each method iteration's record and each
problem's result. A call is committed before its result is returned to the method that asked for it, so a run killed
at any moment loses no finished call; on resume the same calls are replayed from here instead of being sent again.

:class:`RunStore` is one facade over parts with one job each, sharing the store's connection: the database itself
(:mod:`tmas.store.database`: tables, schema versions, opening and migrating), the run's metadata and what it learnt
of its endpoints (:class:`RunMeta`), the problems (:class:`ProblemTable`), the calls (:class:`CallLog`) and figures
over them (:class:`CallStats`), the iteration records (:class:`IterationTable`), the results with their summaries
(:class:`ResultTable`), the grades (:class:`GradeTable`) and the call texts (:class:`tmas.store.texts.TextBlobs`).
Callers use the facade's methods; each is the part's own. Results and iteration records go in and come out as the
typed records of :mod:`tmas.store.records`, validated as they are read, whatever version wrote them.

The methods are synchronous on purpose: each is one small local transaction (tens of microseconds under WAL with
``synchronous=NORMAL``), cheaper than a hop to a worker thread, and it keeps commit order equal to call order.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tmas.errors import InputError
from tmas.llm.types import ChatRequest, Completion, DowngradeKind, ServerFindings, Usage
from tmas.problems import Problem
from tmas.store.call_log import CallLog
from tmas.store.call_stats import CallStats, Spent
from tmas.store.database import (
    DB_NAME,
    SCHEMA_VERSION,
    DamagedStore,
    StoreError,
    UnknownSchema,
    mark_current,
    open_read_only,
    open_writable,
)
from tmas.store.grade_table import GradeRow, GradeTable
from tmas.store.iteration_table import IterationTable
from tmas.store.problem_table import ProblemTable
from tmas.store.records import IterationRecord, ProblemResult
from tmas.store.result_table import ResultTable
from tmas.store.run_lock import RunLock
from tmas.store.run_meta import RunMeta
from tmas.store.texts import TextBlobs

__all__ = ["DB_NAME", "SCHEMA_VERSION", "DamagedStore", "GradeRow", "RunStore", "Spent", "StoreError", "UnknownSchema"]


# The attribute of an SQLite error that names the store it was read from (see damaged_store).
_DAMAGED = "tmas_damaged_store"


def damaged_store(exc: BaseException) -> Path | None:
    """The store whose damage ``exc`` met (an SQLite error raised in a ``with RunStore(...)`` block, a page the
    opening checks do not read: "database disk image is malformed"), or None."""
    found = getattr(exc, _DAMAGED, None)
    return found if isinstance(found, Path) else None


# A sweep directory's manifest, and its folder of one run directory per point (tmas.sweep).
SWEEP_MANIFEST = "sweep.json"
SWEEP_RUNS = "runs"


class RunStore:
    """Open (creating if needed) the store of ``run_dir``; ``read_only`` for readers beside a live writer."""

    def __init__(self, run_dir: str | Path, *, create: bool = True, read_only: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        self._lock: RunLock | None = None
        if (read_only or not create) and not self.path.is_file():
            if (self.run_dir / SWEEP_MANIFEST).is_file():
                runs = self.run_dir / SWEEP_RUNS
                raise StoreError(
                    f"{self.run_dir}: a sweep, not a run directory: each point's run is a directory of {runs}"
                )
            raise StoreError(f"{self.run_dir}: not a run directory (no {DB_NAME})")
        migrate = False
        if read_only:
            self._db = open_read_only(self.path)
        else:
            self._db, migrate = open_writable(self.path)
        self._meta = RunMeta(self._db, str(self.run_dir))
        self._problems = ProblemTable(self._db, str(self.run_dir))
        self._call_log = CallLog(self._db, TextBlobs(self._db, str(self.run_dir)), str(self.run_dir))
        self._call_stats = CallStats(self._db, str(self.run_dir))
        self._iterations = IterationTable(self._db, str(self.run_dir))
        self._results = ResultTable(self._db, str(self.run_dir))
        self._grades = GradeTable(self._db)
        if migrate:
            self._results.summarize_missing()
            mark_current(self._db)

    def close(self) -> None:
        self._db.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def hold(self, lock: RunLock) -> None:
        """Keep the run's ``lock`` (taken) until this store is closed: the process writing the run holds it."""
        self._lock = lock

    @property
    def holds_lock(self) -> bool:
        """Whether this store holds its run's lock (:meth:`hold`)."""
        return self._lock is not None and self._lock.held

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if type(exc) is sqlite3.DatabaseError:  # not a subclass's: a locked store, a failed constraint
            # A page damaged past what opening the store checks ("database disk image is malformed"): the error
            # carries which store it was read from.
            setattr(exc, _DAMAGED, getattr(exc, _DAMAGED, self.path))
        self.close()

    # ---- meta, and what the run learnt of its endpoints (RunMeta) ---------------------------------------------
    def set_meta(self, key: str, value: Any) -> None:
        self._meta.set(key, value)

    def get_meta(self, key: str) -> Any:
        return self._meta.get(key)

    def record_downgrade(
        self, kind: DowngradeKind, endpoint: str, role: str, message: str, model: str | None = None
    ) -> None:
        self._meta.record_downgrade(kind, endpoint, role, message, model)

    def downgrades(self, kind: str) -> dict[str, dict[str, dict[str, Any]]]:
        return self._meta.downgrades(kind)

    def downgrade_messages(self) -> dict[str, dict[str, str]]:
        return self._meta.downgrade_messages()

    def record_server(self, findings: ServerFindings) -> None:
        self._meta.record_server(findings)

    def servers(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self._meta.servers()

    def record_notice(self, kind: str, message: str) -> None:
        self._meta.record_notice(kind, message)

    def notices(self) -> dict[str, str]:
        return self._meta.notices()

    # ---- problems (ProblemTable) ------------------------------------------------------------------------------
    def add_problems(self, problems: Iterable[Problem]) -> int:
        return self._problems.add(problems)

    def problems(self) -> list[Problem]:
        return list(self._problems.iterate())

    def iter_problems(self, batch: int = 256) -> Iterator[Problem]:
        return self._problems.iterate(batch)

    def problem(self, problem_id: str) -> Problem | None:
        return self._problems.get(problem_id)

    def any_labeled(self) -> bool:
        return self._problems.any_labeled()

    def problem_count(self) -> int:
        return self._problems.count()

    # ---- calls (CallLog) --------------------------------------------------------------------------------------
    def record_call(self, completion: Completion, request: ChatRequest) -> int:
        return self._call_log.record(completion, request)

    def lookup_call(
        self, request_hash: str, sample: int, iteration: int | None, *, stopped_early: bool = False
    ) -> Completion | None:
        return self._call_log.lookup(request_hash, sample, iteration, stopped_early=stopped_early)

    def calls(self, problem_id: str | None = None, iteration: int | None = None) -> Iterator[Completion]:
        return self._call_log.iterate(problem_id, iteration)

    def calls_outside(self, problem_id: str, iterations: set[int]) -> Iterator[Completion]:
        return self._call_log.outside(problem_id, iterations)

    def call(self, call_id: int) -> Completion | None:
        return self._call_log.get(call_id)

    def call_messages(self, call_id: int) -> list[dict[str, str]]:
        return self._call_log.messages(call_id)

    def call_sampling(self, call_id: int) -> dict[str, Any]:
        return self._call_log.sampling(call_id)

    def call_sampling_sources(self, call_id: int) -> dict[str, str] | None:
        return self._call_log.sampling_sources(call_id)

    def reply_model_endpoints(self, role: str) -> tuple[str | None, list[str]]:
        return self._call_log.reply_model_endpoints(role)

    def problems_with_calls(self) -> set[str]:
        return self._call_log.problem_ids()

    # ---- figures over the calls (CallStats) -------------------------------------------------------------------
    def call_counts(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, int]:
        return self._call_stats.totals(role, other_roles=other_roles)

    def problem_costs(
        self, role: str | None = None, *, other_roles: bool = False, problem_id: str | None = None
    ) -> dict[str, dict[str, int]]:
        return self._call_stats.by_problem(role, other_roles=other_roles, problem_id=problem_id)

    def spent_by_iteration(
        self, role: str | None = None, *, other_roles: bool = False
    ) -> dict[str, dict[int | None, Spent]]:
        return self._call_stats.by_iteration(role, other_roles=other_roles)

    def failed_spend(self, problem_id: str) -> Spent:
        return self._call_stats.failed_spend(problem_id)

    def asked_again_calls(self, problem_id: str) -> set[int]:
        return self._call_stats.asked_again(problem_id)

    def called_problems(self, role: str | None = None, *, other_roles: bool = False) -> set[str]:
        return self._call_stats.problems(role, other_roles=other_roles)

    def role_costs(self) -> dict[str, dict[str, int]]:
        return self._call_stats.by_role()

    def sure_replays(self) -> dict[str, int]:
        return self._call_stats.sure_replays()

    def sure_replay_usage(self) -> dict[str, tuple[int, int, int]]:
        return self._call_stats.sure_replay_usage()

    def sure_replay_calls(self, problem_id: str) -> dict[int, tuple[int, Usage]]:
        return self._call_stats.sure_replay_calls(problem_id)

    def replies_by_role(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, tuple[int, int]]:
        return self._call_stats.replies(role, other_roles=other_roles)

    def call_causes(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, dict[str, int]]:
        return self._call_stats.causes(role, other_roles=other_roles)

    def call_waits(self, role: str | None = None, *, other_roles: bool = False) -> dict[str, list[float]]:
        return self._call_stats.waits(role, other_roles=other_roles)

    def change_marker(self) -> str:
        """Changes whenever a call, an iteration, a result or a new grade is written, and when grades are deleted: what
        a live viewer polls. Grades are followed by their number and last row id, cheap on a run of 100,000 grades
        (the time of the last one written costs a scan of them all); a verdict rewritten in place, an undecided one
        the judge was asked again, follows the judge's call, which moves the marker. When the results were last
        written is read from their summaries, which hold the same time: read from the results, it walked every
        stored record (100 MB on a run of 1,000 problems of 100 samples), on every poll. A store of an older schema,
        read-only, has no summaries: its results are read then."""
        row = self._db.execute(
            "SELECT (SELECT COALESCE(MAX(id), 0) FROM calls), (SELECT COUNT(*) FROM iterations),"
            " (SELECT COUNT(*) FROM results),"
            " CASE WHEN (SELECT COUNT(*) FROM result_summaries) = (SELECT COUNT(*) FROM results)"
            " THEN (SELECT COALESCE(MAX(finished_at), 0) FROM result_summaries)"
            " ELSE (SELECT COALESCE(MAX(finished_at), 0) FROM results) END,"
            " (SELECT COUNT(*) FROM grades), (SELECT COALESCE(MAX(rowid), 0) FROM grades)"
        ).fetchone()
        return "-".join(str(v) for v in row)

    # ---- iteration records (IterationTable) -------------------------------------------------------------------
    def save_iteration(self, record: IterationRecord) -> None:
        self._iterations.save(record)

    def iterations(self, problem_id: str) -> list[IterationRecord]:
        return self._iterations.of(problem_id)

    def problems_with_iterations(self) -> set[str]:
        return self._iterations.problem_ids()

    # ---- results and their summaries (ResultTable) ------------------------------------------------------------
    def save_result(self, result: ProblemResult) -> None:
        self._results.save(result)

    def result(self, problem_id: str) -> ProblemResult | None:
        return self._results.get(problem_id)

    def results(self) -> list[ProblemResult]:
        return self._results.in_order()

    def result_summaries(
        self, problem_ids: Collection[str] | None = None
    ) -> Iterator[tuple[str, float, ProblemResult]]:
        return self._results.summaries(problem_ids)

    def result_stamps(self) -> dict[str, float]:
        return self._results.stamps()

    def status_counts(self) -> dict[str, int]:
        return self._results.status_counts()

    def finished_problem_ids(self, fingerprint: str | None = None) -> set[str]:
        return self._results.finished_ids(fingerprint)

    def settled_problem_ids(self, fingerprint: str) -> set[str]:
        return self._results.settled_ids(fingerprint)

    # ---- grades (GradeTable) ----------------------------------------------------------------------------------
    def save_grades(self, rows: list[GradeRow]) -> None:
        self._grades.save(rows)

    def grades(self, grader: str | None = None, problem_id: str | None = None) -> list[GradeRow]:
        return self._grades.read(grader, problem_id)

    def grade_last_runs(self) -> list[GradeRow]:
        return self._grades.last_runs()

    def delete_grades(self, grader: str | None = None) -> None:
        self._grades.delete(grader)


def resolved_once(run_dirs: Sequence[Path]) -> list[Path]:
    """``run_dirs`` resolved; :class:`InputError` naming any given twice (its work would count twice over)."""
    resolved = [Path(p).resolve() for p in run_dirs]
    twice = sorted({str(p) for p in resolved if resolved.count(p) > 1})
    if twice:
        raise InputError(f"run directory given twice: {', '.join(twice)}")
    return resolved


def check_began(run_dir: Path, doing: str) -> None:
    """:class:`StoreError` where ``run_dir``'s store file is empty (a run stopped before it wrote anything): said
    before a command that reads the run (``doing``: "export", "report", "grade") opens it, so that nothing is
    written into it."""
    path = Path(run_dir) / DB_NAME
    if path.is_file() and path.stat().st_size == 0:
        raise StoreError(f"{run_dir}: holds no run to {doing}: it was stopped before its first call")
