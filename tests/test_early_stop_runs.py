"""TMAS's early stop through whole runs, in process on the scripted model: settled iterations must come in a row, the
agreement and the verification score a settled iteration needs are parameters, and a run that settles sends exactly
the fewest calls the estimate gives."""

from __future__ import annotations

from typing import Any

import pytest

from scripted_runs import by_role, run_scripted
from tmas.methods import create_method
from tmas.methods.tmas import SETTLED
from tmas.planning.estimate import calls_per_problem
from tmas.testing import Rule

PASS = Rule(role="verifier", replies=["## Analysis\nEvery step checks out.\n\n## Score\nScore: 1"])
GAP = Rule(role="verifier", replies=["## Analysis\nOne step is not justified.\n\n## Score\nScore: 0.5"])


def boxed(answer: str) -> str:
    return f"Working it out by hand.\n\n\\boxed{{{answer}}}"


async def test_patience_counts_settled_iterations_in_a_row() -> None:
    # n = 2, patience 2. Iteration 0 settles (both 391, both passed); iteration 1's first solution boxes 390, which
    # breaks the run; iterations 2 and 3 settle: the stop comes after iteration 3, not after iteration 1.
    rules = [
        Rule(role="solution", times=2, replies=[boxed("391")]),
        Rule(role="solution", times=1, replies=[boxed("390")]),
        PASS,
    ]
    result, model = await run_scripted("tmas", rules, n=2, m=1, iterations=5, early_stop=True, early_stop_patience=2)
    assert result.stopped_reason == SETTLED and result.answer == "391"
    assert [r.iteration for r in result.iterations] == [0, 1, 2, 3]
    assert sorted(c.answer or "" for c in result.iterations[1].candidates) == ["390", "391"]
    # Iterations 0-2 are whole (2 + 2 + 2 + 2 memory calls); the stop skips iteration 3's memory update.
    assert by_role(model) == {"solution": 8, "verifier": 8, "summary": 8, "experience": 3, "guideline": 3}
    record = result.iterations[3].state["early_stop"]
    assert record["iteration"] == 3 and "settled for 2 consecutive iteration(s)" in record["reason"]
    assert all("early_stop" not in r.state for r in result.iterations[:3])


@pytest.mark.parametrize(("score", "stops"), [(None, False), (0.5, True)])
async def test_the_score_a_settled_iteration_needs_is_a_parameter(score: float | None, stops: bool) -> None:
    # Every verification gives 0.5: below the default 0.9, so the run goes on; at early_stop_score 0.5 it settles.
    params: dict[str, Any] = {"n": 2, "m": 1, "iterations": 2, "early_stop": True, "early_stop_patience": 1}
    if score is not None:
        params["early_stop_score"] = score
    result, model = await run_scripted("tmas", [GAP], **params)
    assert (result.stopped_reason == SETTLED) is stops and result.answer == "391"
    if stops:
        assert by_role(model) == {"solution": 2, "verifier": 2, "summary": 2}
        assert result.iterations[0].state["early_stop"]["lowest_verification"] == 0.5
    else:
        assert len(model.calls) == 12 and len(result.iterations) == 2


async def test_a_split_vote_settles_at_the_agreement_it_is_given() -> None:
    # The two candidates box 391 and 390 in turn: agreement 0.5. The default (1.0) never settles; 0.5 does, and the
    # agreeing candidate's verification alone counts.
    rules = [Rule(role="solution", replies=[boxed("391"), boxed("390")]), PASS]
    params = {"n": 2, "m": 1, "iterations": 3, "early_stop": True, "early_stop_patience": 1}
    strict, _ = await run_scripted("tmas", rules, **params)
    assert strict.stopped_reason is None and len(strict.iterations) == 3
    split, model = await run_scripted("tmas", rules, early_stop_agreement=0.5, **params)
    assert split.stopped_reason == SETTLED and len(model.calls) == 6
    record = split.iterations[0].state["early_stop"]
    assert (record["agreement"], record["lowest_verification"]) == (0.5, 1.0)


@pytest.mark.parametrize(
    "params",
    [
        {"n": 2, "m": 1, "iterations": 3},
        {"n": 2, "m": 2, "iterations": 4, "early_stop_patience": 1},
        {"n": 3, "m": 1, "iterations": 4, "early_stop_patience": 3},
        {"n": 2, "m": 1, "iterations": 3, "early_stop_patience": 1, "skip_final_memory": False},
    ],
)
async def test_a_run_that_settles_sends_the_estimates_fewest_calls(params: dict[str, Any]) -> None:
    params = {**params, "early_stop": True}
    result, model = await run_scripted("tmas", [PASS], **params)
    count = calls_per_problem(create_method("tmas", params))
    assert result.stopped_reason == SETTLED and count.fewest is not None
    assert by_role(model) == count.fewest and len(model.calls) == count.fewest_total < count.total


async def test_settling_on_the_last_iteration_saves_nothing_and_is_no_stop() -> None:
    # Patience 2 over 2 iterations: settled only once the last one ends, with nothing left to skip.
    params = {"n": 2, "m": 1, "iterations": 2, "early_stop": True}
    result, model = await run_scripted("tmas", [PASS], **params)
    assert result.stopped_reason is None and len(result.iterations) == 2
    count = calls_per_problem(create_method("tmas", params))
    assert count.exact and len(model.calls) == count.total == 12


async def test_an_answerless_candidate_scores_0_and_counts_against_the_agreement() -> None:
    # n = 2: the first solution gives no answer (iteration 0 sends no reminder), the other boxes 391, and every
    # verification passes. The answerless one scores 0 whatever its verifier says, and only 1 of the 2 candidates
    # agrees: iteration 0 is not settled. Iteration 1 (both 391) settles, but it is the last: no stop.
    rules = [Rule(role="solution", times=1, replies=["Working it out by hand, no result yet."]), PASS]
    params = {"n": 2, "m": 1, "iterations": 2, "early_stop": True, "early_stop_patience": 1}
    result, _ = await run_scripted("tmas", rules, **params)
    first = result.iterations[0]
    [silent] = [c for c in first.candidates if c.answer is None]
    assert silent.score == 0.0 and [v.score for v in silent.meta.verifications or []] == [1.0]
    assert (first.state["agreement"], first.state["mean_score"]) == (0.5, 0.5)
    assert "early_stop" not in first.state
    assert result.stopped_reason is None and len(result.iterations) == 2


async def test_a_failed_verification_counts_0_against_settling() -> None:
    # n = 1, m = 2: iteration 0's first verification fails and its second passes. The failed one reads 0, below
    # early_stop_score, so iteration 0 is not settled; iteration 1's both pass, and the run stops after it.
    rules = [Rule(role="verifier", fault="http_500", times=1), PASS]
    params = {"n": 1, "m": 2, "iterations": 3, "early_stop": True, "early_stop_patience": 1}
    result, _ = await run_scripted("tmas", rules, **params)
    first, second = result.iterations
    assert first.candidates[0].score == 0.5 and "early_stop" not in first.state
    assert second.state["early_stop"]["iteration"] == 1 and result.stopped_reason == SETTLED


@pytest.mark.parametrize("mode", ["numeric", "proof"])
async def test_a_failed_candidate_keeps_an_iteration_from_settling_in_either_mode(mode: str) -> None:
    # n = 2: iteration 0's first solution call fails, the other candidate writes a solution every verifier passes.
    # Half the candidates wrote something: in proof mode, as in numeric, iteration 0 is not settled (it was, read as
    # "agreement 1.00", since proofs have no answer to agree on); iteration 1 (both written and passed) settles.
    written = "## Solution\nSeventeen times twenty-three is 340 plus 51, that is 391.\n\n\\boxed{391}"
    rules = [Rule(role="solution", fault="http_400", times=1), Rule(role="solution", replies=[written]), PASS]
    params = {"n": 2, "m": 1, "iterations": 3, "early_stop": True, "early_stop_patience": 1, "epsilon": 0.0}
    result, _ = await run_scripted("tmas", rules, mode=mode, **params)
    first, second = result.iterations
    assert sum(c.error is not None for c in first.candidates) == 1
    assert first.state["agreement"] == 0.5 and "early_stop" not in first.state
    record = second.state["early_stop"]
    assert result.stopped_reason == SETTLED and (record["agreement"], record["lowest_verification"]) == (1.0, 1.0)
    said = "share of candidates with a proof 1.00" if mode == "proof" else "agreement 1.00"
    assert said in record["reason"]
