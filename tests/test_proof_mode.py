"""Proof mode (``mode = "proof"``): an answer is a written solution, no two counted equal. The methods whose choice
counts equal answers refuse it in one line naming the parameter; the others run it end to end on the scripted model
with prompts that ask for a proof, no reminder of a missing box, and the proof returned."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import scripted_settings
from scripted_runs import by_role, run_scripted, scripted_run
from tmas.errors import ConfigError
from tmas.methods import create_method
from tmas.problems import Problem
from tmas.reports.report import evaluate_run
from tmas.testing import Rule, ScriptedModel, SimScript

PROOF = "## Solution\nSeventeen times twenty-three is 340 plus 51, that is 391, which proves the claim."
VERDICT = "## Analysis\nEvery step holds.\n\n## Score\nScore: 1"


def test_majority_vote_refuses_proof_mode_which_it_could_not_count() -> None:
    # k proofs are never counted equal: the vote read every one as tied and returned the first of k samples.
    with pytest.raises(ConfigError) as caught:
        create_method("majority", {"k": 3, "mode": "proof"})
    message = str(caught.value)
    assert message.startswith("method 'majority': bad value (") and "'mode'" in message
    assert "mode=proof does not apply to it" in message and "\n" not in message


@pytest.mark.parametrize(
    ("method", "rule"),
    [
        *(("tmas", rule) for rule in ("vote", "score_weighted_vote", "confidence_vote", "filtered_vote")),
        *(("verify_refine", rule) for rule in ("vote", "score_weighted_vote")),
    ],
)
def test_a_rule_that_counts_answers_is_refused_in_proof_mode(method: str, rule: str) -> None:
    # Proofs have no answers to count: the rule read as best_score, silently (a confidence rule still asked the
    # server for log-probabilities it never read).
    with pytest.raises(ConfigError) as caught:
        create_method(method, {"mode": "proof", "select": rule})
    message = str(caught.value)
    assert message.startswith(f"method {method!r}: select={rule} counts equal answers and mode=proof has none")
    assert "select=best_score" in message and "\n" not in message
    # The same rule in numeric mode, and best_score in proof mode, are taken.
    create_method(method, {"select": rule})
    create_method(method, {"mode": "proof", "select": "best_score"})


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("cot", {}),
        ("self_refine", {"n": 2, "iterations": 2}),
        ("verify_refine", {"n": 2, "m": 1, "iterations": 2}),
        ("pacore", {"responses_per_round": 2, "iterations": 1}),
        ("rse", {"n": 2, "iterations": 2, "embedder": "local"}),
        ("tmas", {"n": 2, "m": 1, "iterations": 2, "epsilon": 0.0}),
    ],
)
async def test_a_proof_mode_run_asks_for_a_proof_and_returns_one(method: str, params: dict[str, object]) -> None:
    rules = [
        Rule(role="verifier", replies=[VERDICT]),
        Rule(role="distiller", replies=['{"propositions": [], "pitfalls": []}']),
        *(Rule(role=role, replies=[PROOF]) for role in ("solution", "refiner", "corrector", "synthesis")),
    ]
    result, model = await run_scripted(method, rules, mode="proof", **params)
    # No prompt asks for a boxed answer, and no reply without a box is sent back with a reminder: every solution
    # call is one the method plans.
    assert not any("boxed" in m.content for c in model.calls for m in c.messages)
    assert by_role(model) == create_method(method, {**params, "mode": "proof"}).calls_per_problem().expected
    assert result.status == "done" and result.answer is None
    assert result.text == PROOF.removeprefix("## Solution\n")


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("self_refine", {"n": 3, "iterations": 2}),
        ("pacore", {"responses_per_round": 3, "iterations": 1, "synthesis": False}),
        ("rse", {"n": 3, "iterations": 1}),
    ],
)
async def test_a_baseline_without_scores_returns_its_first_written_proof(
    method: str, params: dict[str, object]
) -> None:
    # Different proofs, none scored and none counted equal to another: the first candidate, in candidate order, that
    # wrote one is returned (the first solution call fails: in PaCoRe and RSE that leaves its candidate without a
    # proof; Self-Refine's trajectory starts again in iteration 1).
    proofs = [f"## Solution\nProof number {i}: 17 times 23 is 340 plus 51, that is 391." for i in range(3)]
    rules = [
        Rule(role="solution", fault="http_400", times=1),
        *(Rule(role=role, replies=proofs) for role in ("solution", "refiner")),
    ]
    result, _ = await run_scripted(method, rules, mode="proof", **params)
    last = result.iterations[-1]
    usable = [c for c in last.candidates if c.error is None]
    first = min(usable, key=lambda c: c.index)
    assert result.status == "done" and len({c.text for c in usable}) > 1
    assert result.text == first.text and last.selection is not None and last.selection.candidate == first.index


async def test_a_proof_mode_run_is_recorded_as_one_and_the_report_leaves_it_ungraded(tmp_path: Path) -> None:
    # Problems with reference answers, solved in proof mode by a baseline: the stored parameters say proof mode and the
    # report grades nothing (every proof would read as a wrong answer against the references).
    problems = [
        Problem(problem_id="p1", question="Prove that 17*23 is 391.", answer="391"),
        Problem(problem_id="p2", question="Prove that 12*12 is 144.", answer="144"),
    ]
    settings = scripted_settings(method={"name": "self_refine", "params": {"n": 2, "iterations": 2, "mode": "proof"}})
    rules = [Rule(role=role, replies=[PROOF]) for role in ("solution", "refiner")]
    await scripted_run(ScriptedModel(SimScript(rules=rules), settings), tmp_path / "run", problems)
    evaluation = await evaluate_run(tmp_path / "run", None, None)
    assert evaluation.params["mode"] == "proof" and evaluation.done == 2
    assert evaluation.grades is None and evaluation.not_graded_reason == "proof mode: answers are proofs, not graded"
