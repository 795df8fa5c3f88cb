"""``tmas sweep``: a grid of (method x parameters) over one problem set, one run directory per grid point, resumable
as a whole, and one combined report.

A grid is a list of *studies* (TOML ``[[study]]`` tables, or one study from command-line flags). A study names one
or more methods, fixed ``params``, a ``grid`` (every combination of its value lists) and/or ``variants`` (a list of
param tables, each one point); its points are methods x variants x grid combinations. Points that studies share
(the paper's sensitivity studies all contain the default configuration) run once. Layout of the sweep directory::

    DIR/sweep.json            the grid, the base settings and each point's state
    DIR/runs/<point>/         a normal run directory (tmas run / report / export all work on it)
    DIR/report/               the combined report; DIR/report/<study>/ one per study with several points

One sweep at a time runs in a directory (:func:`sweeping`): a second is refused, in one line, before any call.

Resuming (run the same command again, or ``tmas sweep --resume DIR``): a point whose problems are all finished
with the same method, params and budget, and without a failed call, is skipped without a call; any other is resumed
from its store (a failed call asked again, :func:`tmas.runner.run_problems`).

``run_sweep(..., model=mine)`` runs every point on a :class:`tmas.llm.model.ChatModel` of the caller's own, as
``run_problems(..., model=mine)`` runs one run (each point's store replays and records its calls all the same). A
model run in process (``--hf-model``) is loaded once, at the first point that runs, for every point.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tmas.config import Budget, Sampling, Settings, extra_body_refusal, read_toml, validation_message
from tmas.errors import ConfigError, InputError
from tmas.files import check_out_dir, write_atomic
from tmas.grading.grades import GradeConfig
from tmas.llm.model import ChatModel
from tmas.llm.sampling import with_sampling
from tmas.methods import METHODS, check_given_params, create_method
from tmas.methods.base import ProblemResult
from tmas.problems import Problem, dataset_name, load_problems, resolve_dataset
from tmas.reports.report import build_report
from tmas.runner import (
    RunSetup,
    RunState,
    RunSummary,
    SeriesModel,
    holds_run,
    prepare_run,
    resume_settings,
    run_method,
)
from tmas.store.run_lock import LOCK_NAME, LockHeld, RunLock
from tmas.store.run_store import SWEEP_MANIFEST, SWEEP_RUNS, RunStore

MANIFEST = SWEEP_MANIFEST
# The folder of a sweep directory that holds one run directory per point.
POINTS_DIR = SWEEP_RUNS


class Study(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "sweep"
    method: str | None = None
    methods: list[str] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    variants: list[dict[str, Any]] = Field(default_factory=list)
    # Overrides the sweep's budget for this study's points.
    budget: Budget | None = None

    @model_validator(mode="after")
    def _one_method_at_least(self) -> Study:
        if not self.method and not self.methods:
            raise ValueError("names no method ('method' or 'methods')")
        empty = [k for k, values in self.grid.items() if not values]
        if empty:
            raise ValueError(f"grid key {empty[0]!r} has no values")
        return self

    def all_methods(self) -> list[str]:
        return [*([self.method] if self.method else []), *self.methods]


class GridAbout(BaseModel):
    """What a grid reproduces and what it needs (the paper grids in examples/papers/ fill it in)."""

    model_config = ConfigDict(extra="forbid")

    paper: str = ""
    # The tables or figures it reproduces, as the paper names them ("Table 1", "Figure 3").
    tables: list[str] = Field(default_factory=list)
    # The paper's name of the benchmark the grid's problem file holds (reports/paper_numbers.py matches runs on it).
    benchmark: str | None = None
    # Where the problem file comes from (a command, a download).
    expects: str = ""
    # Environment variables the grid's runs read (endpoint, model, max_tokens, ...).
    env: list[str] = Field(default_factory=list)


class SweepSpec(BaseModel):
    """A grid file's content (relative problem paths are resolved against the file's folder by :func:`load_spec`)."""

    model_config = ConfigDict(extra="forbid")

    problems: str | None = None
    limit: int | None = Field(default=None, ge=1)
    budget: Budget = Field(default_factory=Budget)
    # Sampling for every point, over the config file and TMAS_* variables; command-line flags still win.
    sampling: Sampling | None = None
    about: GridAbout | None = None
    study: list[Study] = Field(default_factory=list)


@dataclass
class SweepPoint:
    name: str
    method: str
    params: dict[str, Any]
    budget: Budget
    studies: list[str] = field(default_factory=list)
    # The study params not applied to this point's method, which does not take or does not use them (another method
    # of its study does): :func:`not_applied`.
    unapplied: list[str] = field(default_factory=list)

    def settings(self, base: Settings) -> Settings:
        """``base`` running this point: its method, with its params over those ``base`` configures for that method
        (a config file's ``[method] params``, as ``tmas run`` keeps them), and its budget."""
        data = base.model_dump(mode="json")
        configured = data["method"]["params"] if data["method"]["name"] == self.method else {}
        data["method"] = {"name": self.method, "params": {**configured, **self.params}}
        data["budget"] = self.budget.model_dump(mode="json")
        return Settings.model_validate(data)


@dataclass
class PointOutcome:
    point: SweepPoint
    # "skipped" (already finished), "resumed", or "new".
    status: str
    summary: RunSummary | None = None


@dataclass
class SweepSummary:
    out_dir: Path
    outcomes: list[PointOutcome]
    report: dict[str, Path] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "points": [
                {
                    "name": o.point.name,
                    # Where the point's run is (tmas report, view and export read it there).
                    "run_dir": str(self.out_dir / POINTS_DIR / o.point.name),
                    "status": o.status,
                    "calls": o.summary.calls if o.summary else 0,
                    "failed": o.summary.failed if o.summary else 0,
                    # Calls that failed after their retries, their problems solved without the replies: the point is
                    # not finished, and the sweep run again asks them.
                    "failed_calls": o.summary.failed_calls if o.summary else 0,
                }
                for o in self.outcomes
            ],
            "report": {k: str(v) for k, v in self.report.items()},
        }


def load_spec(path: Path) -> SweepSpec:
    data = read_toml(path, "grid file")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = _unknown_field(err["loc"])
        raise ConfigError(f"{path}: {_error_place(data, err['loc'])}{msg}") from None
    refusal = None if spec.sampling is None else extra_body_refusal(spec.sampling, "sampling", "endpoint")
    if refusal is not None:
        raise ConfigError(f"{path}: {refusal}")
    if spec.problems and not Path(spec.problems).is_absolute() and (path.parent / spec.problems).exists():
        spec.problems = str(path.parent / spec.problems)
    return spec


def _error_place(data: Mapping[str, Any], loc: tuple[int | str, ...]) -> str:
    """Where in a grid file a validation error is, as its reader names it: ``study 'NAME': budget.tokens: `` (the
    study by its ``name``, else by its place in the file) rather than ``study.0.budget.tokens: ``."""
    if len(loc) >= 2 and loc[0] == "study" and isinstance(loc[1], int):
        studies = data.get("study")
        table = studies[loc[1]] if isinstance(studies, list) and loc[1] < len(studies) else None
        name = table.get("name") if isinstance(table, dict) else None
        study = f"study {name!r}" if isinstance(name, str) else f"study {loc[1] + 1} (of {len(studies or [])})"
        field = ".".join(str(p) for p in loc[2:])
        return f"{study}: {field}: " if field else f"{study}: "
    return f"{'.'.join(str(p) for p in loc)}: " if loc else ""


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """A key no field of its table reads, with the fields the grid file's top level or a study table has."""
    table = SweepSpec if len(loc) == 1 else Study if len(loc) == 3 and loc[0] == "study" else None
    known = f" (known: {', '.join(sorted(table.model_fields))})" if table is not None else ""
    return f"unknown field{known}"


def given_sampling(overrides: Mapping[str, Any]) -> set[str]:
    """The ``sampling`` fields dotted-key ``overrides`` set (None: not given); the run's ``seed`` is none of them."""
    return {
        key.removeprefix("sampling.") for key, v in overrides.items() if key.startswith("sampling.") and v is not None
    }


def with_grid_sampling(settings: Settings, spec: SweepSpec, flags: set[str]) -> Settings:
    """``settings`` with the grid's ``sampling`` on top as the config file's, except the fields named in ``flags``
    (given on the command line, which win over the grid file)."""
    if spec.sampling is None:
        return settings
    fields = {k: getattr(spec.sampling, k) for k in spec.sampling.model_fields_set if k not in flags}
    return with_sampling(settings, "config", Sampling(**fields))


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else str(value)


def point_name(method: str, params: dict[str, Any], budget: Budget) -> str:
    """A readable, stable directory name: the method, then each param (and budget) as key=value."""
    parts = [method, *(f"{k}={_value_text(v)}" for k, v in sorted(params.items()))]
    if budget.tokens is not None:
        # The default count (completion tokens) keeps the short name; a total-token budget says so.
        parts.append(
            f"budget_tokens={budget.tokens}"
            + ("_total" if budget.count == "total" else "")
            + ("_pooled" if budget.pool else "")
        )
    if budget.calls is not None:
        parts.append(f"budget_calls={budget.calls}")
    name = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", "__".join(parts))
    if len(name) > 120:  # keep paths short; the hash keeps them distinct
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        name = f"{name[:100]}__{digest}"
    return name


def expand(spec: SweepSpec, out_dir: Path | None = None) -> list[SweepPoint]:
    """Every grid point, in study order; points equal in method, validated params and budget appear once, named by
    what they are (:func:`named_params`), whichever study gives them first and however it spells them. Invalid params
    raise :class:`ConfigError` here, before any call is made. ``out_dir``: the sweep directory, where a point run
    under the name an older tmas gave it (the first study's spelling of its params) keeps that run."""
    points: dict[str, SweepPoint] = {}
    spellings: dict[str, list[dict[str, Any]]] = {}
    for study in spec.study:
        keys = list(study.grid)
        combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*study.grid.values())]
        budget = study.budget or spec.budget
        methods = study.all_methods()
        for method in methods:

            def others_use(key: str, value: Any, method: str = method, methods: list[str] = methods) -> bool:
                return any(_applies(other, key, value) for other in methods if other != method)

            for variant in study.variants or [{}]:
                for combo in combos:
                    given = {**study.params, **variant, **combo}
                    # A param another method of the study takes is not applied to one that does not take or use it.
                    dropped = [k for k in given if not _applies(method, k, given[k]) and others_use(k, given[k])]
                    params = {k: v for k, v in given.items() if k not in dropped}
                    # As tmas run refuses it: each of such a method's points would be the same run, sent again.
                    check_given_params(method, params, partial(_in_study, spec, study.name))
                    # Equal after validation (defaults filled in) means the same run, whatever the spelling.
                    try:
                        full = create_method(method, params).params.model_dump(mode="json")
                    except ConfigError as exc:
                        # Which of the grid's studies gives the bad parameter.
                        raise ConfigError(_in_study(spec, study.name, str(exc))) from None
                    key = json.dumps([method, full, budget.identity()], sort_keys=True)
                    if key not in points:
                        name = point_name(method, named_params(method, full), budget)
                        points[key] = SweepPoint(name, method, params, budget)
                    # How older tmas named the point: with the params its method did not take or use.
                    spellings.setdefault(key, []).append(given)
                    point = points[key]
                    point.unapplied += [k for k in dropped if k not in point.unapplied]
                    if study.name not in point.studies:
                        point.studies.append(study.name)
    named = _distinct_names(points)
    if out_dir is not None:
        _keep_older_names(points, spellings, out_dir)
    return named


def _applies(method: str, key: str, value: Any) -> bool:
    """Whether the method ``method`` takes the param ``key`` and uses it at ``value``: a method of one round
    (:attr:`tmas.methods.traits.Traits.iterates` false) runs as without ``iterations`` other than 1. A method not
    registered takes everything (:func:`tmas.methods.create_method` says it is unknown)."""
    cls = METHODS.get(method)
    if cls is None:
        return True
    if key not in cls.Params.model_fields:
        return False
    return not (key == "iterations" and not cls.traits.iterates and value != 1)


def _in_study(spec: SweepSpec, study: str, param: str) -> str:
    """Where a grid gives ``param``, as its errors name it: the study where the grid has several."""
    return f"study {study!r}: {param}" if len(spec.study) > 1 else param


def not_applied(points: list[SweepPoint]) -> str | None:
    """One line saying which params the sweep does not apply to which method (each then runs as one point without
    them), or None where it applies every param to every method."""
    by_method: dict[str, list[str]] = {}
    for point in points:
        for key in point.unapplied:
            if key not in by_method.setdefault(point.method, []):
                by_method[point.method].append(key)
    said = [
        f"{', '.join(keys)} not applied to method {method!r}, which does not take or use"
        f" {'it' if len(keys) == 1 else 'them'}"
        for method, keys in by_method.items()
        if keys
    ]
    return f"{'; '.join(said)}: one point for {'it' if len(said) == 1 else 'each'}" if said else None


def named_params(method: str, full: dict[str, Any]) -> dict[str, Any]:
    """The params a point's name shows: the fewest of its validated params ``full`` that validate to all of them
    (each tried for leaving out in turn, by name), so a value at its default (or one a preset sets) is never shown,
    and each value is shown as validated (``1`` as ``1.0``; a table without what validation filled with nothing):
    the name depends on the point alone."""
    cls = METHODS[method]
    shown = dict(full)
    for key in sorted(full):
        rest = {k: v for k, v in shown.items() if k != key}
        try:
            same = cls.Params.model_validate(rest).model_dump(mode="json") == full
        except ValidationError:
            same = False
        if same:
            shown = rest
    return {key: _set_entries(value) for key, value in shown.items()}


def _set_entries(value: Any) -> Any:
    """A validated table as its name shows it: without the entries validation filled with nothing (None, ``{}``),
    so ``sampling = { solution = { temperature = 0.3 } }`` reads so rather than as every field of a role's sampling."""
    if not isinstance(value, dict):
        return value
    kept = {key: _set_entries(entry) for key, entry in value.items()}
    return {key: entry for key, entry in kept.items() if entry is not None and entry != {}}


def _distinct_names(points: dict[str, SweepPoint]) -> list[SweepPoint]:
    """The points, each named apart: points whose readable names meet (values that differ only in characters a
    directory name leaves out: ``pools/x y`` and ``pools/x_y``; or only in case, one directory on a file system that
    ignores it) each take a digest of what they are, so that no point runs in another's directory."""
    named: dict[str, int] = {}
    for point in points.values():
        named[point.name.casefold()] = named.get(point.name.casefold(), 0) + 1
    for key, point in points.items():
        if named[point.name.casefold()] > 1:
            point.name = f"{point.name}__{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    return list(points.values())


def _keep_older_names(points: dict[str, SweepPoint], spellings: dict[str, list[dict[str, Any]]], out_dir: Path) -> None:
    """Each point whose directory under ``out_dir`` holds no run, but whose name from one of its studies' spellings of
    its params (as tmas named points before :func:`named_params`) holds one or is in the sweep's manifest, keeps that
    name: its run goes on there, and the sweep does not report it as left out and added again."""
    taken = {point.name for point in points.values()}
    listed = set(read_manifest(out_dir)["points"]) if (out_dir / MANIFEST).is_file() else set()
    for key, point in points.items():
        if holds_run(out_dir / POINTS_DIR / point.name):
            continue
        for params in spellings[key]:
            older = point_name(point.method, params, point.budget)
            found = [
                name
                for name in (older, f"{older}__{hashlib.sha256(key.encode()).hexdigest()[:10]}")
                if name not in taken and (name in listed or holds_run(out_dir / POINTS_DIR / name))
            ]
            if found:
                taken.add(found[0])
                point.name = found[0]
                # Its run goes on with the params it was made with (a param its method does not use included): the
                # same requests, its finished problems kept.
                point.params = params
                break


def check_studies(spec: SweepSpec, path: Path) -> None:
    """Every point of a grid file's studies valid (:func:`expand`), or one line naming the file and the study; a file
    of no study is said of the file, before an estimate of no calls."""
    if not spec.study:
        raise ConfigError(f"{path}: no [[study]] table: the sweep has no points (add a [[study]])")
    for study in spec.study:
        try:
            expand(SweepSpec(study=[study]))
        except ConfigError as exc:
            raise ConfigError(f"{path}: study {study.name!r}: {exc}") from None


def _problems_digest(problems: list[Problem]) -> str:
    raw = json.dumps([p.model_dump(mode="json") for p in problems], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


@contextmanager
def sweeping(out_dir: Path) -> Iterator[None]:
    """Hold the sweep directory's lock while the block runs (made if missing): one sweep at a time writes a
    directory's manifest and runs its points. Two at once would each rewrite ``sweep.json`` with its own grid, the last
    to write silently dropping the other's record, and meet in the points they share. :class:`InputError` at once,
    in one line, where another sweep holds it."""
    check_out_dir(out_dir, "a sweep is kept in a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out_dir, doing="tmas sweep")
    try:
        lock.acquire()
    except LockHeld as held:
        who = held.doing or "another tmas process"
        raise InputError(
            f"{out_dir}: {who} (pid {held.pid}) is running a sweep in this directory; wait for it to end (then run"
            " this one: a grid that differs replaces its grid, as said then), or give this one another directory"
        ) from None
    try:
        yield
    finally:
        lock.release()


def check_not_running(out_dir: Path) -> None:
    """Refuse, before any call (an estimate's pilot), a sweep whose directory another sweep is running in."""
    if (out_dir / LOCK_NAME).is_file():
        with sweeping(out_dir):
            pass


def _write_manifest(out_dir: Path, data: dict[str, Any]) -> None:
    write_atomic(out_dir / MANIFEST, json.dumps(data, indent=2, sort_keys=True))  # never torn, whatever stops it


def read_manifest(out_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{out_dir}: no {MANIFEST}: not a sweep directory") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise InputError(f"{out_dir / MANIFEST}: not a sweep manifest ({exc})") from None
    if not isinstance(data, dict) or not {"spec", "settings", "points"} <= set(data):
        raise InputError(f"{out_dir / MANIFEST}: not a sweep manifest (no spec, settings and points)")
    return data


def sweep_budget(grid: Budget, configured: Budget, given: dict[str, Any]) -> Budget:
    """The budget of a new sweep's points. Lowest first: the config file and ``TMAS_BUDGET_*`` (``configured``,
    which already holds the flags), then a grid file's own ``budget``, then the ``--budget-*`` flags ``given``
    (name -> value, only those given). A grid without a budget takes ``configured`` whole."""
    if not grid.limited:
        return configured
    if given:
        return Budget.model_validate({**grid.model_dump(), **given})
    return grid


def check_limit_flags(spec: SweepSpec, path: Path, given: Iterable[str]) -> None:
    """Refuse ``--budget-tokens`` and ``--budget-calls`` (``given``: ``tokens``, ``calls``, those typed) where a study
    of the grid file at ``path`` sets its own ``budget``: it replaces the sweep's, limits and all, so the flag would not
    reach that study's points, which would run at the file's limit beside points at the flag's, without a word."""
    flags = [f"--budget-{key}" for key in given]
    own = next((study.name for study in spec.study if study.budget is not None), None)
    if flags and own is not None:
        raise InputError(
            f"{path}: study {own!r} sets its own budget, which {' and '.join(flags)} would not reach (a study's"
            f" budget replaces the sweep's): set the limit in the grid file, or leave {' and '.join(flags)} out"
        )


def with_token_flags(spec: SweepSpec, flags: dict[str, Any]) -> None:
    """Put ``--budget-count`` and ``--budget-pool`` (``flags``: ``count`` and ``pool`` -> value, None where not
    given) on every token budget of a grid, the sweep's and each study's own: they say how a token budget counts,
    whichever table sets its limit (a study's ``budget`` replaces the sweep's, limits and all)."""
    given = {key: value for key, value in flags.items() if value is not None}
    if not given:
        return
    if spec.budget.tokens is not None:
        spec.budget = Budget.model_validate({**spec.budget.model_dump(), **given})
    for study in spec.study:
        if study.budget is not None and study.budget.tokens is not None:
            study.budget = Budget.model_validate({**study.budget.model_dump(), **given})


def resumed_sweep(
    sweep_dir: Path, overrides: dict[str, Any], *, config: str | Path | None = None
) -> tuple[SweepSpec, Settings]:
    """The grid and settings of a sweep to continue: the manifest's, with the flags given now on top (the resume
    rule of :func:`tmas.runner.resume_settings`). The budget is part of each point's name, so it cannot change."""
    if any(value is not None for key, value in overrides.items() if key.startswith("budget.")):
        raise InputError("--resume keeps the sweep's budget (it names the points): give no --budget-* flag")
    manifest = read_manifest(sweep_dir)
    try:
        spec = SweepSpec.model_validate(manifest["spec"])
        stored = Settings.model_validate(manifest["settings"])
    except ValidationError as exc:
        raise InputError(validation_message(exc, f"{sweep_dir / MANIFEST}")) from None
    try:
        expand(spec)
    except ConfigError as exc:
        # A check added since the sweep was stored (mode=proof for majority vote, iterations for cot alone): its
        # points ran, and read, as they ran.
        raise InputError(
            f"{sweep_dir}: cannot resume: this version of tmas refuses the grid stored in its {MANIFEST} ({exc}); its"
            f" finished points are kept and read as they ran (tmas report {sweep_dir / POINTS_DIR}/* -o DIR, tmas"
            f" view {sweep_dir}): start a new sweep for the rest"
        ) from None
    settings = resume_settings(stored, overrides, stored_at=sweep_dir, config=config, same_method=False)
    if config is not None:
        # A config file read afresh holds none of the grid's sampling: it goes on again, under the flags given now.
        settings = with_grid_sampling(settings, spec, given_sampling(overrides))
    return spec, settings


def grid_changes(out_dir: Path, points: list[SweepPoint]) -> tuple[list[str], list[str]]:
    """The points of a sweep run again in ``out_dir`` with another grid than its manifest's: those it adds, and those
    it leaves out (their runs stay under ``runs/``, out of the report); none where ``out_dir`` holds no sweep."""
    if not (out_dir / MANIFEST).is_file():
        return [], []
    before = list(read_manifest(out_dir)["points"])
    now = [point.name for point in points]
    return [name for name in now if name not in before], [name for name in before if name not in now]


@dataclass
class PointResume:
    """What a point's run has still to do, as the cost gate counts it: the problems it ``solves``, the answered calls
    it ``replays`` rather than sends (by problem), its store's answered calls by ``role`` (of which those replayed
    are some): what they are taken off the point's token ceiling at
    (:func:`tmas.planning.estimate.stored_over_points`), and what a pooled token budget's bank holds for the problems
    it solves (``banked``, :meth:`tmas.runner.RunSetup.pooled_left`)."""

    solves: int
    replays: dict[str, int] = field(default_factory=dict)
    roles: dict[str, int] = field(default_factory=dict)
    banked: int = 0
    # The completion tokens the replayed calls spent, by problem (:meth:`tmas.runner.RunSetup.replayed_tokens`).
    spent: dict[str, int] = field(default_factory=dict)


def point_resume(point: SweepPoint, settings: Settings, out_dir: Path, problems: int) -> PointResume:
    """What the point's run has still to do, for the cost gate, as a resume of one run counts it
    (:meth:`tmas.runner.RunSetup.settled`, :meth:`tmas.runner.RunSetup.replays`,
    :meth:`tmas.runner.RunSetup.replayed_roles`): the problems it solves (all ``problems`` where the point has no run
    yet, none where it is finished and skipped), the answered calls of those that it replays rather than sends, by
    problem, the store's answered calls by role, and what a pooled token budget's bank holds for them."""
    run_dir = out_dir / POINTS_DIR / point.name
    if not holds_run(run_dir):
        return PointResume(problems)
    setup = RunSetup.check(point.settings(settings))
    with RunStore(run_dir, create=False) as peek:
        settled = setup.settled(peek)
        return PointResume(
            peek.problem_count() - len(settled),
            setup.replays(peek, settled),
            setup.replayed_roles(peek),
            setup.pooled_left(peek, settled),
            setup.replayed_tokens(peek, settled),
        )


def check_sweep_dir(
    points: list[SweepPoint], problems: list[Problem], settings: Settings, out_dir: Path, *, own_model: bool = False
) -> None:
    """Refuse, before any call, a sweep that ``out_dir`` cannot hold: a file there, a sweep over other problems, or a
    point whose finished problems were solved under other requests than ``settings`` ask now
    (:meth:`tmas.runner.RunSetup.check_resume`), whichever point of the sweep it is (``own_model``: on a model of the
    caller's own). ``tmas sweep`` checks it before its estimate, whose pilot sends calls, and :func:`prepare_sweep`
    again."""
    check_out_dir(out_dir, "a sweep is kept in a directory")
    if (out_dir / MANIFEST).exists() and read_manifest(out_dir).get("problems_digest") != _problems_digest(problems):
        raise InputError(f"{out_dir}: holds a sweep over other problems; choose another directory")
    for point in points:
        run_dir = out_dir / POINTS_DIR / point.name
        if holds_run(run_dir):
            with RunStore(run_dir, create=False) as store:
                RunSetup.check(point.settings(settings), own_model=own_model).check_resume(store)


def prepare_sweep(
    spec: SweepSpec,
    settings: Settings,
    out_dir: Path,
    *,
    own_model: bool = False,
    read: list[Problem] | None = None,
) -> tuple[list[SweepPoint], list[Problem], dict[str, Any]]:
    """Validate every point (before the first call), load the problems (``read``: those :func:`sweep_problems` read
    already, from a pipe, which cannot be read twice), check that the points already run were run as ``settings``
    ask (``own_model``: on a model of the caller's own) and write the manifest. A sweep refused here keeps its
    manifest as it was: resumed without the change, it goes on."""
    points = expand(spec, out_dir)
    if not points:
        raise InputError("the sweep has no points (add a [[study]])")
    problems = read if read is not None else sweep_problems(spec)
    check_sweep_dir(points, problems, settings, out_dir, own_model=own_model)
    out_dir.mkdir(parents=True, exist_ok=True)
    for point in points:  # what a point yet to run names outside it (MATTRL's pool), before the first point runs
        if not holds_run(out_dir / POINTS_DIR / point.name):
            run_method(point.settings(settings), own_model=own_model).check_setup()
    manifest: dict[str, Any] = {
        "spec": spec.model_dump(mode="json"),
        "settings": settings.model_dump(mode="json"),
        "problems_digest": _problems_digest(problems),
        "points": {p.name: {"method": p.method, "params": p.params, "studies": p.studies} for p in points},
    }
    _write_manifest(out_dir, manifest)
    return points, problems, manifest


def open_point(
    point: SweepPoint,
    settings: Settings,
    out_dir: Path,
    problems: list[Problem],
    dataset: str,
    *,
    own_model: bool = False,
) -> tuple[str, RunStore | None, Settings, Iterable[Problem]]:
    """The point's run: ("skipped", None, ...) when finished, else its store opened new or for resuming
    (``own_model``: on a model of the caller's own, as :func:`tmas.runner.prepare_run` takes it)."""
    run_dir = out_dir / POINTS_DIR / point.name
    point_settings = point.settings(settings)
    if holds_run(run_dir):
        with RunStore(run_dir, create=False) as peek:
            setup = RunSetup.check(point_settings, own_model=own_model)
            if _settled(setup, peek):
                # Skipped only where its results are of the requests the sweep asks now (a resumed point is checked
                # so by prepare_run).
                setup.check_resume(peek)
                return "skipped", None, point_settings, []
        store, point_settings, todo = prepare_run(run_dir, point_settings, None, resume=True, own_model=own_model)
        return "resumed", store, point_settings, todo
    store, point_settings, todo = prepare_run(run_dir, point_settings, problems, resume=False, own_model=own_model)
    store.set_meta("dataset", dataset)
    store.set_meta("sweep", {"point": point.name, "studies": point.studies})
    return "new", store, point_settings, todo


def _settled(setup: RunSetup, store: RunStore) -> bool:
    """Whether every problem of the point's run is finished as ``setup`` asks and without a failed call: the point is
    skipped when the sweep runs again."""
    return len(setup.settled(store)) == store.problem_count()


async def run_sweep(
    spec: SweepSpec,
    settings: Settings,
    out_dir: Path,
    *,
    on_point: Callable[[PointOutcome], None] | None = None,
    on_result: Callable[[ProblemResult], None] | None = None,
    on_start: Callable[[SweepPoint, RunState], None] | None = None,
    model: ChatModel | None = None,
    read: list[Problem] | None = None,
) -> SweepSummary:
    """Run every point of ``spec`` not finished yet into ``out_dir``, on the endpoint of ``settings`` or on ``model``
    (a :class:`tmas.llm.model.ChatModel` of the caller's own, for every point); see the module docstring.
    ``on_start`` hears of each point that runs as it begins, with the live state of its run. ``read``: the sweep's
    problems as :func:`sweep_problems` read them already (a pipe is read once)."""
    with sweeping(out_dir):
        return await _run_held(spec, settings, out_dir, on_point, on_result, on_start, model, read)


async def _run_held(
    spec: SweepSpec,
    settings: Settings,
    out_dir: Path,
    on_point: Callable[[PointOutcome], None] | None,
    on_result: Callable[[ProblemResult], None] | None,
    on_start: Callable[[SweepPoint, RunState], None] | None,
    model: ChatModel | None,
    read: list[Problem] | None,
) -> SweepSummary:
    """:func:`run_sweep` with the sweep directory's lock held."""
    points, problems, manifest = prepare_sweep(spec, settings, out_dir, own_model=model is not None, read=read)
    dataset = dataset_name(spec.problems or "")
    outcomes: list[PointOutcome] = []
    async with SeriesModel(model) as series:
        for point in points:
            status, store, point_settings, todo = open_point(
                point, settings, out_dir, problems, dataset, own_model=series.own
            )
            if status == "new" and store is not None and spec.about is not None and spec.about.benchmark:
                # The paper's name for these problems: the report puts the published cells beside this run's.
                store.set_meta("paper_benchmark", spec.about.benchmark)
            outcome = PointOutcome(point, status)
            finished = True
            if store is not None:
                state = RunState()
                if on_start is not None:
                    on_start(point, state)
                with store:
                    outcome.summary = await series.run(point_settings, todo, store, state=state, on_result=on_result)
                    # A problem failed, or solved without a failed call's reply: the sweep run again resumes it.
                    finished = _settled(RunSetup.check(point_settings, own_model=series.own), store)
            manifest["points"][point.name]["finished"] = finished
            _write_manifest(out_dir, manifest)
            outcomes.append(outcome)
            if on_point is not None:
                on_point(outcome)
    return SweepSummary(out_dir, outcomes)


def sweep_problems(spec: SweepSpec) -> list[Problem]:
    """The problems a sweep runs (its file, cut to ``limit``)."""
    if not spec.problems:
        raise InputError("the sweep names no problems (grid file 'problems' or --problems)")
    problems = load_problems(resolve_dataset(spec.problems))
    return problems[: spec.limit] if spec.limit else problems


def spec_from_flags(
    problems: str | None,
    methods: list[str],
    params: dict[str, Any],
    grid: dict[str, list[Any]],
    *,
    limit: int | None,
    budget: Budget,
) -> SweepSpec:
    """One study from command-line flags (``--method`` repeatable, ``--param``, ``--grid KEY=V1,V2``)."""
    try:
        study = Study(name="sweep", methods=methods, params=params, grid=grid)
        return SweepSpec(problems=problems, limit=limit, budget=budget, study=[study])
    except ValidationError as exc:
        raise ConfigError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


def parse_grid_flag(item: str) -> tuple[str, list[Any]]:
    """``KEY=V1,V2,...`` -> (KEY, [values]); each value read as JSON when it parses, else as text."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip() or not raw.strip():
        raise InputError(f"--grid {item!r}: expected KEY=VALUE1,VALUE2,...")
    values: list[Any] = []
    for part in raw.split(","):
        try:
            values.append(json.loads(part))
        except ValueError:
            values.append(part.strip())
    return key.strip(), values


def study_groups(spec: SweepSpec, out_dir: Path) -> dict[str, list[Path]]:
    """Run directories by study, for the per-study reports."""
    groups: dict[str, list[Path]] = {}
    for point in expand(spec, out_dir):
        for study in point.studies:
            groups.setdefault(study, []).append(out_dir / POINTS_DIR / point.name)
    return groups


async def report_sweep(
    spec: SweepSpec,
    out_dir: Path,
    config: GradeConfig,
    settings: Settings | None,
    *,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """The combined report of every point (graded once, grades stored in each run), then one per study that has
    several points, from the stored grades, each point labelled as in the combined one; ``on_step`` hears of each
    step as it begins."""
    points = expand(spec, out_dir)
    dirs = [out_dir / POINTS_DIR / p.name for p in points]
    labels: dict[Path, str] = {}
    written = await build_report(dirs, out_dir / "report", config, settings, on_step=on_step, labels=labels)
    groups = study_groups(spec, out_dir)
    if len(groups) > 1:
        folders = study_folders(list(groups))
        for study, dirs in groups.items():
            if len(dirs) > 1:
                where = out_dir / "report" / folders[study]
                sub = await build_report(dirs, where, config, settings, grade=False, on_step=on_step, labels=labels)
                written[f"{study}/markdown"] = sub["markdown"]
    return written


def study_folders(studies: list[str]) -> dict[str, str]:
    """Each study's folder under the sweep's ``report/``: its name as a folder name, and where names meet so
    (``Table 1 (IMO)`` and ``Table 1 IMO``) a digest of the name besides, so that no study's report writes over
    another's."""
    slugs = {study: _slug(study) for study in studies}
    taken = list(slugs.values())
    return {
        study: slug if taken.count(slug) == 1 else f"{slug}__{hashlib.sha256(study.encode()).hexdigest()[:8]}"
        for study, slug in slugs.items()
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "study"
