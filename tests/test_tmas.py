"""TMAS's logic in process on the scripted model: Algorithm 1's call graph and ordering, epsilon, bad agent output,
ablations, early stopping, selection and presets, and what its paper preset asks for."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import SCRIPTED_URL, scripted_settings
from scripted_runs import by_role, last_user_prompts, solve_in_process
from tmas.agents.echo import ECHO_RETRY_SAMPLE
from tmas.api import asolve
from tmas.config import Sampling, Settings
from tmas.llm.sampling import resolve_role
from tmas.llm.types import ChainKey, Completion, Message
from tmas.methods import create_method
from tmas.methods.base import ProblemResult
from tmas.methods.selection import select
from tmas.methods.tmas import TMAS
from tmas.methods.tmas_params import TMASParams
from tmas.store.records import Selection, VerificationRecord
from tmas.testing import Rule, ScriptedModel, SimScript

Q = "What is 17*23?"
EXPLORE_MARK = "<attempted_strategies>"
REFINE_MARK = "<rollouts>"


async def run_tmas(
    script: SimScript | None = None, seed: int = 0, **params: Any
) -> tuple[ProblemResult, ScriptedModel]:
    # Algorithm 1's whole call graph, the last iteration's summaries and memory updates included (their skip, the
    # default, is tested in test_slot_pinning.py).
    params = {"skip_final_memory": False, **params}
    model = ScriptedModel(
        script or SimScript(), scripted_settings(seed=seed, method={"name": "tmas", "params": params})
    )
    return await solve_in_process(model, Q), model


def calls_by_iteration(model: ScriptedModel) -> dict[int, list[tuple[str, str]]]:
    """iteration -> [(role, user prompt)], in call order."""
    out: dict[int, list[tuple[str, str]]] = {}
    for call in model.calls:
        assert call.key.iteration is not None
        out.setdefault(call.key.iteration, []).append((call.role, call.messages[-1].content))
    return out


async def test_call_graph_per_iteration() -> None:
    n, m, t = 3, 2, 3
    result, model = await run_tmas(n=n, m=m, iterations=t)
    assert result.status == "done" and result.answer == "391"
    assert by_role(model) == {
        "solution": n * t,
        "verifier": n * m * t,
        "summary": n * t,
        "experience": t,
        "guideline": t,
    }
    for calls in calls_by_iteration(model).values():
        roles = [role for role, _ in calls]
        assert {r: roles.count(r) for r in set(roles)} == {
            "solution": n,
            "verifier": n * m,
            "summary": n,
            "experience": 1,
            "guideline": 1,
        }
    assert [len(r.candidates) for r in result.iterations] == [n] * t
    assert all(r.calls == n + n * m + n + 2 for r in result.iterations)
    first = result.iterations[0].candidates[0]
    assert first.meta.mode == "generate" and len(first.meta.verifications) == m
    assert "## Validated Steps" in first.meta.summary


async def test_iteration_t_prompts_see_only_iteration_t_minus_1() -> None:
    # Each solution carries a marker M<call number>; calls of iteration t are numbers t*N .. t*N+N-1 since an
    # iteration starts only after the previous one finished.
    n, t = 3, 4
    replies = [f"Attempt M{k}Z: 17*23 = 391.\n\n\\boxed{{391}}" for k in range(n * t)]
    script = SimScript(rules=[Rule(role="solution", replies=replies)])
    result, model = await run_tmas(script, n=n, m=2, iterations=t, epsilon=0.0)
    assert result.status == "done"
    marks = re.compile(r"M(\d+)Z")
    for it, calls in calls_by_iteration(model).items():
        for role, prompt in calls:
            seen = {int(k) // n for k in marks.findall(prompt)}
            if role == "solution":
                # Exploit prompts show R_{t-1} (all N rollouts), never anything of iteration t or older ones.
                assert seen == ({it - 1} if it else set()), (it, role, seen)
                if it:
                    assert len(set(marks.findall(prompt))) == n
            else:
                assert seen == {it}, (it, role, seen)


@pytest.mark.parametrize("epsilon", [0.0, 1.0])
async def test_epsilon_extremes(epsilon: float) -> None:
    n, t = 4, 3
    result, model = await run_tmas(n=n, m=1, iterations=t, epsilon=epsilon)
    prompts = last_user_prompts(model, "solution")
    assert len(prompts) == n * t
    explore = [EXPLORE_MARK in p for p in prompts]
    refine = [REFINE_MARK in p for p in prompts]
    if epsilon == 0.0:
        assert not any(explore) and sum(refine) == n * (t - 1)
    else:
        assert sum(explore) == n * (t - 1) and not any(refine)
    modes = [c.meta.mode for r in result.iterations for c in r.candidates]
    expected = "exploit" if epsilon == 0.0 else "explore"
    assert modes == ["generate"] * n + [expected] * n * (t - 1)


async def test_draws_depend_on_the_run_seed_only() -> None:
    params = {"n": 8, "m": 1, "iterations": 3, "epsilon": 0.5}
    a, _ = await run_tmas(**params)
    b, _ = await run_tmas(**params)
    c, _ = await run_tmas(seed=7, **params)
    modes = [[r.state["modes"] for r in x.iterations] for x in (a, b, c)]
    assert modes[0] == modes[1] != modes[2]
    assert {"explore", "exploit"} <= set(modes[0][1] + modes[0][2])


async def test_explore_prompt_lists_the_previous_guideline_bank() -> None:
    result, model = await run_tmas(n=2, m=1, iterations=2, epsilon=1.0)
    logged = result.iterations[0].state["guideline_bank"]["strategies"]
    assert logged
    explore = [p for p in last_user_prompts(model, "solution") if EXPLORE_MARK in p]
    assert explore and all(f"[{s['id']}] {s['description']}" in p for p in explore for s in logged)


async def test_exploit_prompt_carries_the_previous_experience_bank() -> None:
    script = SimScript(accuracy=0.5)
    result, model = await run_tmas(script, n=4, m=2, iterations=2, epsilon=0.0)
    entries = result.iterations[0].state["experience_bank"]["entries"]
    assert {e["kind"] for e in entries} == {"anchor", "heuristic"}
    refine = [p for p in last_user_prompts(model, "solution") if REFINE_MARK in p]
    assert refine and all(f"[{e['id']}]" in p and e["content"] in p for p in refine for e in entries)


async def test_selection_prefers_verified_answers() -> None:
    script = SimScript(accuracy=0.5)
    # One iteration: which candidates are wrong is drawn from the plain prompt alone, not from what the banks hold.
    result, _ = await run_tmas(script, n=6, m=2, iterations=1)
    last = result.iterations[-1].candidates
    answers = {c.answer for c in last}
    assert len(answers) > 1  # some candidates are wrong ...
    assert "391" in answers and result.answer == "391"  # ... and the verifiers steer selection to the right one
    best = max(c.score or 0.0 for c in last)
    assert all((c.score or 0.0) == 0.0 for c in last if c.answer != "391")
    assert result.iterations[-1].selected == "391" and best > 0


def test_tie_rule() -> None:
    from tmas.methods.base import Candidate

    def cand(i: int, answer: str | None, score: float) -> Candidate:
        return Candidate(index=i, text="", answer=answer, score=score)

    # Tied at 1.0: "5" twice beats "4" once, and the lowest index among the "5"s wins.
    pool = [cand(0, "4", 1.0), cand(1, "7", 0.5), cand(2, "5", 1.0), cand(3, " 5 ", 1.0)]
    assert select(pool, "numeric") == pool[2]
    # Candidates with an answer beat a better-scored one without.
    assert select([cand(0, None, 1.0), cand(1, "3", 0.0)], "numeric").index == 1  # type: ignore[union-attr]
    assert select([cand(0, "1", 0.5), cand(1, "2", 0.5)], "numeric").index == 0  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------- chains
@dataclass
class ChainLog(ScriptedModel):
    """The scripted model, with how many calls it had answered when each chain ended; a call of ``fail_role`` with
    chain ``fail_chain`` raises (a method error, after which the rollouts still running are cancelled)."""

    ended_after: dict[ChainKey, int] = field(default_factory=dict)
    fail_role: str | None = None
    fail_chain: int | None = None

    async def chat(self, role: str, messages: Sequence[Message], **kwargs: Any) -> Completion:
        key = kwargs.get("key")
        if role == self.fail_role and key is not None and key.chain == self.fail_chain:
            raise RuntimeError("scripted failure")
        return await super().chat(role, messages, **kwargs)

    def end_chain(self, chain: ChainKey) -> None:
        super().end_chain(chain)
        assert chain not in self.ended_after, f"{chain} ended twice"
        self.ended_after[chain] = len(self.calls)


def chain_log(script: SimScript | None = None, budget: dict[str, int] | None = None, **params: Any) -> ChainLog:
    settings = scripted_settings(method={"name": "tmas", "params": params}, **({"budget": budget} if budget else {}))
    return ChainLog(script or SimScript(), settings)


def assert_chains_closed(model: ChainLog) -> None:
    """Every chain that made a call was ended once, after its last call."""
    chains = {call.key.chain_key for call in model.calls} - {None}
    assert chains == set(model.ended_after) == set(model.ended_chains)
    for position, call in enumerate(model.calls):
        chain = call.key.chain_key
        assert chain is None or position < model.ended_after[chain], (position, call.role, chain)


async def test_a_candidate_s_calls_carry_its_chain_and_the_chain_ends_after_them() -> None:
    n, m = 3, 2
    echo = "Finish with one last line that holds nothing but the final answer you computed.\n\\boxed{the final answer}"
    rules = [
        # Iteration 0: a solution that echoes its instructions, asked again; iteration 1 (all exploit): an answerless
        # solution, asked again with the reminder. Both second calls stay in the candidate's chain.
        Rule(role="solution", pattern="<problem>", replies=[echo], times=1),
        Rule(role="solution", pattern=REFINE_MARK, replies=["It is roughly four hundred."], times=1),
    ]
    model = chain_log(
        SimScript(rules=rules), n=n, m=m, iterations=2, epsilon=0.0, style="concise", skip_final_memory=False
    )
    result = await solve_in_process(model, Q)
    assert result.status == "done" and result.answer == "391"
    assert result.counters["solution_echo"] == 1 and result.counters["solution_reminded"] == 1
    for call in model.calls:
        sample = call.key.sample % ECHO_RETRY_SAMPLE
        expected = {"solution": sample, "summary": sample, "verifier": sample // m}.get(call.role)
        assert call.key.chain == expected, (call.role, call.key)
    assert len(model.calls_of("solution")) == 2 * n + 2
    # Chain i of iteration t: one per candidate and iteration, each ended once, after its last call.
    assert sorted(model.ended_chains, key=lambda c: (c.iteration or 0, c.chain)) == [
        ChainKey(problem_id="question", iteration=t, chain=i) for t in range(2) for i in range(n)
    ]
    assert_chains_closed(model)


async def test_chains_end_when_a_budget_stops_them_or_a_failure_cancels_them() -> None:
    # A call budget spent among the verifications: the rollouts stop at their next call, and their chains end.
    model = chain_log(budget={"calls": 4}, n=2, m=2, iterations=1)
    result = await solve_in_process(model, Q)
    assert result.stopped_reason == "budget" and len(model.calls) == 4
    assert {c.chain for c in model.ended_chains} == {0, 1}
    assert_chains_closed(model)
    # A failure in one rollout cancels the others; every chain that began ends.
    model = chain_log(n=3, m=2, iterations=1)
    model.fail_role, model.fail_chain = "verifier", 1
    result = await solve_in_process(model, Q)
    assert result.status == "failed" and "scripted failure" in (result.error or "")
    assert model.ended_chains and all(c.iteration == 0 for c in model.ended_chains)
    assert_chains_closed(model)


# ---------------------------------------------------------------------------------------------- bad agent output
async def test_solution_without_a_boxed_answer() -> None:
    script = SimScript(rules=[Rule(role="solution", replies=["It is roughly four hundred."])])
    result, _ = await run_tmas(script, n=2, m=2, iterations=2)
    assert result.status == "done" and result.answer is None
    assert result.counters["solution_no_answer"] == 4
    for record in result.iterations:
        assert all(c.answer is None and c.score == 0.0 for c in record.candidates)
        assert any("no extractable answer" in note for note in record.notes)


@pytest.mark.parametrize(
    ("cut", "answer", "extraction"),
    [
        # Cut at max_tokens through its statement ("39" of "391"): no answer is read from the unfinished line.
        ("17*23 = 391.\nThe answer is 39", None, "none"),
        # An earlier statement, on a line finished before the cut, stands.
        ("The answer is 391.\nChecking once more: 17*23 = 391, so the answer is 3", "391", "stated"),
        # A box is whole wherever it is: one on the line the cut went through is read.
        ("17*23 = 391, so the answer is \\boxed{391}. To check, 391 / 17 = 2", "391", "boxed"),
    ],
)
async def test_a_solution_cut_at_max_tokens_states_no_answer_on_the_line_the_cut_went_through(
    cut: str, answer: str | None, extraction: str
) -> None:
    script = SimScript(rules=[Rule(role="solution", replies=[cut], finish_reason="length")])
    result, _ = await run_tmas(script, n=1, m=1, iterations=1)
    (candidate,) = result.iterations[0].candidates
    assert (candidate.answer, candidate.meta.extraction, candidate.meta.truncated) == (answer, extraction, True)


@pytest.mark.parametrize(
    ("reply", "finish_reason", "answer", "extraction"),
    [
        # An intermediate value boxed, then the final answer stated: the statement is the answer.
        ("17*20 = \\boxed{340} and 17*3 = 51.\n\nFinal answer: 391", "stop", "391", "stated"),
        # Cut through that statement: the box stands, as the line the cut went through is not read.
        ("17*20 = \\boxed{340} and 17*3 = 51.\n\nFinal answer: 39", "length", "340", "boxed"),
    ],
)
async def test_a_final_answer_stated_after_a_boxed_step_is_the_candidates_answer(
    reply: str, finish_reason: str, answer: str, extraction: str
) -> None:
    script = SimScript(rules=[Rule(role="solution", replies=[reply], finish_reason=finish_reason)])
    result, _ = await run_tmas(script, n=1, m=1, iterations=1)
    (candidate,) = result.iterations[0].candidates
    assert (candidate.answer, candidate.meta.extraction) == (answer, extraction)


@pytest.mark.parametrize(
    "cut",
    [
        # Each verifier restates the scale mid-analysis, then is cut at max_tokens before its verdict.
        "Step 1 holds.\nScore: 1 is for a fully correct solution, so step 2 must be checked.\nStep 2 multiplies",
        # Cut through its last line: "Score: 1/2" (or "Score: 1 when ...") after its first digit.
        "Step 1 holds; step 2 leaves a gap.\nScore: 1",
    ],
)
async def test_a_verification_cut_at_max_tokens_is_not_scored(cut: str) -> None:
    # No score, counted 0; the record says the reply was cut.
    script = SimScript(rules=[Rule(role="verifier", replies=[cut], finish_reason="length")])
    result, _ = await run_tmas(script, n=1, m=2, iterations=1)
    record = result.iterations[0]
    verifications = record.candidates[0].meta.verifications or []
    assert [(v.score, v.truncated, v.raw) for v in verifications] == [(None, True, cut), (None, True, cut)]
    assert record.candidates[0].score == 0.0 and result.counters["verification_unparseable"] == 2
    assert any("cut at max_tokens, so not read" in note for note in record.notes)


async def test_verification_without_a_score() -> None:
    script = SimScript(rules=[Rule(role="verifier", replies=["It all looks plausible to me."])])
    result, _ = await run_tmas(script, n=2, m=3, iterations=1)
    assert result.counters["verification_unparseable"] == 6
    candidate = result.iterations[0].candidates[0]
    assert candidate.score == 0.0 and candidate.answer == "391"
    assert candidate.meta.verifications[0] == VerificationRecord(
        score=None,
        call_id=candidate.meta.verifications[0].call_id,
        raw="It all looks plausible to me.",
    )


@pytest.mark.parametrize(
    ("reply", "finish_reason", "error"),
    [
        ("I would add a few entries.", None, "no valid JSON"),
        ("", None, "empty reply"),
        ('```json\n{"operations": [{"op": "ADD", "kind": "anchor", "content": "x"}]}\n```', "length", "truncated"),
        ('{"entries": []}', None, "no 'operations' list"),
    ],
)
async def test_invalid_experience_update_keeps_the_previous_bank(
    reply: str, finish_reason: str | None, error: str
) -> None:
    # The first update (empty bank) is the simulator's valid one; the second (bank holds E1) is the bad reply.
    rule = Rule(role="experience", pattern=r"\[E1\] ", replies=[reply], finish_reason=finish_reason)
    script = SimScript(rules=[rule])
    result, _ = await run_tmas(script, n=2, m=1, iterations=2)
    first, second = (r.state for r in result.iterations)
    assert first["experience_update"]["status"] == "applied" and first["experience_bank"]["entries"]
    assert second["experience_update"]["status"] == "invalid"
    assert error in second["experience_update"]["error"]
    assert second["experience_update"]["raw"] == reply
    assert second["experience_bank"] == first["experience_bank"]
    assert result.counters["experience_invalid"] == 1
    assert second["guideline_update"]["status"] == "applied"


async def test_a_strategy_the_rollouts_of_one_iteration_share_is_logged_once() -> None:
    # The three rollouts of iteration 0 follow one strategy, described in three wordings too far apart to count as
    # near-duplicates; rollouts 2 and 3 name rollout 1, as the guideline prompt asks. The explorers of iteration 1
    # are shown that strategy once.
    first, second, third = (
        "Split 23 as 20 + 3 and distribute.",
        "Compute 17 times 20 and 17 times 3 separately, then add the partial products.",
        "Break the second factor into tens and units before multiplying.",
    )
    verdicts = [
        {"rollout": 1, "strategy": first, "novelty": 1, "same_as": None},
        {"rollout": 2, "strategy": second, "novelty": 0, "same_as": "R1"},
        {"rollout": 3, "strategy": third, "novelty": 0, "same_as": "R1"},
    ]
    rule = Rule(role="guideline", pattern="none logged yet", replies=[json.dumps({"rollouts": verdicts})])
    result, model = await run_tmas(SimScript(rules=[rule]), n=3, m=1, iterations=2, epsilon=1.0)
    guideline = last_user_prompts(model, "guideline")[0]
    assert "the letter R followed by its number" in guideline
    update = result.iterations[0].state["guideline_update"]
    assert update["report"]["added"] == ["G1"] and update["report"]["repeated"] == {"G1": [2, 3]}
    assert update["report"]["rejected"] == []
    (logged,) = result.iterations[0].state["guideline_bank"]["strategies"]
    assert (logged["id"], logged["description"], logged["attempts"]) == ("G1", first, 3)
    explore = [p for p in last_user_prompts(model, "solution") if EXPLORE_MARK in p]
    assert len(explore) == 3
    for prompt in explore:
        listed = prompt.split(EXPLORE_MARK)[1].split("</attempted_strategies>")[0]
        assert re.findall(r"^- \[(G\d+)\] (.*)$", listed, re.M) == [("G1", first)]


async def test_invalid_guideline_update_keeps_the_previous_bank() -> None:
    rule = Rule(role="guideline", pattern=r"- \[G1\] ", replies=['```json\n{"rollouts": [{"rollout": 1,\n```'])
    script = SimScript(rules=[rule])
    result, _ = await run_tmas(script, n=2, m=1, iterations=3)
    banks = [r.state["guideline_bank"] for r in result.iterations]
    assert banks[0]["strategies"] and banks[1] == banks[0] == banks[2]
    assert result.counters["guideline_invalid"] == 2
    assert [r.state["guideline_update"]["status"] for r in result.iterations] == ["applied", "invalid", "invalid"]


async def test_refused_operations_and_verdicts_are_recorded_and_the_valid_ones_applied() -> None:
    # The second updates (E1 and G1 logged) name an entry and a strategy that do not exist, a rollout that was not
    # shown, an operation the prompt does not define and an ADD without its kind, beside valid items.
    ops = [
        {"op": "DELETE", "id": "E99"},
        {"op": "REFINE", "id": "[e1]", "content": "Seventeen times twenty-three is three hundred and ninety-one."},
        {"op": "ADD", "content": "an entry without its kind"},
        {"op": "MODIFY", "id": "E1", "content": "an operation the prompt does not define"},
        {"op": "ADD", "kind": "heuristic", "content": "Never drop the carry from the tens column."},
    ]
    verdicts = [
        {"rollout": 1, "strategy": "", "novelty": 0, "same_as": "G42"},
        {"rollout": 7, "strategy": "Count the digits of the product first.", "novelty": 1, "same_as": None},
    ]
    script = SimScript(
        rules=[
            Rule(role="experience", pattern=r"\[E1\] ", replies=[json.dumps({"operations": ops})]),
            Rule(role="guideline", pattern=r"- \[G1\] ", replies=[json.dumps({"rollouts": verdicts})]),
        ]
    )
    result, _ = await run_tmas(script, n=2, m=1, iterations=2)
    first, second = (r.state for r in result.iterations)
    assert [e["id"] for e in first["experience_bank"]["entries"]] == ["E1"]
    update = second["experience_update"]
    assert update["status"] == "applied"
    assert update["report"]["rejected"] == ["DELETE E99: no such entry", "ADD: needs both 'kind' and 'content'"]
    assert len(update["malformed"]) == 1 and update["malformed"][0].startswith("operation 4: op")
    assert [(e["id"], e["content"]) for e in second["experience_bank"]["entries"]] == [
        ("E1", ops[1]["content"]),
        ("E2", ops[4]["content"]),
    ]
    assert second["guideline_update"]["report"]["rejected"] == ["rollout 1: 'same_as' 'G42' names no logged strategy"]
    assert second["guideline_bank"] == first["guideline_bank"]
    assert second["anomalies"]["experience_ops_rejected"] == 3
    assert second["anomalies"]["guideline_items_rejected"] == 2
    notes = result.iterations[1].notes
    assert any(n.startswith("experience update: 3 operations refused: ") and "DELETE E99" in n for n in notes)
    assert any("rollout 7: not shown to the agent" in n for n in notes)


async def test_failed_calls_are_handled() -> None:
    rules = [
        Rule(role="solution", fault="http_400", times=1),
        Rule(role="verifier", fault="http_400", times=2),
        Rule(role="summary", fault="http_400", times=1),
        Rule(role="experience", fault="http_400"),
        Rule(role="guideline", fault="http_400", times=1),
    ]
    script = SimScript(rules=rules)
    result, _ = await run_tmas(script, n=3, m=2, iterations=2)
    assert result.status == "done" and result.answer == "391"
    c = result.counters
    assert (c["solution_failed"], c["verification_failed"], c["summary_failed"]) == (1, 2, 1)
    assert (c["experience_failed"], c["guideline_failed"]) == (2, 1)
    failed = [cand for r in result.iterations for cand in r.candidates if cand.error]
    assert len(failed) == 1 and failed[0].score == 0.0 and failed[0].answer is None
    assert all(r.state["experience_bank"]["entries"] == [] for r in result.iterations)
    assert result.failed_calls == 1 + 2 + 1 + 2 + 1


async def test_the_summary_agent_reads_the_verifications_that_came_back_and_none_is_asked_without_one() -> None:
    # m = 2, the first verifier call fails: A_sum(x, c, V) is shown the one verification written, not a placeholder
    # for the failed call; the failed one still counts 0 in the score.
    one = SimScript(rules=[Rule(role="verifier", fault="http_400", times=1)])
    result, model = await run_tmas(one, n=1, m=2, iterations=1)
    (prompt,) = last_user_prompts(model, "summary")
    assert prompt.count("<verification number=") == 1 and '<verification number="1" score="1">' in prompt
    assert "(verification failed)" not in prompt
    (candidate,) = result.iterations[0].candidates
    assert [v.error is not None for v in candidate.meta.verifications or []] == [True, False]
    assert candidate.score == 0.5
    # Both fail: nothing to summarise, so no summary call; the rollout's summary is built from the scores.
    none = SimScript(rules=[Rule(role="verifier", fault="http_400", times=2)])
    result, model = await run_tmas(none, n=1, m=2, iterations=1)
    assert model.calls_of("summary") == []
    (candidate,) = result.iterations[0].candidates
    assert (candidate.meta.summary or "").startswith("(No summary: no verification call came back.)")
    assert "candidate 0: no verification call came back; summary built from the scores" in result.iterations[0].notes


async def test_every_solution_failing_fails_the_problem() -> None:
    script = SimScript(rules=[Rule(role="solution", fault="http_400")])
    result, model = await run_tmas(script, n=2, m=1, iterations=2)
    assert result.status == "failed" and "no candidate" in (result.error or "")
    assert by_role(model) == {"solution": 4}


# ---------------------------------------------------------------------------------------------- ablations, stopping
async def test_no_experience_ablation() -> None:
    result, model = await run_tmas(n=2, m=1, iterations=3, epsilon=0.0, no_experience=True)
    assert "experience" not in by_role(model) and by_role(model)["guideline"] == 3
    refine = [p for p in last_user_prompts(model, "solution") if REFINE_MARK in p]
    assert len(refine) == 4 and not any("<experience>" in p for p in refine)
    assert all(r.state["experience_update"] == {"status": "disabled"} for r in result.iterations)


async def test_no_guideline_ablation() -> None:
    result, model = await run_tmas(n=2, m=1, iterations=3, epsilon=1.0, no_guideline=True)
    assert "guideline" not in by_role(model) and by_role(model)["experience"] == 3
    assert not any(EXPLORE_MARK in p for p in last_user_prompts(model, "solution"))
    assert [c.meta.prompt for c in result.iterations[2].candidates] == ["generate", "generate"]


async def test_both_ablations() -> None:
    _, model = await run_tmas(n=2, m=1, iterations=2, no_experience=True, no_guideline=True)
    assert set(by_role(model)) == {"solution", "verifier", "summary"}


async def test_early_stopping_stops_and_says_why() -> None:
    result, model = await run_tmas(n=3, m=2, iterations=8, early_stop=True, early_stop_patience=2, early_stop_score=0.5)
    assert len(result.iterations) == 2
    assert result.stopped_reason == "settled (early_stop)"
    last = result.iterations[-1]
    assert "settled for 2 consecutive iteration(s)" in last.state["early_stop"]["reason"]
    assert last.state["early_stop"]["iteration"] == 1 and last.state["experience_update"]["status"] == "skipped"
    assert by_role(model)["experience"] == 1  # the stopping iteration's memory update is skipped
    assert result.answer == "391"


async def test_no_early_stop_by_default() -> None:
    result, _ = await run_tmas(n=2, m=1, iterations=3)
    assert len(result.iterations) == 3 and result.stopped_reason is None


async def test_top_k_limits_what_the_exploit_prompt_sees() -> None:
    script = SimScript(accuracy=0.5)
    result, model = await run_tmas(script, n=4, m=1, iterations=2, epsilon=0.0, top_k=2)
    refine = [p for p in last_user_prompts(model, "solution") if REFINE_MARK in p]
    assert refine and all(p.count("<rollout number=") == 2 for p in refine)
    assert any("exploit prompt: left out rollouts" in n for n in result.iterations[1].notes)


@pytest.mark.parametrize("no_experience", [False, True])
async def test_an_iteration_without_rollouts_leaves_the_next_exploits_the_experience_bank(no_experience: bool) -> None:
    # Every exploit of iteration 1 fails: R_1 is empty and E_1 = E_0 (the update is skipped), so iteration 2's exploits
    # get A_sol(x, {}, E_1): the experience bank without rollouts, never R_0; with no bank (ablation), the plain prompt.
    script = SimScript(rules=[Rule(role="solution", pattern=REFINE_MARK, fault="http_400", times=2)])
    result, model = await run_tmas(script, n=2, m=1, iterations=3, epsilon=0.0, no_experience=no_experience)
    assert all(c.error for c in result.iterations[1].candidates)
    bank = result.iterations[1].state["experience_bank"]["entries"]
    assert bank == result.iterations[0].state["experience_bank"]["entries"]
    last = result.iterations[2]
    prompts = last_user_prompts(model, "solution")[-2:]
    assert sum(REFINE_MARK in p for p in last_user_prompts(model, "solution")) == 2  # iteration 1's alone
    if no_experience:
        assert not bank and [c.meta.prompt for c in last.candidates] == ["generate", "generate"]
        assert prompts == last_user_prompts(model, "solution")[:1] * 2  # iteration 0's plain prompt
        assert any("exploit candidates got the plain prompt" in note for note in last.notes)
    else:
        assert bank and [c.meta.prompt for c in last.candidates] == ["refine", "refine"]
        for prompt in prompts:
            assert "<experience>" in prompt and "<rollout" not in prompt
            assert all(f"[{entry['id']}] " in prompt and entry["content"] in prompt for entry in bank)
        assert any("exploit candidates got the experience bank alone" in note for note in last.notes)


async def test_a_new_strategy_keeps_the_score_of_the_rollout_it_came_from() -> None:
    # Two routes to 391, verified at 1 and 0.5; the guideline agent logs one strategy per rollout (numbered from 1 as
    # the prompt shows them): each strategy's best score is its own rollout's.
    routes = ["Route alpha: 17*20 + 17*3 = 391.\n\n\\boxed{391}", "Route beta: 23*17 = 391.\n\n\\boxed{391}"]
    strategies = ["split the second factor into tens and units", "swap the factors and multiply directly"]
    verdicts = [{"rollout": k + 1, "strategy": s, "novelty": 1, "same_as": None} for k, s in enumerate(strategies)]
    rules = [
        Rule(role="solution", replies=routes),
        Rule(role="verifier", pattern="Route alpha", replies=["## Analysis\nSound.\n\n## Score\nScore: 1"]),
        Rule(role="verifier", pattern="Route beta", replies=["## Analysis\nA gap.\n\n## Score\nScore: 0.5"]),
        Rule(role="guideline", replies=[json.dumps({"rollouts": verdicts})]),
    ]
    result, _ = await run_tmas(SimScript(rules=rules), n=2, m=1, iterations=1)
    record = result.iterations[0]
    scores = {c.index + 1: c.score for c in record.candidates}
    assert sorted(scores.values(), key=str) == [0.5, 1.0]
    logged = {s["description"]: s["best_score"] for s in record.state["guideline_bank"]["strategies"]}
    assert logged == {strategies[0]: scores[1], strategies[1]: scores[2]}


# ---------------------------------------------------------------------------------------------- presets, defaults
def test_presets_and_embedded_defaults() -> None:
    paper = TMASParams.model_validate({"preset": "paper"})
    assert (paper.n, paper.m, paper.iterations, paper.epsilon) == (8, 8, 20, 0.2)
    assert paper.sampling["solution"].temperature == 1.0 and paper.sampling["verifier"].top_p == 0.95
    # Algorithm 1 as written: every problem runs all T iterations, no call asks for log-probabilities.
    assert (paper.early_stop, paper.confidence, paper.select) == (False, False, "best_score")
    assert paper.confidence_sampling(paper.select) is None
    local = create_method("tmas", {}, embedded=True).params
    assert isinstance(local, TMASParams) and (local.preset, local.n, local.m, local.iterations) == ("local", 2, 1, 2)
    # The local preset stops a problem once its answer is settled.
    assert (local.early_stop, local.early_stop_patience, local.confidence) == (True, 1, False)
    mine = create_method("tmas", {"iterations": 5}, embedded=True).params
    assert isinstance(mine, TMASParams) and (mine.n, mine.iterations) == (2, 5)
    assert create_method("tmas", {"preset": "paper"}, embedded=True).params.iterations == 20
    assert isinstance(create_method("tmas", {}), TMAS) and Settings().method.name == "tmas"


@pytest.mark.parametrize(("preset", "scored"), [("paper", False), ("local", True)])
async def test_the_paper_preset_shows_rollouts_as_the_paper_does(preset: str, scored: bool) -> None:
    # Algorithm 1's rollout is (c, s): the paper preset shows the solution and its summary alone; beyond the paper
    # each also carries its mean verifier score.
    params = {"preset": preset, "iterations": 2, "n": 1, "m": 1, "epsilon": 0.0, "early_stop": False}
    settings = Settings.model_validate(
        {"endpoint": {"base_url": [SCRIPTED_URL]}, "method": {"name": "tmas", "params": params}}
    )
    model = ScriptedModel(SimScript(), settings)
    await asolve(Q, model=model)
    shown = ["\n".join(m.content for m in c.messages) for c in model.calls if c.role in ("solution", "experience")]
    with_rollouts = [text for text in shown if "<rollout number=" in text]
    assert len(with_rollouts) >= 2  # the exploit prompt and the experience agent's
    assert all(("mean_verifier_score=" in text) == scored for text in with_rollouts)
    assert all(("its mean verifier score" in text) == scored for text in with_rollouts)
    # The experience bank's size: appendix D's 20-35 target; the paper preset names no cap, the others theirs.
    experience = [c.messages[-1].content for c in model.calls if c.role == "experience"]
    assert experience and all("Aim for 20 to 35 entries" in text for text in experience)
    assert all(("the bank holds at most 35." in text) == scored for text in experience)
    assert not any("holds at most 10000" in text for text in experience)
    paper = TMASParams.model_validate({"preset": "paper"})
    assert (paper.answer_reminder, paper.show_scores, paper.experience_max_entries) == (False, False, None)


def test_preset_sampling_yields_to_the_users_settings() -> None:
    local = TMASParams.model_validate({"preset": "local"})

    def sent(settings: Settings, role: str, params: TMASParams) -> Sampling:
        preset, own = params.sampling_layers(role)
        return resolve_role(settings, role, preset=preset, method=own).sampling

    plain = sent(Settings(), "solution", local)
    assert (plain.temperature, plain.max_tokens) == (0.3, 640)
    user = Settings.model_validate(
        {"sampling": {"temperature": 0.9}, "roles": {"solution": {"sampling": {"max_tokens": 99}}}}
    )
    assert (sent(user, "solution", local).temperature, sent(user, "solution", local).max_tokens) == (0.9, 99)
    assert (sent(user, "verifier", local).temperature, sent(user, "verifier", local).max_tokens) == (0.9, 400)
    # The user's own per-role method sampling is no preset value: it is sent whatever the settings say.
    mine = TMASParams.model_validate({"preset": "local", "sampling": {"solution": {"temperature": 0.1}}})
    assert sent(user, "solution", mine).temperature == 0.1


async def test_paper_preset_sends_its_sampling() -> None:
    # Settings of no sampling of their own, as a user's (the wire's view: tests/test_wire_sampling.py).
    settings = Settings.model_validate(
        {
            "endpoint": {"base_url": [SCRIPTED_URL]},
            "method": {"name": "tmas", "params": {"preset": "paper", "iterations": 1, "n": 1, "m": 1}},
        }
    )
    model = ScriptedModel(SimScript(), settings)
    await asolve(Q, model=model)
    bodies = [call.body for call in model.calls]
    assert bodies and all(b["temperature"] == 1.0 and b["top_p"] == 0.95 for b in bodies)


async def test_the_simulated_memory_agents_read_rollouts_shown_without_scores() -> None:
    # The paper preset shows each rollout as (c, s) alone: the simulated experience and guideline agents read such
    # rollouts too, judging each by its verification summary, so both banks fill as they do with scores shown.
    banks = {}
    for shown in (True, False):
        result, _ = await run_tmas(n=2, m=1, iterations=2, epsilon=0.0, show_scores=shown)
        for record in result.iterations:
            assert not {"guideline_invalid", "experience_invalid"} & set(record.state["anomalies"])
            assert record.state["guideline_update"]["status"] == "applied"
        banks[shown] = [(r.state["experience_bank"], r.state["guideline_bank"]) for r in result.iterations]
    experience, guideline = banks[False][0]
    assert [e["kind"] for e in experience["entries"]] == ["anchor"] and len(guideline["strategies"]) == 1
    assert banks[False] == banks[True]


@pytest.mark.parametrize(
    "retry",
    [
        Rule(role="experience", replies=["There is nothing to add."], times=1),
        Rule(role="experience", fault="http_400", times=1),
    ],
    ids=["unreadable", "failed"],
)
async def test_an_unusable_retry_after_an_echo_keeps_the_first_update_less_its_echo(retry: Rule) -> None:
    # The experience update holds one item copied from its instructions and one finding: it is asked again, and the
    # retry is no update at all. The finding of the first reply still enters the bank; the echoed item does not.
    echoed = "a transformation that turns the problem or a sub-problem into a simpler or better understood one"
    finding = "17 times 23 splits as 17 times 20 plus 17 times 3, which is 340 plus 51"
    ops = [{"op": "ADD", "kind": "anchor", "content": text} for text in (echoed, finding)]
    first = Rule(role="experience", replies=[json.dumps({"operations": ops})], times=1)
    result, model = await run_tmas(SimScript(rules=[first, retry]), n=1, m=1, iterations=1)
    asked = [c for c in model.calls if c.role == "experience"]
    assert [c.key.sample for c in asked] == [0, ECHO_RETRY_SAMPLE]
    assert asked[0].messages == asked[1].messages
    state = result.iterations[0].state
    assert [e["content"] for e in state["experience_bank"]["entries"]] == [finding]
    update = state["experience_update"]
    assert update["status"] == "applied" and update["call_id"] == asked[0].reply.call_id
    assert update["retry"]["status"] == ("failed" if retry.fault else "invalid")
    assert len(update["echo_dropped"]) == 1 and "experience_failed" not in state["anomalies"]


@pytest.mark.parametrize("mode", ["numeric", "proof"])
async def test_a_solution_with_no_text_is_neither_verified_nor_summarised(mode: str) -> None:
    # Candidate 0's first reply is cut while the model still reasoned: no content, so nothing to verify. Its M
    # verifications and its summary are not asked; it stays in the record scored 0 and never reaches a later prompt.
    cut = Rule(role="solution", replies=[""], reasoning="Let me multiply 17 by 23 digit", finish_reason="length")
    result, model = await run_tmas(
        SimScript(rules=[cut.model_copy(update={"times": 1})]), n=2, m=3, iterations=2, mode=mode
    )
    first = result.iterations[0]
    empty, written = first.candidates
    assert empty.text == "" and empty.score == 0.0 and empty.meta.unverified and empty.meta.verifications is None
    assert empty.meta.summary is None and written.meta.summary and len(written.meta.verifications or []) == 3
    assert first.state["anomalies"]["solution_empty"] == 1
    asked = [c for c in model.calls if c.key.iteration == 0]
    assert [c.key.chain for c in asked if c.role in ("verifier", "summary")] == [1] * 4
    # R_0 holds candidate 1 alone: the memory agents see one rollout.
    shown = re.findall(r'<rollout number="(\d+)"', last_user_prompts(model, "experience")[0])
    assert shown == ["2"] and by_role(model)["verifier"] == 3 + 2 * 3
    # The exploit prompt RL training rebuilds from the stored record is the one iteration 1 sent.
    method = TMAS(TMASParams(n=2, m=3, iterations=2, mode=mode))
    rebuilt = method.prompts_after(Q, first, method.rendering(None, None)).exploit
    sent = [
        c.messages for c in model.calls_of("solution") if c.key.iteration == 1 and "<rollout" in c.messages[-1].content
    ]
    assert rebuilt is not None and sent and all(messages == rebuilt[1] for messages in sent)
    assert result.answer is not None or mode == "proof"


async def test_in_proof_mode_a_failed_last_iteration_returns_an_earlier_proof() -> None:
    # Every exploit call of iteration 1 fails: the proof of iteration 0 is the answer, recorded as a fallback.
    failing = Rule(role="solution", pattern="<rollout", fault="http_400")
    result, _ = await run_tmas(SimScript(rules=[failing]), n=2, m=1, iterations=2, mode="proof", epsilon=0.0)
    assert all(c.error for c in result.iterations[1].candidates)
    assert result.status == "done" and result.text and result.fallback is not None
    assert (result.fallback.iteration, result.fallback.reason) == (0, "no usable candidate in the last iteration")


async def test_in_proof_mode_the_answer_is_a_written_proof_not_a_reply_without_text() -> None:
    # Iteration 1: candidate 0 is cut while it reasoned (no content, so not in R_T) and every verifier fails
    # candidate 1. Line 22's argmax is over R_T: candidate 1's proof is the answer, not candidate 0's empty text.
    cut = Rule(role="solution", pattern="<rollout", replies=[""], reasoning="Let me", finish_reason="length", times=1)
    zero = Rule(role="verifier", replies=["## Analysis\nThe product is miscomputed.\n\n## Score\nScore: 0"])
    result, _ = await run_tmas(SimScript(rules=[cut, zero]), n=2, m=1, iterations=2, mode="proof", epsilon=0.0)
    empty, written = result.iterations[-1].candidates
    assert empty.meta.unverified and empty.text == "" and written.text and written.score == 0.0
    assert result.status == "done" and result.text == written.text and result.fallback is None
    assert result.iterations[-1].selection == Selection(iteration=1, candidate=1)


async def test_an_experience_update_writing_null_for_the_fields_it_leaves_unused_is_applied() -> None:
    # Each operation spells out every field the prompt lists, null where one does not apply: the update is applied,
    # not refused as invalid with E_{t-1} kept.
    op = {"op": "ADD", "id": None, "kind": "anchor", "subtype": "intermediate_result", "merges": None}
    ops = [
        {**op, "content": "Splitting 23 into 20 and 3 gives 340 and 51, so 17*23 = 391."},
        {**op, "kind": "heuristic", "subtype": None, "content": "Adding 340 and 51 without the carry gives 381."},
    ]
    rule = Rule(role="experience", replies=["```json\n" + json.dumps({"operations": ops}) + "\n```"])
    result, model = await run_tmas(SimScript(rules=[rule]), n=2, m=1, iterations=2, epsilon=0.0)
    first = result.iterations[0].state
    assert first["experience_update"]["status"] == "applied", first["experience_update"]
    assert [e["content"] for e in first["experience_bank"]["entries"]] == [o["content"] for o in ops]
    # E_0 reaches the exploit prompts of iteration 1.
    exploits = [p for p in last_user_prompts(model, "solution") if REFINE_MARK in p]
    assert exploits and all(o["content"] in p for p in exploits for o in ops)
    assert "experience_invalid" not in result.counters
