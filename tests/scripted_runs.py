"""Methods and whole runs in process on :class:`tmas.testing.ScriptedModel`, as a run solves its problems on an
endpoint: the tests of their logic (call graphs, prompts, parsing, banks, selection; a run's store, resume, records
and what is built from them) without HTTP."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import scripted_settings
from tmas.config import Settings
from tmas.llm.model import EndpointUnreachable
from tmas.llm.types import Completion, Message
from tmas.methods.base import ProblemResult
from tmas.problems import Problem
from tmas.runner import RunState, RunSummary, open_new_run, prepare_run, problem_solver, run_method, run_problems
from tmas.testing import Rule, ScriptedModel, SimScript

QUESTION = "What is 17*23?"


@dataclass
class GoneModel(ScriptedModel):
    """A scripted model that goes away: a call of a role in ``gone_roles``, or any call once ``gone`` is set, raises
    :class:`tmas.llm.model.EndpointUnreachable`, as an endpoint that can no longer be reached ends a run or a build
    (what finished is kept for its resume)."""

    gone: bool = False
    gone_roles: frozenset[str] = frozenset()

    async def chat(self, role: str, messages: Sequence[Message], **kwargs: Any) -> Completion:
        if self.gone or role in self.gone_roles:
            raise EndpointUnreachable(f"{role}: the model went away")
        return await super().chat(role, messages, **kwargs)


async def solve_in_process(
    model: ScriptedModel, question: str | Problem, problem_id: str = "question"
) -> ProblemResult:
    """The method of ``model.settings`` on one problem (a question, or a whole problem with its answer and metadata),
    solved through the runner's own solver (:func:`tmas.runner.problem_solver`): the session a run gives it (seed,
    budget, a pooled budget's token bank, the answer equivalence votes group by), its parameters' notices raised, a
    spent budget answered from the iterations so far. No run store: every call reaches the model."""
    settings = model.settings
    problem = question if isinstance(question, Problem) else Problem(problem_id=problem_id, question=question)
    async with problem_solver(settings, model, run_method(settings, own_model=True)) as solver:
        return await solver.solve(problem)


async def run_scripted(
    method: str,
    rules: Sequence[Rule] = (),
    question: str | Problem = QUESTION,
    *,
    script: SimScript | None = None,
    settings: Mapping[str, Any] | None = None,
    **params: Any,
) -> tuple[ProblemResult, ScriptedModel]:
    """``method`` with ``params`` on ``question``, solved in process on a scripted model answering with ``rules`` (or
    the whole ``script``); ``settings`` holds further :func:`scripted_settings` overrides (``budget=...``). The result
    and the model, whose ``calls`` say what was asked."""
    script = script or SimScript(rules=list(rules))
    model = ScriptedModel(script, scripted_settings(method={"name": method, "params": params}, **(settings or {})))
    return await solve_in_process(model, question), model


async def run_scripted_problems(
    method: str, problems: Sequence[Problem], rules: Sequence[Rule] = (), **params: Any
) -> tuple[list[ProblemResult], ScriptedModel]:
    """``method`` with ``params`` on each of ``problems`` in turn, on one scripted model answering with ``rules`` (a
    run with one problem in flight): the results in order, and the model holding every problem's calls."""
    model = ScriptedModel(SimScript(rules=list(rules)), scripted_settings(method={"name": method, "params": params}))
    return [await solve_in_process(model, p) for p in problems], model


def by_role(model: ScriptedModel) -> dict[str, int]:
    """Calls per role, as the simulated server's ``stats().by_role`` counts the requests it received."""
    counts: dict[str, int] = {}
    for call in model.calls:
        counts[call.role] = counts.get(call.role, 0) + 1
    return counts


def last_user_prompts(model: ScriptedModel, role: str) -> list[str]:
    """The last message of each call of ``role``, in call order."""
    return [call.messages[-1].content for call in model.calls_of(role)]


async def scripted_run(
    model: ScriptedModel,
    run_dir: Path,
    problems: Sequence[Problem] | Path | None = None,
    *,
    settings: Settings | None = None,
    state: RunState | None = None,
) -> RunSummary:
    """A whole run on ``model`` into ``run_dir``, as ``tmas run`` makes it but in process: a new run of ``problems``
    (or of a problem file, whose name the run records as its benchmark's), or (without them) the run in ``run_dir``
    resumed. ``settings`` are the run's (``model.settings`` by default; a resume's new ones). The store, its replay,
    the summary and the records are the real ones."""
    settings = settings or model.settings
    if isinstance(problems, Path):
        store, settings, todo = open_new_run(run_dir, settings, problems, own_model=True)
    else:
        store, settings, todo = prepare_run(run_dir, settings, problems, resume=problems is None, own_model=True)
    with store:
        return await run_problems(settings, todo, store, state=state, model=model)
