"""A run whose endpoint names no model is answered by whatever model its server serves: resumed against other URLs,
another model may answer, and its replies would be mixed with the stored ones. Such a resume is refused in one line
before any call, by the check ``tmas data filter`` makes of its samples (RunSetup.changed_servers); the run's own
URLs, or a model named in the run's settings, resume as before."""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from conftest import run_tmas, settings_for
from tmas.config import Settings
from tmas.errors import InputError
from tmas.llm import preflight
from tmas.llm.preflight import served_models
from tmas.problems import Problem
from tmas.runner import (
    RunSetup,
    RunSummary,
    prepare_run,
    resume_settings,
    run_problems,
    served_now,
    stored_settings,
)
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer
from tmas.testing.script import PersonaName

PROBLEMS = [Problem(problem_id=f"p{k}", question=f"What is {k + 2}*7?", answer=str(7 * (k + 2))) for k in range(2)]


async def _run_then_stop(run_dir: Path, settings: Settings) -> None:
    """The run as a stop leaves it with p0 finished and p1 not begun."""
    store, settings, todo = prepare_run(run_dir, settings, PROBLEMS, resume=False)
    with store:
        await run_problems(settings, todo, store)
    with closing(sqlite3.connect(run_dir / "run.sqlite")) as db, db:
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")
        db.execute("DELETE FROM calls WHERE problem_id = 'p1'")


def _resumed(run_dir: Path, base_url: str, **overrides: object) -> Settings:
    return resume_settings(stored_settings(run_dir), {"endpoint.base_url": [base_url], **overrides}, stored_at=run_dir)


async def _resume(run_dir: Path, base_url: str) -> RunSummary:
    """The run resumed at ``base_url``, to its end."""
    store, again, todo = prepare_run(run_dir, _resumed(run_dir, base_url), None, resume=True)
    with store:
        return await run_problems(again, todo, store)


async def _resume_refused(run_dir: Path, settings: Settings) -> InputError:
    """The refusal of a resume under ``settings``: its servers are asked what they serve before any call."""
    store, again, todo = prepare_run(run_dir, settings, None, resume=True)
    with store, pytest.raises(InputError) as refused:
        await run_problems(again, todo, store)
    return refused.value


@pytest.mark.parametrize("finished", [True, False])
async def test_a_resume_against_another_server_with_no_model_named_is_refused(tmp_path: Path, finished: bool) -> None:
    with SimServer(SimScript(model="model-a")) as first, SimServer(SimScript(model="model-b")) as second:
        method = {"name": "majority", "params": {"k": 2}}
        settings = settings_for(first, endpoint__model=None, method=method)
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        if not finished:  # a stored reply of an unfinished problem is mixed the same way
            with sqlite3.connect(run_dir / "run.sqlite") as db:
                db.execute("DELETE FROM results")
        first.reset()
        refused = await _resume_refused(run_dir, _resumed(run_dir, second.base_url))
        assert second.chat_bodies() == [] and first.chat_bodies() == []
        # The run's own server resumes it.
        await _resume(run_dir, first.base_url)
        assert first.chat_bodies() and second.chat_bodies() == []
    message = str(refused)
    assert "\n" not in message
    assert f"model 'model-a' served at the solution endpoint {first.base_url} (now {second.base_url}" in message
    assert "no model is named" in message


async def test_a_run_that_named_its_model_resumes_against_another_server(tmp_path: Path) -> None:
    # The requests name the model: a server that does not serve it says so, and a resume compares the name itself.
    with SimServer(SimScript()) as first, SimServer(SimScript()) as second:
        settings = settings_for(first, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        await _resume(run_dir, second.base_url)
        bodies = second.chat_bodies()
    assert bodies and {b["model"] for b in bodies} == {"sim-model"}


async def test_a_resume_at_the_same_url_whose_server_now_serves_another_model_is_refused(tmp_path: Path) -> None:
    # The server at the run's URL was restarted with another model: before, the resume replayed the stored replies
    # and asked the rest of it, two models' replies under one run.
    with SimServer(SimScript(model="model-a")) as server:
        settings = settings_for(server, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        server.set_script(SimScript(model="model-b"))
        server.reset()
        store, again, todo = prepare_run(run_dir, _resumed(run_dir, server.base_url), None, resume=True)
        with store, pytest.raises(InputError) as refused:
            await run_problems(again, todo, store)
        assert server.chat_bodies() == []
        with RunStore(run_dir, read_only=True) as stored:
            assert {c.model for c in stored.calls()} == {"model-a"}
    message = str(refused.value)
    assert "\n" not in message
    assert (
        f"the run's replies came from model 'model-a' served at the solution endpoint {server.base_url}, which now"
        " serves 'model-b', and no model is named" in message
    )
    assert message.endswith(
        "serve 'model-a' there again to resume, or name the model the run asks for with --model NAME"
    )


async def test_a_resume_at_another_url_names_the_model_served_there(tmp_path: Path) -> None:
    with SimServer(SimScript(model="model-a")) as first, SimServer(SimScript(model="model-b")) as second:
        settings = settings_for(first, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        first.reset()
        setup = RunSetup.check(_resumed(run_dir, second.base_url), resuming=run_dir)
        with RunStore(run_dir, read_only=True) as store, pytest.raises(InputError) as refused:
            setup.check_resume(store, await served_now(setup, store))
        assert second.chat_bodies() == [] and first.chat_bodies() == []
    said = f"model 'model-a' served at the solution endpoint {first.base_url} (now {second.base_url}, which serves"
    assert f"{said} 'model-b'), and no model is named" in str(refused.value)


@pytest.mark.parametrize("persona", ["sim", "llama-server", "sglang"])
async def test_a_resume_at_the_same_server_and_model_is_not_refused(tmp_path: Path, persona: PersonaName) -> None:
    # llama-server and SGLang reply with the model name asked ("default" where none is named), and list the model's
    # path or alias: the stored replies name no model of theirs, and nothing is refused for it.
    with SimServer(SimScript(model="/models/model-a.gguf", persona=persona)) as server:
        settings = settings_for(server, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        server.reset()
        summary = await _resume(run_dir, server.base_url)
        assert summary.done == 2 and server.chat_bodies()


async def test_a_server_that_lists_no_model_is_not_refused(tmp_path: Path) -> None:
    # What it serves is unknown before a call: the resume goes on (the calls say what else is wrong).
    with SimServer(SimScript(model="model-a")) as server:
        settings = settings_for(server, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        setup = RunSetup.check(_resumed(run_dir, server.base_url), resuming=run_dir)
        with RunStore(run_dir, read_only=True) as store:
            assert setup.changed_servers(store, {}) == []
            assert setup.changed_servers(store, {server.base_url: ["model-a"]}) == []
            assert [c.shown for c in setup.changed_servers(store, {server.base_url: ["model-b"]})] == [
                f"solution model at {server.base_url} 'model-a' (now 'model-b')"
            ]


@pytest.mark.parametrize("answers", [{"hf": {"model": "/models/tiny"}}, {}])
async def test_a_model_with_no_endpoint_is_not_asked_what_it_serves(tmp_path: Path, answers: dict[str, Any]) -> None:
    # The in-process model and the embedded one have no URL to ask (and none a resume compares), whatever model
    # the stored replies reported.
    with SimServer(SimScript(model="model-a")) as server:
        settings = settings_for(server, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
    local = Settings.model_validate({**answers, "method": {"name": "majority", "params": {"k": 2}}})
    setup = RunSetup(local, RunSetup.check(settings).method, [])
    with RunStore(run_dir, read_only=True) as store:
        assert setup.unnamed_roles(store) == [] and setup.changed_servers(store, {server.base_url: ["b"]}) == []
    assert await served_models(local, ["solution"]) == {}


async def test_a_reply_that_echoes_the_name_asked_is_not_shown_as_its_model(tmp_path: Path) -> None:
    # llama-server answers with the name asked: 'default' is no model's name, and the refusal does not call it one.
    with (
        SimServer(SimScript(model="/models/a.gguf", persona="llama-server")) as first,
        SimServer(SimScript()) as second,
    ):
        settings = settings_for(first, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        refused = await _resume_refused(run_dir, _resumed(run_dir, second.base_url))
    assert str(refused).startswith(f"{run_dir}: the run's replies came from the model served at the solution")


async def test_one_of_two_replicas_restarted_with_another_model_is_refused(tmp_path: Path) -> None:
    with SimServer(SimScript(model="model-a")) as one, SimServer(SimScript(model="model-a")) as two:
        settings = settings_for(one, two, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        two.set_script(SimScript(model="model-b"))
        setup = RunSetup.check(stored_settings(run_dir), resuming=run_dir)
        with RunStore(run_dir, read_only=True) as store:
            assert [c.shown for c in setup.changed_servers(store, await served_now(setup, store))] == [
                f"solution model at {two.base_url} 'model-a' (now 'model-b')"
            ]


async def test_a_run_moved_to_a_server_that_serves_its_model_resumes(tmp_path: Path) -> None:
    # The server started again on another port with the same model: the replies would come from the model the stored
    # ones came from, and the resume goes on there with no model named.
    with SimServer(SimScript(model="model-a")) as first, SimServer(SimScript(model="model-a")) as second:
        settings = settings_for(first, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        first.reset()
        summary = await _resume(run_dir, second.base_url)
        assert summary.done == 2 and second.chat_bodies() and first.chat_bodies() == []


def test_a_resume_asks_each_server_once_what_it_serves_before_its_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, 'tmas run --resume' asked GET /models twice before its estimate (whether the server answers, then what
    # it serves), and a resumed run twice again before its first call; one answer now serves both each time.
    with SimServer(SimScript(model="model-a")) as server:
        settings = settings_for(server, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        asyncio.run(_run_then_stop(run_dir, settings))
        server.reset()
        out = run_tmas("run", "--resume", str(run_dir), "--dry-run", cwd=tmp_path, text=True)
        assert out.returncode == 0, out.stderr
        assert server.stats().models_requests == 1 and server.chat_bodies() == []
        server.reset()
        # A process that has not checked the server yet: the run's check, then the client's own reading of the
        # replica's context window.
        monkeypatch.setattr(preflight, "_ANSWERED", set())
        summary = asyncio.run(_resume(run_dir, server.base_url))
        assert summary.done == 2 and server.stats().models_requests == 2


async def test_a_replica_that_answered_no_call_is_the_runs_own_on_resume(tmp_path: Path) -> None:
    # Of two replicas, the replies came from one only (the other down, or routed none): before, a resume at the
    # run's own URLs took the other for "another URL" where it lists no model of the replies' (llama-server echoes
    # the name asked), refused, and told to resume with the run's --base-url, which it was.
    def at(*servers: SimServer) -> Settings:
        return resume_settings(
            stored_settings(run_dir), {"endpoint.base_url": [s.base_url for s in servers]}, stored_at=run_dir
        )

    with (
        SimServer(SimScript(model="/models/a.gguf", persona="llama-server")) as one,
        SimServer(SimScript(model="/models/a.gguf", persona="llama-server")) as two,
        SimServer(SimScript(model="/models/a.gguf", persona="llama-server")) as three,
    ):
        settings = settings_for(one, two, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        with sqlite3.connect(run_dir / "run.sqlite") as db:
            db.execute("UPDATE calls SET endpoint = ?", (one.base_url,))
        # A URL the run never sent to is another, as before, and stays so though the refused resume recorded it.
        for _ in range(2):
            refused = await _resume_refused(run_dir, at(one, three))
            now = ", ".join(sorted([one.base_url, three.base_url]))
            assert f"endpoint {one.base_url} (now {now}, which serves '/models/a.gguf')" in str(refused)
        assert three.chat_bodies() == []
        one.reset()
        two.reset()
        store, again, todo = prepare_run(run_dir, at(one, two), None, resume=True)
        with store:
            summary = await run_problems(again, todo, store)
        assert summary.done == 2 and one.chat_bodies() + two.chat_bodies()


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


async def test_a_refused_resume_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    # The resume's settings were recorded before its server was asked what it serves: the refused resume left the run
    # claiming settings it never ran with (here a timeout), and the next resume compared against them.
    with SimServer(SimScript(model="model-a")) as server:
        settings = settings_for(server, endpoint__model=None, method={"name": "majority", "params": {"k": 2}})
        run_dir = tmp_path / "run"
        await _run_then_stop(run_dir, settings)
        before = _files(run_dir)
        server.set_script(SimScript(model="model-b"))
        await _resume_refused(run_dir, _resumed(run_dir, server.base_url, **{"endpoint.timeout_s": 9}))
        assert _files(run_dir) == before
        # A resume that goes on records its settings.
        server.set_script(SimScript(model="model-a"))
        await _resume(run_dir, server.base_url)
    assert stored_settings(run_dir).endpoint.timeout_s == 5
