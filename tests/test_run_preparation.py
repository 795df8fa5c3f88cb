"""A run's one preparation (tmas.runner.prepare_run): settings checked, then the store with the whole setup in it,
before the model is opened and any call sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.errors import ConfigError
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
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
        assert store.get_meta("method")["params"]["k"] == 4
        summary = await run_problems(more, todo, store, model=model)
        assert store.get_meta("method")["params"]["k"] == 4
    assert summary.done == 1 and len(model.calls) == 4  # two samples, then two more (the first two replayed)


def test_bad_method_parameters_stop_a_run_before_its_directory_exists(tmp_path: Path) -> None:
    settings = scripted_settings(method={"name": "majority", "params": {"no_such_parameter": 1}})
    with pytest.raises(ConfigError, match="no_such_parameter"):
        prepare_run(tmp_path / "run", settings, PROBLEMS, resume=False)
    assert not (tmp_path / "run").exists()
