"""What keeps big runs fast: results parsed once, and whole run overviews reused until the run changes.

A run of 1,000 problems with 100 samples each stores about 100 MB of result JSON; the overview reads only each
result's summary (tmas.store.summaries: a few % of it). Results are immutable once written (a problem solved again
gets a new ``finished_at``), so each summary is parsed once and re-read only when its ``finished_at`` moves.
The overview built from them is reused while the run's files and its change marker are unchanged (a write to a
SQLite database in WAL mode changes the time of its ``-wal`` file, or of the database itself after a checkpoint, but
only as finely as the filesystem keeps times, and the size of the WAL no more once it has restarted: the marker
moves with every call, iteration, result and grade written).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tmas.grading.run_results import run_method_name
from tmas.store.records import ProblemResult, running_result
from tmas.store.run_store import RunStore
from tmas.store.summaries import summarize_iteration
from tmas.view.live_grades import Memo
from tmas.view.vote_classes import VoteClasses

T = TypeVar("T")


def file_state(run_dir: Path) -> tuple[tuple[int, int], ...]:
    """Sizes and modification times of the run's database files: they change with every write."""
    state = []
    for suffix in ("", "-wal"):
        try:
            stat = os.stat(run_dir / f"run.sqlite{suffix}")
            state.append((stat.st_size, stat.st_mtime_ns))
        except FileNotFoundError:
            state.append((0, 0))
    return tuple(state)


class RunCache:
    """Per run directory: its parsed results and its last overview (thread-safe: pages render in worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._run_locks: dict[Path, threading.Lock] = {}
        self._results: dict[Path, dict[str, tuple[float, ProblemResult]]] = {}
        self._built: dict[tuple[Path, str], tuple[object, Any]] = {}
        self._verdicts: dict[Path, Memo] = {}
        self.votes = VoteClasses()

    def verdicts(self, run_dir: Path) -> Memo:
        """The run's memo of live verdicts (see :func:`tmas.view.live_grades.live_grades`)."""
        return self._verdicts.setdefault(run_dir.resolve(), {})

    def run_lock(self, run_dir: Path) -> threading.Lock:
        with self._lock:
            return self._run_locks.setdefault(run_dir.resolve(), threading.Lock())

    def results(self, store: RunStore) -> list[ProblemResult]:
        """What :func:`tmas.grading.run_results.load_results` returns, as summaries (tmas.store.summaries)."""
        run_dir = store.run_dir.resolve()
        cached = self._results.setdefault(run_dir, {})
        stamps = store.result_stamps()
        stale = [pid for pid, at in stamps.items() if pid not in cached or cached[pid][0] != at]
        if stale:
            for pid, at, summary in store.result_summaries(stale if len(stale) < len(stamps) else None):
                cached[pid] = (at, summary)
        for pid in set(cached) - set(stamps):
            del cached[pid]
        started = store.problems_with_iterations() - set(stamps)
        out = []
        for problem in store.iter_problems():
            pid = problem.problem_id
            if pid in cached:
                out.append(cached[pid][1])
            elif pid in started:
                iterations = [summarize_iteration(r) for r in store.iterations(pid)]
                if iterations:
                    out.append(running_result(pid, run_method_name(store), iterations))
        return out

    @staticmethod
    def status_counts(store: RunStore) -> dict[str, int]:
        """Problems by status (done, failed, ..., running: iterations but no result, pending: nothing yet)."""
        counts = store.status_counts()
        pending = store.problem_count() - sum(counts.values())
        return {**counts, **({"pending": pending} if pending else {})}

    def reuse(self, run_dir: Path, name: str, key: object, build: Callable[[], T]) -> T:
        """``build()``'s value for this run and ``name``, rebuilt only when ``key`` differs from the last one."""
        slot = (run_dir.resolve(), name)
        with self.run_lock(run_dir):
            hit = self._built.get(slot)
            if hit is not None and hit[0] == key:
                return hit[1]  # type: ignore[no-any-return]
            value = build()
            self._built[slot] = (key, value)
            return value
