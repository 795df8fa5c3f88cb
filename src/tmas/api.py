"""The Python API: solve one question (``tmas solve``), a problem file into a run, or resume a run (``tmas run``),
through the same library functions as the CLI."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from tmas.config import Settings, load_settings
from tmas.methods.base import ProblemResult
from tmas.problems import Problem, check_question
from tmas.runner import RunSummary, open_new_run, prepare_run, resume_settings, run_problems, stored_settings


async def asolve(
    question: str,
    settings: Settings | None = None,
    *,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
) -> ProblemResult:
    """Solve ``question``; with ``run_dir`` the whole run (every call, every iteration) is kept there."""
    check_question(question, "question")
    settings = settings or load_settings()
    if method is not None or params:
        chosen = settings.method.model_copy(
            update={
                "name": method or settings.method.name,
                "params": {**settings.method.params, **(params or {})},
            }
        )
        settings = settings.model_copy(update={"method": chosen})
    problem = Problem(problem_id="question", question=question)
    with tempfile.TemporaryDirectory(prefix="tmas-solve-") as scratch:
        store, settings, problems = prepare_run(Path(run_dir or scratch), settings, [problem], resume=False)
        with store:
            summary = await run_problems(settings, problems, store, keep_results=True)
    return summary.results[0]


def solve(
    question: str,
    settings: Settings | None = None,
    *,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
) -> ProblemResult:
    """Blocking form of :func:`asolve`."""
    return asyncio.run(asolve(question, settings, method=method, params=params, run_dir=run_dir))


async def arun(
    problems: str | Path, out: str | Path, settings: Settings | None = None, *, limit: int | None = None
) -> RunSummary:
    """Solve a problem file (JSONL or a benchmark name) into a new run directory ``out``, as ``tmas run`` does."""
    store, settings, todo = open_new_run(Path(out), settings or load_settings(), problems, limit=limit)
    with store:
        return await run_problems(settings, todo, store)


async def aresume(
    run_dir: str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    config: str | Path | None = None,
    params: dict[str, Any] | None = None,
) -> RunSummary:
    """Continue the run in ``run_dir`` as ``tmas run --resume`` does: its stored settings with dotted-key
    ``overrides`` (e.g. ``{"sampling.temperature": 0.6}``) and method ``params`` (e.g. ``{"iterations": 4}``) on top,
    by the rule of :func:`tmas.runner.resume_settings`."""
    run_dir = Path(run_dir)
    settings = resume_settings(stored_settings(run_dir), overrides or {}, config=config, params=params)
    store, settings, todo = prepare_run(run_dir, settings, None, resume=True)
    with store:
        return await run_problems(settings, todo, store)
