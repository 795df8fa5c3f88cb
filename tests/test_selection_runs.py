"""What each baseline answers, through a whole run in process on the scripted model: majority vote's plurality and
its ties over every iteration so far, Self-Refine's vote over its last trajectories, RSE's vote over its samples, and
PaCoRe's synthesis (or, without one or without an answer in it, its last round). TMAS's and V-R's rules are in
tests/test_selection.py."""

from __future__ import annotations

from scripted_runs import by_role, run_scripted
from tmas.methods.base import Fallback
from tmas.testing import Rule


def boxed(answer: str) -> str:
    return f"Working it out by hand.\n\n\\boxed{{{answer}}}"


# Samples box 7, 9, 9, then again from the start.
SEVEN_NINE_NINE = Rule(role="solution", replies=[boxed("7"), boxed("9"), boxed("9")])


async def test_majority_returns_the_plurality() -> None:
    result, model = await run_scripted("majority", [SEVEN_NINE_NINE], k=3)
    assert result.answer == "9" and by_role(model) == {"solution": 3}
    assert result.iterations[0].state["votes"] == {"9": 2, "7": 1}


async def test_majority_vote_runs_over_every_iteration_so_far_and_a_tie_goes_to_the_first_answer() -> None:
    # k = 2: iteration 0 draws 7 and 9 (a tie: 7, drawn first); iteration 1 draws 9 and 7, and votes over all four:
    # 2 against 2, still 7.
    rules = [Rule(role="solution", replies=[boxed("7"), boxed("9"), boxed("9"), boxed("7")])]
    result, _ = await run_scripted("majority", rules, k=2, iterations=2)
    assert [r.selected for r in result.iterations] == ["7", "7"] and result.answer == "7"
    assert [r.state["samples"] for r in result.iterations] == [2, 4]
    assert result.iterations[1].state["votes"] == {"7": 2, "9": 2}


async def test_self_refine_answers_the_vote_of_its_last_trajectories() -> None:
    # Three first solutions (7, 9, 9: the vote is 9); the first refinement keeps 7, the others take the scripted
    # refiner's 391: the last iteration's vote, 391, is the answer.
    rules = [SEVEN_NINE_NINE, Rule(role="refiner", replies=[boxed("7")], times=1)]
    result, model = await run_scripted("self_refine", rules, n=3, iterations=2)
    assert by_role(model) == {"solution": 3, "refiner": 3}
    assert [r.selected for r in result.iterations] == ["9", "391"] and result.answer == "391"
    assert [c.answer for c in result.iterations[1].candidates] == ["7", "391", "391"]


async def test_rse_answers_the_vote_of_its_samples() -> None:
    result, model = await run_scripted("rse", [SEVEN_NINE_NINE], n=3, iterations=1)
    assert result.answer == "9" and by_role(model) == {"solution": 3}


async def test_pacore_answers_its_synthesis_not_its_rounds() -> None:
    # The round votes 9; the three syntheses box 5, 6, 6: the answer is theirs, 6.
    rules = [SEVEN_NINE_NINE, Rule(role="synthesis", replies=[boxed("5"), boxed("6"), boxed("6")])]
    result, model = await run_scripted("pacore", rules, responses_per_round=3, iterations=1, synthesis_responses=3)
    assert by_role(model) == {"solution": 3, "synthesis": 3}
    assert [r.selected for r in result.iterations] == ["9", "6"] and result.answer == "6"
    assert [r.state["round"] for r in result.iterations] == [0, "synthesis"]


async def test_pacore_without_synthesis_answers_its_last_round() -> None:
    result, model = await run_scripted(
        "pacore", [SEVEN_NINE_NINE], responses_per_round=3, iterations=1, synthesis=False
    )
    assert result.answer == "9" and by_role(model) == {"solution": 3} and len(result.iterations) == 1


async def test_pacore_with_an_unanswerable_synthesis_answers_its_last_round_recorded_as_a_fallback() -> None:
    # The round votes 9 (candidates 1 and 2); the synthesis only judges and boxes nothing.
    rules = [SEVEN_NINE_NINE, Rule(role="synthesis", replies=["The solution is correct."])]
    result, _ = await run_scripted("pacore", rules, responses_per_round=3, iterations=1)
    fallback = Fallback(iteration=0, candidate=1, answer="9", reason="no answered candidate in the last iteration")
    assert result.status == "done" and result.answer == "9" and result.fallback == fallback
    synthesis = result.iterations[1]
    assert [c.answer for c in synthesis.candidates] == [None]
    assert synthesis.selected == "9" and synthesis.state["answer_fallback"] == fallback.model_dump()
    assert "answer from iteration 0: no answered candidate in the last iteration" in synthesis.notes
    # Off: the synthesis's missing answer is the problem's.
    off, _ = await run_scripted("pacore", rules, responses_per_round=3, iterations=1, answer_fallback=False)
    assert off.answer is None and off.fallback is None and "answer_fallback" not in off.iterations[1].state


async def test_pacore_falls_back_to_the_latest_round_with_an_answer_not_a_vote_over_all() -> None:
    # Round 0 votes 7 (7, 7, 7); round 1 votes 9 (9, 9, 7); the synthesis boxes nothing: round 1's 9, the newest
    # round's, though 7 leads over both rounds.
    rules = [
        Rule(role="solution", replies=[boxed("7"), boxed("7"), boxed("7"), boxed("9"), boxed("9"), boxed("7")]),
        Rule(role="synthesis", replies=["The solution is correct."]),
    ]
    result, _ = await run_scripted("pacore", rules, responses_per_round=3, iterations=2)
    assert [r.selected for r in result.iterations] == ["7", "9", "9"]
    assert result.answer == "9" and result.fallback is not None and result.fallback.iteration == 1
