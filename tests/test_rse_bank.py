"""RSE's experience bank through whole runs, in process on the scripted model: what the distiller finds is merged
(near-duplicates judged by the embeddings dropped, the oldest items dropped past ``bank_max``), the next iteration's
samples see it, a wrong attempt becomes a pitfall, and an unusable distillation adds nothing."""

from __future__ import annotations

import json

import pytest

from scripted_runs import by_role, last_user_prompts, run_scripted
from tmas.agents.echo import ECHO_RETRY_SAMPLE
from tmas.testing import Rule

# What the simulator's distiller finds in a right attempt at 17*23 (tmas.testing.baseline_responders).
EXPRESSION = "The quantity to compute is the expression 17*23."
STEPS = "Carrying out the operations of 17*23 step by step gives 391."
SLIP = "One attempt slipped in the last operation and reached 390; redo that step."


def boxed(answer: str) -> str:
    return f"Working it out by hand.\n\n\\boxed{{{answer}}}"


async def test_two_right_attempts_bank_their_findings_once_and_the_next_samples_see_them() -> None:
    # n = 2: each distillation finds the same two propositions; the second pair are duplicates (cosine 1).
    result, model = await run_scripted("rse", n=2, iterations=2)
    assert by_role(model) == {"solution": 4, "distiller": 2}
    first, second = result.iterations
    assert first.state["distill"] == {
        "distilled": 2,
        "added": 2,
        "duplicates": 2,
        "dropped_old": 0,
        "similarity": "embedding",
        "refused": 0,
    }
    assert first.state["bank"] == {"propositions": [EXPRESSION, STEPS], "pitfalls": []}
    # One embedding request for the propositions (no pitfall was proposed): the two kept and four proposed items.
    assert len(model.embedded) == 1 and len(model.embedded[0]) == 4
    # The next iteration's samples are asked with the bank; the last iteration is not distilled.
    assert second.state["bank_in"] == first.state["bank"] and "distill" not in second.state
    assert [c.meta.prompt for c in second.candidates] == ["with_bank", "with_bank"]
    prompt = last_user_prompts(model, "solution")[-1]
    assert f"Verified propositions:\n- {EXPRESSION}\n- {STEPS}\n\nCritical pitfalls:\n- (none yet)" in prompt


async def test_the_bank_keeps_its_newest_items_past_bank_max() -> None:
    result, _ = await run_scripted("rse", n=2, iterations=2, bank_max=1)
    distill = result.iterations[0].state["distill"]
    assert (distill["added"], distill["duplicates"], distill["dropped_old"]) == (2, 2, 1)
    assert result.iterations[0].state["bank"]["propositions"] == [STEPS]


async def test_a_wrong_attempt_becomes_a_pitfall() -> None:
    # The first sample boxes 390: its distillation brings the slip; the right one its two propositions.
    rules = [Rule(role="solution", replies=[boxed("390")], times=1)]
    result, model = await run_scripted("rse", rules, n=2, iterations=2)
    bank = result.iterations[0].state["bank"]
    assert bank == {"propositions": [EXPRESSION, STEPS], "pitfalls": [SLIP]}
    assert (result.iterations[0].state["distill"]["added"], result.answer) == (3, "391")
    # Propositions and pitfalls are judged for duplicates apart: one embedding request each.
    assert len(model.embedded) == 2
    assert f"Critical pitfalls:\n- {SLIP}" in last_user_prompts(model, "solution")[-1]


async def test_an_unusable_distillation_adds_nothing_and_the_next_samples_start_afresh() -> None:
    rules = [Rule(role="distiller", replies=["Nothing to report."])]
    result, model = await run_scripted("rse", rules, n=1, iterations=2)
    first, second = result.iterations
    assert first.state["distill"]["distilled"] == 0 and first.state["bank"] == {"propositions": [], "pitfalls": []}
    assert first.replies["distiller"].unusable == 1
    assert "distillation of candidate 0 unusable: no valid JSON object in the reply" in first.notes
    # With an empty bank the next sample is the plain first sample again, and nothing was embedded.
    assert [c.meta.prompt for c in second.candidates] == ["generate"] and model.embedded == []
    solution = model.calls_of("solution")
    assert solution[0].messages == solution[1].messages


@pytest.mark.parametrize(
    "retry",
    [
        Rule(role="distiller", replies=["Nothing to report."], times=1),
        Rule(role="distiller", fault="http_400", times=1),
    ],
    ids=["unreadable", "failed"],
)
async def test_an_unusable_retry_after_an_echo_keeps_the_first_distillation_less_its_echo(retry: Rule) -> None:
    # The distillation holds one item copied from its instructions and one finding: it is asked again, and the retry
    # is no distillation at all. The first reply's finding still enters the bank; the echoed item does not.
    echoed = "intermediate facts the attempt establishes that you have rechecked yourself and found correct"
    first = Rule(role="distiller", replies=[json.dumps({"propositions": [echoed, STEPS], "pitfalls": []})], times=1)
    result, model = await run_scripted("rse", [first, retry], n=1, iterations=2)
    asked = model.calls_of("distiller")
    assert [c.key.sample for c in asked] == [0, ECHO_RETRY_SAMPLE] and asked[0].messages == asked[1].messages
    state = result.iterations[0].state
    assert state["bank"] == {"propositions": [STEPS], "pitfalls": []} and state["distill"]["distilled"] == 1
    assert any("dropped" in note and "echoes the instructions" in note for note in result.iterations[0].notes)
    assert result.iterations[0].replies["distiller"].unusable == (0 if retry.fault else 1)
