"""A run's one preparation (tmas.runner.prepare_run): settings checked, then the store with the whole setup in it,
before the model is opened and any call sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.errors import ConfigError, InputError
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems, stored_settings
from tmas.store.run_lock import running
from tmas.store.run_store import RunStore, StoreError
from tmas.testing import ScriptedModel, SimScript

PROBLEMS = [Problem(problem_id="a", question="What is 17*23?", answer="391")]


def test_the_store_holds_the_whole_setup_before_any_call(tmp_path: Path) -> None:
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "majority", "params": {"k": 3}}))
    store, settings, _ = prepare_run(tmp_path / "run", model.settings, PROBLEMS, resume=False, own_model=True)
    with store:
        assert store.get_meta("settings") == settings.model_dump(mode="json")
        assert store.get_meta("method")["name"] == "majority"
        assert store.get_meta("method")["params"]["k"] == 3
        assert store.get_meta("prompt_overrides") == {}
    assert model.calls == []


async def test_a_resume_records_the_new_setup_and_the_run_keeps_it(tmp_path: Path) -> None:
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "majority", "params": {"k": 2}}))
    await scripted_run(model, tmp_path / "run", PROBLEMS)
    more = scripted_settings(method={"name": "majority", "params": {"k": 4}})
    store, more, todo = prepare_run(tmp_path / "run", more, None, resume=True, own_model=True)
    with store:
        assert store.get_meta("method")["params"]["k"] == 2  # recorded once the resume goes on, before its first call
        summary = await run_problems(more, todo, store, model=model)
        assert store.get_meta("method")["params"]["k"] == 4
    assert summary.done == 1 and len(model.calls) == 4  # two samples, then two more (the first two replayed)


def test_bad_method_parameters_stop_a_run_before_its_directory_exists(tmp_path: Path) -> None:
    settings = scripted_settings(method={"name": "majority", "params": {"no_such_parameter": 1}})
    with pytest.raises(ConfigError, match="no_such_parameter"):
        prepare_run(tmp_path / "run", settings, PROBLEMS, resume=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("problems_stored", [False, True])
async def test_a_new_run_killed_while_storing_its_problems_starts_again_in_its_directory(
    tmp_path: Path, problems_stored: bool
) -> None:
    run_dir = tmp_path / "run"
    # What a kill leaves: the store made, its problems' transaction never committed (or committed, and the kill came
    # before the setup was recorded). No call was made from it.
    with RunStore(run_dir) as left:
        if problems_stored:
            left.add_problems(PROBLEMS)
    with pytest.raises(StoreError, match="stopped while it stored its problems, before any call: start it again"):
        stored_settings(run_dir)
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "majority", "params": {"k": 2}}))
    summary = await scripted_run(model, run_dir, PROBLEMS)
    assert summary.done == 1 and len(model.calls) == 2
    # Now it holds a run: a new one there is refused, a resume replays it.
    with pytest.raises(InputError, match="already holds a run"):
        prepare_run(run_dir, model.settings, PROBLEMS, resume=False, own_model=True)
    again = await scripted_run(model, run_dir, settings=stored_settings(run_dir))
    assert again.done == 1 and len(model.calls) == 2


async def test_a_store_with_calls_and_no_settings_is_never_started_over(tmp_path: Path) -> None:
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "majority", "params": {"k": 2}}))
    await scripted_run(model, tmp_path / "run", PROBLEMS)
    with RunStore(tmp_path / "run") as store:
        store.set_meta("settings", None)
    with pytest.raises(InputError, match="already holds a run"):
        prepare_run(tmp_path / "run", model.settings, PROBLEMS, resume=False, own_model=True)
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.call_counts()["calls"] == 2


def test_a_store_another_process_is_still_making_is_left_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore(run_dir) as making:
        making.add_problems(PROBLEMS)
    settings = scripted_settings(method={"name": "majority", "params": {"k": 2}})
    # The other process holds the run's lock while it stores its problems and records its setup.
    with running(run_dir), pytest.raises(InputError, match="this process is running this run already"):
        prepare_run(run_dir, settings, PROBLEMS, resume=False, own_model=True)
    with RunStore(run_dir, create=False) as store:
        assert store.problem_count() == 1


async def test_a_resume_refused_beside_a_running_process_writes_nothing_into_its_store(tmp_path: Path) -> None:
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "majority", "params": {"k": 2}}))
    run_dir = tmp_path / "run"
    await scripted_run(model, run_dir, PROBLEMS)
    with RunStore(run_dir, create=False) as store:
        before = (store.get_meta("settings"), store.get_meta("method"))
    more = scripted_settings(method={"name": "majority", "params": {"k": 4}})
    # The other process runs the run (it holds the lock): the resume with another k is refused before it records it.
    with running(run_dir), pytest.raises(InputError, match="this process is running this run already"):
        prepare_run(run_dir, more, None, resume=True, own_model=True)
    with RunStore(run_dir, create=False) as store:
        assert (store.get_meta("settings"), store.get_meta("method")) == before


@pytest.mark.parametrize("resume", [False, True])
async def test_a_prepared_run_holds_its_lock_until_its_store_is_closed(tmp_path: Path, resume: bool) -> None:
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "majority", "params": {"k": 2}}))
    run_dir = tmp_path / "run"
    if resume:
        await scripted_run(model, run_dir, PROBLEMS)
    store, settings, todo = prepare_run(
        run_dir, model.settings, None if resume else PROBLEMS, resume=resume, own_model=True
    )
    with store:
        # Between its preparation and its solving (a model loading meanwhile), no other process takes the run over.
        with pytest.raises(InputError, match="this process is running this run already"), running(run_dir):
            pass
        summary = await run_problems(settings, todo, store, model=model)
        with pytest.raises(InputError, match="this process is running this run already"), running(run_dir):
            pass
    assert summary.done == 1
    with running(run_dir):  # let go with the store
        pass
