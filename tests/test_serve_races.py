"""`tmas serve` at its moments of hand-over, driven in process: the app called as an ASGI server calls it, each
client's reading and leaving held by the test, the upstream a scripted model whose calls wait on the test's gates.
Every step waits on an event, never on time."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from tmas.llm.types import Completion, Message
from tmas.methods import METHODS
from tmas.serve import jobs
from tmas.serve.app import ServeApp
from tmas.serve.jobs import PENDING, Job, ServedRuns, Waiting
from tmas.serve.metrics import ServeMetrics
from tmas.serve.observed_store import ObservedStore
from tmas.serve.protocol import ChatBody
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel

QUESTION = [{"role": "user", "content": "What is 17*23?"}]


@dataclass
class GatedModel(ScriptedModel):
    """The scripted upstream, each call answered once ``gate`` is open; a call cancelled while it waits lets go only
    once ``let_go`` is set (an upstream whose dropped call takes a while to close)."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    let_go: asyncio.Event = field(default_factory=asyncio.Event)
    asked: asyncio.Event = field(default_factory=asyncio.Event)
    cancelling: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.gate.set()
        self.let_go.set()

    async def chat(self, role: str, messages: Sequence[Message], **kwargs: Any) -> Completion:
        self.asked.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelling.set()
            await self.let_go.wait()
            raise
        return await super().chat(role, messages, **kwargs)


class Client:
    """One request to the app. A slow reader with ``hold``: the server's send of the first message holding those
    bytes waits until ``read_on()``; ``leave()`` disconnects it (a send then delivers nothing, as uvicorn's). ``spec``
    is the ASGI HTTP spec version the server speaks (uvicorn's by default)."""

    def __init__(
        self, app: Any, body: dict[str, Any], hold: bytes | None = None, spec: str = "2.3", last: bytes | None = None
    ) -> None:
        self.payload = json.dumps(body).encode()
        # With ``last``: the client leaves once it has the message holding those bytes, before that send returns.
        self.last = last
        self.spec = spec
        self.hold = hold
        self.reading = asyncio.Event()
        self.left = asyncio.Event()
        self.seen_leaving = asyncio.Event()
        self.waiting_to_send = asyncio.Event()  # a send waits on the reader
        self.messages: list[dict[str, Any]] = []
        self._asked = False
        self.task = asyncio.create_task(app(self._scope(), self._receive, self._send))

    def _scope(self) -> dict[str, Any]:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.payload)).encode())]
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": self.spec},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }

    async def _receive(self) -> dict[str, Any]:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": self.payload, "more_body": False}
        await self.left.wait()
        self.seen_leaving.set()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if self.left.is_set():
            return
        if self.hold is not None and self.hold in message.get("body", b""):
            self.hold = None
            self.waiting_to_send.set()
            reading = asyncio.create_task(self.reading.wait())
            await asyncio.wait({reading, asyncio.create_task(self.left.wait())}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                return
        self.messages.append(message)
        if self.last is not None and self.last in message.get("body", b""):
            self.leave()
            await self.seen_leaving.wait()

    def read_on(self) -> None:
        self.reading.set()

    def leave(self) -> None:
        self.left.set()

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    def reply(self) -> dict[str, Any]:
        return dict(json.loads(self.body()))

    def events(self) -> list[dict[str, Any]]:
        lines = self.body().decode().split("\n\n")
        return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@dataclass
class Served:
    runs: ServedRuns
    app: Any
    metrics: ServeMetrics
    model: GatedModel

    def ask(self, hold: bytes | None = None, *, spec: str = "2.3", last: bytes | None = None, **body: Any) -> Client:
        return Client(self.app, {"model": "cot/sim-model", "messages": QUESTION, **body}, hold, spec, last)

    def counted(self, status: int) -> float:
        labels = {"method": "cot", "status": str(status)}
        return self.metrics.registry.get_sample_value("tmas_requests_total", labels) or 0.0


def served(serve_dir: Path) -> Served:
    settings = scripted_settings()
    model = GatedModel(settings=settings)
    runs = ServedRuns(serve_dir, settings, embedded=False, model=model, max_problems=4, max_queue=4)
    metrics = ServeMetrics(queued=lambda: runs.admission.queued, in_flight=lambda: len(runs.active))
    runs.on_call = metrics.call_done
    app = ServeApp(
        runs, methods=sorted(METHODS), upstreams=["sim-model"], token=None, max_body_bytes=1 << 20, metrics=metrics
    )
    return Served(runs, app.build(), metrics, model)


def run_dirs(serve_dir: Path) -> list[Path]:
    return sorted(p for p in serve_dir.iterdir() if (p / "run.sqlite").is_file())


def reply_id(client: Client) -> str:
    return str(client.events()[0]["id"] if client.events() else client.reply()["id"])


async def test_a_reply_on_its_way_to_a_slow_reader_is_not_handed_to_a_twin(tmp_path: Path) -> None:
    serve_dir = tmp_path / "served"
    s = served(serve_dir)
    for stream, hold in [(True, b"[DONE]"), (False, b'"choices"')]:
        # The first client's run has ended; its reply is being sent, its reader slow.
        first = s.ask(hold, stream=stream)
        await first.waiting_to_send.wait()
        [run_dir] = [d for d in run_dirs(serve_dir) if (d / PENDING).is_file()]
        # The same request without a seed meanwhile is a sample of its own: a run of its own, asked anew.
        asked = len(s.model.calls)
        twin = s.ask(stream=False)
        await twin.task
        assert twin.status == 200 and twin.reply()["id"] != run_dir.name
        assert len(s.model.calls) == asked + 1
        first.read_on()
        await first.task
        assert first.status == 200 and reply_id(first) == run_dir.name
        # Both replies were had: neither run keeps one for a later request.
        assert not any((d / PENDING).is_file() for d in run_dirs(serve_dir))
    assert len(run_dirs(serve_dir)) == 4
    await s.runs.close()


async def test_a_reply_whose_slow_reader_left_goes_to_the_next_twin(tmp_path: Path) -> None:
    serve_dir = tmp_path / "served"
    s = served(serve_dir)
    first = s.ask(b"boxed", stream=True)
    await first.waiting_to_send.wait()
    first.leave()
    await first.seen_leaving.wait()
    [run_dir] = run_dirs(serve_dir)
    # The client left before it had the reply: the same request without a seed gets it, with no upstream call.
    asked = len(s.model.calls)
    twin = s.ask(stream=False)
    await twin.task
    assert twin.status == 200 and twin.reply()["id"] == run_dir.name
    assert len(s.model.calls) == asked and not (run_dir / PENDING).is_file()
    await first.task
    await s.runs.close()


async def test_a_stream_read_to_its_end_counts_as_answered_though_its_client_leaves_at_once(tmp_path: Path) -> None:
    s = served(tmp_path / "served")
    # The client has [DONE] and goes; the server's send of it returns only after it has seen the client go (a
    # server that speaks ASGI's HTTP spec 2.4 may).
    first = s.ask(spec="2.4", last=b"[DONE]", stream=True)
    await first.task
    assert first.body().endswith(b"data: [DONE]\n\n") and b"boxed{391}" in first.body()
    assert (s.counted(200), s.counted(499)) == (1, 0)
    # It had the reply: its run keeps none for a later request.
    [run_dir] = run_dirs(tmp_path / "served")
    assert not (run_dir / PENDING).is_file()
    await s.runs.close()


@pytest.mark.parametrize("seed", [5, None])
async def test_a_request_arriving_while_its_run_is_being_cancelled_resumes_it(tmp_path: Path, seed: int | None) -> None:
    # With a seed it would join the run, without one take over its twin's run that no client follows any more.
    serve_dir = tmp_path / "served"
    s = served(serve_dir)
    s.model.gate.clear()  # the upstream holds its calls
    s.model.let_go.clear()  # and a dropped call lets go only when the test says
    first = s.ask(stream=True, seed=seed)
    await s.model.asked.wait()
    [run_dir] = run_dirs(serve_dir)
    # Its only client leaves: its run is being cancelled, its upstream call not yet let go.
    first.leave()
    await s.model.cancelling.wait()
    # The same request arrives meanwhile.
    entered = asyncio.Event()
    enter = s.runs.enter

    def entering(body: ChatBody, method: str, upstream: str) -> Job | Waiting:
        entry = enter(body, method, upstream)
        entered.set()
        return entry

    s.runs.enter = entering  # type: ignore[method-assign]
    again = s.ask(seed=seed)
    await entered.wait()
    s.model.let_go.set()
    s.model.gate.set()
    await again.task
    await first.task
    # It resumed the cancelled run once that had let go of it: its reply, from the same run, its one call asked again
    # (the cancelled run's was dropped unanswered).
    assert again.status == 200, again.body()
    assert again.reply()["id"] == run_dir.name and "boxed{391}" in again.reply()["choices"][0]["message"]["content"]
    assert run_dirs(serve_dir) == [run_dir] and not (run_dir / PENDING).is_file()
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
    assert result.status == "done" and len(s.model.calls) == 1
    await s.runs.close()


async def test_a_run_cut_off_before_its_request_was_stored_is_run_again_in_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve_dir = tmp_path / "served"
    opening, go_on, closed = threading.Event(), threading.Event(), threading.Event()

    class Store(ObservedStore):
        def close(self) -> None:
            super().close()
            closed.set()

    def held_store(*args: Any, **kwargs: Any) -> ObservedStore:
        opening.set()
        go_on.wait()
        return Store(*args, **kwargs)

    monkeypatch.setattr(jobs, "ObservedStore", held_store)
    s = served(serve_dir)
    first = s.ask(stream=True, seed=5)
    await asyncio.to_thread(opening.wait)
    [job] = s.runs.active.values()
    assert job.task is not None
    # Its client leaves while its store is being made: its run ends before its request is stored.
    first.leave()
    await first.task
    go_on.set()
    await asyncio.wait({job.task})
    await asyncio.to_thread(closed.wait)  # the store it opened is closed, never left open
    [run_dir] = run_dirs(serve_dir)
    # The same request, sent again, runs in the run's own directory: one run, its reply.
    again = s.ask(seed=5)
    await again.task
    assert again.status == 200, again.body()
    assert again.reply()["id"] == run_dir.name and "boxed{391}" in again.reply()["choices"][0]["message"]["content"]
    assert run_dirs(serve_dir) == [run_dir]
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
        assert store.get_meta("serve_request")["seed"] == 5
    assert result.status == "done"
    await s.runs.close()


async def test_a_stream_joining_a_run_follows_it_before_its_first_byte_is_sent(tmp_path: Path) -> None:
    s = served(tmp_path / "served")
    s.model.gate.clear()
    first = s.ask(seed=5)
    await s.model.asked.wait()
    # The same request as a stream joins the run; the server's send of its head waits (its body not begun).
    second = s.ask(b"", stream=True, seed=5)
    await second.waiting_to_send.wait()
    # The first client leaves meanwhile: the run has a client still, and goes on for it.
    first.leave()
    await first.task
    s.model.gate.set()
    second.read_on()
    await second.task
    assert b'"error"' not in second.body() and b"boxed{391}" in second.body()
    await s.runs.close()


async def test_a_retry_while_its_cancelled_run_still_makes_its_store_waits_for_that_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve_dir = tmp_path / "served"
    opening, go_on, entered = threading.Event(), threading.Event(), asyncio.Event()
    guard = threading.Lock()
    open_now: list[int] = []  # stores opened or being opened and not closed yet, as each store begins to open
    opened = [0]

    class Store(ObservedStore):
        def close(self) -> None:
            super().close()
            with guard:
                opened[0] -= 1

    def held_store(*args: Any, **kwargs: Any) -> ObservedStore:
        with guard:
            open_now.append(opened[0])
            opened[0] += 1
            first = len(open_now) == 1
        if first:
            opening.set()
            go_on.wait()
        return Store(*args, **kwargs)

    monkeypatch.setattr(jobs, "ObservedStore", held_store)
    s = served(serve_dir)
    enter = s.runs.enter

    def entering(body: ChatBody, method: str, upstream: str) -> Job | Waiting:
        entry = enter(body, method, upstream)
        entered.set()
        return entry

    s.runs.enter = entering  # type: ignore[method-assign]
    first = s.ask(stream=True, seed=5)
    await asyncio.to_thread(opening.wait)
    [job] = s.runs.active.values()
    run_dir = job.run_dir
    try:
        # Its client leaves while the store is being made on a thread; the same request comes again meanwhile.
        first.leave()
        await first.task
        again = s.ask(seed=5)
        await entered.wait()
    finally:
        go_on.set()
    await again.task
    # The retry waited for the cancelled run's thread to make its store and close it: one store open at a time, one
    # run, its reply.
    assert again.status == 200, again.body()
    assert again.reply()["id"] == run_dir.name and "boxed{391}" in again.reply()["choices"][0]["message"]["content"]
    assert open_now == [0, 0]
    assert run_dirs(serve_dir) == [run_dir]
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
        assert store.get_meta("serve_request")["seed"] == 5
    assert result.status == "done"
    await s.runs.close()
    assert opened == [0]  # both closed


async def test_a_reply_without_a_stream_counts_as_answered_only_once_its_client_has_it(tmp_path: Path) -> None:
    s = served(tmp_path / "served")
    # The client leaves while the server sends the reply's body: it never had it.
    first = s.ask(b'"choices"')
    await first.waiting_to_send.wait()
    assert (s.counted(200), s.counted(499)) == (0, 0)  # not counted before it is sent
    first.leave()
    await first.task
    assert first.body() == b""
    assert (s.counted(200), s.counted(499)) == (0, 1)
    # One that has the reply and goes at once (the server's send returns after it has seen the client go, as a server
    # speaking ASGI's HTTP spec 2.4 may) had it, as a stream read to its end.
    second = s.ask(spec="2.4", last=b'"choices"')
    await second.task
    assert b"boxed{391}" in second.body()
    assert (s.counted(200), s.counted(499)) == (1, 1)
    await s.runs.close()


async def test_a_retry_after_a_resuming_request_left_waits_for_the_cancelled_run(tmp_path: Path) -> None:
    serve_dir = tmp_path / "served"
    s = served(serve_dir)
    s.model.gate.clear()
    s.model.let_go.clear()
    first = s.ask(stream=True, seed=5)
    await s.model.asked.wait()
    [run_dir] = run_dirs(serve_dir)
    first.leave()
    await s.model.cancelling.wait()
    entered = asyncio.Event()
    enter = s.runs.enter

    def entering(body: ChatBody, method: str, upstream: str) -> Job | Waiting:
        entry = enter(body, method, upstream)
        entered.set()
        return entry

    s.runs.enter = entering  # type: ignore[method-assign]
    # The same request arrives while the run is being cancelled (it waits to resume it), and its client leaves too.
    second = s.ask(seed=5)
    await entered.wait()
    second.leave()
    await second.task
    # A third arrives while the first run has still not let go of its run: it waits for it, then resumes the run.
    entered.clear()
    third = s.ask(seed=5)
    await entered.wait()
    [job] = s.runs.active.values()
    if job.before is None or job.before.done():
        await third.task  # it did not wait: it ran beside the first run, still holding its run
    s.model.let_go.set()
    s.model.gate.set()
    await third.task
    await first.task
    assert third.status == 200, third.body()
    assert third.reply()["id"] == run_dir.name and "boxed{391}" in third.reply()["choices"][0]["message"]["content"]
    assert run_dirs(serve_dir) == [run_dir]
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
    assert result.status == "done" and len(s.model.calls) == 1
    await s.runs.close()
