"""The proxy's runs: each request is a run directory under the serve directory, solved by one asyncio task.

A request whose question was already asked and left unfinished (the server crashed, or the client went away) is
resumed from its run, so every finished upstream call is replayed instead of sent again. So is a request whose run
ended with a reply no client has had (:data:`PENDING`, kept across restarts), or whose method failed on calls that
failed after their retries (only those are asked again). Several clients may follow one run; when the last one
disconnects, the run is cancelled (its upstream calls with it) and stays resumable. A new run needs one of the
problem slots; past them, its request waits its turn (:mod:`tmas.serve.admission`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tmas.config import Settings
from tmas.errors import ConfigError, InputError, TmasError
from tmas.llm.failures import lasting, refuses_request
from tmas.llm.model import ChatModel
from tmas.llm.routes import key_problem
from tmas.llm.sampling import with_sampling
from tmas.llm.types import Completion
from tmas.methods import METHODS, check_given_params, create_method, question_params
from tmas.methods.base import ProblemResult
from tmas.planning.estimate import QUESTION_CALLS
from tmas.problems import Problem
from tmas.runner import Unreachable, run_problems
from tmas.serve.admission import Admission
from tmas.serve.api_errors import ApiError
from tmas.serve.client_sampling import ClientSampling, request_sampling
from tmas.serve.cost_gate import check_request_cost
from tmas.serve.observed_store import ObservedStore, Progress
from tmas.serve.protocol import ChatBody
from tmas.store.run_store import DB_NAME, RunStore, StoreError

log = logging.getLogger("tmas.serve")

# Meta key of a served run: what is needed to resume it (the request, never its headers).
REQUEST_META = "serve_request"
# A file beside a served run's store while no client has had the reply of its run: made as the run starts solving,
# removed once a client got its reply. A restart finds a run that ended with it still there (finished with nobody
# asking, or its client gone before the reply) and keeps that reply for the first request for it.
PENDING = "reply-pending"


@dataclass
class Job:
    """One request's run in progress, and the clients following it."""

    run_id: str
    run_dir: Path
    fingerprint: str
    seed: int
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    task: asyncio.Task[ProblemResult] | None = None
    # Whether a request has this run's reply coming: False for an unfinished run a restarted server resumed with
    # nobody asking, until the first request for it (with a seed or without) joins it.
    claimed: bool = True
    # Its last client went away and it is being cancelled: the same request resumes it once it has ended.
    cancelling: bool = False
    # The task of the cancelled run this one resumes, waited for before this one starts.
    before: asyncio.Task[ProblemResult] | None = None
    events: list[Progress] = field(default_factory=list)
    # The calls its ended run was left with failed (never asked again), by cause (tmas.llm.failures): how a run whose
    # method failed is answered, and whether the same request resumes it.
    failed: dict[str, int] = field(default_factory=dict)
    _followers: list[asyncio.Queue[Progress | None]] = field(default_factory=list)

    def publish(self, event: Progress) -> None:
        self.events.append(event)
        for queue in self._followers:
            queue.put_nowait(event)

    def follow(self) -> asyncio.Queue[Progress | None]:
        """A queue of this run's progress (what happened so far first), ``None`` once the run has ended."""
        queue: asyncio.Queue[Progress | None] = asyncio.Queue()
        for event in self.events:
            queue.put_nowait(event)
        if self.task is not None and self.task.done():
            queue.put_nowait(None)
        self._followers.append(queue)
        return queue

    def unfollow(self, queue: asyncio.Queue[Progress | None], *, disconnected: bool) -> None:
        """A client stopped following; the last one to go away before the end cancels the run."""
        if queue in self._followers:
            self._followers.remove(queue)
        if disconnected and not self._followers and self.task is not None and not self.task.done():
            self.cancelling = True
            self.task.cancel()

    def ended(self) -> None:
        for queue in self._followers:
            queue.put_nowait(None)

    def handing(self) -> bool:
        """Whether this ended run's reply is on its way to a client: one that followed it to the end has neither had
        it in full nor gone away (a slow reader keeps it so for as long as it reads)."""
        return self.task is not None and self.task.done() and bool(self._followers)

    def outcome(self) -> ProblemResult:
        """The finished run's result; an :class:`ApiError` when the run failed."""
        if self.task is None or not self.task.done() or self.task.cancelled():
            raise ApiError(500, "the request's run was cancelled; send it again to resume it", "cancelled")
        exc = self.task.exception()
        if isinstance(exc, ConfigError) or (isinstance(exc, Unreachable) and lasting(exc.cause)):
            # A handshake refused, a model the upstream does not serve: the same request fails the same way.
            raise ApiError(424, f"upstream: {for_client(str(exc))}; {UNUSABLE}", "upstream_unusable")
        if isinstance(exc, TmasError):
            reason = for_client(str(exc))
            raise ApiError(502, f"upstream: {reason}; send the request again to resume its run", "upstream_error")
        if exc is not None:
            raise ApiError(500, f"the run failed: {type(exc).__name__}", "server_error")
        result = self.task.result()
        if result.status != "done":
            error = result.error or "no answer"
            if self.failed and all(refuses_request(cause) for cause in self.failed):
                # The upstream refused what the request asks (a prompt past its context window): a request sent
                # again is refused again, so no client should retry it as it retries a 502.
                raise ApiError(400, f"the upstream refused the request: {for_client(error)}", "upstream_refused")
            if self.failed and all(lasting(cause) or refuses_request(cause) for cause in self.failed):
                # The upstream refuses every call so (a key refused, a model it does not serve): the operator's to fix.
                raise ApiError(424, f"the method failed: {for_client(error)}; {UNUSABLE}", "upstream_unusable")
            again = "; send the request again to resume its run" if resumable(result, self.failed) else ""
            raise ApiError(502, f"the method failed: {for_client(error)}{again}", "upstream_error")
        return result


def resumable(result: ProblemResult, failed: dict[str, int]) -> bool:
    """Whether a run that ended with ``result``, its calls left ``failed`` by cause, is resumed by the same request
    sent again: its method failed with calls that failed after their retries (an upstream that failed for a while),
    so the retry replays the answered calls and asks only the failed ones (and what waits on them), as ``tmas run
    --resume`` does. A method that failed on what the upstream answered would replay into the same failure, and a
    request whose every failed call was refused for what it asks is refused again: the same request is then a new
    run."""
    return result.status != "done" and bool(failed) and not all(refuses_request(cause) for cause in failed)


# What a client is told of an upstream no request can be served by until the server's operator fixes it: a retry
# meets the same failure, so it is answered 424 (Failed Dependency), which clients do not retry as they retry a 5xx.
UNUSABLE = (
    "the upstream cannot serve this server's requests until the server's operator fixes it (its log says what"
    " failed); sent again before that, the request fails the same way"
)
# What a client is told of a role without an API key (ServedRuns._check_keys).
MISSING_KEY = "sent again before the server's operator sets it, the request fails the same way"
_URL = re.compile(r"https?://[^\s;,'\"()]*[^\s;,'\"():.]")


def for_client(message: str) -> str:
    """A failure's message as an API client gets it: without the upstream's address and the advice to the server's
    operator (a command, a flag), both in the server's log."""
    return _URL.sub("the upstream", message.split("; ")[0])


@dataclass
class Waiting:
    """A request waiting in the queue for a problem slot (``turn`` is done once it holds one)."""

    body: ChatBody
    method: str
    upstream: str
    params: dict[str, Any]
    fingerprint: str  # the request's own (ChatBody.fingerprint); its run's key is chosen once it has its turn
    turn: asyncio.Future[None]


class ServedRuns:
    """Every run of the proxy: the active ones (at most ``max_problems``), the requests waiting for a slot (at most
    ``max_queue``), and the unfinished runs to resume."""

    def __init__(
        self,
        serve_dir: Path,
        settings: Settings,
        *,
        embedded: bool,
        model: ChatModel | None = None,
        max_problems: int,
        max_queue: int,
        on_call: Callable[[Completion], None] | None = None,
        client_sampling: ClientSampling = "defaults",
        max_request_calls: int = QUESTION_CALLS,
    ) -> None:
        self.serve_dir = serve_dir
        # The most upstream calls one request's run may make (tmas.serve.cost_gate).
        self.max_request_calls = max_request_calls
        # What a request's sampling fields mean for its run's calls (tmas.serve.client_sampling).
        self.client_sampling = client_sampling
        # Told of every upstream call a run makes (the metrics).
        self.on_call = on_call
        self.settings = settings
        # The upstream is an embedded model: methods get its small defaults, as on `tmas run`.
        self.embedded = embedded
        # The model run in process that answers every run's calls (loaded once); None: the runs go to the endpoint.
        self.model = model
        self.admission = Admission(max_problems, max_queue)
        self.active: dict[str, Job] = {}
        # Request fingerprint -> the run directory of a run of that request whose reply no client has had: an
        # unfinished one, or one that ended with nobody to take its reply (its reply goes to the first request for
        # it, replayed from its store), or one whose method failed on failed calls (a retry resumes it).
        self.unfinished: dict[str, Path] = {}
        # Ended runs whose reply was on its way to a client when last looked at (Job.handing): no twin's to take.
        self._handing: list[Job] = []
        # Stores of ended runs being closed (a WAL checkpoint): after the reply, not before it.
        self._closing: set[asyncio.Task[None]] = set()
        # Runs found ended with a reply no client has had: kept for the first request for each (said at start).
        self.kept_replies: list[Path] = []
        serve_dir.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        for run_dir in sorted(p for p in self.serve_dir.iterdir() if (p / DB_NAME).is_file()):
            try:
                with RunStore(run_dir, read_only=True) as store:
                    request = store.get_meta(REQUEST_META)
                    finished = bool(store.results())
            except StoreError:
                continue  # not a run this proxy can resume: leave it alone
            # A finished run without the marker had its reply taken (or was made before runs kept one): done with.
            kept = not finished or (run_dir / PENDING).is_file()
            if isinstance(request, dict) and isinstance(request.get("fingerprint"), str) and kept:
                self.unfinished[request["fingerprint"]] = run_dir
                if finished:
                    self.kept_replies.append(run_dir)

    def enter(self, body: ChatBody, method: str, upstream: str) -> Job | Waiting:
        """The job answering ``body`` (the same request's active run, or its run started in a free slot), or its
        place in the queue. A bad parameter is a 400 and a full queue a 429, both before any waiting."""
        fingerprint = body.fingerprint()
        job = self._joined(body, fingerprint)
        if job is not None:
            return job
        stored = self._stored(body, fingerprint)
        # Checked of a request given now: a stored request made before a check (the retry of its unfinished run, or
        # of one whose reply no client has had) resumes as it was asked. A field refused since was never part of a
        # request's fingerprint (it was ignored), so its run is the run of the same request without it.
        if stored is None and body.refusal is not None:
            raise body.refusal
        try:
            if stored is None:
                check_given_params(method, body.tmas, lambda param: f"tmas.{param}", InputError)
        except InputError as exc:
            raise ApiError(400, str(exc), "invalid_value", "tmas") from None
        try:
            # A stored reply is had from its store, without a call: the checks of a run to come (the cost cap, the
            # folders a method reads, as the server is configured now) are not its.
            params = self._params(method, body, checked=stored is None or not self._kept_reply(stored))
        except ApiError as exc:
            if stored is None:
                raise
            why = f"{exc.message}; its run {stored.name}, stored unfinished, cannot be resumed as this server is now"
            raise ApiError(exc.status, f"{why} configured", exc.code, exc.param) from None
        turn = self.admission.enter()
        if turn is not None:
            return Waiting(body, method, upstream, params, fingerprint, turn)
        return self._open_held(body, method, upstream, params, self._own_key(body, fingerprint))

    async def admit(self, waiting: Waiting) -> Job:
        """Wait for ``waiting``'s turn, then its job; cancelled (the client left), it leaves the queue instead."""
        try:
            await waiting.turn
        except BaseException:
            self.admission.leave(waiting.turn)
            raise
        job = self._joined(waiting.body, waiting.fingerprint)
        if job is not None:
            # The same request arrived again meanwhile and got its run going: follow that, and pass the slot on.
            self.admission.release()
            return job
        fingerprint = self._own_key(waiting.body, waiting.fingerprint)
        return self._open_held(waiting.body, waiting.method, waiting.upstream, waiting.params, fingerprint)

    def _joined(self, body: ChatBody, fingerprint: str) -> Job | None:
        """The active run a request joins, whose reply is its reply: the same seeded request running already (a
        retry, or lm-eval's repeats), or an unfinished run of the same request that a restart resumed with nobody
        asking (the retry it was resumed for, seeded or not: for a request without a seed, that of any of its twins).
        A request without a seed is otherwise a sample of its own, as at OpenAI."""
        if body.seed is not None:
            job = self.active.get(fingerprint)
        else:
            job = next((j for key, j in self.active.items() if twin_of(key, fingerprint) and not j.claimed), None)
        if job is None or job.cancelling:
            return None  # a run being cancelled has no reply to give: its request resumes it once it has ended
        job.claimed = True
        return job

    def _own_key(self, body: ChatBody, fingerprint: str) -> str:
        """The key a request's run is kept under (and by which a retry finds it): its fingerprint, or, for a request
        without a seed whose twin is running or being sent its reply, one of its own (so its twin's run is not taken
        over). A request without a seed takes over the unfinished run of an earlier twin that went away (or whose run
        is being cancelled), under that run's key."""
        if body.seed is None:
            left = (key for key in self.unfinished if twin_of(key, fingerprint) and not self._taken(key))
            key = next(left, None)
            if key is not None:
                return key
            if self._taken(fingerprint):
                return f"{fingerprint}-{secrets.token_hex(4)}"
        if self._running(fingerprint):
            return f"{fingerprint}-{secrets.token_hex(4)}"
        return fingerprint

    def _running(self, key: str) -> bool:
        """Whether the run kept under ``key`` is active and not being cancelled (one being cancelled is resumed)."""
        job = self.active.get(key)
        return job is not None and not job.cancelling

    def _taken(self, key: str) -> bool:
        """Whether the run kept under ``key`` is some client's: running, or ended with its reply on its way to a
        client (a request without a seed neither takes it over nor gets that reply: it is a sample of its own)."""
        self._handing = [job for job in self._handing if job.handing()]
        return self._running(key) or any(job.fingerprint == key for job in self._handing)

    def _open_held(self, body: ChatBody, method: str, upstream: str, params: dict[str, Any], fingerprint: str) -> Job:
        """Start ``body``'s run in the slot the caller holds (given back if the run cannot start)."""
        try:
            return self._open(body, method, upstream, params, fingerprint)
        except BaseException:
            self.admission.release()
            raise

    def _open(self, body: ChatBody, method: str, upstream: str, params: dict[str, Any], fingerprint: str) -> Job:
        """Its unfinished run resumed, or a new run."""
        run_dir = self.unfinished.get(fingerprint)
        before = self.active.get(fingerprint)  # its run, being cancelled: resumed once it has let go
        if run_dir is not None and before is not None:
            return self._start(run_dir, fingerprint, body, method, upstream, params, before.seed, True, before)
        if run_dir is not None:
            seed = _stored_seed(run_dir)
            if seed is not None:
                return self._start(run_dir, fingerprint, body, method, upstream, params, seed, resume=True)
            # Cut off before its request was stored (its client left as its store was made): run in its directory.
            seed = body.seed if body.seed is not None else secrets.randbits(31)
            return self._start(run_dir, fingerprint, body, method, upstream, params, seed, resume=False)
        run_id = f"chatcmpl-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        return self._start(self.serve_dir / run_id, fingerprint, body, method, upstream, params, seed, resume=False)

    def resume_all(self) -> list[Job]:
        """Start the unfinished runs found on disk (as many as the problem limit allows); a run that ended already
        waits for its request (its reply is in its store, or its retry asks its failed calls again)."""
        jobs = []
        for fingerprint, run_dir in list(self.unfinished.items()):
            if fingerprint in self.active:
                continue
            with RunStore(run_dir, read_only=True) as store:
                request = store.get_meta(REQUEST_META)
                ended = bool(store.results())
            if ended:
                continue
            try:
                body = ChatBody.model_validate(request["body"])
                method, upstream, seed = str(request["method"]), str(request["upstream"]), int(request["seed"])
                params = self._params(method, body)
            except (KeyError, TypeError, ValueError, ApiError) as exc:
                log.warning("%s: cannot resume this request (%s); left as it is", run_dir, exc)
                continue
            if not self.admission.try_hold():
                break
            job = self._start(run_dir, fingerprint, body, method, upstream, params, seed, resume=True)
            job.claimed = False
            jobs.append(job)
        return jobs

    def _stored(self, body: ChatBody, fingerprint: str) -> Path | None:
        """The stored run a request resumes or has the reply of (as :meth:`_own_key` finds it): its own, or, without a
        seed, one of a twin's that no client has (a twin's run on its way to its client is not its)."""
        if body.seed is not None:
            return self.unfinished.get(fingerprint)
        left = (
            run_dir for key, run_dir in self.unfinished.items() if twin_of(key, fingerprint) and not self._taken(key)
        )
        return next(left, None)

    def _kept_reply(self, run_dir: Path) -> bool:
        """Whether the stored run in ``run_dir`` ended with its reply (a retry has it from the store, without a call);
        an active run (its store perhaps still being made) has not ended."""
        if any(job.run_dir == run_dir for job in self.active.values()) or not (run_dir / DB_NAME).is_file():
            return False
        with RunStore(run_dir, read_only=True) as store:
            return any(result.status == "done" for result in store.results())

    def _params(self, method: str, body: ChatBody, *, checked: bool = True) -> dict[str, Any]:
        """The parameters ``body``'s run goes with; ``checked``: a run to come, refused (a 400) where it could not run
        as the server is configured (for a stored reply, only the parameters)."""
        named = sorted(SERVER_PATHS.intersection(body.tmas))
        if named:
            # A folder on the server's disk is the server's to choose: a client naming one would have it read
            # whatever folder the client picked.
            message = f"tmas.{named[0]}: a folder on the server, set by its configuration, not by a request"
            raise ApiError(400, message, "invalid_value", "tmas")
        params = served_params(self.settings, method, body.tmas, embedded=self.embedded)
        if not checked:
            return params
        try:
            # Bad parameters, a run past the cost cap and a folder they name that cannot be read (MATTRL's pool) are
            # the client's error, found before anything runs.
            check_request_cost(method, params, self.settings, self.max_request_calls)
            built = create_method(method, params, embedded=self.embedded)
            built.check_setup()
        except (ConfigError, InputError) as exc:
            raise ApiError(400, str(exc), "invalid_value", "tmas") from None
        self._check_keys(method, built.traits.roles)
        return params

    def _check_keys(self, method: str, roles: Iterable[str]) -> None:
        """A 424 where a role ``method`` calls has no API key to send (its ``api_key_env`` names a variable unset or
        empty): the server's own configuration, which no request can change; `tmas serve` checks at start only the
        configured method's roles."""
        if self.settings.uses_in_process_model:
            return  # a model run in process takes no key
        for role in roles:
            problem = key_problem(self.settings, role, lambda _: "the server's settings")
            if problem is not None:
                log.warning("a request for method %s refused: role %s has no API key (%s)", method, role, problem)
                message = f"role {role!r} of method {method!r} has no API key on this server ({problem}); {MISSING_KEY}"
                raise ApiError(424, message, "upstream_unusable", "model")

    def _start(
        self,
        run_dir: Path,
        fingerprint: str,
        body: ChatBody,
        method: str,
        upstream: str,
        params: dict[str, Any],
        seed: int,
        resume: bool,
        before: Job | None = None,
    ) -> Job:
        data = self.settings.model_dump(mode="json")
        data["endpoint"]["model"] = upstream
        data["method"] = {"name": method, "params": params}
        data["seed"] = seed
        # The request's own sampling is set by its sender, as a flag is: a method's preset yields to it.
        settings = Settings.model_validate(data)
        laid = request_sampling(body, self.client_sampling, settings.sampling)
        settings = with_sampling(settings, "flags", laid)
        job = Job(run_id=run_dir.name, run_dir=run_dir, fingerprint=fingerprint, seed=seed)
        job.before = before.task if before is not None else None
        request: dict[str, Any] = {"fingerprint": fingerprint, "body": body.model_dump(mode="json")}
        request |= {"method": method, "upstream": upstream, "seed": seed}
        job.task = asyncio.create_task(self._solve(job, settings, body, request, resume))
        job.task.add_done_callback(lambda task: self._finished(job, task))
        self.active[fingerprint] = job
        self.unfinished[fingerprint] = run_dir
        return job

    async def _solve(
        self, job: Job, settings: Settings, body: ChatBody, request: dict[str, Any], resume: bool
    ) -> ProblemResult:
        if job.before is not None:
            # The run's cancelled task lets go of its store and its lock as it ends; it may have ended before its
            # request was stored, when this one stores it. Cancelled meanwhile (its client left too), this one ends
            # only after it, so that a request sent then finds the run let go of (or this one, still ending, to wait
            # for) rather than resuming it beside the cancelled task that still holds it.
            try:
                await asyncio.wait({job.before})
            except asyncio.CancelledError:
                await _unstoppable(_ended(job.before))
                raise
        store = await _open_store(job, create=not resume or job.before is not None, on_call=self.on_call)
        try:
            if not store.problems():
                question, context = body.question()
                problem_id = problem_id_of(body, job.fingerprint, job.run_id)
                problem = Problem(problem_id=problem_id, question=question, metadata={"context": context})
                store.add_problems([problem])
                store.set_meta(REQUEST_META, request)
            problems = store.problems()
            kept = store.result(problems[0].problem_id) if resume else None
            if kept is not None and kept.status == "done":
                # A run that ended with a reply no client has had: that reply, from its store, as it ended.
                return kept
            (job.run_dir / PENDING).touch()
            # An in-process model is the settings' own, opened once here: each run is as one that opens it.
            await run_problems(settings, problems, store, model=self.model, own_model=False)
            result = store.result(problems[0].problem_id)
            job.failed = store.call_causes()["failed"]
        finally:
            self._close_later(store)
        if result is None:
            raise StoreError(f"{job.run_dir}: the run ended without a result")
        return result

    def _close_later(self, store: ObservedStore) -> None:
        """Close ``store`` on a thread once its run has ended: closing checkpoints the WAL (disk waits) and the
        reply need not wait for it, as everything is committed already."""
        closing = asyncio.create_task(asyncio.to_thread(store.close))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def _finished(self, job: Job, task: asyncio.Task[ProblemResult]) -> None:
        # The run stays among the unfinished ones until a client has had its reply (replied); a request that came
        # while it was being cancelled has its key already.
        if self.active.get(job.fingerprint) is job:
            del self.active[job.fingerprint]
        self.admission.release(time.monotonic() - job.started)
        log.info("request %s: %s", job.run_id, _ending(task, time.monotonic() - job.started))
        job.ended()
        if job.handing():
            self._handing.append(job)

    async def replied(self, job: Job) -> None:
        """A client has had the reply of ``job``'s ended run: unless a retry resumes it (its method failed on failed
        calls), the run is done with, and the same request is a new run, after a restart too."""
        task = job.task
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return  # no result to have: the run stays resumable
        if resumable(task.result(), job.failed):
            return
        (job.run_dir / PENDING).unlink(missing_ok=True)
        if self.unfinished.get(job.fingerprint) == job.run_dir:
            del self.unfinished[job.fingerprint]

    async def close(self) -> None:
        """Cancel the runs in progress (they stay resumable) and wait for them to let go of their stores; the
        requests still waiting get no slot."""
        self.admission.close()
        jobs = list(self.active.values())
        tasks = [task for job in jobs for task in (job.before, job.task) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await asyncio.gather(*self._closing)


# Method parameters that name a folder on the server's disk (MATTRL's experience pool): configured, never per request.
SERVER_PATHS = frozenset({"pool"})


def served_params(settings: Settings, method: str, given: dict[str, Any], *, embedded: bool) -> dict[str, Any]:
    """The parameters a request for ``method`` runs with: the server's configured ones (for its configured method)
    under the request's own ``given``; for one question, the embedded model's small defaults there, on a user's
    endpoint the method's question defaults."""
    params = {**settings.method.params, **given} if method == settings.method.name else given
    return {**METHODS[method].embedded_defaults, **params} if embedded else question_params(method, params)


def check_served_methods(settings: Settings, *, embedded: bool) -> None:
    """Refuse to serve where a method, as a request that gives no parameters runs it, names something outside its
    run that cannot be read (the configured MATTRL's experience pool, or the ``pool`` extra missing): one line at
    start, not an error of every request."""
    for method in sorted(METHODS):
        params = served_params(settings, method, {}, embedded=embedded)
        try:
            create_method(method, params, embedded=embedded).check_setup()
        except InputError as exc:
            raise InputError(f"cannot serve method {method!r} as configured: {exc}") from None


def _stored_seed(run_dir: Path) -> int | None:
    """The seed of the served run in ``run_dir``; None for one cut off before its request was stored."""
    with RunStore(run_dir, read_only=True) as store:
        request = store.get_meta(REQUEST_META)
    return int(request["seed"]) if isinstance(request, dict) else None


def twin_of(key: str, fingerprint: str) -> bool:
    """Whether the run kept under ``key`` is one of the request with ``fingerprint``: its own key, or one of its
    own that a twin without a seed got while another twin was running (kept in its store, found after a restart)."""
    return key == fingerprint or key.startswith(f"{fingerprint}-")


def problem_id_of(body: ChatBody, fingerprint: str, run_id: str) -> str:
    """The id of a request's problem, from which (with the run seed) each of its calls' seeds is derived. A request
    with a ``seed`` gets one fixed by the request itself, so the same request with the same seed asks the very same
    calls again, run after run; one without gets its run's id (its run seed is drawn fresh anyway)."""
    return f"request-{fingerprint}" if body.seed is not None else run_id


def _ending(task: asyncio.Task[ProblemResult], took_s: float) -> str:
    """How a request's run ended, for the log line every run (a resumed one too) ends with."""
    if task.cancelled():
        return f"cancelled after {took_s:.1f} s; its run stays resumable"
    exc = task.exception()
    if exc is not None:
        return f"failed after {took_s:.1f} s: {str(exc).split('; finished work is kept')[0]}; its run stays resumable"
    result = task.result()
    ended = "done" if result.status == "done" else f"failed ({result.error or 'no answer'})"
    return f"{ended} in {took_s:.1f} s: answer {result.answer!r}, {result.calls} calls"


async def _open_store(job: Job, *, create: bool, on_call: Callable[[Completion], None] | None) -> ObservedStore:
    """``job``'s store, opened on a thread: a new store's schema and WAL set-up wait on the disk, and the other
    requests need not wait with them."""
    opening = asyncio.ensure_future(
        asyncio.to_thread(ObservedStore, job.run_dir, job.publish, create=create, on_call=on_call)
    )
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        # Cancelled while it opens (its client left): the run ends only once its thread has made the store and it is
        # closed again, so that a retry meanwhile neither finds the store half made nor makes it from a second thread.
        await _unstoppable(_close_once_open(opening))
        raise


async def _close_once_open(opening: asyncio.Future[ObservedStore]) -> None:
    try:
        store = await opening
    except Exception:
        return  # it failed to open: nothing to close
    await asyncio.to_thread(store.close)


async def _ended(task: asyncio.Task[ProblemResult]) -> None:
    await asyncio.wait({task})


async def _unstoppable(step: Coroutine[Any, Any, None]) -> None:
    """Run ``step`` to its end, however often the task awaiting it is cancelled meanwhile (it is ending already)."""
    task = asyncio.ensure_future(step)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
