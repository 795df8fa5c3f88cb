"""The Python API: solve one question (``tmas solve``), a problem file into a run, or resume a run (``tmas run``),
through the same library functions as the CLI.

Each takes an optional ``model``: a :class:`tmas.llm.model.ChatModel` of the caller's own (a backend that is not an
OpenAI-compatible endpoint, or :class:`tmas.testing.ScriptedModel`) that the run uses instead of the endpoint of its
settings, replayed from and recorded in the run's store as an endpoint's calls are. Without ``settings`` the run takes
the model's own. ``settings`` may also be given as a mapping of tmas.toml's keys and tables (e.g. ``{"endpoint":
{"base_url": URL, "model": NAME}, "sampling": {"temperature": 0.6}}``), checked as a configuration file is."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tmas.config import Settings, config_sampling_sources, load_settings, validation_message
from tmas.errors import ConfigError
from tmas.llm.model import ChatModel, EndpointUnreachable
from tmas.llm.preflight import check_endpoints
from tmas.methods import question_params
from tmas.methods.base import ProblemResult
from tmas.problems import Problem, check_question
from tmas.runner import (
    RunSummary,
    Unreachable,
    open_new_run,
    prepare_run,
    resume_settings,
    run_method,
    run_problems,
    stored_settings,
)


async def asolve(
    question: str,
    settings: Settings | Mapping[str, Any] | None = None,
    *,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
    model: ChatModel | None = None,
) -> ProblemResult:
    """Solve ``question``; with ``run_dir`` the whole run (every call, every iteration) is kept there."""
    check_question(question, "question")
    settings = question_settings(_settings_of(settings, model), method, params, own_model=model is not None)
    problem = Problem(problem_id="question", question=question)
    await _check_endpoints(settings, model)
    with tempfile.TemporaryDirectory(prefix="tmas-solve-") as scratch:
        own = model is not None
        store, settings, problems = prepare_run(
            Path(run_dir or scratch), settings, [problem], resume=False, own_model=own
        )
        with store:
            try:
                summary = await run_problems(settings, problems, store, keep_results=True, model=model)
            except Unreachable as exc:
                if run_dir is not None:
                    raise
                # The scratch directory goes with this block: point at nothing that will not be there.
                kept = "nothing was kept (a run directory keeps a question's calls: tmas solve --run-dir DIR)"
                raise Unreachable(f"{exc.reason}; {kept}", None) from None
    return summary.results[0]


def solve(
    question: str,
    settings: Settings | Mapping[str, Any] | None = None,
    *,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
    model: ChatModel | None = None,
) -> ProblemResult:
    """Blocking form of :func:`asolve`; where an event loop already runs (a notebook, async code), await
    :func:`asolve` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(asolve(question, settings, method=method, params=params, run_dir=run_dir, model=model))
    raise RuntimeError("tmas.solve cannot run inside a running event loop; there use: await tmas.asolve(...)")


async def arun(
    problems: str | Path,
    out: str | Path,
    settings: Settings | Mapping[str, Any] | None = None,
    *,
    limit: int | None = None,
    model: ChatModel | None = None,
) -> RunSummary:
    """Solve a problem file (JSONL or a benchmark name) into a new run directory ``out``, as ``tmas run`` does."""
    own = model is not None
    settings = _settings_of(settings, model)
    await _check_endpoints(settings, model)
    store, settings, todo = open_new_run(Path(out), settings, problems, limit=limit, own_model=own)
    with store:
        return await run_problems(settings, todo, store, model=model)


async def aresume(
    run_dir: str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    config: str | Path | None = None,
    params: dict[str, Any] | None = None,
    model: ChatModel | None = None,
) -> RunSummary:
    """Continue the run in ``run_dir`` as ``tmas run --resume`` does: its stored settings with dotted-key
    ``overrides`` (e.g. ``{"sampling.temperature": 0.6}``) and method ``params`` (e.g. ``{"iterations": 4}``) on top,
    by the rule of :func:`tmas.runner.resume_settings`. With ``model`` the run goes on on that model: the calls it
    finished are replayed from the store wherever the model asks them again."""
    run_dir = Path(run_dir)
    settings = resume_settings(stored_settings(run_dir), overrides or {}, config=config, params=params)
    store, settings, todo = prepare_run(run_dir, settings, None, resume=True, own_model=model is not None)
    with store:
        return await run_problems(settings, todo, store, model=model)


def question_settings(
    settings: Settings, method: str | None = None, params: dict[str, Any] | None = None, *, own_model: bool = False
) -> Settings:
    """The settings one question runs with: ``method`` and ``params`` over those of ``settings``; on a user's
    endpoint (or model), where no parameter is given at all, the method's question defaults
    (:func:`tmas.methods.question_params`: TMAS's ``quick`` preset). On the embedded model its embedded defaults
    apply instead, as for a run."""
    name = method or settings.method.name
    chosen = {**settings.method.params, **(params or {})} if name == settings.method.name else dict(params or {})
    if own_model or not settings.uses_local_model:
        chosen = question_params(name, chosen)
    return settings.model_copy(update={"method": settings.method.model_copy(update={"name": name, "params": chosen})})


async def _check_endpoints(settings: Settings, model: ChatModel | None) -> None:
    """Nothing listening at an endpoint the method's roles call, or a base URL without its /v1: said before a run
    directory is made (as the commands do), so the same call works once the server is up. A model of the caller's
    own, or one tmas starts itself, has none to check."""
    if model is not None or settings.uses_local_model:
        return
    try:
        await check_endpoints(settings, run_method(settings).traits.roles)
    except EndpointUnreachable as exc:
        raise Unreachable(str(exc), None) from None


def _settings_of(settings: Settings | Mapping[str, Any] | None, model: ChatModel | None) -> Settings:
    """The settings given (a mapping read as a configuration file's tables), else the model's own (where a model is
    given), else those of the configuration."""
    if isinstance(settings, Mapping):
        try:
            return Settings.model_validate({"sampling_sources": config_sampling_sources(settings), **settings})
        except ValidationError as exc:
            raise ConfigError(validation_message(exc, "settings")) from None
    if settings is not None:
        return settings
    return model.settings if model is not None else load_settings()
