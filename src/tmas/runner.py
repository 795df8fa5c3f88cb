"""Run a method over problems into a run directory, durably and resumably."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Mapping, Sized
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tmas.agents.overrides import Override, check_not_grading, check_overrides, sources_of
from tmas.agents.templates import prompts_from
from tmas.config import (
    Budget,
    Settings,
    check_pinned_batches,
    config_source,
    load_settings,
    validation_message,
    with_method_params,
    with_overrides,
)
from tmas.errors import ConfigError, InputError, LocalModelError, TmasError
from tmas.files import check_out_dir
from tmas.grading.judge import JUDGE_ROLE
from tmas.llm.factory import open_model
from tmas.llm.hf_checkpoint import check_folder
from tmas.llm.model import ChatModel, ClientStats, EndpointUnreachable
from tmas.llm.preflight import check_endpoints, served_models
from tmas.llm.provision import on_embedded_model
from tmas.llm.replay import ReplayTurns
from tmas.llm.routes import DEFAULT_MODEL, check_api_keys
from tmas.llm.sampling import resolve_role
from tmas.llm.types import Lane
from tmas.llm.weights import check_model_named
from tmas.memory.embedders import LOCAL, LOCAL_NAME
from tmas.methods import METHODS, check_given_params, check_roles, create_method
from tmas.methods.base import (
    BudgetExhausted,
    Candidate,
    IterationRecord,
    Method,
    ProblemResult,
    ProblemSession,
    TokenBank,
    gather_all,
    truncation_warnings,
)
from tmas.methods.state import FallbackState
from tmas.problems import Problem, dataset_name, iter_problems, resolve_dataset
from tmas.store.run_lock import RunLock
from tmas.store.run_store import DB_NAME, RunStore, StoreError

if TYPE_CHECKING:
    from tmas.answer_classes import EquivalenceCheck

# The store's meta key of the URLs a run sent each role's calls to that name no model (RunSetup.record_servers).
OWN_URLS = "own_urls"


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
    # The run's call counters, from when its model is open (None while it starts).
    stats: ClientStats | None = None
    # Most problems solved at once (see :func:`problems_in_flight`); 0 until the run starts.
    problem_slots: int = 0
    # The iterations each problem is planned to run (the method's T), for the progress display's ETA.
    iterations: int = 1
    # Called as each problem starts an iteration, with its id and the iteration.
    on_iteration: Callable[[str, int], None] | None = None

    def iteration_started(self, problem_id: str, iteration: int) -> None:
        if self.on_iteration is not None:
            self.on_iteration(problem_id, iteration)


@dataclass
class RunSummary:
    run_dir: Path
    problems: int
    done: int
    failed: int
    skipped: int
    calls: int
    replayed_calls: int
    # Over the whole run, from the store: calls that failed and were never asked again, and those that failed and
    # were asked again (a resume asks each failed call once more: history, no failure of the run; their tokens count
    # below).
    failed_calls: int
    # Over every call of the run: prompt, completion, and the part of completion that was reasoning.
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    # How the run's token budget counts (``budget.count``), so the figures above read against the right limit.
    budget_count: str
    wall_s: float
    # The results of this session, only when asked for (``keep_results``): a big run does not hold them all.
    results: list[ProblemResult]
    # Handled anomalies (e.g. bad agent outputs) summed over the problems solved in this session.
    anomalies: dict[str, int] = field(default_factory=dict)
    # Over the whole run (every session), from the store: calls cut at max_tokens, failed calls by their last
    # failure's cause, and failed attempts that were retried, by cause ("http_503", "timeout", "malformed", ...).
    truncated_calls: int = 0
    # Per role, successful calls cut at max_tokens, and a warning line per role where that passes 10 % of them.
    truncated_by_role: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    failed_calls_by_cause: dict[str, int] = field(default_factory=dict)
    asked_again_calls: int = 0
    asked_again_by_cause: dict[str, int] = field(default_factory=dict)
    retries_by_cause: dict[str, int] = field(default_factory=dict)
    # Prompt tokens the servers took from their prompt caches (as they reported), over the whole run.
    cached_prompt_tokens: int = 0
    # Kind -> where (the endpoint URL and the model refused: tmas.store.run_meta.downgrade_where) -> the server's
    # refusal, for each thing a server refused and the run went on without (tmas.llm.types.DOWNGRADES:
    # response_format, streaming, n > 1, a sampling field).
    downgrades: dict[str, dict[str, str]] = field(default_factory=dict)
    # The run's one-line notices (e.g. confidence rules on a server without log-probabilities), each kind once.
    notices: list[str] = field(default_factory=list)
    # Why the problems that failed in this session failed: each error (the first line of it) -> how many.
    failures: dict[str, int] = field(default_factory=dict)
    # Finished problems whose result holds a call that failed after its retries: a resume asks those calls again.
    problems_with_failed_calls: int = 0

    @property
    def cached_prompt_share(self) -> float | None:
        """cached_prompt_tokens / prompt_tokens (None without prompt tokens)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "results"}
        data["run_dir"] = str(self.run_dir)
        data["cached_prompt_share"] = self.cached_prompt_share
        return data


def params_fingerprint(method: str, params: dict[str, Any], budget: dict[str, Any] | None = None) -> str:
    data: dict[str, Any] = {"method": method, "params": params}
    if budget:
        # Only a set budget is part of it, so runs without one keep their fingerprints; a resume with another
        # budget re-solves the problems (from the stored calls) to the new limit.
        data["budget"] = budget
    raw = json.dumps(data, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def run_fingerprint(method: Method[Any], settings: Settings) -> str:
    """What a finished problem's result must match to be skipped: the method, its params and the budget."""
    return params_fingerprint(method.name, method.params.model_dump(mode="json"), settings.budget.identity())


def problems_in_flight(settings: Settings, *, own_model: bool = False) -> int:
    """How many problems a run solves at once: ``settings.problems_in_flight`` where set, else what the solution
    role's endpoint serves at once (``max_in_flight`` per replica times its replicas: for the embedded model, as
    provisioned, its slots times its replicas), else the call cap; never more than the call cap (``concurrency``).
    A run on a model of the caller's own (``own_model``) has no endpoint to size by: the call cap.

    More problems than the endpoint has slots would only share the slots: every problem slows down, and the first
    one finishes after most of the run's time instead of after its own.
    """
    cap = settings.concurrency
    if settings.problems_in_flight is not None:
        return min(settings.problems_in_flight, cap)
    if own_model:
        return cap
    if settings.uses_local_model:
        slots = settings.local.slots * settings.local.replicas
    else:
        # The solution role's own endpoint fields where it sets them (as the client routes it), else the default's.
        override = settings.roles.get("solution")
        urls, per_replica = settings.endpoint.base_url, settings.endpoint.max_in_flight
        if override is not None:
            urls = override.base_url or urls
            per_replica = override.max_in_flight if override.max_in_flight is not None else per_replica
        slots = per_replica * len(urls)
    return min(slots, cap) if slots > 0 else cap


class Unreachable(TmasError):
    """The endpoint could not be reached; finished work is kept for --resume (in ``run_dir``, where one is kept).
    ``again``: the command that continues it (default ``tmas run --resume RUN_DIR``; a sweep's names the sweep);
    ``then``: the command to run after it (``tmas eval``'s report); ``cause``: the last failure's (tmas.llm.failures),
    ``connect``, ``tls`` or ``quota``."""

    def __init__(
        self,
        reason: str,
        run_dir: Path | None,
        *,
        again: str | None = None,
        then: str | None = None,
        cause: str = "connect",
    ) -> None:
        if again is None and run_dir is not None:
            again = f"tmas run --resume {run_dir}"
        kept = f"; finished work is kept: continue with '{again}'{_then(then)}" if again is not None else ""
        super().__init__(reason + kept)
        self.reason = reason
        self.run_dir = run_dir
        self.cause = cause


class StoreFailed(TmasError):
    """The run's store failed as the run wrote or read it (a full disk, an I/O error): the run stops at once, not
    solving on with calls it cannot keep; what was committed before is kept for --resume."""

    def __init__(
        self, reason: str, run_dir: Path, *, kept: bool = True, again: str | None = None, then: str | None = None
    ) -> None:
        """``kept`` False: the run directory is a scratch one that goes (:func:`tmas.api.asolve`). ``again``: the
        command that continues it (default ``tmas run --resume RUN_DIR``; a sweep's names the sweep); ``then``: the
        command to run after it (``tmas eval``'s report)."""
        where = f"{run_dir / DB_NAME}: the run's store failed ({reason})"
        if kept:
            where += (
                "; the calls and results stored before are kept: continue with"
                f" '{again or f'tmas run --resume {run_dir}'}' once it can be written{_then(then)}"
            )
        super().__init__(where)
        self.reason = reason
        self.run_dir = run_dir


def _then(command: str | None) -> str:
    """The step after a resume, as a stop's line says it: ", then 'COMMAND'" (nothing without one)."""
    return f", then '{command}'" if command else ""


class StoredProblems:
    """A run's problems as stored, read in batches each time it is iterated: a large run never holds them all."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def __iter__(self) -> Iterator[Problem]:
        return self.store.iter_problems()

    def __len__(self) -> int:
        return self.store.problem_count()


def resume_settings(
    stored: Settings,
    overrides: dict[str, Any],
    *,
    stored_at: Path,
    config: str | Path | None = None,
    params: dict[str, Any] | None = None,
    same_method: bool = True,
) -> Settings:
    """A resumed run's settings: the ``stored`` ones with every dotted-key override given now (None = not given)
    and method ``params`` on top. A ``config`` file replaces the stored settings (read with the environment, as a
    new run's are), its method and parameters the stored ones where it names none; without one the environment is
    not read again: a run continues as it was set up unless a flag says otherwise. ``same_method``: another method
    than the stored one is refused (it would solve every finished problem again and replace its result). The CLI's
    ``run --resume`` and ``sweep --resume`` (whose points set their own methods) and :func:`tmas.api.aresume` use
    this rule. ``stored_at``: the run's (or sweep's) directory, named where the settings it continues with are
    refused as a new run's would be (:func:`tmas.config.check_pinned_batches`, which a config file read afresh
    passes already)."""
    fresh = config is not None
    settings = load_settings(config, overrides=overrides) if fresh else with_overrides(stored, overrides)
    if not fresh:
        check_pinned_batches(settings, f"{stored_at} (its stored settings)")
    if fresh and "method" not in settings.model_fields_set:
        settings = settings.model_copy(update={"method": stored.method})
    elif fresh:
        # The file's own parameters, given now (those ``params`` replace aside); the stored ones ran as they ran.
        configured = {key: value for key, value in settings.method.params.items() if key not in (params or {})}
        check_given_params(
            settings.method.name, configured, lambda param: f"{config_source(config)}: method.params.{param}"
        )
    if same_method and settings.method.name != stored.method.name:
        raise InputError(
            f"the run was made with method {stored.method.name!r}: resumed with {settings.method.name!r}, every"
            " finished result would be replaced; start a new run for it"
        )
    return with_method_params(settings, params)


def stored_settings(run_dir: Path) -> Settings:
    """The settings a run directory was made with."""
    with RunStore(run_dir, create=False) as store:
        data = store.get_meta("settings")
        if data is None:
            raise _no_settings(store)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:  # written by a newer tmas, or edited
        raise StoreError(validation_message(exc, f"{run_dir}: the run's recorded settings")) from None


def stored_params_refusal(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` cannot be resumed with the method parameters it was stored with, where a check
    this tmas makes of them was added since (mode=proof for a method that cannot take it, a selection rule of the
    other mode, a TMAS role's ``extra_body`` key tmas sends itself): one line naming the run, the stored parameter
    and what is kept. None where its parameters are taken, or where there is none to read (no run there, no
    settings stored: said as it is) or its method is not registered."""
    try:
        stored = stored_settings(run_dir)
    except StoreError:
        return None
    cls = METHODS.get(stored.method.name)
    if cls is None:
        return None
    try:
        cls.Params.model_validate(stored.method.params)
    except ValidationError as exc:
        error = exc.errors()[0]
        why = str(error["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(part) for part in error["loc"])
        field = f"method.params.{loc} = {json.dumps(error['input'])}" if loc else "method parameters"
        return (
            f"{run_dir}: cannot resume: this version of tmas refuses the run's stored {field} (method"
            f" {stored.method.name!r}: {why}); its finished work is kept and reads as it ran (tmas report, tmas"
            " export, tmas view): start a new run for the problems it left"
        )
    return None


@dataclass(frozen=True)
class RunSetup:
    """What a run is set up with, checked before anything is made: its settings (their ``[roles]`` known to the
    registered methods), the method they name (parameters validated) and the packaged templates its prompt overrides
    replace (a bad override is a one-line error)."""

    settings: Settings
    method: Method[Any]
    overrides: list[Override]

    @classmethod
    def check(cls, settings: Settings, *, own_model: bool = False, resuming: Path | None = None) -> RunSetup:
        """``own_model``: the run is on a model of the caller's own, not the embedded one (:func:`run_method`).
        ``resuming``: the stored run the settings continue, whose own method parameters, where this tmas refuses
        them, are said so (:func:`stored_params_refusal`)."""
        try:
            method = run_method(settings, own_model=own_model)
        except ConfigError:
            if resuming is not None and (refusal := stored_params_refusal(resuming)) is not None:
                raise InputError(refusal) from None
            raise
        check_roles(settings)
        overrides = check_not_grading(check_overrides(settings.prompts_dir)) if settings.prompts_dir else []
        return cls(settings, method, overrides)

    def requests(self, settings: Settings, prompts: dict[str, str]) -> dict[str, Any]:
        """What the calls of this setup's method ask under ``settings`` beyond its parameters (which the results'
        fingerprint holds): each role's model and sampling as resolved, the run seed the per-call seeds come from,
        and each prompt override's SHA-256 in ``prompts``; one readable name per value."""
        asked: dict[str, Any] = {"seed": settings.seed}
        if settings.uses_local_model:
            asked["local model"] = settings.local.model
        elif settings.uses_in_process_model:
            asked["in-process model"] = settings.hf.model
        for role in self.method.traits.roles:
            override = settings.roles.get(role)
            asked[f"{role} model"] = (override.model if override else None) or settings.endpoint.model
            if role == "embedding" and getattr(self.method.params, "embedder", None) == LOCAL:
                # The vectors come from the embedder in process: no call of the role goes to an endpoint.
                asked[f"{role} model"] = LOCAL_NAME
            preset, own = self.method.params.sampling_layers(role)
            sampling = resolve_role(settings, role, preset=preset, method=own).sampling
            for name, value in sampling.model_dump(mode="json", exclude_defaults=True).items():
                asked[f"{role} {name}"] = value
        asked.update({f"prompt template {name}": sha[:12] for name, sha in prompts.items()})
        return asked

    def handling(self, settings: Settings) -> dict[str, str]:
        """How each role's calls are sent and their replies read under ``settings`` beyond what the calls ask (the
        request hash leaves both out): ``endpoint.reasoning`` (replies read as thinking inside their content or not)
        and ``endpoint.structured_output`` (a JSON reply's schema sent as ``response_format`` or not), a role's own
        setting over the endpoint's."""
        shown: dict[str, str] = {}
        for role in self.method.traits.roles:
            override = settings.roles.get(role)
            reasoning = (override.reasoning if override else None) or settings.endpoint.reasoning
            structured = (override.structured_output if override else None) or settings.endpoint.structured_output
            shown[f"{role} reasoning"], shown[f"{role} structured_output"] = reasoning, structured
        return shown

    def changed_requests(self, store: RunStore) -> list[str]:
        """What this setup asks otherwise than ``store``'s recorded settings did (another model, sampling, seed or
        prompt template), each as ``NAME OLD (now NEW)``; none where the recorded settings are another version's."""
        before = _recorded_settings(store)
        if before is None:
            return []
        stored_prompts = store.get_meta("prompt_overrides")
        prompts = {o.name: o.sha256 for o in self.overrides} if stored_prompts is not None else {}
        old, new = self.requests(before, stored_prompts or {}), self.requests(self.settings, prompts)
        return [
            f"{name} {_shown(old.get(name))} (now {_shown(new.get(name))})"
            for name in sorted(old.keys() | new.keys())
            if old.get(name) != new.get(name)
        ]

    def changed_params(self, store: RunStore) -> list[str]:
        """The method parameters this setup gives otherwise than ``store``'s run recorded, each as ``NAME OLD (now
        NEW)``: its finished problems are then solved again (their stored calls replayed where asked alike). None
        where the run recorded another method (refused) or none."""
        before = store.get_meta("method")
        if not isinstance(before, dict) or before.get("name") != self.method.name:
            return []
        old, new = before.get("params") or {}, self.method.params.model_dump(mode="json")
        return [
            f"{name} {_shown(old.get(name))} (now {_shown(new.get(name))})"
            for name in sorted(old.keys() | new.keys())
            if old.get(name) != new.get(name)
        ]

    def changed_handling(self, store: RunStore) -> list[str]:
        """Where this setup sends the calls or reads their replies otherwise than ``store``'s recorded settings did
        (:meth:`handling`), each as ``NAME OLD (now NEW)``."""
        before = _recorded_settings(store)
        if before is None:
            return []
        old, new = self.handling(before), self.handling(self.settings)
        return [
            f"{name} {_shown(old[name])} (now {_shown(new[name])})" for name in sorted(old) if old[name] != new[name]
        ]

    def unnamed_roles(self, store: RunStore) -> list[str]:
        """The roles of this setup's method whose calls name no model and go to an endpoint (each server answers
        with a model of its own there) and of which ``store`` holds a reply: those whose model a resume compares
        (:meth:`changed_servers`)."""
        replied = store.replies_by_role()
        return [
            role
            for role in self.method.traits.roles
            if replied.get(role, (0, 0))[0] and _served_by(self.settings, role) is not None
        ]

    def changed_servers(self, store: RunStore, served: Mapping[str, list[str]] | None = None) -> list[ServerChange]:
        """The roles of this setup's method, where no model is named (each server answers with a model of its own),
        whose replies would now come from another model than ``store``'s replies of them did: their endpoint URLs are
        not those the replies came from nor others the run's starts checked (:meth:`record_servers`), and their
        servers are not known to serve the replies' model (another model may answer there), or ``served`` (URL -> the
        models its server lists now: :func:`tmas.llm.preflight.served_models`) says their server serves another model
        than the stored replies reported (a server restarted with another model at the same URL). None where no reply
        of those roles is stored (nothing would be mixed) or the recorded settings are another version's. A named
        model is compared by :meth:`changed_requests` instead. The one check of a resumed run and of ``tmas data
        filter``'s samples."""
        roles = self.unnamed_roles(store)
        before = _recorded_settings(store) if roles else None
        if before is None:
            return []
        served = served or {}
        changed = []
        for role in roles:
            recorded, new = _served_by(before, role), _served_by(self.settings, role)
            if recorded is None or new is None:
                continue
            # The URLs the replies came from, as stored with them: the run's recorded settings are those of its last
            # start, which may have sent none.
            replied, came_from = store.reply_model_endpoints(role)
            old = [url for url in came_from if url.startswith(("http://", "https://"))] or recorded
            # A reply that says DEFAULT_MODEL echoes the name asked (llama-server, SGLang): it names no model.
            named = replied if replied != DEFAULT_MODEL else None
            # Other URLs than the replies came from and than the run's own (a replica that answered none of its calls
            # is one), where what they serve (or the replies' model) is unknown: another model may answer there.
            # Those that list what they serve are compared below, as the run's own.
            own = _own_urls(store).get(role, [])
            moved_to = [url for url in new if url not in old and url not in own]
            listed = list(dict.fromkeys(name for url in new for name in served.get(url, [])))
            if moved_to and (not named or any(not served.get(url) for url in moved_to)):
                changed.append(ServerChange(role, old, new, named, listed, moved=True))
                continue
            # Each replica's server on its own: one of two restarted with another model mixes its replies in alike.
            other = next((url for url in new if named and served.get(url) and named not in served[url]), None)
            if other in moved_to:
                changed.append(ServerChange(role, old, new, named, listed, moved=True))
            elif other is not None:
                changed.append(ServerChange(role, old, [other], named, served[other], moved=False))
        return changed

    def check_servers(self, store: RunStore, served: Mapping[str, list[str]] | None = None) -> None:
        """Refuse, in one line, to resume ``store``'s run where a role's replies would come from another model than
        its stored ones did (:meth:`changed_servers`)."""
        if changed := self.changed_servers(store, served):
            own = self.settings.roles.get(changed[0].role)
            raise InputError(changed[0].refusal(store.run_dir, len(changed) - 1, bool(own and own.base_url)))

    def record_servers(self, store: RunStore) -> None:
        """Add the URLs this setup's roles that name no model are sent to to those ``store`` keeps as its run's own
        (:meth:`changed_servers` takes them for its own whether or not a reply came from them): once a start has
        checked them, before any call. A resume refused for them never gets here, though it recorded its settings."""
        own = _own_urls(store)
        for role in self.method.traits.roles:
            urls = _served_by(self.settings, role)
            if urls:
                own[role] = sorted({*own.get(role, []), *urls})
        store.set_meta(OWN_URLS, own)

    @cached_property
    def inputs(self) -> dict[str, str]:
        """What the method reads outside the run, by the identity of its content (:meth:`Method.inputs`): read once
        per setup."""
        return self.method.inputs()

    def changed_inputs(self, store: RunStore) -> list[str]:
        """The names of what the method reads outside the run (its experience pool) whose content is not what
        ``store``'s run recorded at its start; none where the run recorded nothing (another version's)."""
        before = store.get_meta("method_inputs")
        if not isinstance(before, dict):
            return []
        return [name for name, identity in self.inputs.items() if name in before and before[name] != identity]

    def unrecorded_inputs(self, store: RunStore) -> list[str]:
        """The names of what the method reads outside the run that ``store``'s run, made by an earlier version of
        tmas, recorded no identity of, where a finished problem keeps what it read: a resume cannot tell whether it
        changed."""
        if store.get_meta("method_inputs") is not None or not self.inputs:
            return []
        return list(self.inputs) if store.finished_problem_ids(run_fingerprint(self.method, self.settings)) else []

    def check_resume(self, store: RunStore, served: Mapping[str, list[str]] | None = None) -> None:
        """Refuse to resume ``store``'s run where a problem it finished would keep its result though this setup asks
        other requests than the run's recorded settings did (:meth:`changed_requests`), or sends them or reads their
        replies otherwise (:meth:`changed_handling`): the run would then hold results of two configurations under one
        record of its settings. Where no model is named, also where another model would answer (:meth:`check_servers`;
        ``served``: what the servers list now; where not asked, :func:`run_problems` asks them before any call)."""
        if served is not None:
            self.check_servers(store, served)
        finished = store.finished_problem_ids(run_fingerprint(self.method, self.settings))
        if not finished:
            return
        count = "1 finished problem was" if len(finished) == 1 else f"{len(finished)} finished problems were"
        if inputs := self.changed_inputs(store):
            raise _input_changed(store, count, inputs[0])
        changed = sorted(self.changed_requests(store) + self.changed_handling(store))
        if changed:
            raise _settings_changed(store, count, changed)

    def check_prompts(self, store: RunStore) -> None:
        """Refuse, as :meth:`check_resume` does, to resume ``store``'s run where the prompt overrides as this setup
        read them (the text the run renders and records) are not those its finished problems were solved with: a
        template edited after the resume's check (another setup's read) would otherwise be sent and recorded."""
        finished = store.finished_problem_ids(run_fingerprint(self.method, self.settings))
        changed = [c for c in self.changed_requests(store) if c.startswith("prompt template ")] if finished else []
        if changed:
            count = "1 finished problem was" if len(finished) == 1 else f"{len(finished)} finished problems were"
            raise _settings_changed(store, count, changed)

    def settled(self, store: RunStore) -> set[str]:
        """The problems of ``store``'s run that a resume under this setup leaves as they are (:func:`run_problems`):
        finished with its method, parameters and budget, and without a failed call. None of their calls is sent or
        replayed, so a resume's estimate counts the other problems alone."""
        return store.settled_problem_ids(run_fingerprint(self.method, self.settings))

    def replays(self, store: RunStore, settled: Collection[str]) -> dict[str, int]:
        """The answered calls of ``store`` that a resume under this setup replays whatever its failed calls answer
        now, by problem (:meth:`RunStore.sure_replays`), the ``settled`` problems' left out (they are skipped, not
        replayed); none where it asks other requests than the run's recorded settings (:meth:`changed_requests`)."""
        if self.changed_requests(store):
            return {}
        return {pid: n for pid, n in store.sure_replays().items() if pid not in settled}

    def replayed_tokens(self, store: RunStore, settled: Collection[str]) -> dict[str, int]:
        """What a problem's completion-token budget has spent, by problem, once a resume under this setup has replayed
        the calls :meth:`replays` counts: their completion tokens, and those of its calls that failed, which a resume
        counts against the budget from the start (``ProblemSession._spent_before``), whatever the requests; what a
        resume's estimate under one takes off each problem's share (:func:`tmas.planning.estimate.stored_ceiling`).
        The ``settled`` problems' left out."""
        spent = {pid: completion for pid, (_, _, completion) in store.sure_replay_usage().items()}
        if self.changed_requests(store):
            spent = {}
        for pid in store.called_problems():
            failed = store.failed_spend(pid).usage.completion_tokens
            if failed:
                spent[pid] = spent.get(pid, 0) + failed
        return {pid: n for pid, n in spent.items() if pid not in settled}

    def pooled_left(self, store: RunStore, settled: Collection[str]) -> int:
        """What a pooled token budget's bank holds when a resume under this setup starts (:func:`pooled_left`): the
        problems it solves may spend it beside their own shares, and a resume's estimate counts it so."""
        return pooled_left(store, self.settings.budget, settled)

    def replayed_roles(self, store: RunStore) -> dict[str, int]:
        """The answered calls of ``store`` by role, of which those :meth:`replays` counts are some: what a resume's
        token ceiling takes them off at, each at its role's max_tokens (:func:`tmas.planning.estimate.stored_ceiling`);
        none where it asks other requests than the run's recorded settings."""
        if self.changed_requests(store):
            return {}
        return {role: n for role, (n, _) in store.replies_by_role().items()}

    def record(self, store: RunStore, inputs: Mapping[str, str] | None = None) -> None:
        """Write the setup into the run's store: the settings, the method and its parameters, and each override
        template's SHA-256 (``{}`` when none). What the method reads outside the run is recorded as it was (``{}``
        in a new run) with ``inputs`` over it: what :func:`pin_inputs` read for the run at its start, which a read
        here would only repeat (a pool read twice)."""
        store.set_meta("settings", self.settings.model_dump(mode="json"))
        store.set_meta("method", {"name": self.method.name, "params": self.method.params.model_dump(mode="json")})
        store.set_meta("prompt_overrides", {o.name: o.sha256 for o in self.overrides})
        recorded = store.get_meta("method_inputs")
        store.set_meta("method_inputs", {**(recorded if isinstance(recorded, dict) else {}), **(inputs or {})})


def _settings_changed(store: RunStore, count: str, changed: list[str]) -> InputError:
    """The refusal of a run whose finished problems (``count`` of them) were solved with other requests: ``changed``,
    each as ``NAME OLD (now NEW)``."""
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return InputError(
        f"{store.run_dir}: {count} solved with {'; '.join(changed[:3])}{more}: resumed so, what finished would"
        " stay of the run's old settings; resume without the change, or start a new run for it"
    )


def _input_changed(store: RunStore, count: str, name: str) -> InputError:
    """The refusal of a run whose finished problems read ``name`` with other content than it has now."""
    return InputError(
        f"{store.run_dir}: {count} solved with {name} as it was at the run's start; it has changed since"
        " (rebuilt, added to or pruned): resumed so, what finished would stay of the old pool and the rest"
        " get the new one's; start a new run on it, or resume with the pool as it was"
    )


def pin_inputs(method: Method[Any], store: RunStore, fingerprint: str) -> dict[str, str]:
    """Read what ``method`` reads outside the run (MATTRL's pool) once, now, for the whole run (the method keeps what
    it read, and the run's record of it, :meth:`RunSetup.record` of a setup of ``method``, says what that is). A build
    that saved the pool after a resume's checks would otherwise have the run retrieve from content it never checked:
    refused (as :meth:`RunSetup.check_resume` refuses) where a problem of ``fingerprint`` (:func:`run_fingerprint`)
    has finished. What it read is returned, for :meth:`RunSetup.record` once the run's checks pass."""
    used = method.inputs()
    recorded = store.get_meta("method_inputs")
    if not isinstance(recorded, dict):
        return used  # a run of an earlier version, which recorded none: the resume said so (prepare_run)
    changed = [name for name, identity in used.items() if name in recorded and recorded[name] != identity]
    finished = store.finished_problem_ids(fingerprint) if changed else set()
    if finished:
        count = "1 finished problem was" if len(finished) == 1 else f"{len(finished)} finished problems were"
        raise _input_changed(store, count, changed[0])
    return used


async def served_now(
    setup: RunSetup, store: RunStore, asked: Mapping[str, list[str]] | None = None
) -> dict[str, list[str]]:
    """What the servers of ``setup``'s roles that name no model serve now, where ``store`` holds replies of such a role
    (:meth:`RunSetup.unnamed_roles`), as :func:`tmas.llm.preflight.served_models` asks them (but those in ``asked``,
    what :func:`tmas.llm.preflight.check_endpoints` was told just now); nothing is asked (and none said) otherwise."""
    roles = setup.unnamed_roles(store)
    return await served_models(setup.settings, roles, asked) if roles else {}


async def check_served(setup: RunSetup, store: RunStore, asked: Mapping[str, list[str]] | None = None) -> None:
    """Refuse, before any call, a resume of ``store``'s run under ``setup`` whose servers, where it names no model,
    serve another model now than its stored replies came from (:meth:`RunSetup.check_servers`)."""
    setup.check_servers(store, await served_now(setup, store, asked))


def _recorded_settings(store: RunStore) -> Settings | None:
    """The settings ``store``'s run recorded (None where recorded by another version: nothing to compare with)."""
    try:
        return Settings.model_validate(store.get_meta("settings"))
    except ValidationError:
        return None


@dataclass(frozen=True)
class ServerChange:
    """A role whose calls name no model, whose replies would now come from another model than its stored ones:
    asked at other URLs (``moved``: ``before`` -> ``now``, whose servers list ``serving``), or at the same ones, one of
    whose servers (``now``) lists ``serving``, not the model its stored replies reported (``replied``; None where a
    stored reply named none)."""

    role: str
    before: list[str]
    now: list[str]
    replied: str | None
    serving: list[str]
    moved: bool

    @property
    def shown(self) -> str:
        """The change as ``NAME OLD (now NEW)``."""
        if self.moved:
            serves = f", which serves {_names(self.serving)}" if self.serving else ""
            return f"{self.role} endpoint {', '.join(self.before)} (now {', '.join(self.now)}{serves})"
        return f"{self.role} model at {', '.join(self.now)} {self.replied!r} (now {_names(self.serving)})"

    def refusal(self, run_dir: Path, others: int, own_url: bool) -> str:
        """The one line refusing a resume of ``run_dir`` (``others``: how many more roles changed so; ``own_url``: the
        role's URL is its own ``[roles.NAME]`` one, where its model is named too)."""
        model = f"model {self.replied!r}" if self.replied else "the model"
        more = f" and {others} more" if others else ""
        name = f'model = "NAME" in [roles.{self.role}]' if own_url else "--model NAME"
        if self.moved:
            return (
                f"{run_dir}: the run's replies came from {model} served at the {self.shown}{more}, and no model is"
                " named: another model may answer there, and its replies would be mixed with the stored ones; resume"
                f" with the run's --base-url, or name the model the run asks for with {name}"
            )
        return (
            f"{run_dir}: the run's replies came from {model} served at the {self.role} endpoint {', '.join(self.now)},"
            f" which now serves {_names(self.serving)}{more}, and no model is named: its replies would be mixed with"
            f" the stored ones; serve {self.replied!r} there again to resume, or name the model the run asks for with"
            f" {name}"
        )


def _own_urls(store: RunStore) -> dict[str, list[str]]:
    """The URLs ``store``'s run sent each role's calls to that name no model, as its starts checked them
    (:meth:`RunSetup.record_servers`); none in a run of an earlier version."""
    kept = store.get_meta(OWN_URLS)
    return {role: list(urls) for role, urls in kept.items()} if isinstance(kept, dict) else {}


def _names(models: list[str]) -> str:
    return ", ".join(repr(m) for m in models)


def _served_by(settings: Settings, role: str) -> list[str] | None:
    """The URLs whose own model answers ``role``'s calls where no model is named; None where one is (the requests
    name it, and a resume compares it) or no endpoint answers (the local or in-process model, named likewise)."""
    own = settings.roles.get(role)
    if (own.model if own else None) or settings.endpoint.model:
        return None
    urls = (own.base_url if own else None) or settings.endpoint.base_url
    return sorted(urls) if urls else None


def _shown(value: Any) -> str:
    """A requested value as a message shows it: unset where none."""
    return "unset" if value is None else json.dumps(value)


def open_new_run(
    run_dir: Path,
    settings: Settings,
    problems: str | Path,
    *,
    limit: int | None = None,
    own_model: bool = False,
    read: Iterable[Problem] | None = None,
) -> tuple[RunStore, Settings, StoredProblems]:
    """A new run in ``run_dir`` of the problems in a JSONL file or a benchmark name (the first ``limit``): the
    problems are streamed into the store, which records the benchmark name that reports group runs by. ``read``:
    the file's problems, read already (from a pipe, which cannot be read twice)."""
    reader = iter(read) if read is not None else iter_problems(resolve_dataset(Path(problems)))
    todo = islice(reader, limit) if limit else reader
    store, settings, stored = prepare_run(run_dir, settings, todo, resume=False, own_model=own_model)
    store.set_meta("dataset", dataset_name(Path(problems)))
    return store, settings, stored


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run to resume: a store with its setup recorded, or with any call. A store with
    neither is what a new run killed while storing its problems leaves (its own clean-up never ran): no call was
    made from it, and a new run starts over in its place (:func:`prepare_run`)."""
    if not (run_dir / DB_NAME).exists():
        return False
    with RunStore(run_dir, create=False) as store:
        return store.get_meta("settings") is not None or store.call_counts()["calls"] > 0


def check_new_run_dir(run_dir: Path) -> None:
    """:class:`InputError` where a new run cannot be made in ``run_dir``: a file there, or a run it holds already
    (:func:`holds_run`). :func:`prepare_run` checks it again under the run's lock; a command checks it first, before
    an estimate's pilot runs into the directory."""
    check_out_dir(run_dir, "a run is kept in a directory")
    if holds_run(run_dir):
        raise RunExists(run_dir)


class RunExists(InputError):
    """A new run is refused in ``run_dir``: it holds a run already. ``resume``: how its caller continues that run
    (``tmas run --resume`` by default, for tmas run and tmas solve alike; :func:`tmas.api.aresume` in the Python
    API)."""

    def __init__(self, run_dir: Path, resume: str | None = None) -> None:
        resume = resume or f"'tmas run --resume {run_dir}'"
        super().__init__(f"{run_dir}: already holds a run; continue it with {resume} or choose another directory")
        self.run_dir = run_dir


def _remove_store(run_dir: Path) -> None:
    for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"):
        (run_dir / name).unlink(missing_ok=True)


def _no_settings(store: RunStore) -> StoreError:
    """The error of resuming a store without recorded settings (``store`` may be closed: its directory is named)."""
    if not holds_run(store.run_dir):
        return StoreError(
            f"{store.run_dir}: the run was stopped while it stored its problems, before any call: start it again"
            " as a new run into the same directory"
        )
    return StoreError(f"{store.run_dir}: the run has no recorded settings")


def prepare_run(
    run_dir: Path, settings: Settings, problems: Iterable[Problem] | None, *, resume: bool, own_model: bool = False
) -> tuple[RunStore, Settings, StoredProblems]:
    """A run's one preparation, in order: its settings checked (:class:`RunSetup`: the method's parameters, the
    prompt overrides) before a run directory exists; then its store, where a new run records its problems (streamed:
    ``problems`` may be a lazy reader of a file, and a bad line in it leaves no run directory behind) and a resumed
    one reads them back, and either records its setup. The run's lock (:mod:`tmas.store.run_lock`) is taken first and
    held by the store returned until it is closed. :func:`run_problems` then opens the model, once (``own_model``:
    a model of the caller's own, not the embedded one, where the settings name no endpoint)."""
    setup = RunSetup.check(settings, own_model=own_model, resuming=run_dir if resume else None)
    setup.method.check_setup()  # what its parameters name outside the run (MATTRL's pool): readable before any call
    if not own_model:
        check_embedded_model(settings)
    # The run's lock, taken before its store is written at all and held by the store until it is closed: a second
    # process is refused before it records its own setup over the running one's.
    lock = RunLock(run_dir)
    if resume:
        if (run_dir / DB_NAME).is_file():
            lock.acquire()
        try:
            store = RunStore(run_dir, create=False)
        except BaseException:
            lock.release()
            raise
        store.hold(lock)
        if store.get_meta("settings") is None:
            store.close()
            raise _no_settings(store)
        try:
            setup.check_resume(store)
            for name in setup.unrecorded_inputs(store):
                store.record_notice(
                    "inputs_unrecorded",
                    f"{name}: the run recorded no identity of it at its start (an earlier version of tmas), so this"
                    " resume cannot tell whether it changed since: problems finished before keep what they read then",
                )
        except BaseException:
            store.close()
            raise
        # Recorded by run_problems once its own checks pass: a resume refused before any call leaves the run as it was.
        return store, settings, StoredProblems(store)
    if problems is None:
        raise InputError("no problems given")
    check_new_run_dir(run_dir)
    existed = run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Under the run's lock: a store without a setup may be another process's, still storing its problems.
    lock.acquire()
    try:
        check_new_run_dir(run_dir)
        # A new run killed while it stored its problems left its store behind: no call was made from it.
        _remove_store(run_dir)
        store = RunStore(run_dir)
        try:
            if store.add_problems(problems) == 0:
                raise InputError(f"{run_dir}: no problems given (empty problem file?)")
            setup.record(store)
        except BaseException:
            # Nothing was run: leave no half-made run behind, so the same command works once the input is fixed.
            store.close()
            _remove_store(run_dir)
            if not existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
    except BaseException:
        lock.release()
        raise
    store.hold(lock)
    return store, settings, StoredProblems(store)


async def run_problems(
    settings: Settings,
    problems: Iterable[Problem],
    store: RunStore,
    *,
    state: RunState | None = None,
    on_result: Callable[[ProblemResult], None] | None = None,
    keep_results: bool = False,
    model: ChatModel | None = None,
    own_model: bool | None = None,
    scratch: bool = False,
) -> RunSummary:
    """Solve every problem not already finished with the same method parameters, or finished with a failed call;
    results are stored as they come.
    The store holds the run's problems (:func:`prepare_run`); the run's setup is recorded in it
    (:meth:`RunSetup.record`) once the checks before any call pass and a problem is left to solve, so a refused resume
    leaves the run as it was and a finished one is not written to. The model is opened here, through
    :func:`tmas.llm.factory.open_model`: the endpoint of ``settings``, or ``model``, a
    :class:`tmas.llm.model.ChatModel` of the caller's own, replayed from and recorded in the store all the same.
    ``own_model`` False says that ``model`` is the one ``settings`` name, already open (:class:`SeriesModel`): the run
    is then as one that opens it (by default, whether ``model`` is given). ``scratch`` says that the store's directory
    goes when the run ends (a question without a run directory): an embedded server started for the run then logs to
    the cache, where a log that an error names is kept.

    A fixed pool of workers pulls problems from ``problems`` one at a time, so a run of any size holds only the
    problems being solved (at most :func:`problems_in_flight`: what the endpoint serves at once). Results are not
    kept in memory unless ``keep_results`` (e.g. for :func:`tmas.api.solve`); the summary is computed from counters
    and the store. Votes group answers by the grading rules' equivalence where Math-Verify is installed. On a resumed
    run, the problems with finished calls replay them one at a time (:class:`tmas.llm.replay.ReplayTurns`). A problem
    that finished with a call that failed after its retries (a server that failed for a while) is solved again: its
    replied calls replay from the store, and only its failed calls (never replayed) and the calls that depend on
    their replies are sent.
    """
    state = state or RunState()
    own_model = model is not None if own_model is None else own_model
    setup = RunSetup.check(settings, own_model=own_model)
    method = setup.method
    fingerprint = run_fingerprint(method, settings)
    finished = store.settled_problem_ids(fingerprint)
    state.total = len(problems) if isinstance(problems, Sized) else store.problem_count()
    state.iterations = method.params.iterations
    tally = _Tally()
    todo = _pending(problems, finished, state)
    started = time.monotonic()
    turns = ReplayTurns(store.problems_with_calls())
    # Another process running this directory would send its unfinished problems' calls a second time. A store that
    # prepare_run opened holds the lock already.
    # The prompt overrides as the setup's check read them: what the run renders is what it records (setup.record).
    prompts = sources_of(setup.overrides) if settings.prompts_dir else None
    with nullcontext() if store.holds_lock else RunLock(store.run_dir), prompts_from(prompts):
        inputs = pin_inputs(method, store, fingerprint)
        if state.total > len(finished):
            # The overrides this run renders, read once above: a resume's check read them before, and a template
            # edited since would be sent beside what its finished problems were solved with.
            setup.check_prompts(store)
        stats = ClientStats()
        log_dir = None if scratch else store.run_dir
        opened = open_model(settings, store, log_dir=log_dir, stats=stats, on_send=turns.sent, model=model)
        async with (
            opened as llm,
            problem_solver(settings, llm, method, store, state=state, finished=finished) as solver,
        ):
            state.stats = stats
            method.check_model(llm)

            async def one(problem: Problem, lane: Lane) -> None:
                async with turns.turn(problem.problem_id):
                    result = await solver.solve(problem, lane)
                result.fingerprint = fingerprint
                store.save_result(result)
                tally.add(result, keep_results)
                if result.status == "done":
                    state.done += 1
                else:
                    state.failed += 1
                if on_result is not None:
                    on_result(result)

            async def worker(lane: Lane) -> None:
                # The workers share one iterator; next() runs without awaiting, so each problem goes to one worker.
                for problem in todo:
                    await one(problem, lane)

            # The settings as provisioned (a caller's own model runs under the run's: tmas.llm.factory.UnderSettings).
            state.problem_slots = problems_in_flight(llm.settings, own_model=own_model)
            workers = max(1, min(state.problem_slots, state.total - len(finished)))
            try:
                asked: dict[str, list[str]] = {}
                if model is None and state.total > len(finished):
                    # Nothing listening, or a base URL without its /v1: said in seconds, before any call.
                    asked = await check_endpoints(llm.settings, method.traits.roles)
                if not own_model and state.total > len(finished):
                    # A server restarted with another model where the run names none: refused before any call (from
                    # what the check just asked, where it did).
                    await check_served(setup, store, asked)
                    setup.record_servers(store)
                if state.total > len(finished):
                    # What only a reply names (MATTRL's pool, its embedding model): before the first chat call.
                    await method.check_served(llm)
                    setup.record(store, inputs)
                # Each worker is a lane (tmas.llm.lanes): on an endpoint with pin_slots, its calls share one slot.
                await gather_all(worker(Lane(w, workers)) for w in range(workers))
            except EndpointUnreachable as exc:
                raise Unreachable(str(exc), store.run_dir, cause=exc.cause) from None
            except sqlite3.Error as exc:
                raise StoreFailed(str(exc), store.run_dir) from None
    summary = _summary(store, settings, state, tally, stats, time.monotonic() - started)
    summary.problems_with_failed_calls = len(
        store.finished_problem_ids(fingerprint) - store.settled_problem_ids(fingerprint)
    )
    return summary


class SeriesModel:
    """The model of a series of runs (a sweep's points, a pilot's configurations), for :func:`run_problems`: the
    caller's own where one is given; else the in-process model their settings name, loaded at the first run that
    starts and kept open for the rest (loaded again only for other ``hf`` settings), which spares each later run the
    load and keeps it out of their wall times; else none, and each run opens its endpoint."""

    def __init__(self, model: ChatModel | None = None) -> None:
        self.own = model is not None
        self._model = model
        self._loaded: AsyncExitStack | None = None

    async def __aenter__(self) -> SeriesModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._unload()

    async def run(
        self,
        settings: Settings,
        problems: Iterable[Problem],
        store: RunStore,
        *,
        state: RunState | None = None,
        on_result: Callable[[ProblemResult], None] | None = None,
    ) -> RunSummary:
        """:func:`run_problems` of ``settings`` on the series' model."""
        loaded = self._model.settings.hf if self._model is not None else None
        if not self.own and settings.uses_in_process_model and settings.hf != loaded:
            await self._unload()
            from tmas.llm.hf_model import open_hf_model  # torch and transformers only where a model runs in process

            self._loaded = AsyncExitStack()
            self._model = await self._loaded.enter_async_context(open_hf_model(settings))
        model = self._model if self.own or settings.uses_in_process_model else None
        return await run_problems(
            settings, problems, store, state=state, on_result=on_result, model=model, own_model=self.own
        )

    async def _unload(self) -> None:
        loaded = self._loaded
        if loaded is not None:
            self._loaded, self._model = None, None
            await loaded.aclose()


def _pending(problems: Iterable[Problem], finished: Collection[str], state: RunState) -> Iterator[Problem]:
    """The problems not finished yet, one at a time (each finished one counted as skipped as it is passed)."""
    for problem in problems:
        if problem.problem_id in finished:
            state.skipped += 1
        else:
            yield problem


def _summary(
    store: RunStore, settings: Settings, state: RunState, tally: _Tally, stats: ClientStats, wall_s: float
) -> RunSummary:
    """The run's summary: its problems from ``tally`` and ``state``, its calls and tokens from the store (every
    stored call of the method, replayed ones included), what was sent from ``stats``. A judge that graded the run
    stored its calls there too: they are the grading's (``tmas report`` counts them apart), not the method's."""
    counts = store.call_counts(JUDGE_ROLE, other_roles=True)
    causes = store.call_causes(JUDGE_ROLE, other_roles=True)
    by_role = store.replies_by_role(JUDGE_ROLE, other_roles=True)
    return RunSummary(
        run_dir=store.run_dir,
        problems=state.total,
        done=tally.done + state.skipped,
        failed=tally.failed,
        skipped=state.skipped,
        calls=stats.calls,
        replayed_calls=stats.replayed,
        failed_calls=counts["failed"],
        prompt_tokens=counts["prompt_tokens"],
        completion_tokens=counts["completion_tokens"],
        reasoning_tokens=counts["reasoning_tokens"],
        budget_count=settings.budget.count,
        wall_s=wall_s,
        results=tally.results,
        anomalies=dict(sorted(tally.anomalies.items())),
        truncated_calls=counts["truncated"],
        truncated_by_role={role: cut for role, (_, cut) in by_role.items() if cut},
        warnings=truncation_warnings(by_role),
        failed_calls_by_cause=causes["failed"],
        asked_again_calls=counts["asked_again"],
        asked_again_by_cause=causes["asked_again"],
        retries_by_cause=causes["retried"],
        cached_prompt_tokens=counts["cached_prompt_tokens"],
        downgrades=store.downgrade_messages(),
        notices=list(store.notices().values()),
        failures=dict(sorted(tally.failures.items(), key=lambda item: -item[1])),
    )


def check_embedded_model(settings: Settings) -> None:
    """A model tmas runs itself (the embedded server's, or one in process) that names neither a known model nor a
    file (or checkpoint folder with its tokenizer) there is a one-line error before a run directory is made."""
    if settings.uses_local_model:
        check_model_named(settings.local.model, "local.model", "--local-model")
    elif settings.uses_in_process_model:
        check_model_named(str(settings.hf.model), "hf.model", "--hf-model", folders=True)
        folder = Path(str(settings.hf.model)).expanduser()
        if folder.is_dir():
            try:
                check_folder(folder)
            except LocalModelError as exc:
                raise ConfigError(f"hf.model (--hf-model) {exc}") from None


def check_before_estimate(
    settings: Settings, origin: Callable[[str], str] | None = None, roles: Iterable[str] | None = None
) -> None:
    """What every command that sends calls checks of its settings before its cost estimate, so that an estimate (a
    dry run's success, the gate's question) is never said of calls that could not start: a model tmas would run
    itself that names nothing there (:func:`check_embedded_model`), an API key variable (``api_key_env``) unset or
    empty for a role the method calls (``roles``: those, else the method's own; :func:`tmas.llm.routes.key_problem`,
    ``origin`` saying where a key was given), and a ``prompts_dir`` (``--prompts-dir``) that is no folder or holds an
    override that does not render (:func:`tmas.agents.overrides.check_overrides`) or that replaces a template grading
    renders (:func:`tmas.agents.overrides.check_not_grading`)."""
    check_embedded_model(settings)
    if not settings.uses_in_process_model:
        check_api_keys(settings, run_method(settings).traits.roles if roles is None else roles, origin)
    if settings.prompts_dir:
        check_not_grading(check_overrides(settings.prompts_dir))


def run_method(settings: Settings, *, own_model: bool = False) -> Method[Any]:
    """The method a run of ``settings`` solves with: the embedded model's defaults under its parameters when the run
    is on an embedded model (the local server's, or one run in process by name; no model of the caller's own:
    ``own_model``)."""
    embedded = on_embedded_model(settings) and not own_model
    return create_method(settings.method.name, settings.method.params, embedded=embedded)


@dataclass
class ProblemSolver:
    """Solves one problem after another as a run does (:func:`problem_solver` makes it): each in a session with the
    run's seed, budget and shared token bank, the progress display's live state, and the answer equivalence votes
    group by; what a problem left of its pooled token share goes back to the bank when it is done."""

    settings: Settings
    llm: ChatModel
    store: RunStore | None
    method: Method[Any]
    state: RunState
    equivalence: EquivalenceCheck | None
    bank: TokenBank | None

    async def solve(self, problem: Problem, lane: Lane | None = None) -> ProblemResult:
        """``problem`` solved in a session of its own (``lane``: the run's worker solving it, in every call's key)."""
        settings, state = self.settings, self.state
        session = ProblemSession(
            problem,
            self.llm,
            self.store,
            seed=settings.seed,
            active=state.active,
            budget=settings.budget,
            equivalence=self.equivalence,
            on_iteration=state.iteration_started,
            bank=self.bank,
            params=self.method.params,
            lane=lane,
        )
        try:
            result = await solve_one(self.method, session)
        finally:
            state.active.pop(problem.problem_id, None)
        if self.bank is not None and settings.budget.tokens is not None:
            self.bank.deposit(settings.budget.tokens + session.drawn - session.spent_tokens)
        return result


@asynccontextmanager
async def problem_solver(
    settings: Settings,
    llm: ChatModel,
    method: Method[Any],
    store: RunStore | None = None,
    *,
    state: RunState | None = None,
    finished: Collection[str] = (),
) -> AsyncIterator[ProblemSolver]:
    """The solver of a run of ``method`` (:func:`run_method`) on ``llm``: :func:`run_problems` solves each problem
    through it, and a caller that solves problems without a run directory (a test in process) solves them the same
    way. A pooled budget's bank holds what the ``finished`` problems of ``store`` left. Votes group answers by the
    grading rules' equivalence where Math-Verify is installed; its worker pool stops on leaving."""
    bank = _token_bank(store, settings.budget, finished)
    # The grading rules group the votes' answers where Math-Verify is installed (the eval extra); imported here, as
    # the local server is, so a run pays for the evaluation package only when it starts.
    from tmas.answer_rules import RuleEquivalence, math_verify_installed

    equivalence = RuleEquivalence() if math_verify_installed() else None
    try:
        yield ProblemSolver(settings, llm, store, method, state or RunState(), equivalence, bank)
    finally:
        if equivalence is not None:
            await equivalence.aclose()


# Distinct reasons for failed problems a run summary keeps.
MAX_FAILURE_REASONS = 20


@dataclass
class _Tally:
    """What the summary needs of the results, accumulated as they come instead of keeping them all."""

    done: int = 0
    failed: int = 0
    anomalies: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    results: list[ProblemResult] = field(default_factory=list)

    def add(self, result: ProblemResult, keep: bool) -> None:
        if result.status == "done":
            self.done += 1
        else:
            self.failed += 1
            why = (result.error or "no answer").splitlines()[0]
            # A few distinct reasons say why; a run whose every problem failed differently need not keep them all.
            if why in self.failures or len(self.failures) < MAX_FAILURE_REASONS:
                self.failures[why] = self.failures.get(why, 0) + 1
        for kind, count in result.counters.items():
            self.anomalies[kind] = self.anomalies.get(kind, 0) + count
        if keep:
            self.results.append(result)


def _token_bank(store: RunStore | None, budget: Budget, finished: Collection[str]) -> TokenBank | None:
    """A pooled token budget's bank (None without one), holding what the problems finished before (a resumed run)
    left of the pool (:func:`pooled_left`)."""
    if not budget.pool or budget.tokens is None:
        return None
    return TokenBank(pooled_left(store, budget, finished))


def pooled_left(store: RunStore | None, budget: Budget, finished: Collection[str]) -> int:
    """What the ``finished`` problems of ``store`` left of a pooled token budget (0 without one): each one's share
    less what it spent, what a resumed run's bank starts with for the problems it solves. A problem's draws came out
    of the bank before it finished and went back with what it left of them, so they count for nothing here."""
    if not budget.pool or budget.tokens is None or store is None or not finished:
        return 0
    return sum(budget.tokens - budget.spent(r.usage) for r in store.results() if r.problem_id in finished)


def budget_result(method: str, session: ProblemSession, detail: str) -> ProblemResult:
    """The result of a problem stopped by its budget: the iterations finished so far, the last one's answer, and the
    text of the candidate that answer is (an earlier iteration's where the answer fell back to it: the fallback too,
    as a result of a method that ran to its end says it)."""
    last = session.records[-1] if session.records else None
    chosen = _selected_candidate(session.records)
    result = session.result(method, answer=last.selected if last else None, text=chosen.text if chosen else "")
    if last is not None:
        result.fallback = FallbackState.model_validate(last.state).answer_fallback
    session.budget_stopped(result, detail)
    if last is None:
        result.status, result.error = "failed", f"{detail}, before any iteration finished"
    return result


def _selected_candidate(records: list[IterationRecord]) -> Candidate | None:
    """The candidate the last of ``records`` answers with: the one its selection names (an earlier record's where the
    answer fell back to it; a proof, which has no answer), else, where the method set the answer alone, the first of
    the record's candidates with that answer; None where the answer is no candidate's (MATTRL's decision)."""
    if not records:
        return None
    last, chosen = records[-1], records[-1].selection
    if chosen is None:
        answered = (c for c in last.candidates if last.selected is not None and c.answer == last.selected)
        return next(answered, None)
    written = next((r.candidates for r in records if r.iteration == chosen.iteration), [])
    return next((c for c in written if c.index == chosen.candidate), None)


async def solve_one(method: Method[Any], session: ProblemSession) -> ProblemResult:
    """``method`` on the session's problem as a run solves it: its parameters' notices raised, a spent budget
    answered from the iterations so far, a failure kept as the problem's result."""
    for kind, line in method.params.notices().items():
        session.notice(kind, line)
    try:
        return await method.solve(session)
    except (EndpointUnreachable, asyncio.CancelledError, sqlite3.Error):
        # A store that cannot be written is no failure of the problem: the run stops (run_problems).
        raise
    except BudgetExhausted as exc:
        # The method let the stop through: keep its finished iterations, answer from the last one.
        return budget_result(method.name, session, exc.detail)
    except Exception as exc:  # a method bug must cost one problem, not the run
        result = session.result(method.name, answer=None, text="")
        # tmas's own errors are written for the user (a stored record that cannot be read says which and why);
        # another exception is a bug, its class name part of what it says.
        said = str(exc) if isinstance(exc, TmasError) else f"{type(exc).__name__}: {exc}"
        result.status, result.error = "failed", said
        return result
