"""Where a budget stops each method, in process on the scripted model: every registered method stops at the call its
budget refuses and asks nothing it would not have asked without one; then, per method, the call refused in the middle
of an iteration (worked by hand from the method's call graph) and what the cut iteration keeps."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import by_role, run_scripted
from tmas.methods import METHODS, create_method
from tmas.methods.base import ProblemSession
from tmas.problems import Problem
from tmas.runner import solve_one
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript

# Every reply reports 30 completion tokens, so token spends are worked by hand.
THIRTY = SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=100, completion_tokens=30))])


async def solve(method: str, budget: dict[str, Any], script: SimScript | None = None, **params: Any) -> Any:
    return await run_scripted(method, script=script, settings={"budget": budget}, **params)


def asked(model: ScriptedModel) -> Counter[tuple[str, str]]:
    """Each call's role and whole conversation, counted: what a run asked, whatever the order of parallel calls."""
    return Counter((c.role, "\n".join(m.content for m in c.messages)) for c in model.calls)


def cut_note(result: Any) -> str:
    return result.iterations[-1].notes[-1]


@pytest.mark.parametrize("method", sorted(METHODS))
async def test_a_call_budget_one_short_stops_every_method_at_that_call(method: str) -> None:
    params = METHODS[method].example_params
    if params is None:
        pytest.skip(f"{method} declares no example_params")
    free, unlimited = await run_scripted(method, **params)
    assert free.stopped_reason is None and free.status == "done"
    needed = len(unlimited.calls)
    if needed == 1:
        # One call is all the method asks: a budget of one call is no stop.
        stopped, limited = await solve(method, {"calls": 1}, **params)
        assert stopped.stopped_reason is None and asked(limited) == asked(unlimited)
        return
    stopped, limited = await solve(method, {"calls": needed - 1}, **params)
    assert len(limited.calls) == stopped.calls == needed - 1
    assert stopped.stopped_reason == "budget" and stopped.counters == {"budget_stops": 1}
    # The budget changes where the run ends, never what it asks before that.
    assert not asked(limited) - asked(unlimited)
    # The iterations that finished are kept, and the answer comes from them.
    assert stopped.status == "done" and stopped.iterations and stopped.answer == free.answer == "391"


async def test_verify_refine_keeps_a_correction_its_budget_left_unverified() -> None:
    # n = 2, m = 1: iteration 0 is 2 solutions and 2 verifications (4 calls). Iteration 1's two corrections start
    # together: the first is the 5th call, the second is refused, and so is the first one's verification.
    result, model = await solve("verify_refine", {"calls": 5}, n=2, m=1, iterations=3)
    assert [c.role for c in model.calls] == ["solution", "solution", "verifier", "verifier", "corrector"]
    assert result.stopped_reason == "budget" and result.answer == "391"
    [cut] = result.iterations[1].candidates
    assert (cut.index, cut.meta.prompt, cut.meta.unverified, cut.score) == (0, "correct", True, None)
    assert (
        cut_note(result)
        == "stopped: budget spent (5 calls of a budget of 5) in iteration 1; 1 of 2 candidates finished"
    )
    # Iteration 0's candidates were verified before the stop.
    assert [c.score for c in result.iterations[0].candidates] == [1.0, 1.0]


async def test_verify_refine_refused_at_an_iterations_start_keeps_the_last_whole_one() -> None:
    # 30 completion tokens a call. Iteration 0's solutions go together at a spend of 0 (60), its verifications at 60
    # (120); at 120 >= 100 iteration 1's corrections are refused: no candidate, so no iteration 1 record.
    result, model = await solve("verify_refine", {"tokens": 100}, THIRTY, n=2, m=1, iterations=3)
    assert by_role(model) == {"solution": 2, "verifier": 2}
    assert result.stopped_reason == "budget" and result.answer == "391" and result.status == "done"
    assert [r.iteration for r in result.iterations] == [0] and result.usage.completion_tokens == 120


async def test_majority_cut_mid_iteration_votes_over_the_samples_it_has() -> None:
    # k = 4, 3 calls: the 4th sample is refused; the vote is over 3.
    result, model = await solve("majority", {"calls": 3}, k=4)
    assert by_role(model) == {"solution": 3} and result.answer == "391"
    assert len(result.iterations[0].candidates) == 3
    assert (
        cut_note(result)
        == "stopped: budget spent (3 calls of a budget of 3) in iteration 0; 3 of 4 candidates finished"
    )


async def test_majority_token_budget_reached_by_a_round_of_parallel_samples() -> None:
    # k = 2 a round, 30 tokens a sample: rounds go at 0 and 60 (each check before its round), the third is refused
    # at 120 >= 100. Parallel calls may take the spend past the budget; none is sent once it is reached.
    result, model = await solve("majority", {"tokens": 100}, THIRTY, k=2, iterations=5)
    assert by_role(model) == {"solution": 4} and result.usage.completion_tokens == 120
    assert [len(r.candidates) for r in result.iterations] == [2, 2] and result.stopped_reason == "budget"


async def test_rse_cut_at_its_distillation_keeps_the_iterations_samples() -> None:
    # n = 2: iteration 0's 2 samples, then its distillation (the 3rd call); iteration 1's first sample is refused.
    result, model = await solve("rse", {"calls": 3}, n=2, iterations=3)
    assert [c.role for c in model.calls] == ["solution", "solution", "distiller"]
    assert [r.iteration for r in result.iterations] == [0] and len(result.iterations[0].candidates) == 2
    assert (
        cut_note(result)
        == "stopped: budget spent (3 calls of a budget of 3) in iteration 0; 2 of 2 candidates finished"
    )
    # The distillation that came back is in the bank; the record says the other was refused, not that it failed.
    assert result.iterations[0].state["distill"]["distilled"] == 1
    # What is stored of the refused ones is how many, as every other figure of the record.
    assert result.iterations[0].state["distill"]["refused"] == 1
    assert "1 of 2 distillations came back before the budget stop; the bank takes theirs" in result.iterations[0].notes


@pytest.mark.parametrize(
    ("method", "params", "second", "prompt"),
    [
        ("self_refine", {"n": 2, "iterations": 3}, "refiner", "refine"),
        ("pacore", {"responses_per_round": 2, "iterations": 2}, "solution", "round"),
    ],
)
async def test_a_trajectory_method_cut_in_its_second_round_keeps_the_one_that_went(
    method: str, params: dict[str, Any], second: str, prompt: str
) -> None:
    # Two first solutions, then the second round's first call; the second round's other call is refused.
    result, model = await solve(method, {"calls": 3}, **params)
    assert [c.role for c in model.calls] == ["solution", "solution", second]
    [kept] = result.iterations[1].candidates
    assert (kept.index, kept.meta.prompt, kept.answer) == (0, prompt, "391")
    assert (
        cut_note(result)
        == "stopped: budget spent (3 calls of a budget of 3) in iteration 1; 1 of 2 candidates finished"
    )


async def test_tmas_cut_in_its_second_iteration_keeps_the_solution_that_came_back() -> None:
    # n = 2, m = 2: iteration 0 is 2 solutions, 4 verifications, 2 summaries, experience and guideline (10 calls);
    # iteration 1's first solution is the 11th, its second is refused, and so are the first one's verifications. The
    # solution that came back is iteration 1's candidate, kept unverified and unscored; the answer is chosen from it.
    result, model = await solve("tmas", {"calls": 11}, n=2, m=2, iterations=2)
    assert by_role(model) == {"solution": 3, "verifier": 4, "summary": 2, "experience": 1, "guideline": 1}
    assert model.calls[-1].role == "solution" and model.calls[-1].key.iteration == 1
    assert [r.iteration for r in result.iterations] == [0, 1] and result.answer == "391"
    [cut] = result.iterations[1].candidates
    assert (cut.index, cut.meta.unverified, cut.score, cut.meta.verifications) == (0, True, None, None)
    assert result.iterations[1].selection is not None
    assert (result.iterations[1].selection.iteration, result.iterations[1].selection.candidate) == (1, 0)
    assert result.text == cut.text and result.stopped_reason == "budget" and result.status == "done"
    assert (
        cut_note(result)
        == "stopped: budget spent (11 calls of a budget of 11) in iteration 1; 1 of 2 candidates finished"
    )
    assert "candidate 0: the budget stopped its verifications before any came back; unscored" in (
        result.iterations[1].notes
    )


# A verification that passes the solution: every one scores 1, so a score over the ones that came back reads 1.0.
PASS = Rule(role="verifier", replies=["## Analysis\nEvery step checks out.\n\n## Score\nScore: 1"])


@pytest.mark.parametrize("method", ["tmas", "verify_refine"])
async def test_a_candidate_is_scored_from_the_verifications_that_came_back_before_the_stop(method: str) -> None:
    # n = 1, m = 2, 2 calls: the solution, then its first verification; the second is refused. The candidate is scored
    # from the one that came back (1.0; counted with the refused one as 0 it would read 0.5, unscored None), and
    # recorded with it.
    result, model = await solve(method, {"calls": 2}, SimScript(rules=[PASS]), n=1, m=2, iterations=2)
    assert [c.role for c in model.calls] == ["solution", "verifier"]
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    [candidate] = record.candidates
    assert candidate.score == 1.0 and not candidate.meta.unverified
    assert [(v.score, v.call_id) for v in candidate.meta.verifications or []] == [(1.0, model.calls[1].reply.call_id)]
    assert "candidate 0: 1 of 2 verifications came back before the budget stop; scored from them" in record.notes


async def test_tmas_cut_mid_iteration_selects_among_its_candidates_and_stores_them(tmp_path: Path) -> None:
    # n = 2, m = 1, 3 iterations: iteration 0 is 8 calls (2 solutions, 2 verifications, 2 summaries, the two memory
    # calls). In iteration 1 both solutions go (9, 10), then candidate 0's verification (11); candidate 1's is refused,
    # and so is candidate 0's summary. The stored record holds both candidates, as the result does: candidate 0 scored
    # from its verification, candidate 1 unscored; the answer is candidate 0's, chosen among them.
    settings = scripted_settings(
        method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 3}}, budget={"calls": 11}
    )
    model = ScriptedModel(SimScript(rules=[PASS]), settings)
    problem = Problem(problem_id="q", question="What is 17*23?")
    solver = create_method("tmas", settings.method.params)
    with RunStore(tmp_path / "run") as store:
        store.add_problems([problem])
        session = ProblemSession(problem, model, store, budget=settings.budget, params=solver.params)
        result = await solve_one(solver, session)
        stored = store.iterations("q")
    assert [c.role for c in model.calls[8:]] == ["solution", "solution", "verifier"]
    assert [r.iteration for r in stored] == [r.iteration for r in result.iterations] == [0, 1]
    cut = stored[1]
    assert cut.model_dump() == result.iterations[1].model_dump()
    assert [(c.index, c.score, c.meta.unverified) for c in cut.candidates] == [(0, 1.0, None), (1, None, True)]
    assert cut.candidates[0].meta.summary is None
    assert cut.selection is not None and (cut.selection.iteration, cut.selection.candidate) == (1, 0)
    assert (result.answer, result.text) == (cut.selected, cut.candidates[0].text)
    assert cut.state["experience_update"] == cut.state["guideline_update"] == {"status": "skipped"}
    assert "stopped: budget spent (11 calls of a budget of 11) in iteration 1; 2 of 2 candidates finished" in cut.notes


async def test_a_tmas_problem_its_budget_stopped_keeps_the_counters_of_its_finished_iterations() -> None:
    # n = 1, m = 1: iteration 0's verification fails (its summary is then built from the scores, with no call): the
    # solution, the verification and the two memory calls. The budget of 4 calls refuses iteration 1's solution. The
    # failed verification of the finished iteration still counts, beside the stop.
    failing = SimScript(rules=[Rule(role="verifier", fault="http_400", times=1)])
    result, model = await solve("tmas", {"calls": 4}, failing, n=1, m=1, iterations=3)
    assert [c.role for c in model.calls] == ["solution", "verifier", "experience", "guideline"]
    assert result.stopped_reason == "budget" and [r.iteration for r in result.iterations] == [0]
    assert result.counters == {"budget_stops": 1, "verification_failed": 1}


async def test_tmas_token_budget_past_its_verifications_skips_the_memory_update() -> None:
    # n = 1, m = 1, 30 tokens a call: solution at 0, verification at 30, summary at 60, the memory calls at 90 and
    # 120 (each may cost its max_tokens, more than what is left, so they go one after the other); iteration 1's
    # solution at 150 >= 150 is refused. With 80: the summary (at 60) goes, the memory calls (at 90) are refused:
    # iteration 0's verified candidate stands, as the last iteration's does without its memory update, and the
    # problem answers with it.
    kept, model = await solve("tmas", {"tokens": 150}, THIRTY, n=1, m=1, iterations=3)
    assert len(model.calls) == 5 and kept.status == "done" and kept.answer == "391"
    assert kept.usage.completion_tokens == 150
    cut, model = await solve("tmas", {"tokens": 80}, THIRTY, n=1, m=1, iterations=3)
    assert [c.role for c in model.calls] == ["solution", "verifier", "summary"]
    assert (cut.status, cut.answer, cut.stopped_reason, len(cut.iterations)) == ("done", "391", "budget", 1)
    notes = cut.iterations[0].notes
    assert "budget spent during the memory update: the banks stay as they were" in notes
    # Each update the budget refused says so (it was due, not skipped), with the stop that refused it.
    refused = {"status": "refused", "error": "budget spent (90 completion tokens of a budget of 80) in iteration 0"}
    assert cut.iterations[0].state["experience_update"] == cut.iterations[0].state["guideline_update"] == refused


def stop_notes(result: Any) -> list[str]:
    return [n for n in result.iterations[-1].notes if n.startswith("stopped: budget spent")]


@pytest.mark.parametrize("method", sorted(METHODS))
async def test_every_methods_budget_stop_is_noted_in_its_last_record(method: str) -> None:
    # Each budget that stops the method: one call short of the whole run, and each that refuses a whole iteration
    # (its first call). However the stop came, the last record says so, once.
    params = METHODS[method].example_params
    if params is None:
        pytest.skip(f"{method} declares no example_params")
    params = {**params, "iterations": max(2, params.get("iterations", 1))}
    _, unlimited = await run_scripted(method, **params)
    starts = {t: i for i, c in reversed(list(enumerate(unlimited.calls))) if (t := c.key.iteration or 0)}
    budgets = sorted({*starts.values(), len(unlimited.calls) - 1} - {0})
    if not budgets:
        pytest.skip(f"{method} asks one call: no call budget stops it")
    for calls in budgets:
        stopped, limited = await solve(method, {"calls": calls}, **params)
        assert len(limited.calls) == calls and stopped.stopped_reason == "budget"
        assert stopped.counters["budget_stops"] == 1
        [note] = stop_notes(stopped)
        assert note.startswith(f"stopped: budget spent ({calls} calls of a budget of {calls}) in iteration ")


async def test_a_baseline_refused_a_whole_iteration_notes_it_on_the_one_before() -> None:
    # n = 2, 30 tokens a call: iteration 0 is 2 solutions and 2 verifications (120 tokens); iteration 1's first
    # correction is refused. No record of iteration 1: iteration 0's says where the run stopped.
    result, _ = await solve("verify_refine", {"tokens": 100}, THIRTY, n=2, m=1, iterations=3)
    assert [r.iteration for r in result.iterations] == [0]
    assert cut_note(result) == "stopped: budget spent (120 completion tokens of a budget of 100) in iteration 1"


@pytest.mark.parametrize(("method", "params", "calls"), [("self_refine", {"n": 1}, 1), ("tmas", {"n": 1, "m": 1}, 5)])
async def test_the_stop_note_is_in_the_stored_iteration_record(
    method: str, params: dict[str, Any], calls: int, tmp_path: Path
) -> None:
    # ``calls`` is iteration 0's calls: iteration 1's first is refused. The note joins iteration 0's record, already
    # stored: it is stored again, so readers of the store's iterations see it too.
    settings = scripted_settings(
        method={"name": method, "params": {**params, "iterations": 3}}, budget={"calls": calls}
    )
    model = ScriptedModel(SimScript(), settings)
    problem = Problem(problem_id="q", question="What is 17*23?")
    solver = create_method(method, settings.method.params)
    with RunStore(tmp_path / "run") as store:
        store.add_problems([problem])
        session = ProblemSession(problem, model, store, budget=settings.budget, params=solver.params)
        result = await solve_one(solver, session)
        stored = store.iterations("q")
    note = f"stopped: budget spent ({calls} calls of a budget of {calls}) in iteration 1"
    assert result.stopped_reason == "budget" and [r.iteration for r in stored] == [0]
    assert stored[0].notes[-1] == cut_note(result) == note
    assert stored[0].notes.count(note) == 1


@pytest.mark.parametrize("mode", ["numeric", "proof"])
async def test_a_budget_stop_after_an_answer_fallback_returns_the_earlier_candidates_text(mode: str) -> None:
    # Every exploit call of iteration 1 fails: its record answers with iteration 0's candidate (the answer fallback).
    # The budget refuses iteration 2's first call, so the runner ends the problem from iteration 1's record: the
    # answer and the text are that candidate's, and the result says the answer fell back, as one that ran to its end
    # says it. The text was empty: it was looked for among iteration 1's candidates by answer (a proof has none).
    failing = SimScript(rules=[Rule(role="solution", pattern="<rollout", fault="http_400")])
    params = {"n": 2, "m": 1, "iterations": 3, "epsilon": 0.0, "mode": mode}
    _, unlimited = await solve("tmas", {}, failing, **params)
    before = sum(1 for c in unlimited.calls if (c.key.iteration or 0) < 2)
    result, model = await solve("tmas", {"calls": before}, failing, **params)
    assert len(model.calls) == before and [r.iteration for r in result.iterations] == [0, 1]
    last = result.iterations[-1]
    assert last.selection is not None and last.selection.iteration == 0 and last.selection.fallback
    chosen = result.iterations[0].candidates[last.selection.candidate]
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", chosen.answer)
    assert result.text == chosen.text and "\\boxed{" in result.text
    assert result.fallback is not None and (result.fallback.iteration, result.fallback.candidate) == (
        0,
        last.selection.candidate,
    )


@pytest.mark.parametrize(("method", "calls", "params"), [("self_refine", 4, {}), ("verify_refine", 7, {"m": 1})])
async def test_a_cut_iteration_votes_with_the_solutions_the_refused_trajectories_hold(
    method: str, calls: int, params: dict[str, Any]
) -> None:
    # n = 3. Iteration 0 answers 5, 7, 7 (Verify-Refine: each verified and scored 1, 6 calls). Iteration 1's first
    # refinement (trajectory 0, answering 5) is the last call the budget allows; trajectories 1 and 2 are refused and
    # hold their 7s. The vote is over 5, 7, 7: 7, iteration 0's candidate 1 (Verify-Refine's best score: the unscored
    # 5 counts 0 against two 1s). The refinement that came back alone would have answered 5.
    refined = "## Feedback\nRechecked.\n\n## Solution\nPath A again: 5.\n\n\\boxed{5}"
    script = SimScript(
        rules=[
            Rule(
                role="solution",
                replies=[f"Path {p}: {a}.\n\n\\boxed{{{a}}}" for p, a in zip("ABC", "577", strict=True)],
            ),
            Rule(role="refiner", replies=[refined]),
            Rule(role="corrector", replies=[refined]),
            PASS,
        ]
    )
    result, model = await solve(method, {"calls": calls}, script, n=3, iterations=3, **params)
    assert len(model.calls) == calls and model.calls[-1].role in ("refiner", "corrector")
    first, cut = result.iterations
    assert [c.answer for c in first.candidates] == ["5", "7", "7"]
    assert [(c.index, c.answer) for c in cut.candidates] == [(0, "5")]
    assert (result.answer, result.text, result.stopped_reason) == ("7", first.candidates[1].text, "budget")
    assert cut.selection is not None and (cut.selection.iteration, cut.selection.candidate) == (0, 1)
    assert cut.held_over == [1, 2]
    assert cut.notes[-2:] == [
        "trajectories 1, 2: the budget refused their calls; each holds its solution of the iteration before, which"
        " counts here in its place",
        f"stopped: budget spent ({calls} calls of a budget of {calls}) in iteration 1; 1 of 3 candidates finished",
    ]
