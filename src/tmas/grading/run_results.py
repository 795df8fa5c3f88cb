"""A run's per-problem records as evaluation reads them: finished results, plus problems still mid-way.

A problem that was stopped or killed mid-way has no result yet, but every iteration it finished is in the store.
Such a problem is given a stand-in result with status ``running`` and those iterations, so grading and reports show
the finished iterations instead of nothing. Metrics count it only at the iterations it reached (see metrics.py).
"""

from __future__ import annotations

from typing import Any

from tmas.store.run_store import RunStore

# Status of a stand-in result: the problem has iterations in the store but no result.
RUNNING = "running"


def load_results(store: RunStore) -> list[dict[str, Any]]:
    """Results in problem order; problems without a result but with finished iterations as ``running`` ones."""
    finished = {r["problem_id"]: r for r in store.results()}
    out: list[dict[str, Any]] = []
    for problem in store.iter_problems():
        result = finished.get(problem.problem_id)
        if result is None:
            iterations = store.iterations(problem.problem_id)
            if not iterations:
                continue
            result = {"problem_id": problem.problem_id, "status": RUNNING, "iterations": iterations}
        out.append(result)
    return out


def in_progress(result: dict[str, Any]) -> bool:
    return result.get("status") == RUNNING
