"""A run's per-problem records as evaluation reads them: finished results, plus problems still mid-way.

A problem that was stopped or killed mid-way has no result yet, but every iteration it finished is in the store.
Such a problem is given a stand-in result with status ``running`` and those iterations
(:func:`tmas.store.records.running_result`), so grading and reports show the finished iterations instead of
nothing. Metrics count it only at the iterations it reached (see metrics.py).
"""

from __future__ import annotations

from tmas.store.records import RUNNING, ProblemResult, running_result
from tmas.store.run_store import RunStore

__all__ = ["RUNNING", "load_results", "run_method_name"]


def run_method_name(store: RunStore) -> str:
    """The name of the method the run in ``store`` solves with, as its setup recorded it ("?" where none did)."""
    method = store.get_meta("method") or {}
    settings = store.get_meta("settings") or {}
    return str(method.get("name") or (settings.get("method") or {}).get("name") or "?")


def load_results(store: RunStore) -> list[ProblemResult]:
    """Results in problem order; problems without a result but with finished iterations as ``running`` ones."""
    finished = {r.problem_id: r for r in store.results()}
    method: str | None = None
    out: list[ProblemResult] = []
    for problem in store.iter_problems():
        result = finished.get(problem.problem_id)
        if result is None:
            iterations = store.iterations(problem.problem_id)
            if not iterations:
                continue
            method = method or run_method_name(store)
            result = running_result(problem.problem_id, method, iterations)
        out.append(result)
    return out
