"""A problem solved again from its run store under a budget meets the budget decisions of its live run: replayed
calls come back at once, one branch after the other, whatever order the live run's replies of calls made side by side
came back in; no call the live run's budget refused is sent, none it made is refused. Stored calls the pass no longer
asks leave its budget whole, and a lower budget stops the replay at its limit. In process on the scripted model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from test_echo_retry_refused import SOLUTION_ECHO, Q, memory_echoes
from tmas.llm.replay import StoreReplay
from tmas.methods import create_method
from tmas.methods.base import ProblemSession
from tmas.problems import Problem
from tmas.runner import solve_one
from tmas.store.records import IterationRecord
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript

# Calls made side by side whose replies the live run's budget counted in another order than a replay meets them:
# two TMAS candidates (the retry of candidate 0's echo refused while candidate 1's solution was in flight), the two
# memory updates (each echoes; the experience update's retry refused while the guideline call was in flight), and two
# candidates under a token budget of 60, 30 tokens a reply and 40 held a call: candidate 1's solution comes back
# first, its verification waits, and candidate 0's echo brings the spend to 60, which refuses its retry and that
# verification.
THIRTY = ScriptedUsage(prompt_tokens=100, completion_tokens=30)
SIDE_BY_SIDE = [
    (
        {"n": 2, "m": 1, "iterations": 2, "style": "concise"},
        [Rule(role="solution", pattern="", replies=[SOLUTION_ECHO], times=1)],
        {"budget": {"calls": 2}},
        2,
    ),
    ({"n": 1, "m": 1, "iterations": 2}, memory_echoes(), {"budget": {"calls": 5}}, 5),
    (
        {"n": 2, "m": 1, "iterations": 2, "style": "concise"},
        [
            Rule(role="solution", pattern="", replies=[SOLUTION_ECHO], times=1, usage=THIRTY, latency_s=0.05),
            Rule(usage=THIRTY),
        ],
        {"budget": {"tokens": 60}, "sampling": {"temperature": 0.7, "max_tokens": 40}},
        2,
    ),
]


@pytest.mark.parametrize(("params", "rules", "setup", "calls"), SIDE_BY_SIDE)
async def test_calls_side_by_side_solved_again_from_the_store_meet_the_live_budget_decisions(
    tmp_path: Path, params: dict[str, Any], rules: list[Rule], setup: dict[str, Any], calls: int
) -> None:
    # Solved again from its store, the problem's stored replies come back at once, one sibling's chain after the
    # other: its budget must still let go every call the live run made and refuse every one it refused, so nothing
    # new is asked and the records are the live run's.
    settings = scripted_settings(method={"name": "tmas", "params": params}, **setup)
    problem = Problem(problem_id="q", question=Q, answer="391")
    solver = create_method("tmas", params)
    with RunStore(tmp_path / "run") as store:
        first_model = ScriptedModel(SimScript(rules=rules), settings)
        session = ProblemSession(
            problem, StoreReplay(first_model, store), store, budget=settings.budget, params=solver.params
        )
        first = await solve_one(solver, session)
        again_model = ScriptedModel(SimScript(), settings)
        replay = StoreReplay(again_model, store)
        again = await solve_one(
            solver, ProblemSession(problem, replay, store, budget=settings.budget, params=solver.params)
        )
    assert len(first_model.calls) == calls and first.stopped_reason == "budget"
    assert again_model.calls == [] and replay.replayed == calls
    assert (again.stopped_reason, again.answer) == (first.stopped_reason, first.answer)
    # Notes are written as replies come back: the same notes, in the order the replays came back in.
    assert [unordered_notes(r) for r in again.iterations] == [unordered_notes(r) for r in first.iterations]


def unordered_notes(record: IterationRecord) -> dict[str, Any]:
    return {**record.model_dump(), "notes": sorted(record.notes)}


async def test_stored_calls_a_problem_solved_again_no_longer_asks_leave_its_budget_whole(tmp_path: Path) -> None:
    # The first pass spends its 3 calls; solved again in another style, the problem asks its solution and its
    # verification otherwise and replays the summary (its prompt is the same): its budget counts the calls it asks,
    # not the stored solution and verification it no longer asks, and stops at the same 3.
    problem = Problem(problem_id="q", question=Q, answer="391")
    passes = []
    with RunStore(tmp_path / "run") as store:
        for style in ("concise", "paper"):
            params = {"n": 1, "m": 1, "iterations": 2, "style": style}
            settings = scripted_settings(method={"name": "tmas", "params": params}, budget={"calls": 3})
            solver = create_method("tmas", params)
            model = ScriptedModel(SimScript(), settings)
            replay = StoreReplay(model, store)
            session = ProblemSession(problem, replay, store, budget=settings.budget, params=solver.params)
            passes.append((await solve_one(solver, session), model, replay))
    (first, first_model, _), (again, again_model, replay) = passes
    assert [c.role for c in first_model.calls] == ["solution", "verifier", "summary"]
    assert [c.role for c in again_model.calls] == ["solution", "verifier"] and replay.replayed == 1
    stop = "stopped: budget spent (3 calls of a budget of 3) in iteration 0"
    assert first.iterations[-1].notes[-1] == again.iterations[-1].notes[-1] == stop


async def test_a_problem_solved_again_under_a_lower_budget_replays_up_to_it(tmp_path: Path) -> None:
    # 5 calls made under a budget of 5; solved again from the store under a budget of 3, the replay stops at the
    # third call: the stored calls the live run made are checked against what was replayed before them.
    params = {"n": 1, "m": 1, "iterations": 2}
    problem = Problem(problem_id="q", question=Q, answer="391")
    solver = create_method("tmas", params)
    with RunStore(tmp_path / "run") as store:
        for calls in (5, 3):
            settings = scripted_settings(method={"name": "tmas", "params": params}, budget={"calls": calls})
            model = ScriptedModel(SimScript(), settings)
            replay = StoreReplay(model, store)
            session = ProblemSession(problem, replay, store, budget=settings.budget, params=solver.params)
            result = await solve_one(solver, session)
    assert model.calls == [] and replay.replayed == 3
    assert result.iterations[-1].notes[-1] == "stopped: budget spent (3 calls of a budget of 3) in iteration 0"
