"""Runs that finish: problems in flight default to what the endpoint serves, not the call cap;
the simulated server counts the problems in flight at once; progress (in process) names each active problem's
iteration, a run on a model of one's own sized by the run's problems_in_flight."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings, settings_for
from tmas.cli.progress import RunProgress
from tmas.config import Settings, load_settings, with_overrides
from tmas.problems import Problem
from tmas.runner import RunState, prepare_run, problems_in_flight, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript, SimServer


def remote(**data: Any) -> Settings:
    return Settings.model_validate({"endpoint": {"base_url": "http://a/v1"}, **data})


def test_the_default_is_what_the_solution_endpoint_serves() -> None:
    # No cap known: the call cap, as before.
    assert problems_in_flight(remote()) == 64
    assert problems_in_flight(remote(concurrency=8)) == 8
    # max_in_flight per replica times the replicas.
    two = {"base_url": "http://a/v1,http://b/v1", "max_in_flight": 3}
    assert problems_in_flight(Settings.model_validate({"endpoint": two})) == 6
    # The solution role's own endpoint and cap win over the default's.
    role = {"base_url": ["http://c/v1"], "max_in_flight": 2}
    assert problems_in_flight(Settings.model_validate({"endpoint": two, "roles": {"solution": role}})) == 2
    inherits = {"base_url": ["http://c/v1"]}
    assert problems_in_flight(Settings.model_validate({"endpoint": two, "roles": {"solution": inherits}})) == 3
    # The embedded model: its slots times its replicas.
    assert problems_in_flight(Settings()) == 4
    assert problems_in_flight(Settings.model_validate({"local": {"parallel": 3, "replicas": 2}})) == 6
    # Never more than the call cap; an explicit setting wins, under the same cap.
    assert problems_in_flight(Settings.model_validate({"local": {"parallel": 8}, "concurrency": 5})) == 5
    assert problems_in_flight(remote(problems_in_flight=2)) == 2
    assert problems_in_flight(remote(problems_in_flight=100, concurrency=10)) == 10


def test_the_setting_comes_from_the_environment_and_is_checked() -> None:
    assert load_settings(environ={"TMAS_PROBLEMS_IN_FLIGHT": "3"}).problems_in_flight == 3
    with pytest.raises(Exception, match="problems_in_flight"):
        load_settings(environ={"TMAS_PROBLEMS_IN_FLIGHT": "0"})


def _problems(n: int) -> list[Problem]:
    return [Problem(problem_id=f"q{i}", question=f"What is {i}+{i}?", answer=str(2 * i)) for i in range(n)]


def _run(sim: SimServer, tmp_path: Path, name: str, **overrides: Any) -> tuple[list[str], RunState]:
    """Six problems of majority vote (two iterations of two samples each: several calls per problem, in turn)."""
    settings = settings_for(sim, method={"name": "majority", "params": {"k": 2, "iterations": 2}}, **overrides)
    store, settings, todo = prepare_run(tmp_path / name, settings, _problems(6), resume=False)
    finished: list[str] = []
    state = RunState()
    with store:
        summary = asyncio.run(
            run_problems(settings, todo, store, state=state, on_result=lambda r: finished.append(r.problem_id))
        )
    assert summary.done == 6
    return finished, state


def test_problems_in_flight_never_exceed_the_endpoints_slots(tmp_path: Path) -> None:
    with SimServer(SimScript(latency_s=0.02)) as sim:
        # Two slots on the endpoint, the call cap at its default of 64.
        finished, state = _run(sim, tmp_path, "slots", endpoint__max_in_flight=2)
        assert state.problem_slots == 2
        assert sim.stats().max_problems_in_flight == 2
        assert sim.stats().max_in_flight <= 2
        # Problems are taken in order and written as they finish, not all at the end.
        assert sorted(finished) == [f"q{i}" for i in range(6)]
        # The server's count is real: with every problem let in at once, it sees more than two.
        sim.reset()
        _run(sim, tmp_path, "all", endpoint__max_in_flight=2, problems_in_flight=6)
        assert sim.stats().max_problems_in_flight > 2


async def test_progress_without_a_terminal_is_a_line_per_finished_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The progress `tmas run -m majority -p k=2 -T 2 --problems-in-flight 1` prints without a terminal, in process.
    params = {"k": 2, "iterations": 2}
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "majority", "params": params}))
    # The flag is the run's: the model's own settings do not hold it.
    settings = with_overrides(model.settings, {"problems_in_flight": 1})
    store, settings, todo = prepare_run(tmp_path / "run", settings, _problems(3), resume=False, own_model=True)
    state = RunState()
    progress = RunProgress(state, live=False)
    with store:
        async with progress.running():
            await run_problems(settings, todo, store, state=state, on_result=progress.on_result, model=model)
    log = capsys.readouterr().err.splitlines()
    # A line per finished problem, none per iteration (the live display and the plain summary name the iterations).
    assert [line.split(" · ")[:2] for line in log] == [
        [f"[{i + 1}/3] q{i}: done", f"answer '{2 * i}'"] for i in range(3)
    ]
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.get_meta("settings")["problems_in_flight"] == 1
