"""The Python API: solve one question (``tmas solve``), a problem file into a run, or resume a run (``tmas run``),
through the same library functions as the CLI.

Each takes an optional ``model``: a :class:`tmas.llm.model.ChatModel` of the caller's own (a backend that is not an
OpenAI-compatible endpoint, or :class:`tmas.testing.ScriptedModel`) that the run uses instead of the endpoint of its
settings, replayed from and recorded in the run's store as an endpoint's calls are. Without ``settings`` the run takes
the model's own. ``settings`` may also be given as a mapping of tmas.toml's keys and tables (e.g. ``{"endpoint":
{"base_url": URL, "model": NAME}, "sampling": {"temperature": 0.6}}``), checked as a configuration file is.

Each is refused in one line, before anything is sent or made, where the run's cost estimate (as the CLI's gate works it
out: :mod:`tmas.planning.estimate`) is over ``max_calls`` calls (by default 500 for a question, 20,000 for a run, as
``tmas solve`` and ``tmas run`` ask first) or ``max_completion_tokens`` (50M, where the estimate knows them); a larger
value, or None, lets it run (one below 0, or NaN, is refused). A resume counts only the calls it has still to
send."""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from itertools import islice
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tmas.config import (
    OverrideError,
    Settings,
    check_embedding_role,
    check_extra_body,
    check_pinned_batches,
    config_sampling_sources,
    config_source,
    load_settings,
    validation_message,
)
from tmas.errors import ConfigError, InputError
from tmas.llm.model import ChatModel, EndpointUnreachable
from tmas.llm.preflight import check_endpoints
from tmas.methods import check_given_params, check_settings_params, question_params
from tmas.methods.base import ProblemResult
from tmas.planning.estimate import (
    CONFIRM_TOKENS,
    QUESTION_CALLS,
    RUN_CALLS,
    Estimate,
    brief_estimate,
    estimate_point,
    replay_credit,
    stored_ceiling,
)
from tmas.problems import Problem, check_question, iter_problems, resolve_dataset
from tmas.runner import (
    RunExists,
    RunSetup,
    RunState,
    RunSummary,
    StoreFailed,
    Unreachable,
    open_new_run,
    prepare_run,
    resume_settings,
    run_method,
    run_problems,
    stored_settings,
)
from tmas.store.run_store import RunStore


async def asolve(
    question: str,
    settings: Settings | Mapping[str, Any] | None = None,
    *,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
    model: ChatModel | None = None,
    max_calls: int | None = QUESTION_CALLS,
    max_completion_tokens: float | None = CONFIRM_TOKENS,
) -> ProblemResult:
    """Solve ``question``; with ``run_dir`` the whole run (every call, every iteration) is kept there. Refused where
    its estimate is over ``max_calls`` or ``max_completion_tokens`` (None: no limit)."""
    return await solve_question(
        question,
        settings,
        method=method,
        params=params,
        run_dir=run_dir,
        model=model,
        max_calls=max_calls,
        max_completion_tokens=max_completion_tokens,
    )


async def solve_question(
    question: str,
    settings: Settings | Mapping[str, Any] | None = None,
    *,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
    model: ChatModel | None = None,
    max_calls: int | None = QUESTION_CALLS,
    max_completion_tokens: float | None = CONFIRM_TOKENS,
    for_api: bool = True,
    state: RunState | None = None,
) -> ProblemResult:
    """:func:`asolve`, whose errors name what continues its run: the API's call and keyword (``for_api``), or the
    commands' (``tmas solve``). ``state``: the run's live figures, for a progress display."""
    check_question(question, "question")
    check_arguments("tmas.solve", settings=settings, method=method, params=params, run_dir=run_dir, model=model)
    check_limits("tmas.solve", max_calls, max_completion_tokens)
    given = _settings_of(settings, model)
    check_given_params(method or given.method.name, params or {}, _params_named("tmas.solve"), InputError)
    settings = question_settings(given, method, params, own_model=model is not None)
    check_cost("tmas.solve", settings, 1, model, max_calls, max_completion_tokens)
    problem = Problem(problem_id="question", question=question)
    await _check_endpoints(settings, model)
    with tempfile.TemporaryDirectory(prefix="tmas-solve-") as scratch:
        own = model is not None
        with api_advice() if for_api else nullcontext():
            store, settings, problems = prepare_run(
                Path(run_dir or scratch), settings, [problem], resume=False, own_model=own
            )
        with store:
            solving = run_problems(
                settings, problems, store, state=state, keep_results=True, model=model, scratch=run_dir is None
            )
            try:
                summary = await (_solving(solving) if for_api else solving)
            except Unreachable as exc:
                if run_dir is not None:
                    raise
                # The scratch directory goes with this block: point at nothing that will not be there.
                keeps = "pass run_dir=DIR" if for_api else "tmas solve --run-dir DIR"
                kept = f"nothing was kept (a run directory keeps a question's calls: {keeps})"
                raise Unreachable(f"{exc.reason}; {kept}", None) from None
            except StoreFailed as exc:
                if run_dir is not None:
                    raise
                raise StoreFailed(exc.reason, Path(scratch), kept=False) from None
    return summary.results[0]


def solve(
    question: str,
    settings: Settings | Mapping[str, Any] | None = None,
    *,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
    model: ChatModel | None = None,
    max_calls: int | None = QUESTION_CALLS,
    max_completion_tokens: float | None = CONFIRM_TOKENS,
) -> ProblemResult:
    """Blocking form of :func:`asolve`; where an event loop already runs (a notebook, async code), await
    :func:`asolve` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asked = asolve(
            question,
            settings,
            method=method,
            params=params,
            run_dir=run_dir,
            model=model,
            max_calls=max_calls,
            max_completion_tokens=max_completion_tokens,
        )
        return asyncio.run(asked)
    raise RuntimeError("tmas.solve cannot run inside a running event loop; there use: await tmas.asolve(...)")


async def arun(
    problems: str | Path,
    out: str | Path,
    settings: Settings | Mapping[str, Any] | None = None,
    *,
    limit: int | None = None,
    model: ChatModel | None = None,
    max_calls: int | None = RUN_CALLS,
    max_completion_tokens: float | None = CONFIRM_TOKENS,
) -> RunSummary:
    """Solve a problem file (JSONL or a benchmark name) into a new run directory ``out``, as ``tmas run`` does.
    Refused where its estimate is over ``max_calls`` or ``max_completion_tokens`` (None: no limit)."""
    check_arguments(
        "tmas.api.arun", required=("problems", "out"), problems=problems, out=out, settings=settings, model=model
    )
    check_limits("tmas.api.arun", max_calls, max_completion_tokens)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        # islice would take 0 as no limit at all (every problem solved) and fail on a negative one.
        raise InputError(f"tmas.api.arun: limit must be a whole number of problems, 1 or more (got {limit!r})")
    own = model is not None
    settings = _settings_of(settings, model)
    if max_calls is not None or max_completion_tokens is not None:
        reader = iter_problems(resolve_dataset(Path(problems)))
        count = sum(1 for _ in (islice(reader, limit) if limit else reader))
        check_cost("tmas.api.arun", settings, count, model, max_calls, max_completion_tokens)
    await _check_endpoints(settings, model)
    with api_advice():
        store, settings, todo = open_new_run(Path(out), settings, problems, limit=limit, own_model=own)
    with store:
        return await _solving(run_problems(settings, todo, store, model=model))


async def aresume(
    run_dir: str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    config: str | Path | None = None,
    params: dict[str, Any] | None = None,
    model: ChatModel | None = None,
    max_calls: int | None = RUN_CALLS,
    max_completion_tokens: float | None = CONFIRM_TOKENS,
) -> RunSummary:
    """Continue the run in ``run_dir`` as ``tmas run --resume`` does: its stored settings with dotted-key
    ``overrides`` (e.g. ``{"sampling.temperature": 0.6}``) and method ``params`` (e.g. ``{"iterations": 4}``) on top,
    by the rule of :func:`tmas.runner.resume_settings`. With ``model`` the run goes on on that model: the calls it
    finished are replayed from the store wherever the model asks them again. Refused where the calls it has still
    to send are over ``max_calls``, or their completion tokens over ``max_completion_tokens`` (None: no limit)."""
    check_arguments(
        "tmas.api.aresume",
        required=("run_dir",),
        run_dir=run_dir,
        overrides=overrides,
        config=config,
        params=params,
        model=model,
    )
    check_limits("tmas.api.aresume", max_calls, max_completion_tokens)
    run_dir = Path(run_dir)
    try:
        settings = resume_settings(
            stored_settings(run_dir), overrides or {}, stored_at=run_dir, config=config, params=params
        )
    except OverrideError as exc:
        raise ConfigError(f"tmas.api.aresume: {override_error(exc, overrides or {})}") from None
    check_given_params(settings.method.name, params or {}, _params_named("tmas.api.aresume"), InputError)
    if max_calls is not None or max_completion_tokens is not None:
        with RunStore(run_dir, create=False) as peek:
            setup = RunSetup.check(settings, own_model=model is not None, resuming=run_dir)
            # The settled problems are skipped; the stored calls of the others are replayed (under other requests,
            # none), as the CLI's gate counts.
            settled = setup.settled(peek)
            count = peek.problem_count() - len(settled)
            stored = setup.replays(peek, settled)
            roles = setup.replayed_roles(peek)
            banked = setup.pooled_left(peek, settled)
            spent = setup.replayed_tokens(peek, settled)
        check_cost(
            "tmas.api.aresume",
            settings,
            count,
            model,
            max_calls,
            max_completion_tokens,
            stored=stored,
            roles=roles,
            banked=banked,
            spent=spent,
        )
    store, settings, todo = prepare_run(run_dir, settings, None, resume=True, own_model=model is not None)
    with store:
        return await _solving(run_problems(settings, todo, store, model=model))


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


def _params_named(what: str) -> Callable[[str], str]:
    """How an error names a parameter given in ``params=`` of the API function ``what``."""
    return lambda param: f"{what}: params[{param!r}]"


def override_error(exc: OverrideError, overrides: Mapping[str, Any]) -> str:
    """A bad value that dotted-key ``overrides`` set, said of the argument as the caller passed it
    (``bad value for overrides={'sampling.temperature': -1}: ...``), not of a command line."""
    given = {key: overrides[key] for key in exc.keys if key in overrides}
    return f"bad value for overrides={given!r}: {exc.reason}"


# What each argument of the API's functions must be, said as its error says it.
_PATH = "a path (str or pathlib.Path)"
_EXPECTED: dict[str, tuple[str, Callable[[object], bool]]] = {
    "settings": (
        "a tmas.config.Settings or a mapping of tmas.toml's keys and tables",
        lambda value: isinstance(value, Settings | Mapping),
    ),
    "method": ("a method's name (str)", lambda value: isinstance(value, str)),
    "params": ("a mapping of parameter names to values", lambda value: isinstance(value, Mapping)),
    "overrides": (
        "a mapping of dotted settings keys (str) to values",
        lambda value: isinstance(value, Mapping) and all(isinstance(key, str) for key in value),
    ),
    "run_dir": (_PATH, lambda value: isinstance(value, str | os.PathLike)),
    "config": (_PATH, lambda value: isinstance(value, str | os.PathLike)),
    "problems": (
        f"{_PATH} of a JSONL problem file, or a benchmark's name",
        lambda value: isinstance(value, str | os.PathLike),
    ),
    "out": (_PATH, lambda value: isinstance(value, str | os.PathLike)),
    "model": (
        "a tmas.llm.model.ChatModel (with settings, chat and embed)",
        lambda value: all(hasattr(value, name) for name in ("settings", "chat", "embed")),
    ),
}


def check_arguments(what: str, *, required: tuple[str, ...] = (), **given: object) -> None:
    """Refuse, in one line naming ``what`` and the argument, an argument of the wrong kind (``settings=42``,
    ``params=[...]``), which would otherwise fail deep inside the run with an AttributeError or TypeError; None
    passes but for the ``required``."""
    for name, value in given.items():
        if value is None and name not in required:
            continue
        expects, fits = _EXPECTED[name]
        if value is None or not fits(value):
            shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
            raise InputError(f"{what}: {name} must be {expects} (got {type(value).__name__} {shown})")


def check_limits(what: str, max_calls: int | None, max_completion_tokens: float | None) -> None:
    """Refuse, in one line naming ``what``, a cost limit that cannot be one: NaN compares false with every estimate,
    so it would let any run through unasked, and one below 0 would refuse every run (``tmas run``'s
    ``--confirm-calls`` and ``--confirm-tokens`` are refused alike)."""
    for name, value in [("max_calls", max_calls), ("max_completion_tokens", max_completion_tokens)]:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0
        ):
            raise InputError(f"{what}: {name} must be a number 0 or more, or None for no limit (got {value!r})")


def check_cost(
    what: str,
    settings: Settings,
    problems: int,
    model: ChatModel | None,
    max_calls: int | None,
    max_completion_tokens: float | None,
    *,
    stored: Mapping[str, int] | None = None,
    roles: Mapping[str, int] | None = None,
    banked: int = 0,
    spent: Mapping[str, int] | None = None,
) -> None:
    """Refuse, in one line naming ``what``, a run of ``problems`` under ``settings`` whose estimate (less the
    ``stored`` answered calls, by problem, a resume replays, at their ``roles``' max_tokens or, under a token budget,
    at what they ``spent`` of it by problem; with what a pooled token
    budget's bank holds for the problems, ``banked``) is over ``max_calls`` or ``max_completion_tokens``; a method
    that states no calls per problem goes ahead, as under ``tmas serve``'s cap."""
    method = run_method(settings, own_model=model is not None)
    point = estimate_point(what, method, settings, problems, None, banked=banked)
    estimate = Estimate([point], stored_calls=replay_credit(point, stored or {}))
    estimate.stored_tokens = stored_ceiling(point, estimate.stored_calls, roles or {}, spent)
    why = estimate.over(max_calls, max_completion_tokens)
    if why is not None:
        calls_over = max_calls is not None and estimate.calls_to_send > max_calls
        limit = "max_calls" if calls_over else "max_completion_tokens"
        raise InputError(
            f"{what}: the estimate is {why}: {brief_estimate(estimate)} (method {method.name!r}); pass fewer"
            f" calls in its parameters, or {limit}=N (None: no limit) to run it"
        )


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


def resume_call(run_dir: Path) -> str:
    """The call that continues the run in ``run_dir``, as an API user's error names it."""
    return f"tmas.api.aresume({str(run_dir)!r})"


@contextmanager
def api_advice() -> Iterator[None]:
    """A run directory that holds a run already, refused with the call that continues it (not the CLI's flag)."""
    try:
        yield
    except RunExists as exc:
        raise RunExists(exc.run_dir, resume_call(exc.run_dir)) from None


async def _solving(solving: Awaitable[RunSummary]) -> RunSummary:
    """A run solved; where it stops (nothing answers, its store cannot be written) its error names the call that
    continues it rather than the command."""
    try:
        return await solving
    except Unreachable as exc:
        if exc.run_dir is None:
            raise
        raise Unreachable(exc.reason, exc.run_dir, again=resume_call(exc.run_dir)) from None
    except StoreFailed as exc:
        raise StoreFailed(exc.reason, exc.run_dir, again=resume_call(exc.run_dir)) from None


def _settings_of(settings: Settings | Mapping[str, Any] | None, model: ChatModel | None) -> Settings:
    """The settings given (a mapping read as a configuration file's tables), else the model's own (where a model is
    given), else those of the configuration."""
    if isinstance(settings, Mapping):
        try:
            given = Settings.model_validate({"sampling_sources": config_sampling_sources(settings), **settings})
        except ValidationError as exc:
            raise ConfigError(validation_message(exc, "settings")) from None
        check_extra_body(given, "settings")
        check_embedding_role(given, "settings")
        check_pinned_batches(given, "settings")
        check_settings_params(given, "settings")
        return given
    if settings is not None:
        check_settings_params(settings, "settings")
        return settings
    if model is not None:
        return model.settings
    configured = load_settings()
    check_settings_params(configured, config_source(None))
    return configured
