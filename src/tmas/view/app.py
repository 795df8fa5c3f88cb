"""The viewer's pages (Starlette routes over :class:`RunReader`), rendered from the Jinja2 templates beside it."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import jinja2
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from tmas.answer_rules import MissingExtra
from tmas.grading.grades import SELECTED
from tmas.grading.judge import JUDGE_ROLE
from tmas.llm.types import Completion, Usage
from tmas.memory.transcript import Transcript
from tmas.methods import stored_params
from tmas.methods.state import MATTRLState
from tmas.store.records import IterationRecord, UnreadableRecord
from tmas.store.run_store import DB_NAME, DamagedStore, RunStore, StoreError, UnknownSchema
from tmas.view.cache import RunCache
from tmas.view.charts import accuracy_by_tokens_png, frontiers_png, pass1_by_iteration_png
from tmas.view.compare import compare_runs, parse_budgets
from tmas.view.credits import load_credits
from tmas.view.host_check import HostCheck
from tmas.view.live_grades import LiveGrades
from tmas.view.mathtext import INLINE_RAW_CHARS, answer, rich
from tmas.view.runs import RunReader, RunRef, discover, returned_nothing, verdict

# How often (ms) an open page asks whether its run changed.
POLL_MS = 2000
# A prompt message longer than this (an aggregation prompt quoting 16 long solutions is megabytes) is not carried by
# its call's page: the page shows its first MESSAGE_HEAD_CHARS and fetches the whole from its address when asked.
MESSAGE_CHARS = 4_000
MESSAGE_HEAD_CHARS = 1_500
# Problems per page of a run's problem table.
PAGE_SIZE = 100
# Model text and records served as they are: never read as a page by a browser guessing their type.
PLAIN_HEADERS = {"X-Content-Type-Options": "nosniff"}
# What a damaged store raises while a page reads it: a record no layout reads, a file or table SQLite cannot read, a
# setting that is not JSON. The page then says so in one line instead of failing.
UNREADABLE: tuple[type[Exception], ...] = (UnreadableRecord, sqlite3.DatabaseError, json.JSONDecodeError)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tmas.view", "templates"),
        autoescape=True,
        # Records differ by method: a field one method lacks renders empty instead of failing the page.
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["pretty"] = _pretty
    env.filters["score"] = lambda value: "-" if value is None else f"{float(value):.2f}"
    env.filters["rich"] = rich
    env.filters["answer"] = answer
    env.globals["poll_ms"] = POLL_MS
    env.globals["inline_chars"] = INLINE_RAW_CHARS
    env.globals["message_chars"] = MESSAGE_CHARS
    env.globals["message_head_chars"] = MESSAGE_HEAD_CHARS
    return env


class Viewer:
    """The pages over the run directories given on the command line (re-read on every page)."""

    def __init__(self, paths: list[Path], *, warm_up: bool = True) -> None:
        self.paths = paths
        self.warm = warm_up
        self.env = _environment()
        self.cache = RunCache()

    def build(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/", _threaded(self.index)),
                Route("/compare", _threaded(self.compare)),
                Route("/compare/marker", _threaded(self.compare_marker)),
                Route("/compare/chart.png", _threaded(self.compare_chart)),
                Route("/run/{key}", _threaded(self.run)),
                Route("/run/{key}/marker", _threaded(self.marker)),
                Route("/run/{key}/chart/{x}.png", _threaded(self.chart)),
                Route("/run/{key}/where-lost", _threaded(self.where_lost)),
                Route("/run/{key}/problem", _threaded(self.problem)),
                Route("/run/{key}/problem/solution", _threaded(self.solution_text)),
                Route("/run/{key}/iteration", _threaded(self.iteration)),
                Route("/run/{key}/iteration/record.json", _threaded(self.iteration_json)),
                Route("/run/{key}/iteration/text", _threaded(self.candidate_text)),
                Route("/run/{key}/call/{call_id:int}", _threaded(self.call)),
                Route("/run/{key}/call/{call_id:int}/content", _threaded(self.call_text)),
                Route("/run/{key}/call/{call_id:int}/reasoning", _threaded(self.call_text)),
                Route("/run/{key}/call/{call_id:int}/message/{index:int}", _threaded(self.call_message)),
            ],
            exception_handlers={HTTPException: self._error, **dict.fromkeys(UNREADABLE, self._unreadable)},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Big runs are read once in the background from start-up, so their first pages open warm.
        if self.warm:
            threading.Thread(target=self.warm_up, name="tmas-view-warm-up", daemon=True).start()
        yield

    def warm_up(self) -> None:
        """Build every run's overview and frontier into the cache (a page asking meanwhile waits for its run)."""
        for ref in discover(self.paths):
            try:
                compare_runs([ref], cache=self.cache)
            except Exception:  # a run being created, or not ours: its page reports the problem when opened
                continue

    # ------------------------------------------------------------------------------------------------ pages
    def index(self, request: Request) -> Response:
        runs = []
        unreadable = []
        for ref in discover(self.paths):
            try:
                with RunReader(ref, self.cache) as run:
                    runs.append((ref, run.summary()))
            except (UnknownSchema, DamagedStore) as exc:  # a newer tmas's, or a damaged file: it stays so, so say so
                unreadable.append((ref, str(exc).removeprefix(f"{ref.path / DB_NAME}: ")))
            except StoreError:
                continue  # a run still being created, or not ours: listed once it can be read
            except UNREADABLE as exc:
                unreadable.append((ref, _one_line(exc).removeprefix(f"{ref.path}: ")))
        return self._page("index.html", runs=runs, unreadable=unreadable)

    def run(self, request: Request) -> Response:
        with self._open(request) as run:
            marker = run.marker()
            overview = run.overview()
        pages = max(1, -(-len(overview.problems) // PAGE_SIZE))
        try:
            page = int(request.query_params.get("page", "1"))
        except ValueError:
            raise HTTPException(400, "page must be a page number") from None
        if not 1 <= page <= pages:
            raise HTTPException(404, f"no page {page}: the problems fill {pages} page(s)")
        shown = overview.problems[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
        return self._page(
            "run.html", ref=run.ref, run=overview, shown=shown, page=page, pages=pages, live=True, marker=marker
        )

    def where_lost(self, request: Request) -> Response:
        with self._open(request) as run:
            marker = run.marker()
            page = run.where_lost()
        return self._page("where_lost.html", ref=run.ref, page=page, live=True, marker=marker)

    def problem(self, request: Request) -> Response:
        pid = request.query_params.get("id", "")
        with self._open(request) as run:
            marker = run.marker()
            problem = run.store.problem(pid)
            if problem is None:
                raise HTTPException(404, f"no problem {pid!r} in this run")
            result, records = run.solved(pid)
            live = run.problem_grades(problem, result, records)
            verdicts = {
                (r.iteration, c.index): _verdict(live, (pid, r.iteration, c.index))
                for r in records
                for c in r.candidates
            }
            last = records[-1] if records else None
            final = (
                _verdict(live, (pid, last.iteration, SELECTED))
                if last
                else (returned_nothing(result, problem, live.grades if live else None), None)
            )
            # A confidence column where a candidate has one, by the measure the run's rules read.
            stored = run.store.get_meta("method") or {}
            params = stored_params(str(stored.get("name")), stored.get("params"))
            measured = any(c.confidence is not None for r in records for c in r.candidates)
            # Calls no recorded iteration holds: an iteration in progress, or one the problem never finished; and
            # apart from them, those of the judge that graded the problem's answers (tmas report).
            outside = list(run.store.calls_outside(pid, {r.iteration for r in records}))
            unrecorded = [c for c in outside if c.key.role != JUDGE_ROLE]
            judged = [c for c in outside if c.key.role == JUDGE_ROLE]
            # What the problem spent, counted as the run page and tmas report count it (the judge's calls apart).
            spent = run.store.problem_costs(JUDGE_ROLE, other_roles=True, problem_id=pid).get(pid)
            return self._page(
                "problem.html",
                ref=run.ref,
                problem=problem,
                result=result,
                records=records,
                verdicts=verdicts,
                final=final,
                measure=params.get("confidence_measure") if measured else None,
                unrecorded=unrecorded,
                judged=judged,
                asked_again=run.store.asked_again_calls(pid) if outside else set(),
                spent=spent,
                live=True,
                marker=marker,
            )

    def iteration(self, request: Request) -> Response:
        pid, t = _iteration_query(request)
        with self._open(request) as run:
            marker = run.marker()
            result, records = run.solved(pid)
            found = run.iteration(records, t)
            if found is None:
                raise HTTPException(404, f"problem {pid!r} has no iteration {t}")
            record, diffs = found
            problem = run.store.problem(pid)
            live = run.problem_grades(problem, result, records) if problem else None
            verdicts = {c.index: _verdict(live, (pid, t, c.index)) for c in record.candidates}
            calls = list(run.store.calls(pid, t))
            # What the iteration spent as the report's per-iteration table counts it: every stored call of the
            # iteration (a failed one a resume asked again included), not the record's, which holds only the pass
            # that finished it.
            spent = [c for c in calls if c.key.role != JUDGE_ROLE]
            run_path = str(run.ref.path.resolve())
            credits = {
                (round_, agent): r
                for (path, problem, round_, agent), r in load_credits([r.path for r in discover(self.paths)]).items()
                if path == run_path and problem == pid
            }
            return self._page(
                "iteration.html",
                ref=run.ref,
                pid=pid,
                record=record,
                diffs=diffs,
                verdicts=verdicts,
                calls=calls,
                spent_calls=len(spent),
                spent_usage=sum((c.usage for c in spent), Usage()),
                asked_again=run.store.asked_again_calls(pid),
                transcript=_transcript(record.state),
                credits=credits,
                live=True,
                marker=marker,
            )

    def iteration_json(self, request: Request) -> Response:
        """An iteration's whole record as JSON (linked from its page, which does not carry it)."""
        record = self._record(request)
        return Response(_pretty(record), media_type="application/json; charset=utf-8", headers=PLAIN_HEADERS)

    def candidate_text(self, request: Request) -> Response:
        """One candidate's text as the model wrote it, as plain text (the page's *raw text* of a long solution)."""
        record = self._record(request)
        try:
            index = int(request.query_params.get("c", ""))
        except ValueError:
            raise HTTPException(400, "c must be a candidate number") from None
        candidate = next((c for c in record.candidates if c.index == index), None)
        if candidate is None:
            raise HTTPException(404, f"iteration {record.iteration} has no candidate {index}")
        return PlainTextResponse(candidate.text, headers=PLAIN_HEADERS)

    def solution_text(self, request: Request) -> Response:
        """The solution a problem returned, as plain text (the problem page's *raw text* of a long one)."""
        pid = request.query_params.get("id", "")
        with self._open(request) as run:
            result = run.store.result(pid)
        if result is None or not result.text:
            raise HTTPException(404, f"problem {pid!r} returned no solution")
        return PlainTextResponse(result.text, headers=PLAIN_HEADERS)

    def call(self, request: Request) -> Response:
        call_id = _call_id(request)
        with self._open(request) as run:
            call = _stored_call(run.store, call_id)
            return self._page(
                "call.html",
                ref=run.ref,
                call=call,
                messages=run.store.call_messages(call_id),
                sampling=run.store.call_sampling(call_id),
            )

    def call_text(self, request: Request) -> Response:
        """A call's reply or reasoning as the model wrote it, as plain text (``/content``, ``/reasoning``)."""
        call_id = _call_id(request)
        with self._open(request) as run:
            call = _stored_call(run.store, call_id)
        text = call.reasoning if request.url.path.endswith("/reasoning") else call.content
        return PlainTextResponse(text, headers=PLAIN_HEADERS)

    def call_message(self, request: Request) -> Response:
        """One message of a call's prompt, as plain text."""
        call_id = _call_id(request)
        index = int(request.path_params["index"])
        with self._open(request) as run:
            _stored_call(run.store, call_id)
            messages = run.store.call_messages(call_id)
        if index >= len(messages):
            raise HTTPException(404, f"call {call_id} has no message {index} (it has {len(messages)})")
        return PlainTextResponse(messages[index]["content"], headers=PLAIN_HEADERS)

    def marker(self, request: Request) -> Response:
        with self._open(request) as run:
            return PlainTextResponse(run.marker(), headers={"Cache-Control": "no-store"})

    def chart(self, request: Request) -> Response:
        x = request.path_params["x"]
        if x not in ("iteration", "tokens"):
            raise HTTPException(404, f"no chart {x!r}")
        with self._open(request) as run:
            overview = run.overview()
            label = run.ref.name
        if overview.grades is None or overview.metrics is None:
            raise HTTPException(404, f"{overview.not_graded}: no accuracy to chart")
        try:
            if x == "iteration":
                png = pass1_by_iteration_png(label, overview.metrics)
            else:
                png = accuracy_by_tokens_png(label, overview.frontier)
        except MissingExtra as exc:
            raise HTTPException(404, str(exc)) from None
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    # ------------------------------------------------------------------------------------------------ comparison
    def _compared(self, request: Request) -> list[RunRef]:
        keys = request.query_params.getlist("run")
        refs = {r.key: r for r in discover(self.paths)}
        missing = [k for k in keys if k not in refs]
        if missing:
            raise HTTPException(
                404, f"no run {', '.join(map(repr, missing))} (the viewer shows the runs it was started with)"
            )
        chosen = [refs[k] for k in dict.fromkeys(keys)]
        if len(chosen) < 2:
            raise HTTPException(400, "pick two or more runs to compare (tick them on the runs page)")
        return chosen

    def compare(self, request: Request) -> Response:
        refs = self._compared(request)
        try:
            budgets = parse_budgets(request.query_params.get("budgets"))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        marker = self._compare_marker(refs)
        try:
            comparison = compare_runs(refs, budgets, self.cache)
        except StoreError as exc:
            raise HTTPException(404, str(exc)) from None
        query = "&".join(f"run={r.key}" for r in refs)
        return self._page(
            "compare.html",
            comparison=comparison,
            query=query,
            marker_url=f"/compare/marker?{query}",
            live=True,
            marker=marker,
        )

    def compare_marker(self, request: Request) -> Response:
        return PlainTextResponse(self._compare_marker(self._compared(request)), headers={"Cache-Control": "no-store"})

    def _compare_marker(self, refs: list[RunRef]) -> str:
        """The compared runs' change markers as one ("-" for a run that cannot be opened yet)."""
        markers = []
        for ref in refs:
            try:
                with RunReader(ref, self.cache) as run:
                    markers.append(run.marker())
            except StoreError:
                markers.append("-")
        return "/".join(markers)

    def compare_chart(self, request: Request) -> Response:
        try:
            comparison = compare_runs(self._compared(request), cache=self.cache)
        except StoreError as exc:
            raise HTTPException(404, str(exc)) from None
        try:
            png = frontiers_png([(run.label, run.points) for run in comparison.runs])
        except MissingExtra as exc:
            raise HTTPException(404, str(exc)) from None
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    # ------------------------------------------------------------------------------------------------ helpers
    def _open(self, request: Request) -> RunReader:
        key = request.path_params["key"]
        ref = next((r for r in discover(self.paths) if r.key == key), None)
        if ref is None:
            raise HTTPException(404, f"no run {key!r} (the viewer shows the run directories it was started with)")
        try:
            return RunReader(ref, self.cache)
        except (UnknownSchema, DamagedStore) as exc:  # as a damaged record's page says it
            detail = str(exc).removeprefix(f"{ref.path / DB_NAME}: ")
            raise HTTPException(500, f"the run {ref.path} cannot be read: {detail}") from None
        except StoreError as exc:
            raise HTTPException(404, str(exc)) from None

    def _record(self, request: Request) -> IterationRecord:
        pid, t = _iteration_query(request)
        with self._open(request) as run:
            record = next((r for r in run.records(pid) if r.iteration == t), None)
        if record is None:
            raise HTTPException(404, f"problem {pid!r} has no iteration {t}")
        return record

    def _page(self, name: str, **context: Any) -> HTMLResponse:
        """A page; a live one (``live=True``) also takes ``marker``, its run's change marker read before its data."""
        context.setdefault("live", False)
        if context["live"] and "marker_url" not in context:
            context["marker_url"] = f"/run/{context['ref'].key}/marker"
        return HTMLResponse(self.env.get_template(name).render(**context))

    async def _error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        html = self.env.get_template("error.html").render(status=exc.status_code, detail=exc.detail, live=False)
        return HTMLResponse(html, status_code=exc.status_code)

    async def _unreadable(self, request: Request, exc: Exception) -> Response:
        """A page of a damaged run: which run, and what of it cannot be read."""
        key = request.path_params.get("key")
        ref = next((r for r in discover(self.paths) if r.key == key), None) if key else None
        text = _one_line(exc)
        if ref is None:
            detail = f"a run compared cannot be read: {text}"
        else:
            detail = f"the run {ref.path} cannot be read: {text.removeprefix(f'{ref.path}: ')}"
        html = self.env.get_template("error.html").render(status=500, detail=detail, live=False)
        return HTMLResponse(html, status_code=500)


def _threaded(page: Callable[[Request], Response]) -> Callable[[Request], Awaitable[Response]]:
    """Pages render in worker threads: a big run's first render must not hold up other pages and live polls."""

    async def endpoint(request: Request) -> Response:
        return await run_in_threadpool(page, request)

    return endpoint


def _stored_call(store: RunStore, call_id: int) -> Completion:
    """The run's call ``call_id``; a 404 where it has none."""
    call = store.call(call_id)
    if call is None:
        raise HTTPException(404, f"no call {call_id} in this run")
    return call


def _call_id(request: Request) -> int:
    """The call a request's address names; past SQLite's integers, no such call."""
    call_id = int(request.path_params["call_id"])
    if call_id >= 2**63:
        raise HTTPException(404, f"no call {call_id} in this run")
    return call_id


def _iteration_query(request: Request) -> tuple[str, int]:
    """The problem and iteration a request names (``?id=...&t=...``)."""
    try:
        t = int(request.query_params.get("t", ""))
    except ValueError:
        raise HTTPException(400, "t must be an iteration number") from None
    return request.query_params.get("id", ""), t


def _transcript(state: dict[str, Any]) -> Transcript | None:
    """The deliberation transcript an iteration's state keeps (MATTRL's state), or None (a state of another kind)."""
    try:
        return MATTRLState.model_validate(state).transcript
    except ValidationError:
        return None


def _one_line(exc: Exception) -> str:
    """An exception's message on one line, with what it is when SQLite's or JSON's own."""
    text = " ".join(str(exc).split())
    if isinstance(exc, sqlite3.DatabaseError):
        return f"SQLite: {text}"
    if isinstance(exc, json.JSONDecodeError):
        return f"a stored setting is not JSON ({text})"
    return text


def _pretty(value: Any) -> str:
    """A record (a model of tmas.store.records) or plain data as indented JSON."""
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return json.dumps(data, indent=2, ensure_ascii=False)


def _verdict(live: LiveGrades | None, key: tuple[str, int, int]) -> tuple[bool | None, str | None]:
    """An item's verdict and who gave it ("rules": the viewer's live check; else the stored grades' mode)."""
    if live is None:
        return None, None
    return verdict(live.grades, key), live.source(key)


def view_app(paths: list[Path], *, warm_up: bool = True, host: str = "127.0.0.1") -> HostCheck:
    """The viewer of ``paths``, answering requests addressed to ``host`` (the address it listens on) or loopback."""
    return HostCheck(Viewer([Path(p) for p in paths], warm_up=warm_up).build(), host)
