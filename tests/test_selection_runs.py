"""What each baseline answers, through a whole run in process on the scripted model: majority vote's plurality and
its ties over every iteration so far, Self-Refine's vote over its last trajectories, RSE's vote over its samples (or,
without an answer in the last iteration, over every earlier one's, also on resuming a run stored before that), and
PaCoRe's synthesis (or, without one or without an answer in it, its last round). TMAS's and V-R's rules are in
tests/test_selection.py."""

from __future__ import annotations

from pathlib import Path

from conftest import scripted_settings
from scripted_runs import QUESTION, by_role, run_scripted, scripted_run
from tmas.methods.base import Fallback
from tmas.methods.rse import RSEParams
from tmas.problems import Problem
from tmas.runner import params_fingerprint, stored_settings
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript


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


async def test_rse_whose_last_iteration_failed_answers_with_the_earlier_samples_recorded_as_a_fallback() -> None:
    # Iteration 0's two samples box 391; every sample of iteration 1 (the bank's readers) fails.
    rules = [Rule(role="solution", replies=[boxed("391")], times=2), Rule(role="solution", error_status=400)]
    result, model = await run_scripted("rse", rules, n=2, iterations=2)
    assert by_role(model) == {"solution": 4, "distiller": 2}
    fallback = Fallback(iteration=0, candidate=0, answer="391", reason="no answered candidate in the last iteration")
    assert result.status == "done" and result.answer == "391" and result.fallback == fallback
    last = result.iterations[1]
    assert [c.error is not None for c in last.candidates] == [True, True]
    assert last.selected == "391" and last.state["answer_fallback"] == fallback.model_dump()
    assert "answer from iteration 0: no answered candidate in the last iteration" in last.notes
    assert last.state["bank_in"] == result.iterations[0].state["bank"]
    # Off: the problem fails with the last iteration's error, as the paper's RSE answers from its last samples alone.
    off, _ = await run_scripted("rse", rules, n=2, iterations=2, answer_fallback=False)
    assert off.status == "failed" and off.answer is None and off.fallback is None
    assert off.error is not None and "HTTP 400" in off.error and "answer_fallback" not in off.iterations[1].state


async def test_rse_falls_back_to_the_vote_of_every_earlier_iteration() -> None:
    # Iteration 0 votes 7 (7, 7, 7), iteration 1 votes 9 (9, 9, 7), iteration 2 fails: the vote over both earlier
    # iterations is 7 (four votes to two). Each iteration samples afresh, so an earlier sample is a vote like a later.
    answers = ["7", "7", "7", "9", "9", "7"]
    rules = [
        Rule(role="solution", replies=[boxed(a) for a in answers], times=6),
        Rule(role="solution", error_status=400),
    ]
    result, _ = await run_scripted("rse", rules, n=3, iterations=3)
    assert [r.selected for r in result.iterations] == ["7", "9", "7"]
    assert result.answer == "7" and result.fallback is not None and result.fallback.iteration == 1


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


async def test_an_rse_run_stored_before_the_answer_fallback_resumes_from_its_stored_calls(tmp_path: Path) -> None:
    # A run made without the parameter: p0 answered; p1's last iteration failed, so p1 failed without an answer.
    params = {"n": 2, "iterations": 2, "answer_fallback": False}
    p1_fails = Rule(role="solution", pattern="Verified propositions.*19\\*23", error_status=400)
    problems = [Problem(problem_id="p0", question=QUESTION), Problem(problem_id="p1", question="What is 19*23?")]
    old = ScriptedModel(SimScript(rules=[p1_fails]), scripted_settings(method={"name": "rse", "params": params}))
    run_dir = tmp_path / "run"
    await scripted_run(old, run_dir, problems)
    # What the older code stored: the method's parameters without answer_fallback, and their fingerprint.
    settings = stored_settings(run_dir)
    without = {k: v for k, v in settings.method.params.items() if k != "answer_fallback"}
    now = RSEParams.model_validate(without).model_dump(mode="json")
    before = {k: v for k, v in now.items() if k != "answer_fallback"}
    with RunStore(run_dir, create=False) as store:
        store.set_meta("method", {"name": "rse", "params": before})
        method = settings.method.model_copy(update={"params": without})
        store.set_meta("settings", settings.model_copy(update={"method": method}).model_dump(mode="json"))
        for result in store.results():
            result.fingerprint = params_fingerprint("rse", before)
            store.save_result(result)
        assert {r.problem_id: r.status for r in store.results()} == {"p0": "done", "p1": "failed"}
        sent = len(list(store.calls()))
    # Resumed now, on a server that still fails p1's last samples: the fingerprint holds answer_fallback, so p0 is
    # solved again from its stored calls alone; only the calls that had failed are sent again.
    resumed = ScriptedModel(SimScript(rules=[p1_fails]), stored_settings(run_dir))
    await scripted_run(resumed, run_dir, settings=stored_settings(run_dir))
    assert [(c.key.problem_id, c.key.iteration, c.role) for c in resumed.calls] == [("p1", 1, "solution")] * 2
    with RunStore(run_dir, create=False) as store:
        results = {r.problem_id: r for r in store.results()}
        assert len(list(store.calls())) == sent + 2
        assert {r.fingerprint for r in results.values()} == {params_fingerprint("rse", now)}
    assert now["answer_fallback"] is True
    assert results["p0"].answer == "391" and results["p0"].fallback is None
    assert results["p1"].status == "done" and results["p1"].answer == "437"
    assert results["p1"].fallback is not None and results["p1"].fallback.iteration == 0
