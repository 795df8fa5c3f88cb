"""Run a method over problems into a run directory, durably and resumably."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tmas.config import Settings
from tmas.errors import InputError, TmasError
from tmas.llm.client import EndpointUnreachable, LLMClient
from tmas.llm.provision import provisioned
from tmas.methods import create_method
from tmas.methods.base import BUDGET_STOP, BudgetExhausted, Method, ProblemResult, ProblemSession
from tmas.problems import Problem
from tmas.store.run_store import RunStore, StoreError


@dataclass
class RunState:
    """Live progress of a run, read by the progress display."""

    total: int = 0
    done: int = 0
    failed: int = 0
    skipped: int = 0
    # Problems being solved -> the iteration each is in.
    active: dict[str, int] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    llm: LLMClient | None = None


@dataclass
class RunSummary:
    run_dir: Path
    problems: int
    done: int
    failed: int
    skipped: int
    calls: int
    cached_calls: int
    failed_calls: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    results: list[ProblemResult]
    # Handled anomalies (e.g. bad agent outputs) summed over the problems solved in this session.
    anomalies: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "results"}
        data["run_dir"] = str(self.run_dir)
        return data


def params_fingerprint(method: str, params: dict[str, Any], budget: dict[str, Any] | None = None) -> str:
    data: dict[str, Any] = {"method": method, "params": params}
    if budget:
        # Only a set budget is part of it, so runs without one keep their fingerprints; a resume with another
        # budget re-solves the problems (from the stored calls) to the new limit.
        data["budget"] = budget
    raw = json.dumps(data, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def run_fingerprint(method: Method, settings: Settings) -> str:
    """What a finished problem's result must match to be skipped: the method, its params and the budget."""
    budget = settings.budget.model_dump(exclude_none=True)
    return params_fingerprint(method.name, method.params.model_dump(mode="json"), budget)


class Unreachable(TmasError):
    """The endpoint could not be reached; finished work is kept for --resume."""


def prepare_run(
    run_dir: Path, settings: Settings, problems: list[Problem] | None, *, resume: bool
) -> tuple[RunStore, Settings, list[Problem]]:
    """Open the run's store. A new run records settings and problems; a resumed one reads them back."""
    if resume:
        store = RunStore(run_dir, create=False)
        stored = store.get_meta("settings")
        if stored is None:
            raise StoreError(f"{run_dir}: the run has no recorded settings")
        problems = store.problems()
        store.set_meta("settings", settings.model_dump(mode="json"))
        return store, settings, problems
    if problems is None:
        raise InputError("no problems given")
    if (run_dir / "run.sqlite").exists():
        raise InputError(f"{run_dir}: already holds a run; continue it with --resume or choose another directory")
    store = RunStore(run_dir)
    store.set_meta("settings", settings.model_dump(mode="json"))
    store.add_problems(problems)
    return store, settings, problems


async def run_problems(
    settings: Settings,
    problems: list[Problem],
    store: RunStore,
    *,
    state: RunState | None = None,
    on_result: Callable[[ProblemResult], None] | None = None,
) -> RunSummary:
    """Solve every problem not already finished with the same method parameters; results are stored as they come."""
    state = state or RunState()
    method = create_method(settings.method.name, settings.method.params, embedded=settings.uses_local_model)
    fingerprint = run_fingerprint(method, settings)
    store.set_meta("method", {"name": method.name, "params": method.params.model_dump(mode="json")})
    finished = {
        pid for pid in store.finished_problem_ids() if (store.result(pid) or {}).get("fingerprint") == fingerprint
    }
    todo = [p for p in problems if p.problem_id not in finished]
    state.total, state.skipped = len(problems), len(problems) - len(todo)
    started = time.monotonic()
    async with provisioned(settings, log_dir=store.run_dir) as live, LLMClient(live, store) as llm:
        state.llm = llm
        # Bound the problems in flight so a long problem file is not all held in memory at once.
        gate = asyncio.Semaphore(max(1, settings.concurrency))

        async def one(problem: Problem) -> ProblemResult:
            async with gate:
                try:
                    result = await _solve_one(method, problem, llm, store, settings, state.active)
                finally:
                    state.active.pop(problem.problem_id, None)
            record = result.model_dump(mode="json")
            record["fingerprint"] = fingerprint
            store.save_result(problem.problem_id, result.status, record)
            if result.status == "done":
                state.done += 1
            else:
                state.failed += 1
            if on_result is not None:
                on_result(result)
            return result

        tasks = [asyncio.create_task(one(p)) for p in todo]
        try:
            results = await asyncio.gather(*tasks)
        except EndpointUnreachable as exc:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise Unreachable(
                f"{exc}; finished work is kept: continue with 'tmas run --resume {store.run_dir}'"
            ) from None
        stats = llm.stats
    counts = store.call_counts()
    return RunSummary(
        run_dir=store.run_dir,
        problems=len(problems),
        done=sum(r.status == "done" for r in results) + state.skipped,
        failed=sum(r.status != "done" for r in results),
        skipped=state.skipped,
        calls=stats.calls,
        cached_calls=stats.cached,
        failed_calls=counts["failed"],
        prompt_tokens=counts["prompt_tokens"],
        completion_tokens=counts["completion_tokens"],
        wall_s=time.monotonic() - started,
        results=list(results),
        anomalies=_sum_counters(results),
    )


def budget_result(method: str, session: ProblemSession, detail: str) -> ProblemResult:
    """The result of a problem stopped by its budget: the iterations finished so far, the last one's answer."""
    last = session.records[-1] if session.records else None
    text = ""
    if last is not None and last.selected is not None:
        text = next((c.text for c in last.candidates if c.answer == last.selected), "")
    result = session.result(method, answer=last.selected if last else None, text=text, stopped_reason=BUDGET_STOP)
    result.counters = {"budget_stops": 1}
    if last is None:
        result.status, result.error = "failed", f"{detail}, before any iteration finished"
    else:
        last.notes.append(f"stopped: {detail}")
    return result


def _sum_counters(results: list[ProblemResult]) -> dict[str, int]:
    total: dict[str, int] = {}
    for result in results:
        for kind, count in result.counters.items():
            total[kind] = total.get(kind, 0) + count
    return dict(sorted(total.items()))


async def _solve_one(
    method: Method, problem: Problem, llm: LLMClient, store: RunStore, settings: Settings, active: dict[str, int]
) -> ProblemResult:
    session = ProblemSession(problem, llm, store, seed=settings.seed, active=active, budget=settings.budget)
    try:
        return await method.solve(session)
    except (EndpointUnreachable, asyncio.CancelledError):
        raise
    except BudgetExhausted as exc:
        # The method let the stop through: keep its finished iterations, answer from the last one.
        return budget_result(method.name, session, exc.detail)
    except Exception as exc:  # a method bug must cost one problem, not the run
        result = session.result(method.name, answer=None, text="")
        result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
        return result
