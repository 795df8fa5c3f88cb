"""A refining trajectory that sends a prompt it sent before changes a configured seed: Self-Refine and Verify-Refine
started afresh after a reply with no text, or asked again to refine a solution they hold on after an answerless
refinement; PaCoRe sampling the plain prompt again after a round with no successful response; a MATTRL seat whose
opinions keep failing, sent the same prompt again once the snapshot and bulletin stand still; TMAS's exploit candidates
sent the plain prompt again after an iteration that left no rollout; RSE sampling and distilling again what it did
before, its bank left as it was by unreadable distillations. Under the same seed a
server that honours it would give the same unusable reply again. Asserted on the request bodies the simulated server
received; a stored run's resume, replaying every call, sends the same seeds (nothing is asked again)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from test_wire_sampling import Q, bodies_by_role, settings_from, toml
from tmas.api import asolve
from tmas.llm.replay import StoreReplay
from tmas.methods import create_method
from tmas.methods.base import ProblemSession
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

SEEDED = "[sampling]\nseed = 7\n"
# A reply that copies the concise generation prompt's instruction as its answer: an echo, asked again once.
ECHO = "Finish with one last line that holds nothing but the final answer you computed.\n\\boxed{the final answer}"
ANSWERLESS = "## Feedback\nLooks fine.\n\n## Solution\nThe product is what it is."


def seeds(bodies: list[dict[str, Any]]) -> list[int]:
    return [b["seed"] for b in bodies]


@pytest.mark.parametrize("method", ["self_refine", "verify_refine"])
async def test_a_trajectory_started_afresh_changes_a_configured_seed(
    sim: SimServer, tmp_path: Path, method: str
) -> None:
    # Iteration 0's solution has no text: iteration 1 sends the generation prompt again, which the same seed would
    # answer with the same empty reply.
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[""], times=1)]))
    result = await asolve(Q, settings_from(tmp_path, toml(sim, method, SEEDED, n=1, iterations=3)))
    assert result.answer == "391"
    first, again = bodies_by_role(sim)["solution"]
    assert first["messages"] == again["messages"]
    assert first["seed"] == 7 and again["seed"] != 7


@pytest.mark.parametrize(("method", "role"), [("self_refine", "refiner"), ("verify_refine", "corrector")])
async def test_a_held_solution_refined_again_changes_a_configured_seed(
    sim: SimServer, tmp_path: Path, method: str, role: str
) -> None:
    # Iteration 1's refinement and its reminder give no answer: the trajectory holds its answered solution, and
    # iteration 2 sends the very prompt of iteration 1 again.
    sim.set_script(SimScript(rules=[Rule(role=role, replies=[ANSWERLESS], times=2)]))
    result = await asolve(Q, settings_from(tmp_path, toml(sim, method, SEEDED, n=1, iterations=3)))
    assert result.answer == "391"
    refined = bodies_by_role(sim)[role]
    # Iteration 1's refinement, its reminder (another prompt), iteration 2's refinement of the same solution.
    assert len(refined) == 3 and refined[0]["messages"] == refined[2]["messages"]
    assert seeds(refined)[:2] == [7, 7] and refined[2]["seed"] != 7


async def test_an_echo_retry_and_the_fresh_start_after_it_each_get_their_own_seed(
    sim: SimServer, tmp_path: Path
) -> None:
    # Iteration 0's solution echoes twice (no usable solution): the retry after the echo is the prompt's second
    # send, iteration 1's fresh start its third; each under a seed of its own.
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[ECHO], times=2)]))
    settings = settings_from(tmp_path, toml(sim, "self_refine", SEEDED, n=1, iterations=2, style="concise"))
    result = await asolve(Q, settings)
    assert result.answer == "391"
    solved = bodies_by_role(sim)["solution"]
    assert len(solved) == 3 and all(b["messages"] == solved[0]["messages"] for b in solved)
    assert solved[0]["seed"] == 7 and len(set(seeds(solved))) == 3


async def test_pacore_sampling_the_plain_prompt_again_changes_a_configured_seed(sim: SimServer, tmp_path: Path) -> None:
    # Round 0's responses both echo twice (no successful response): round 1 samples the generation prompt again.
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[ECHO], times=4)]))
    params = {"responses_per_round": 2, "iterations": 2, "synthesis": False, "style": "concise"}
    result = await asolve(Q, settings_from(tmp_path, toml(sim, "pacore", SEEDED, **params)))
    assert result.answer == "391"
    solved = bodies_by_role(sim)["solution"]
    assert len(solved) == 6 and all(b["messages"] == solved[0]["messages"] for b in solved)
    # Round 0: each response's first send (response i: the seed + i) and its echo retry; round 1: each one's third
    # send. Every send has a seed of its own: no retry draws with another response's seed.
    assert sorted(b["seed"] for b in solved if b["seed"] in (7, 8)) == [7, 8] and len(set(seeds(solved))) == 6


async def test_without_a_configured_seed_a_fresh_start_keeps_its_derived_seed(sim: SimServer, tmp_path: Path) -> None:
    # The derived seeds already differ by iteration: the count of sends changes none of them.
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[""], times=1)]))
    await asolve(Q, settings_from(tmp_path, toml(sim, "self_refine", n=1, iterations=2)))
    first, again = bodies_by_role(sim)["solution"]
    assert first["messages"] == again["messages"] and first["seed"] != again["seed"]


@pytest.mark.parametrize("method", ["self_refine", "verify_refine"])
async def test_a_resumed_run_sends_the_same_seeds_and_asks_nothing_again(tmp_path: Path, method: str) -> None:
    settings = scripted_settings(method={"name": method, "params": {"n": 2, "iterations": 3}}, sampling__seed=7)
    rules = [Rule(role="solution", replies=["", "", "So it is \\boxed{391}."], times=3)]
    model = ScriptedModel(SimScript(rules=rules), settings)
    problem = Problem(problem_id="q", question=Q, answer="391")
    await scripted_run(model, tmp_path / "run", [problem])
    sent = [(c.role, c.key.iteration, c.key.sample, c.body["seed"]) for c in model.calls_of("solution")]
    # Both trajectories start with no text and start afresh in iteration 1, under a seed of their own.
    assert [s[1] for s in sent] == [0, 0, 1, 1] and {s[3] for s in sent[2:]} != {7}
    # Solved again from the store: every call is replayed (its request, seed included, is the stored one), none sent.
    again = ScriptedModel(SimScript(rules=[Rule(replies=["unexpected"])]), settings)
    method = create_method(method, {"n": 2, "iterations": 3})
    with RunStore(tmp_path / "run", create=False) as store:
        replay = StoreReplay(again, store)
        result = await method.solve(ProblemSession(problem, replay, None, params=method.params))
    assert again.calls == [] and replay.replayed == len(model.calls)
    assert result.answer == "391"


async def test_a_mattrl_opinion_prompt_sent_again_changes_a_configured_seed(sim: SimServer, tmp_path: Path) -> None:
    # Every opinion of rounds 0 to 2 is empty: each seat keeps no attempt, the snapshot and bulletin stand still, and
    # round 2 sends each seat round 1's prompt again.
    sim.set_script(SimScript(rules=[Rule(role="specialist", replies=[""], times=6)]))
    await asolve(Q, settings_from(tmp_path, toml(sim, "mattrl", SEEDED, team_size=2, iterations=3)))
    opinions = bodies_by_role(sim)["specialist"]
    assert len(opinions) == 6
    # Round 1's prompts (calls 2 and 3, in either order) differ from round 0's; round 2's (4 and 5) are round 1's again.
    prompts = [json.dumps(b["messages"]) for b in opinions]
    assert len(set(prompts[:4])) == 4 and set(prompts[4:]) == set(prompts[2:4])
    # Seat i's opinion goes with the seed + i; sent again, with a seed of its own.
    assert seeds(opinions[:4]) == [7, 8, 7, 8] and all(b["seed"] not in (7, 8) for b in opinions[4:])


async def test_tmas_sampling_the_plain_prompt_again_changes_a_configured_seed(sim: SimServer, tmp_path: Path) -> None:
    # Iteration 0's solutions have no text: no rollout, no experience, so iteration 1's exploit candidates get the
    # plain prompt again, which the same seed would answer with the same empty replies.
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[""], times=2)]))
    params = {"n": 2, "m": 1, "iterations": 2, "epsilon": 0.0}
    result = await asolve(Q, settings_from(tmp_path, toml(sim, "tmas", SEEDED, **params)))
    assert result.answer == "391"
    solved = bodies_by_role(sim)["solution"]
    assert len(solved) == 4 and all(b["messages"] == solved[0]["messages"] for b in solved)
    # Candidate i's first solution goes with the seed + i (under one seed the N rollouts of iteration 0 were one
    # sample N times); asked again, each with a seed of its own.
    assert sorted(seeds(solved[:2])) == [7, 8] and len(set(seeds(solved))) == 4


async def test_rse_asked_again_with_a_bank_left_as_it_was_changes_a_configured_seed(
    sim: SimServer, tmp_path: Path
) -> None:
    # Every distillation is unreadable: the bank stays empty, so iteration 1 samples the plain prompt again and
    # distils the same solution again; under the same seed both would draw the same replies.
    sim.set_script(SimScript(rules=[Rule(role="distiller", replies=["nothing to distil"])]))
    result = await asolve(Q, settings_from(tmp_path, toml(sim, "rse", SEEDED, n=1, iterations=3)))
    assert result.answer == "391"
    bodies = bodies_by_role(sim)
    solved, distilled = bodies["solution"], bodies["distiller"]
    assert len(solved) == 3 and all(b["messages"] == solved[0]["messages"] for b in solved)
    assert len(distilled) == 2 and distilled[0]["messages"] == distilled[1]["messages"]
    assert solved[0]["seed"] == distilled[0]["seed"] == 7
    assert len(set(seeds(solved))) == 3 and distilled[1]["seed"] != 7
