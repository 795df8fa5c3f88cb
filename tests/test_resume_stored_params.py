"""A run stored with method parameters a later check refuses (mode=proof for majority vote, a vote rule in proof
mode, a TMAS role's ``extra_body`` key that tmas sends itself) is refused on resume in one line naming the run, the
stored parameter and what is kept, before any call and with its store untouched; its finished work still reads."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.api import aresume
from tmas.cli.main import app
from tmas.errors import InputError
from tmas.methods import METHODS
from tmas.methods.majority import MajorityParams
from tmas.problems import Problem
from tmas.runner import prepare_run, stored_settings
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript

PROBLEMS = [Problem(problem_id=f"p{k}", question=f"What is {k + 2}*7?", answer=str(7 * (k + 2))) for k in range(2)]
KEPT = "its finished work is kept and reads as it ran (tmas report, tmas export, tmas view): start a new run for the"

CASES = {
    "majority in proof mode": (
        "majority",
        {"k": 2},
        {"mode": "proof"},
        f"method.params.mode = \"proof\" (method 'majority': {MajorityParams.proof_refused})",
    ),
    "a vote in proof mode": (
        "tmas",
        {"n": 2, "m": 1, "iterations": 1},
        {"mode": "proof", "select": "vote"},
        "method parameters (method 'tmas': select=vote counts equal answers and mode=proof has none, no two proofs"
        " being counted equal: proofs are chosen by verifier score, select=best_score)",
    ),
    "a key tmas sends in a role's extra_body": (
        "tmas",
        {"n": 2, "m": 1, "iterations": 1},
        {"sampling": {"solution": {"extra_body": {"top_k": 20}}}},
        "method parameters (method 'tmas': sampling.solution.extra_body.top_k would replace the top_k tmas sends"
        " from its settings: set sampling.solution.top_k instead)",
    ),
}


async def stored_with(tmp_path: Path, method: str, params: dict[str, Any], stored: dict[str, Any]) -> Path:
    """A run of ``method`` stopped after its first problem, its parameters rewritten to ``stored`` as a tmas that
    took them stored them."""
    run_dir = tmp_path / "run"
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": method, "params": params}))
    await scripted_run(model, run_dir, PROBLEMS)
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")
        db.execute("DELETE FROM result_summaries WHERE problem_id = 'p1'")
    with RunStore(run_dir) as store:
        settings, recorded = store.get_meta("settings"), store.get_meta("method")
        settings["method"]["params"].update(stored)
        recorded["params"].update(stored)
        store.set_meta("settings", settings)
        store.set_meta("method", recorded)
    return run_dir


def _calls_and_results(run_dir: Path) -> tuple[int, list[str]]:
    with RunStore(run_dir, read_only=True) as store:
        return sum(1 for _ in store.calls()), [r.problem_id for r in store.results()]


@pytest.mark.parametrize("case", list(CASES))
async def test_a_run_stored_with_parameters_refused_since_is_refused_on_resume_in_one_line(
    tmp_path: Path, case: str
) -> None:
    method, params, stored, said = CASES[case]
    run_dir = await stored_with(tmp_path, method, params, stored)
    before = _calls_and_results(run_dir)
    line = f"{run_dir}: cannot resume: this version of tmas refuses the run's stored {said}; {KEPT} problems it left"
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir), "-y"])
    assert isinstance(out.exception, InputError), out.output
    assert str(out.exception) == line
    model = ScriptedModel(SimScript(), stored_settings(run_dir))
    with pytest.raises(InputError) as caught:
        await aresume(run_dir, model=model)
    assert str(caught.value) == line
    with pytest.raises(InputError) as caught:
        prepare_run(run_dir, stored_settings(run_dir), None, resume=True, own_model=True)
    assert str(caught.value) == line
    assert model.calls == [] and _calls_and_results(run_dir) == before == (before[0], ["p0"])
    # What it finished still reads as it ran.
    exported = CliRunner().invoke(app, ["export", str(run_dir)])
    assert exported.exit_code == 0, exported.output
    assert [json.loads(row)["problem_id"] for row in exported.output.splitlines()] == ["p0"]


async def test_a_value_given_now_for_the_refused_parameter_resumes(tmp_path: Path) -> None:
    # Given another mode now, the run is resumed with it (its finished problem solved again under it).
    run_dir = await stored_with(tmp_path, "majority", {"k": 2}, {"mode": "proof"})
    model = ScriptedModel(SimScript(), stored_settings(run_dir))
    summary = await aresume(run_dir, params={"mode": "numeric"}, model=model)
    assert summary.done == 2 and summary.failed == 0


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("majority", {"mode": "proof"}),
        ("mattrl", {"mode": "proof"}),
        ("verify_refine", {"mode": "proof", "select": "vote"}),
        ("tmas", {"mode": "proof", "select": "vote"}),
        ("tmas", {"sampling": {"verifier": {"extra_body": {"max_tokens": 9}}}}),
    ],
)
def test_a_stored_runs_parameters_read_back_pass_the_checks_added_since_and_no_other(
    method: str, params: dict[str, Any]
) -> None:
    cls = METHODS[method].Params
    with pytest.raises(ValidationError):
        cls.model_validate(params)
    assert cls.as_stored(params).model_dump(mode="json")["mode"] == params.get("mode", "numeric")
    with pytest.raises(ValidationError):
        cls.as_stored({**params, "iterations": 0})
