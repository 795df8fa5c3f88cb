"""The Python API: solve one question with a method, as ``tmas solve`` does."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from tmas.config import Settings, load_settings
from tmas.methods.base import ProblemResult
from tmas.problems import Problem, check_question
from tmas.runner import prepare_run, run_problems


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
