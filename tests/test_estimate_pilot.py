"""The estimate a pilot measures, against what a whole run of the same settings really spends (every stored call, as
a run's spend is counted), in process on the scripted model the simulated server answers with: the expected tokens
come within a few percent of the spend, and the max_tokens ceiling is never below it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import run_tmas, scripted_settings
from scripted_runs import scripted_run
from tmas.methods import METHODS, create_method
from tmas.planning.estimate import estimate_point
from tmas.planning.pilot import run_pilot
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript, SimServer

PROBLEMS = [Problem(problem_id=f"p{i}", question=f"What is {i + 3}*7?", answer=str((i + 3) * 7)) for i in range(4)]

# Every method past the pilot's two iterations, where it cuts the structure, and the stopping rules.
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("cot", {}),
    ("majority", {"k": 3}),
    ("majority", {"k": 8, "stop": "beta", "round_size": 2}),
    ("self_refine", {"n": 2, "iterations": 3}),
    ("verify_refine", {"n": 2, "m": 2, "iterations": 3}),
    ("pacore", {"responses_per_round": 2, "iterations": 3}),
    ("rse", {"n": 2, "iterations": 3}),
    ("tmas", {"n": 2, "m": 2, "iterations": 3}),
    ("tmas", {"preset": "local"}),
    ("mattrl", {"team_size": 3, "iterations": 3}),
]


async def _pilot_and_run(
    method: str, params: dict[str, Any], tmp_path: Path, budget: dict[str, Any] | None = None
) -> tuple[float, float, float, int]:
    """The estimate of ``PROBLEMS`` from a pilot on them (two iterations at most), its max_tokens ceiling, the
    completion tokens a run of them spent, and the pilot's calls (under ``budget``, where given)."""
    settings = scripted_settings(method={"name": method, "params": params}, budget=budget or {})
    pilot = ScriptedModel(SimScript(), settings)
    rates = await run_pilot([("run", settings)], PROBLEMS, tmp_path / "pilot", model=pilot)
    solver = create_method(method, params)
    estimate = estimate_point("run", solver, settings, len(PROBLEMS), rates)
    ceiling = estimate_point("run", solver, settings, len(PROBLEMS), None)
    await scripted_run(ScriptedModel(SimScript(), settings), tmp_path / "run", PROBLEMS)
    with RunStore(tmp_path / "run", create=False) as store:
        spent = sum(c["completion_tokens"] for c in store.role_costs().values())
    assert estimate.basis == "pilot" and ceiling.basis == "max_tokens"
    assert estimate.completion_tokens is not None and ceiling.completion_tokens is not None
    return estimate.completion_tokens, ceiling.completion_tokens, spent, len(pilot.calls)


@pytest.mark.parametrize(("method", "params"), SETTINGS)
async def test_a_pilots_estimate_is_what_a_run_spends(method: str, params: dict[str, Any], tmp_path: Path) -> None:
    expected, ceiling, spent, _ = await _pilot_and_run(method, params, tmp_path)
    # The pilot saw the run's own problems: where it ran them whole, the estimate is their spend; where it cut them at
    # its second iteration, the rest is the mean per call of the calls the structure states beyond it.
    assert spent * 0.95 <= expected <= spent * 1.05, (expected, spent)
    assert spent <= ceiling


@pytest.mark.parametrize(
    ("method", "params", "calls"),
    [
        # Two solutions and two refinements a problem in the pilot; the budget lets a whole run send two more
        # refinements of the six its structure states beyond the pilot's: a third of them.
        ("self_refine", {"n": 2, "iterations": 5}, 6),
        # The budget stops each problem at the pilot's twelve calls: a whole run sends none beyond them.
        ("verify_refine", {"n": 2, "m": 2, "iterations": 4}, 12),
    ],
)
async def test_a_pilots_estimate_under_a_call_budget_is_what_a_run_spends(
    method: str, params: dict[str, Any], calls: int, tmp_path: Path
) -> None:
    expected, ceiling, spent, _ = await _pilot_and_run(method, params, tmp_path, {"calls": calls})
    # The scripted replies cost alike in the pilot and the run: the estimate is the run's spend.
    assert expected == spent, (expected, spent)
    assert spent <= ceiling


@pytest.mark.parametrize(("method", "params"), SETTINGS)
@pytest.mark.parametrize("budget", [{"tokens": 300}, {"tokens": 600, "count": "total"}])
async def test_a_pilots_estimate_under_a_token_budget_is_what_a_run_spends(
    method: str, params: dict[str, Any], budget: dict[str, Any], tmp_path: Path
) -> None:
    # A problem stops once it has spent its budget, passing it by the one call that went last: the estimate counts
    # that call at its mean (its prompt too where the budget counts prompts), so it is never below the run's spend
    # and above it by less than a call a problem. Stopped at the budget alone it was up to 20% below (TMAS, RSE,
    # MATTRL), and under a budget of prompt + completion tokens it was not cut at all (MATTRL 4 times the spend).
    expected, ceiling, spent, _ = await _pilot_and_run(method, params, tmp_path, budget)
    assert spent <= expected <= spent * 1.15, (expected, spent)
    assert spent <= ceiling


def test_every_registered_method_is_piloted_here() -> None:
    assert {method for method, _ in SETTINGS} == set(METHODS)


async def test_mattrl_counts_the_rounds_its_pilot_saw_deliberation_stop_after(tmp_path: Path) -> None:
    # The scripted specialists agree at once: one round of the three, 11 calls (recruit, 3 opinions, 3 x 2 reviews,
    # decision) and 732 completion tokens a problem, where the structure states 2 + 9 + 18 = 29 calls. The pilot's
    # problems stopped before its last iteration, so a whole run's stop there too: 4 x 732, not 29 calls each at the
    # pilot's means by role.
    expected, _, spent, pilot_calls = await _pilot_and_run("mattrl", {"team_size": 3, "iterations": 3}, tmp_path)
    assert pilot_calls == 4 * 11
    assert expected == spent == 4 * 732


def test_a_dry_run_with_a_pilot_says_mattrl_spends_what_its_pilot_problems_spent(
    sim: SimServer, tmp_path: Path
) -> None:
    # Ten problems, the pilot on two: each converges after its first round, 732 completion tokens (as above), so
    # 7,320 in all; counted at the structure's 29 calls a problem it said 19k. The fewest: recruit, one opinion and
    # the decision a problem at the pilot's means, 10 x (2 x 79.5 + 35) = 1,940.
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        "".join(
            f'{{"problem_id": "q{i}", "question": "What is {i + 3}*7?", "answer": "{(i + 3) * 7}"}}\n'
            for i in range(10)
        )
    )
    base = ["run", str(problems), "--out", str(tmp_path / "run"), "--base-url", sim.base_url, "--method", "mattrl"]
    out = run_tmas(*base, "--dry-run", "--pilot", "2", text=True)
    assert out.returncode == 0, out.stderr
    said = "what its problems spent, and the calls it cut off at its mean per call, measured by the pilot"
    assert f"  completion tokens: 1.9k to 7.3k ({said})" in out.stderr
