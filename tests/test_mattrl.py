"""MATTRL in process on the scripted model: team formation, review-driven convergence, the decision, bad output
repaired or defaulted, experience injection, the budget; against the simulated server, per-role endpoints and
sampling, and kill + resume."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import clean_env, run_tmas, scripted_settings, settings_for
from scripted_runs import by_role, last_user_prompts, scripted_run, solve_in_process
from tmas.agents.mattrl_team import EDUCATION_CATALOG, MEDICINE_CATALOG
from tmas.api import asolve
from tmas.llm.replay import StoreReplay
from tmas.memory.embedders import LOCAL_NAME, EndpointEmbedder, LocalEmbedder
from tmas.memory.pool import Pool
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember, Transcript
from tmas.methods import create_method
from tmas.methods.base import ProblemResult, ProblemSession
from tmas.methods.mattrl_deliberation import REVIEW_SAMPLE, Seat, differential_change
from tmas.methods.mattrl_domains import domain_named
from tmas.problems import Problem, question_hash
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer
from tmas.testing.mattrl_responders import SIM_DIFFERENTIAL

Q = "What is 17*23?"
WRONG = "Multiplying gives 17*23 = 390.\n\nTherefore, the final answer is \\boxed{390}."


async def run(
    rules: list[Rule] | None = None, settings_extra: dict[str, Any] | None = None, **params: Any
) -> tuple[ProblemResult, ScriptedModel]:
    settings = scripted_settings(method={"name": "mattrl", "params": params}, **(settings_extra or {}))
    model = ScriptedModel(SimScript(rules=rules or []), settings)
    return await solve_in_process(model, Q), model


def transcript(result: ProblemResult, record: int = -1) -> Transcript:
    return Transcript.model_validate(result.iterations[record].state["transcript"])


def chat_requests(sim: SimServer, role: str) -> list[dict[str, Any]]:
    return [r.body for r in sim.requests if r.endpoint == "chat" and r.role == role]


# The first round's slip of the leading specialist, once.
SLIP = Rule(role="specialist", pattern="You are Arithmetic strategist", replies=[WRONG], times=1)


async def test_a_team_that_agrees_at_once_decides_in_the_first_round() -> None:
    result, model = await run()
    assert result.answer == "391" and result.status == "done"
    [record] = result.iterations
    assert by_role(model) == {"coordinator": 2, "specialist": 3, "reviewer": 6}
    t = transcript(result)
    assert [m.specialty for m in t.team] == ["Arithmetic strategist", "Computation checker", "Edge-case auditor"]
    assert [m.leader for m in t.team] == [True, False, False]
    kinds = [u.kind for u in t.utterances]
    assert kinds.count("opinion") == 3 and kinds.count("review") == 6 and kinds[-2:] == ["report", "decision"]
    assert {(u.agent, u.target) for u in t.utterances if u.kind == "review"} == {
        (a, b) for a in ("S1", "S2", "S3") for b in ("S1", "S2", "S3") if a != b
    }
    assert t.final_answer == "391" and record.selected == "391"
    assert [c.score for c in record.candidates] == [1.0, 1.0, 1.0]
    assert all(m["accepted"] and m["converged"] for m in record.state["members"])
    assert record.state["decision"]["answer"] == "391" and record.notes == []


async def test_a_wrong_attempt_is_revised_from_peer_feedback_until_accepted() -> None:
    result, model = await run([SLIP])
    assert result.answer == "391" and len(result.iterations) == 2
    first, second = result.iterations
    members = {m["id"]: m for m in first.state["members"]}
    assert members["S1"] == {"id": "S1", "answer": "390", "accepted": False, "converged": False, "spoke": True}
    assert members["S2"]["accepted"] and members["S3"]["accepted"]
    assert [c.score for c in first.candidates] == [0.0, 1.0, 1.0]
    # Round 2: only the open specialist speaks again, and only its attempt is reviewed.
    assert [c.meta.member for c in second.candidates] == ["S1"]
    specialist = last_user_prompts(model, "specialist")
    assert len(specialist) == 4 and len(model.calls_of("reviewer")) == 6 + 2
    revision = specialist[-1]
    assert "<your_previous_attempt>" in revision and "\\boxed{390}" in revision
    feedback = json.loads(revision.split("<peer_feedback>\n", 1)[1].split("\n</peer_feedback>", 1)[0])
    assert feedback["verdicts"] == {"S2": "revise", "S3": "revise"}
    assert {i["type"] for i in feedback["issues"]} == {"computation_error"}
    # The bulletin keeps one copy of the issue both reviewers raised.
    meeting = [u for u in transcript(result).utterances if u.kind == "meeting"]
    assert len(meeting) == 1 and meeting[0].text.count("computation_error") == 1
    assert "<accepted_snapshot>" in revision and "S2 (Computation checker), accepted" in revision
    assert all(m["converged"] for m in second.state["members"])
    # Eq. 7: the chair reads every round's opinions, the revised-away attempt of round 1 included.
    summary = last_user_prompts(model, "coordinator")[-1].split("<team_summary>", 1)[1]
    assert summary.index('<round number="1">') < summary.index("\\boxed{390}") < summary.index('<round number="2">')
    assert summary.count("S1 Arithmetic strategist:") == 2


async def test_the_discussion_is_fitted_to_the_chairs_window_older_rounds_first() -> None:
    result, model = await run([SLIP], {"endpoint__context_length": 920})
    assert result.answer == "391" and len(result.iterations) == 2
    decision = last_user_prompts(model, "coordinator")[-1]
    summary = decision.split("<team_summary>\n", 1)[1].split("\n</team_summary>", 1)[0]
    # The window (920) less the reply's max_tokens (256) and the 256-token margin, at 4 characters a token, less
    # the decision prompt around the discussion.
    budget = (920 - 256 - 256) * 4 - sum(len(m.content) for m in domain_named("math").decision_prompt(Q, ""))
    assert len(summary) <= budget
    first, second = summary.split('<round number="2">')
    # Round 1's three opinions are cut, head and tail kept; round 2 (the latest) is whole.
    assert first.count("characters left out to fit the context window ...]") == 3
    assert "Multiplying give" in first and "\\boxed{390}." in first
    opinion = next(u.text for u in transcript(result).utterances if u.round == 1 and u.kind == "opinion")
    assert opinion.strip() in second


async def test_a_specialist_that_never_convinces_its_peers_runs_to_r_max() -> None:
    result, model = await run([SLIP.model_copy(update={"times": None})], iterations=3)
    assert len(result.iterations) == 3 and result.answer == "391"
    assert [m["converged"] for m in result.iterations[-1].state["members"]] == [False, True, True]
    assert "decision" in result.iterations[-1].state and "decision" not in result.iterations[1].state
    assert by_role(model)["specialist"] == 3 + 1 + 1


async def test_an_issue_written_as_a_plain_string_keeps_the_attempt_open_and_reaches_its_author() -> None:
    # S1 says 390 in every round; its peers answer "revise" and list their issue as a plain string, not an object.
    # The criticism is an issue still: S1's unchanged answer has not converged "under critique" (B.3), and the
    # revision prompt and the bulletin carry the note. Dropped, S1 converged in round 2 with 390, none the wiser.
    issue = "17*23 is 391: the partial product 17*3 = 51 was added as 50."
    string_issue = json.dumps({"analysis": "One slip.", "verdict": "revise", "validated": [], "issues": [issue]})
    rules = [
        SLIP.model_copy(update={"times": None}),
        Rule(role="reviewer", pattern='"author": \\{\n  "specialty": "Arithmetic strategist"', replies=[string_issue]),
    ]
    result, model = await run(rules, iterations=3)
    assert [m["converged"] for m in result.iterations[1].state["members"]] == [False, True, True]
    assert len(result.iterations) == 3 and by_role(model)["specialist"] == 3 + 1 + 1
    revision = last_user_prompts(model, "specialist")[3]
    feedback = json.loads(revision.split("<peer_feedback>\n", 1)[1].split("\n</peer_feedback>", 1)[0])
    assert [(i["severity"], i["note"]) for i in feedback["issues"]] == [("major", issue), ("major", issue)]
    [meeting, *_] = [u for u in transcript(result).utterances if u.kind == "meeting"]
    assert meeting.text.count(issue) == 1


# S1's first answer is right but draws a minor issue, so S1 stays open after round 1.
FIRST_PASS = "On a first pass, 17*23 = 391.\n\nTherefore, the final answer is \\boxed{391}."
NITPICK = json.dumps(
    {
        "analysis": "Right value, terse derivation.",
        "verdict": "revise",
        "validated": ["result"],
        "issues": [
            {"type": "logic_gap", "severity": "minor", "note": "Show the partial products.", "fix": "Add them."}
        ],
    }
)


async def test_a_specialist_whose_revision_call_fails_is_neither_reviewed_nor_converged() -> None:
    rules = [
        Rule(
            role="specialist",
            pattern="<your_previous_attempt>.*You are Arithmetic strategist",
            fault="http_400",
            times=1,
        ),
        Rule(role="specialist", pattern="You are Arithmetic strategist", replies=[FIRST_PASS], times=1),
        Rule(role="reviewer", pattern="On a first pass", replies=[NITPICK], times=2),
    ]
    result, model = await run(rules, iterations=3)
    first, second, third = result.iterations
    assert [m["converged"] for m in first.state["members"]] == [False, True, True]
    # Round 2: S1's call failed, so its round-1 attempt is not reviewed again and it has not converged; the record
    # says it did not speak, and so does the bulletin.
    assert second.state["members"][0] == {
        "id": "S1",
        "answer": "391",
        "accepted": False,
        "converged": False,
        "spoke": False,
    }
    assert [m["spoke"] for m in second.state["members"]] == [False, None, None]
    assert any(n.startswith("S1: opinion call failed") for n in second.notes)
    assert [c.answer for c in second.candidates] == [None]
    said = transcript(result, 1).utterances
    assert [u.kind for u in said if u.round == 1] == ["opinion", "meeting"] and said[-2].answer is None
    assert "S1 (Arithmetic strategist): did not speak this round (its opinion call failed)" in said[-1].text
    # Round 3: S1 speaks again, answering the round-1 feedback it still holds, and is reviewed and accepted.
    revision = last_user_prompts(model, "specialist")[-1]
    assert "Show the partial products." in revision.split("<peer_feedback>", 1)[1]
    assert len(model.calls_of("reviewer")) == 6 + 2
    assert third.state["members"][0]["accepted"] and third.state["members"][0]["spoke"]
    assert result.answer == "391"


# A reply made of the opinion prompt's own instructions.
ECHO = (
    "Think step by step from your speciality and write ONE integrated, concise message: a one- or two-sentence "
    "reflection, the core reasoning, and the final answer alone inside \\boxed{}. Keep it rigorous and "
    "self-contained; no decorative tags, no step numbering."
)


async def test_an_opinion_that_echoes_the_instructions_twice_never_reaches_the_chair() -> None:
    result, model = await run(
        [Rule(role="specialist", pattern="You are Edge-case auditor", replies=[ECHO])], iterations=1
    )
    first = result.iterations[0]
    assert "S3: the retried opinion echoed the instructions too; keeps its attempt" in first.notes
    summary = last_user_prompts(model, "coordinator")[-1].split("<team_summary>", 1)[1].split("</team_summary>")[0]
    assert "ONE integrated" not in summary and summary.count("S3 Edge-case auditor") == 1
    [s3] = [u for u in transcript(result).utterances if u.kind == "opinion" and u.agent == "S3"]
    assert s3.text == "" and s3.answer is None
    # The record's candidate keeps what the model said, with why it was not used.
    assert first.candidates[2].text.startswith("Think step by step") and first.candidates[2].error is not None
    assert result.answer == "391"


# A peer's review objecting to 390 as 17*23.
OBJECTION = json.dumps(
    {
        "analysis": "The product is off.",
        "verdict": "revise",
        "validated": [],
        "issues": [{"type": "algebra_error", "severity": "major", "note": "17*23 is not 390.", "fix": "Redo it."}],
    }
)


async def test_a_kept_answer_whose_reviews_all_failed_has_not_converged() -> None:
    rules = [
        Rule(role="specialist", pattern="You are Arithmetic strategist", replies=[WRONG], times=2),
        # Round 1: both peers object to 390; round 2: every review of S1's unchanged 390 fails (each asked twice).
        Rule(role="reviewer", pattern="= 390", replies=[OBJECTION], times=2),
        Rule(role="reviewer", pattern="= 390", fault="http_400", times=4),
    ]
    result, _ = await run(rules, iterations=3)
    second = result.iterations[1]
    assert [n for n in second.notes if n.startswith("review of S1")] == [
        "review of S1 by S2: unusable (scripted http_400); counted as revise",
        "review of S1 by S3: unusable (scripted http_400); counted as revise",
    ]
    # No peer read the kept 390, so "unchanged under critique" does not hold: S1 stays open and speaks again.
    assert second.state["members"][0]["converged"] is False
    assert len(result.iterations) == 3 and result.iterations[2].state["members"][0]["accepted"]
    assert result.answer == "391"


async def test_an_unreadable_review_is_no_verdict_in_its_authors_feedback() -> None:
    rules = [
        SLIP,
        # Round 1: S2 objects to S1's 390; S3's review of it fails, its retry too.
        Rule(role="reviewer", pattern="= 390.*You are Computation checker, reviewing", replies=[OBJECTION], times=1),
        Rule(role="reviewer", pattern="= 390.*You are Edge-case auditor, reviewing", fault="http_400", times=2),
    ]
    result, model = await run(rules, iterations=2)
    assert "review of S1 by S3: unusable (scripted http_400); counted as revise" in result.iterations[0].notes
    [again] = [p for p in last_user_prompts(model, "specialist")[3:] if "You are Arithmetic strategist" in p]
    feedback = json.loads(again.split("<peer_feedback>\n", 1)[1].split("\n</peer_feedback>", 1)[0])
    # S1 is told what S2 said; S3 said nothing it could read, so it is no verdict (no "revise" nobody gave).
    assert feedback["verdicts"] == {"S2": "revise"}
    assert [i["note"] for i in feedback["issues"]] == ["17*23 is not 390."]
    # It still counts as revise where acceptance is decided: S1 was not accepted in round 1.
    assert result.iterations[0].state["members"][0]["accepted"] is False


async def test_a_specialist_silent_in_round_1_is_asked_for_a_first_attempt_not_a_revision() -> None:
    fail = Rule(role="specialist", pattern="You are Arithmetic strategist", fault="http_400", times=1)
    result, model = await run([fail], iterations=2)
    assert result.iterations[0].state["members"][0]["spoke"] is False
    [again] = [p for p in last_user_prompts(model, "specialist")[3:] if "You are Arithmetic strategist" in p]
    # Nothing to revise: no empty previous attempt or feedback, no request to revise; the team's state is shown.
    assert "<your_previous_attempt>" not in again and "<peer_feedback>" not in again
    assert "Revise your previous attempt" not in again
    assert "<bulletin>" in again and "S1 (Arithmetic strategist): did not speak this round" in again
    assert "S2 (Computation checker), accepted" in again
    assert result.iterations[1].state["members"][0]["accepted"] and result.answer == "391"


async def test_unusable_team_json_is_retried_then_the_default_team_is_used() -> None:
    result, _ = await run(
        [Rule(role="coordinator", pattern="Exactly one member", replies=["a team of experts", "[{}]"])]
    )
    notes = result.iterations[0].notes
    assert notes[0] == "team formation attempt 1: unusable reply: no JSON array of team members in the reply"
    assert notes[1].startswith("team formation attempt 2: unusable reply: none of the 1 team members is usable")
    assert notes[2] == "team formation: no usable team from the coordinator; the default team is used"
    assert [m.specialty for m in transcript(result).team] == [
        "Problem analyst",
        "Computation checker",
        "Edge-case auditor",
    ]
    assert result.answer == "391"


async def test_an_unreadable_review_is_retried_then_counted_as_revise() -> None:
    rule = Rule(
        role="reviewer", pattern='"specialty": "Computation checker",\n  "role": "analyst"\n }\n}', replies=["no json"]
    )
    result, model = await run([rule], iterations=1)
    first = result.iterations[0]
    bad = [n for n in first.notes if n.startswith("review of")]
    # S2 reviews S1 and S3; each review is asked twice (one retry) and stays unreadable.
    assert bad == [
        "review of S1 by S2: unusable (no valid JSON object in the reply); counted as revise",
        "review of S3 by S2: unusable (no valid JSON object in the reply); counted as revise",
    ]
    assert by_role(model)["reviewer"] == 6 + 2
    assert [m["accepted"] for m in first.state["members"]] == [False, True, False]
    assert result.answer == "391"


# Reviews whose analysis is the review prompt's own instructions (B.4's, A.4's).
ECHOED_ANALYSIS = {
    "math": 'Keep "analysis" to two to four sentences: what holds up first, then the targeted criticism.',
    "medicine": "Judge the differential against the patient record only; do not invent findings, tests or results.",
}


@pytest.mark.parametrize("domain", ["math", "medicine"])
async def test_an_unusable_review_is_no_turn_of_the_discussion_experience_construction_reads(domain: str) -> None:
    # S2's reviews of S1 echo the review prompt's instructions (asked twice), or are not JSON: no review. Like an
    # unusable opinion, its text stays out of the transcript, which experience construction credits as S2's turn.
    echoed = json.dumps({"analysis": ECHOED_ANALYSIS[domain], "verdict": "accept", "validated": [], "issues": []})
    for bad in (echoed, "no json here at all"):
        s1_by_s2 = r'"role": "leader"\n }[\s\S]*"reviewer": \{\n  "specialty": "(Computation checker|Urology)"'
        rule = Rule(role="reviewer", pattern=s1_by_s2, replies=[bad])
        result, _ = await run([rule], iterations=2, domain=domain)
        reviews = [u for u in transcript(result, 0).utterances if u.kind == "review"]
        bad_reviews = [u for u in reviews if u.target == "S1" and u.agent == "S2"]
        assert len(bad_reviews) == 1 and bad_reviews[0].text == "" and bad_reviews[0].call_id is not None
        assert all(u.text for u in reviews if u not in bad_reviews)
        assert any(n.startswith("review of S1 by S2: unusable") for n in result.iterations[0].notes)


async def test_a_decision_without_tags_gets_one_rewrite_pass() -> None:
    result, model = await run(
        [Rule(role="coordinator", pattern="<team_summary>", replies=["So the answer is \\boxed{391}."])]
    )
    assert result.answer == "391"
    assert "decision: the required tags are missing; asked for one rewrite" in result.iterations[-1].notes
    rewrite = last_user_prompts(model, "coordinator")[-1]
    assert "<reply>\nSo the answer is \\boxed{391}.\n</reply>" in rewrite


async def test_a_rewrite_that_changes_the_decisions_own_answer_does_not_replace_it() -> None:
    # The rewrite is asked for the reply's content in the layout, its conclusion unchanged (paper 003, B.5: a rewrite
    # pass "that preserves mathematical content"). One that writes another answer in its tags re-solved: the answer
    # the chair's reply states stands (before, the rewrite's 390 was the decision and the chair's 391 was lost).
    rewritten = (
        "<analysis>\n- tally\n</analysis>\n<final_answer>\n390\n</final_answer>\n<formal_proof>\n17*23\n</formal_proof>"
    )
    rules = [
        Rule(role="coordinator", pattern="<team_summary>", replies=["The team agrees: \\boxed{391}."]),
        Rule(role="coordinator", pattern="<reply>", replies=[rewritten]),
    ]
    result, _ = await run(rules, iterations=1)
    record = result.iterations[-1]
    assert result.answer == "391" and record.selected == "391" and record.state["decision"]["answer"] == "391"
    assert transcript(result).final_answer == "391"
    assert record.notes[-1] == (
        "decision: the rewrite's answer (390) is not the one its reply states (391): the reply's is used"
    )
    # A rewrite that keeps the answer, however it spells it, is the decision as it was.
    kept = rewritten.replace("\n390\n", "\n$391$\n")
    result, _ = await run([rules[0], Rule(role="coordinator", pattern="<reply>", replies=[kept])], iterations=1)
    assert result.answer == "391" and result.iterations[-1].notes[-1].endswith("asked for one rewrite")


async def test_a_rewrite_whose_answer_echoes_its_instructions_is_not_the_decision() -> None:
    # The chair states no answer; the rewrite's tags hold the rewrite prompt's own wording for the answer. Before, the
    # first decision reply was checked by the echo guard but the rewrite's was not: that wording was the decision.
    echoed = (
        "<analysis>\n- tally\n</analysis>\n<final_answer>\nthe reply's final answer alone, on one line\n"
        "</final_answer>\n<formal_proof>\n17*23\n</formal_proof>"
    )
    rules = [
        Rule(role="specialist", pattern="You are Edge-case auditor", replies=[WRONG]),
        Rule(role="coordinator", pattern="<team_summary>", replies=["The team has spoken."]),
        Rule(role="coordinator", pattern="<reply>", replies=[echoed]),
    ]
    result, model = await run(rules, iterations=1)
    record = result.iterations[-1]
    assert result.answer == "391" and record.selected == "391" and record.state["decision"]["answer"] == "391"
    assert transcript(result).final_answer == "391"
    assert record.notes[-2:] == [
        "decision: the required tags are missing; asked for one rewrite",
        "decision: unreadable (the rewrite's answer echoed the instructions); the team's majority answer is used",
    ]
    # One rewrite pass, as before: the echo is not asked again.
    assert sum("<reply>" in prompt for prompt in last_user_prompts(model, "coordinator")) == 1


async def test_the_decision_and_its_rewrite_are_calls_apart_from_the_team_formations() -> None:
    # Round 0 is the last: the decision and its rewrite share the team formation's role and iteration, and must not
    # share its attempts' sample indices (0 and 1 here: the first reply is unusable, the second forms the team).
    rules = [
        Rule(role="coordinator", pattern="Exactly one member", replies=["a team of experts"], times=1),
        Rule(role="coordinator", pattern="<team_summary>", replies=["So the answer is \\boxed{391}."]),
    ]
    result, model = await run(rules, iterations=1)
    coordinator = [c.key for c in model.calls_of("coordinator")]
    assert [(k.iteration, k.sample) for k in coordinator] == [(0, 0), (0, 1), (0, 3000), (0, 3001)]
    assert result.answer == "391" and "decision: the required tags are missing; asked for one rewrite" in (
        result.iterations[-1].notes
    )


async def test_a_decision_without_tags_that_hedges_between_boxes_is_read_as_both() -> None:
    hedged = "So \\boxed{391} or \\boxed{392}."
    result, _ = await run([Rule(role="coordinator", pattern="<team_summary>|<reply>", replies=[hedged])], iterations=1)
    assert result.answer == "391 or 392"  # not 392, the last box alone


async def test_a_decision_unreadable_after_the_rewrite_falls_back_to_the_team() -> None:
    rules = [
        Rule(role="specialist", pattern="You are Edge-case auditor", replies=[WRONG]),
        Rule(role="coordinator", pattern="<team_summary>|<reply>", replies=["I cannot decide."]),
    ]
    result, _ = await run(rules, iterations=1)
    assert result.answer == "391"  # two of three specialists hold it
    assert (
        result.iterations[-1].notes[-1]
        == "decision: unreadable (no tags after the rewrite); the team's majority answer is used"
    )


async def test_the_decisions_fallback_note_says_why_the_rewrite_was_not_asked_or_failed() -> None:
    wrong_s3 = Rule(role="specialist", pattern="You are Edge-case auditor", replies=[WRONG])
    # An empty decision has nothing to rewrite: no rewrite is asked, and the note does not claim one was.
    empty = Rule(role="coordinator", pattern="<team_summary>", replies=[""])
    result, model = await run([wrong_s3, empty], iterations=1)
    assert result.answer == "391"
    assert not any("<reply>" in prompt for prompt in last_user_prompts(model, "coordinator"))
    assert result.iterations[-1].notes[-1] == "decision: unreadable (empty reply); the team's majority answer is used"
    # A rewrite whose call failed: the note names its error, not tags it never had the chance to write.
    untagged = Rule(role="coordinator", pattern="<team_summary>", replies=["I lean to 391."])
    failed = Rule(role="coordinator", pattern="<reply>", fault="http_400")
    result, model = await run([wrong_s3, untagged, failed], iterations=1)
    assert result.answer == "391" and any("<reply>" in p for p in last_user_prompts(model, "coordinator"))
    assert result.iterations[-1].notes[-1] == (
        "decision: unreadable (the rewrite failed: scripted http_400); the team's majority answer is used"
    )


async def test_a_decision_with_no_answer_in_its_tags_falls_back_to_the_team() -> None:
    rules = [
        Rule(role="specialist", pattern="You are Edge-case auditor", replies=[WRONG]),
        Rule(role="coordinator", pattern="<team_summary>", replies=["<final_answer>N/A</final_answer>"]),
    ]
    result, model = await run(rules, iterations=1)
    assert result.answer == "391" and result.status != "failed"
    assert (
        result.iterations[-1].notes[-1]
        == "decision: unreadable (its tags hold no answer); the team's majority answer is used"
    )
    assert not any("<reply>" in prompt for prompt in last_user_prompts(model, "coordinator"))


async def test_a_decision_cut_inside_its_final_answer_is_read_without_a_rewrite() -> None:
    cut = "<analysis>tally</analysis>\n<final_answer>\nThe final answer is \\(\\boxed{391}\\).\n\n<formal_proof>\nBy"
    result, model = await run([Rule(role="coordinator", pattern="<team_summary>", replies=[cut])], iterations=1)
    assert result.answer == "391"
    assert not any("rewrite" in note for note in result.iterations[-1].notes)
    assert not any("<reply>" in prompt for prompt in last_user_prompts(model, "coordinator"))


async def test_a_decision_cut_at_max_tokens_is_not_read_from_the_line_the_cut_went_through() -> None:
    # Cut at max_tokens inside its one-line answer ("39" of "391"): the line is unfinished, so the answer tag holds
    # no answer, and the team's answer is used.
    cut = "<analysis>\n- 17*23 = 391\n</analysis>\n<final_answer>\n39"
    rules = [Rule(role="coordinator", pattern="<team_summary>", replies=[cut], finish_reason="length")]
    result, _ = await run(rules, iterations=1)
    assert result.answer == "391"
    assert result.iterations[-1].notes[-1] == (
        "decision: unreadable (its tags hold no answer); the team's majority answer is used"
    )


async def test_a_medicine_decision_cut_at_max_tokens_drops_the_diagnosis_the_cut_went_through() -> None:
    cut = "<analysis>\n- storage disease\n</analysis>\n<top10>\n[1] Fabry disease\n[2] Gaucher disease\n[3] Pompe dis"
    rules = [Rule(role="coordinator", pattern="<team_summary>", replies=[cut], finish_reason="length")]
    result, _ = await run(rules, domain="medicine", iterations=1)
    assert result.iterations[-1].state["decision"]["top10"] == ["Fabry disease", "Gaucher disease"]


async def test_each_role_gets_its_own_model_and_sampling(sim: SimServer, sim2: SimServer, tmp_path: Path) -> None:
    roles = {
        "coordinator": {"model": "chair", "sampling": {"temperature": 0.1, "max_tokens": 900}},
        "specialist": {"base_url": sim2.base_url, "model": "solver", "sampling": {"temperature": 0.9, "top_p": 0.8}},
        "reviewer": {"model": "critic", "sampling": {"temperature": 0.2, "extra_body": {"top_k": 5}}},
    }
    # A fixed seed: the role sampling under test is then all the session merges (per-call seeds, and the merge bug
    # that drops a role's sampling when the session adds one, are not what this test checks).
    settings = settings_for(sim, method={"name": "mattrl", "params": {}}, roles=roles, sampling__seed=11)
    result = await asolve(Q, settings, run_dir=tmp_path / "run")
    assert result.answer == "391"
    assert {r.role for r in sim2.requests} == {"specialist"} and "specialist" not in sim.stats().by_role
    for body in chat_requests(sim, "coordinator"):
        assert (body["model"], body["temperature"], body["max_tokens"]) == ("chair", 0.1, 900)
    for body in [r.body for r in sim2.requests]:
        assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == ("solver", 0.9, 0.8, 256)
    for body in chat_requests(sim, "reviewer"):
        # The configured seed plus the review's sample index (sample j: seed + j).
        assert (body["model"], body["temperature"], body["top_k"]) == ("critic", 0.2, 5)
        assert body["seed"] >= 11 + REVIEW_SAMPLE
    assert len(chat_requests(sim, "reviewer")) == 6


async def test_retrieved_experience_is_injected_and_recorded(tmp_path: Path) -> None:
    texts = [
        ("What is 17*23: multiply 17 by 23", "Split 23 into 20 + 3 and add the partial products of 17."),
        ("Draw the triangle", "A sketch of the angles shows which sides are equal."),
        ("List small primes", "Trial division by primes below the root settles primality."),
        ("Simplify fractions", "Cancel common factors before multiplying numerators."),
        ("Count lattice paths", "Binomial coefficients count monotone paths on a grid."),
    ]
    entries = [PoolEntry(id=f"e{i}", action=a, experience=e) for i, (a, e) in enumerate(texts)]
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    pool = Pool.create(tmp_path / "pool", embed.name)
    await pool.add(entries, embed)
    pool.save()
    result, model = await run(pool=str(tmp_path / "pool"), top_k=2)
    opinions = [u for u in transcript(result).utterances if u.kind == "opinion"]
    assert all(len(u.experience_ids) == 2 and u.experience_ids[0] == "e0" for u in opinions)
    for prompt in last_user_prompts(model, "specialist"):
        hints = prompt.split("<experience_hints>\n", 1)[1].split("\n</experience_hints>", 1)[0]
        assert hints.count("- ACTION:") == 2 and "- ACTION: What is 17*23: multiply 17 by 23" in hints
        # The hints are data: after the problem, before the specialist's instructions (which name them).
        assert prompt.index("</problem>") < prompt.index("<experience_hints>") < prompt.index("You are ")
    queries = model.embedded
    assert len(queries) == 3 and all(Q in q[0] for q in queries)
    assert result.iterations[0].candidates[0].meta.experience_ids == opinions[0].experience_ids


async def test_entries_distilled_from_the_problem_being_solved_are_left_out_unless_asked_for(tmp_path: Path) -> None:
    # A pool built from runs on the very problems a run solves (the test split overlaps the build split): the
    # summarizer wrote this problem's entries knowing its reference answer, so its own entry, the nearest by far,
    # never reaches its specialists; an entry of another problem still does. Asked for, both come back.
    own = PoolEntry(
        id="own", action=Q, experience="The reference answer is 391.", source_question=question_hash(f"  {Q}\n")
    )
    other = PoolEntry(
        id="other", action="Multiply in parts", experience="Split a factor.", source_question=question_hash("1+1?")
    )
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    pool = Pool.create(tmp_path / "pool", embed.name)
    await pool.add([own, other], embed)
    pool.save()
    result, model = await run(pool=str(tmp_path / "pool"), top_k=8)
    opinions = [u for u in transcript(result).utterances if u.kind == "opinion"]
    assert opinions and all(u.experience_ids == ["other"] for u in opinions)
    assert all("391" not in p.split("<experience_hints>")[1] for p in last_user_prompts(model, "specialist"))
    assert "experience retrieval: 1 pool entries distilled from this problem left out" in result.iterations[0].notes
    assert result.notices == [
        f"pool={tmp_path / 'pool'} holds entries distilled from problems of this run: each problem's own are left out"
        " of its retrieval (pool_same_problem=true retrieves them)"
    ]
    result, _ = await run(pool=str(tmp_path / "pool"), top_k=8, pool_same_problem=True)
    opinions = [u for u in transcript(result).utterances if u.kind == "opinion"]
    assert opinions and all(u.experience_ids == ["own", "other"] for u in opinions)
    assert result.notices == [] and not any("left out" in n for n in result.iterations[0].notes)


async def test_the_local_embedder_is_loaded_once_for_a_runs_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # all-MiniLM-L6-v2 is read from its weights file on first use: once per run, not once per problem.
    loads: list[int] = []

    class Encoder:
        def encode(self, texts: list[str]) -> np.ndarray:
            return np.array([[1.0, float(len(t) % 7)] for t in texts], dtype=np.float32)

    def load() -> Encoder:
        loads.append(1)
        return Encoder()

    monkeypatch.setattr("tmas.memory.minilm.MiniLM.load", load)
    pool = Pool.create(tmp_path / "pool", LOCAL_NAME)
    await pool.add([PoolEntry(id="e1", action="Multiply in parts", experience="Split a factor.")], LocalEmbedder())
    pool.save()
    loads.clear()
    settings = scripted_settings(
        method={"name": "mattrl", "params": {"pool": str(tmp_path / "pool"), "embedder": "local", "iterations": 1}}
    )
    problems = [Problem(problem_id=f"p{i}", question=f"What is 17*2{i}?") for i in range(3)]
    summary = await scripted_run(ScriptedModel(SimScript(), settings), tmp_path / "run", problems)
    assert summary.done == 3
    with RunStore(tmp_path / "run", create=False) as store:
        used = [transcript_ids(r.iterations[0]) for r in store.results()]
    assert used == [{"e1"}] * 3 and len(loads) == 1


def transcript_ids(record: Any) -> set[str]:
    return {i for u in Transcript.model_validate(record.state["transcript"]).utterances for i in u.experience_ids}


async def test_a_pool_of_several_domains_gives_each_run_only_its_own_domains_entries(tmp_path: Path) -> None:
    # One pool built from math and medicine runs: the medical entry says the same words as the problem, so by
    # similarity alone it would come first; a math specialist never sees it, a medical one sees nothing else.
    entries = [
        PoolEntry(id="math", action="Multiply in parts", experience="Split a factor and add the partial products."),
        PoolEntry(id="med", domain="medicine", action="What is 17*23?", experience="What is 17*23?"),
    ]
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    pool = Pool.create(tmp_path / "pool", embed.name)
    await pool.add(entries, embed)
    pool.save()
    for domain, own in (("math", "math"), ("medicine", "med")):
        result, model = await run(pool=str(tmp_path / "pool"), top_k=8, domain=domain)
        opinions = [u for u in transcript(result).utterances if u.kind == "opinion"]
        assert opinions and all(u.experience_ids == [own] for u in opinions)
        prompts = last_user_prompts(model, "specialist")
        assert prompts and all(p.count("- ACTION:") == 1 for p in prompts)


async def test_a_pool_with_no_entries_of_the_runs_domain_says_the_run_has_no_experience(tmp_path: Path) -> None:
    # A build that kept no turn leaves an empty pool; a pool of another domain's runs holds none for this one. Either
    # way no specialist can get a hint, so the run is the team without experience: it says so, once, and asks the
    # embedder nothing.
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    Pool.create(tmp_path / "empty", embed.name)
    other = Pool.create(tmp_path / "medicine", embed.name)
    await other.add([PoolEntry(id="med", domain="medicine", action="Rank by onset", experience="Onset first.")], embed)
    other.save()
    for name, holds in (("empty", "no entries"), ("medicine", "no math entries (1 of other domains)")):
        result, model = await run(pool=str(tmp_path / name))
        assert result.answer == "391"
        assert result.notices == [
            f"pool={tmp_path / name} holds {holds}: the specialists get no experience hints, so this run is the team"
            " without experience"
        ]
        assert model.embedded == []
        specialists = last_user_prompts(model, "specialist")
        assert specialists and all("<experience_hints>" not in p for p in specialists)


async def test_a_pool_built_with_another_model_fails_the_problem_with_a_clear_error(tmp_path: Path) -> None:
    Pool.create(tmp_path / "pool", "endpoint:other-embedder")
    result, _ = await run(pool=str(tmp_path / "pool"))
    assert result.status == "failed" and result.error is not None
    assert (
        "built with embedding model 'endpoint:other-embedder', but the embedding role now gets 'endpoint:sim-model'"
        in result.error
    )


async def test_medicine_ranks_ten_diagnoses_with_a_catalog_team() -> None:
    result, model = await run(domain="medicine")
    assert result.answer == "Fabry disease" and result.text.splitlines()[1] == "[2] Gaucher disease"
    t = transcript(result)
    assert [m.specialty for m in t.team] == ["Pediatrics", "Urology", "Hematology"]
    # Round 1: lists, then each member reviews the other two (A.4); round 2: the same lists again, so every
    # specialist converged and the final round asks for no review.
    assert len(result.iterations) == 2 and by_role(model)["reviewer"] == 6
    assert result.iterations[-1].state["decision"]["top10"][9] == "Amyloidosis"
    recruit = last_user_prompts(model, "coordinator")[0]
    assert "Traditional Chinese Medicine" in recruit
    revision = next(t for t in last_user_prompts(model, "specialist")[3:] if "\nYou are Pediatrics (" in t)
    # The bulletin shares each member's change (round 1: its whole list), not a pooled list.
    assert "S1 (Pediatrics): proposed Fabry disease; Gaucher disease; Pompe disease" in revision
    assert "Borda" not in revision and "<accepted_snapshot>" not in revision
    feedback = json.loads(revision.split("<peer_feedback>\n", 1)[1].split("\n</peer_feedback>", 1)[0])
    assert [f["reviewer"] for f in feedback] == ["S2", "S3"]
    assert feedback[0]["agreements"] == ["Fabry disease explains the main findings."]
    assert feedback[0]["disagreements"] == [] and feedback[0]["changes"] == []


async def test_a_medicine_specialist_whose_revision_call_fails_keeps_its_list_out_of_review() -> None:
    fail = Rule(role="specialist", pattern="<your_previous_attempt>.*You are Pediatrics", fault="http_400", times=1)
    result, model = await run([fail], domain="medicine", iterations=3)
    said = transcript(result, 1).utterances
    # S1 did not speak in round 2: its round-1 list is not critiqued again, nor announced as unchanged.
    targets = [u.target for u in said if u.kind == "review" and u.round == 1]
    assert targets == ["S2", "S2", "S3", "S3"]
    [meeting] = [u for u in said if u.kind == "meeting" and u.round == 1]
    assert meeting.text.splitlines()[0] == "S1 (Pediatrics): did not speak this round (its opinion call failed)"
    members = result.iterations[1].state["members"]
    assert [(m["converged"], m["spoke"]) for m in members] == [(False, False), (True, True), (True, True)]
    # Round 3 (the last): S1 gives its list again and converges; the last round asks for no review.
    assert by_role(model)["reviewer"] == 6 + 4
    assert [m["converged"] for m in result.iterations[-1].state["members"]] == [True, True, True]


async def test_a_medicine_opinion_without_its_diagnosis_tags_states_its_top_diagnosis_not_its_outline() -> None:
    # S1 numbers its reply's parts as A.3 lays them out, but leaves out the <diagnosis> tags. Its answer is the
    # first diagnosis of its list; before, the outline's "1) Reflection: ..." was read as its top diagnosis.
    listed = "\n".join(f"{i}. {name}: fits part of the record." for i, name in enumerate(SIM_DIFFERENTIAL, 1))
    untagged = f"1) Reflection: The record points to a storage disorder.\n2) Differential:\n{listed}"
    rule = Rule(role="specialist", pattern="You are Pediatrics", replies=[untagged], times=1)
    result, _ = await run([rule], domain="medicine", iterations=2)
    first = result.iterations[0]
    assert first.candidates[0].meta.member == "S1" and first.candidates[0].answer == "Fabry disease"
    assert first.candidates[0].meta.top10 == list(SIM_DIFFERENTIAL)
    assert not any("differential has" in n for n in first.notes)


async def test_a_rank_holding_insufficient_evidence_is_no_diagnosis() -> None:
    # The opinion prompt asks for "insufficient evidence" rather than a guess. S1 puts it at rank 1: its answer is
    # its first named diagnosis, and "Insufficient evidence" is in neither its differential nor the bulletin.
    listed = "\n".join(f"{i}. {name}: fits part of the record." for i, name in enumerate(SIM_DIFFERENTIAL[:9], 2))
    reply = f"Too little to rank.\n<diagnosis>\n1. Insufficient evidence: no enzyme assay.\n{listed}\n</diagnosis>"
    rule = Rule(role="specialist", pattern="You are Pediatrics", replies=[reply], times=1)
    result, _ = await run([rule], domain="medicine", iterations=2)
    first = result.iterations[0].candidates[0]
    assert first.meta.member == "S1" and first.answer == "Fabry disease"
    assert first.meta.top10 == list(SIM_DIFFERENTIAL[:9])
    [meeting] = [u for u in transcript(result, 0).utterances if u.kind == "meeting"]
    assert "Insufficient evidence" not in meeting.text


async def test_medicine_replies_of_bare_numbers_name_no_diagnosis_and_the_team_reaches_no_answer() -> None:
    # Every reply is bare ranks ("1.", "2.", "[1]"): no differential, no decision. The problem fails with "no
    # answer"; before, a rank's line was read into the one before it and "2." was the team's top diagnosis.
    rules = [Rule(role=role, replies=["1.\n2.\n[1]\n"]) for role in ("coordinator", "specialist", "reviewer")]
    result, _ = await run(rules, domain="medicine", iterations=2)
    assert result.status == "failed" and result.answer is None and result.error == "the team reached no answer"
    assert all("differential has 0 of 10 diagnoses" in " ".join(r.notes) for r in result.iterations)


async def test_a_medicine_list_written_again_in_other_letter_case_has_converged() -> None:
    # Round 2: Pediatrics gives the same ten diagnoses in the same order, only capitalised differently. Eq. 5's
    # Delta O_s is empty, as the Borda pool and the de-duplication of a list already read the names.
    same = "\n".join(f"{i}. {name.title()}: fits part of the record." for i, name in enumerate(SIM_DIFFERENTIAL, 1))
    again = Rule(
        role="specialist",
        pattern="<your_previous_attempt>.*You are Pediatrics",
        replies=[f"Nothing to change.\n<diagnosis>\n{same}\n</diagnosis>"],
    )
    result, model = await run([again], domain="medicine", iterations=3)
    members = result.iterations[1].state["members"]
    assert [m["converged"] for m in members] == [True, True, True]
    # Everyone converged in round 2: the chair decides there; no review of the unchanged list, no round 3.
    assert len(result.iterations) == 2 and by_role(model)["reviewer"] == 6
    seat = Seat(0, TeamMember(id="S1", specialty="Pediatrics"))
    seat.previous_top10, seat.top10 = list(SIM_DIFFERENTIAL), [n.title() for n in SIM_DIFFERENTIAL]
    assert differential_change(seat) == "unchanged"


REVIEW_OF_S1 = json.dumps(
    {
        "analysis": "Fabry disease fits; Pompe disease does not.",
        "agreements": ["Fabry disease fits the angiokeratomas."],
        "disagreements": ["Pompe disease does not explain the skin findings."],
        "changes": ["Move Pompe disease below rank 5."],
    }
)


async def test_medicine_reviews_reach_the_bulletin_and_the_author() -> None:
    rules = [
        # S3 (Hematology) disputes S1's list twice over; S2 (Urology) raises the same disagreement in other words.
        Rule(
            role="reviewer",
            pattern='"author": \\{\n  "specialty": "Pediatrics".*"specialty": "Hematology"',
            replies=[REVIEW_OF_S1],
        ),
        Rule(
            role="reviewer",
            pattern='"author": \\{\n  "specialty": "Pediatrics".*"specialty": "Urology"',
            replies=[REVIEW_OF_S1.replace("Fabry disease fits the angiokeratomas.", "Agreed on Fabry disease.")],
        ),
    ]
    result, model = await run(rules, domain="medicine", iterations=2)
    first = transcript(result, 0)
    reviews = [u for u in first.utterances if u.kind == "review"]
    assert {(u.agent, u.target) for u in reviews} == {
        (a, b) for a in ("S1", "S2", "S3") for b in ("S1", "S2", "S3") if a != b
    }
    [meeting] = [u for u in first.utterances if u.kind == "meeting"]
    lines = meeting.text.splitlines()
    assert lines[0].startswith("S1 (Pediatrics): proposed Fabry disease; Gaucher disease")
    # The shared disagreement and change appear once (the second reviewer's copies are duplicates).
    assert lines[1:3] == [
        "  - S2 disagrees: Pompe disease does not explain the skin findings.",
        "  - S2 asks to change: Move Pompe disease below rank 5.",
    ]
    assert meeting.text.count("Pompe disease does not explain") == 1
    assert not any("disagrees" in line for line in lines[3:])
    prompt = next(t for t in last_user_prompts(model, "specialist")[3:] if "\nYou are Pediatrics (" in t)
    assert "This is round 2. Revise your differential" in prompt
    feedback = json.loads(prompt.split("<peer_feedback>\n", 1)[1].split("\n</peer_feedback>", 1)[0])
    assert [f["reviewer"] for f in feedback] == ["S2", "S3"]
    assert feedback[1]["disagreements"] == ["Pompe disease does not explain the skin findings."]
    assert "<bulletin>\n" + meeting.text in prompt
    # The labelled Borda option adds the pooled list to the bulletin.
    pooled, _ = await run(rules, domain="medicine", iterations=2, pooled_differential=True)
    [meeting] = [u for u in transcript(pooled, 0).utterances if u.kind == "meeting"]
    assert meeting.text.splitlines()[-1].startswith(
        "Team differential by Borda count (pooled_differential option): Fabry disease; Gaucher disease"
    )


def _final(run_dir: Path) -> list[Any]:
    with RunStore(run_dir, create=False) as store:
        return [
            (
                r.answer,
                [
                    (it.selected, it.state["members"], it.state["transcript"]["utterances"], it.notes)
                    for it in r.iterations
                ],
            )
            for r in store.results()
        ]


def _strip_call_ids(state: list[Any]) -> list[Any]:
    return json.loads(re.sub(r'"call_id": \d+', '"call_id": 0', json.dumps(state)))


@pytest.mark.slow
def test_killed_mid_deliberation_and_resumed_equals_uninterrupted(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem_id": "mult", "question": Q, "answer": "391"}) + "\n")
    script = SimScript(
        latency_s=0.05,
        rules=[Rule(role="specialist", pattern="You are Arithmetic strategist", replies=[WRONG], times=1)],
    )
    with SimServer(script) as sim:
        args = ["run", str(problems), "--base-url", sim.base_url, "--method", "mattrl", "--seed", "2"]
        ref = subprocess.run(
            [sys.executable, "-m", "tmas", *args, "-o", str(tmp_path / "ref")],
            env=clean_env(),
            capture_output=True,
            timeout=120,
        )
        assert ref.returncode == 0, ref.stderr.decode()
        sim.set_script(script)  # the scripted slip again, from its first use
        sim.reset()
        killed = tmp_path / "killed"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tmas", *args, "-o", str(killed)],
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if (killed / "run.sqlite").exists() and sim.stats().by_role.get("reviewer", 0) >= 7:
                break  # inside round 2's reviews: round 1 is stored, the deliberation is not over
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        resumed = run_tmas("run", "--resume", str(killed), timeout=120)
        assert resumed.returncode == 0, resumed.stderr.decode()
        summary = json.loads(resumed.stdout)
        # The resumed run's own count of the calls it sent: the killed process's last requests may still reach the
        # simulator after the kill, so its request count is no measure of what the resume asked.
        asked_again = summary["calls"]
    # Round 1 (1 + 3 + 6 calls) and round 2's opinion came from the store: only round 2's unfinished reviews and
    # the decision were asked again.
    assert summary["done"] == 1 and summary["replayed_calls"] >= 11
    assert 1 <= asked_again <= 3
    assert _strip_call_ids(_final(killed)) == _strip_call_ids(_final(tmp_path / "ref"))
    assert _final(killed)[0][0] == "391"


async def test_a_spent_budget_keeps_the_round_so_far_and_answers_by_majority() -> None:
    result, model = await run(settings_extra={"budget": {"calls": 6}})
    assert result.stopped_reason == "budget" and result.answer == "391"
    [record] = result.iterations
    # The team (1 call) and three opinions (3) finished; two of the six reviews fit the budget.
    assert by_role(model) == {"coordinator": 1, "specialist": 3, "reviewer": 2} and record.calls == 6
    assert [c.meta.member for c in record.candidates] == ["S1", "S2", "S3"]
    assert record.notes[-1].startswith("stopped: budget spent (6 calls of a budget of 6)")
    assert "decision" not in record.state and record.selected == "391"


@pytest.mark.parametrize("domain", ["math", "medicine"])
async def test_reviews_that_finished_before_the_budget_stop_stay_in_the_transcript(domain: str) -> None:
    # The team (1 call) and three opinions (3) finished, then two reviews of S1 before the budget refused the rest.
    result, model = await run(settings_extra={"budget": {"calls": 6}}, domain=domain, iterations=2)
    assert result.stopped_reason == "budget" and by_role(model)["reviewer"] == 2
    reviews = [u for u in transcript(result).utterances if u.kind == "review"]
    sent = model.calls_of("reviewer")
    assert [(u.agent, u.target) for u in reviews] == [("S2", "S1"), ("S3", "S1")]
    # Each holds the reply its call got, as a review of a finished round does.
    assert [u.text for u in reviews] == [c.reply.content for c in sent] and all(u.text for u in reviews)
    # The round did not finish: S2 and S3, whose reviews the budget refused, were not judged.
    assert [m["converged"] for m in result.iterations[-1].state["members"]][1:] == [False, False]
    assert result.iterations[-1].notes[-3:-1] == ["S2: 0 of 2 reviews came back", "S3: 0 of 2 reviews came back"]


@pytest.mark.parametrize("domain", ["math", "medicine"])
async def test_a_review_whose_retry_the_budget_refused_keeps_its_first_reply_in_the_record(domain: str) -> None:
    # The team (1 call) and three opinions (3), then the reviews of S1 by S2 and S3 (6 calls); the rest are refused.
    # S2's review does not parse: its retry would be the 7th call, and the budget refuses it. Its reply was answered
    # and spent: the round's record keeps it (its call, and the reason it is no review) and says the retry was refused.
    unusable = Rule(role="reviewer", replies=["no review here"], times=1)
    result, model = await run([unusable], settings_extra={"budget": {"calls": 6}}, domain=domain, iterations=2)
    assert result.stopped_reason == "budget" and by_role(model)["reviewer"] == 2
    [record] = result.iterations
    first, second = model.calls_of("reviewer")
    assert first.reply.content == "no review here"
    reviews = [u for u in transcript(result).utterances if u.kind == "review"]
    # In pair order: S2's review of S1, whose reply was unusable (no text, as any unusable review), then S3's.
    assert [(u.agent, u.target, u.call_id) for u in reviews] == [
        ("S2", "S1", first.reply.call_id),
        ("S3", "S1", second.reply.call_id),
    ]
    assert [u.text for u in reviews] == ["", second.reply.content]
    [refused] = [n for n in record.notes if n.startswith("review of S1 by S2: unusable (")]
    assert refused.endswith("; the budget refused its retry")
    # The review did not finish: S1 is not judged from the one that did, and the record counts what came back.
    assert record.notes[-4:-1] == [
        "S1: 1 of 2 reviews came back",
        "S2: 0 of 2 reviews came back",
        "S3: 0 of 2 reviews came back",
    ]
    assert [m["converged"] for m in record.state["members"]] == [False, False, False]
    assert record.calls == 6 and record.replies["reviewer"].unusable == 1


async def test_a_specialist_whose_reviews_all_came_back_before_the_budget_stop_is_judged_and_scored() -> None:
    # S3's slip is reviewed second; budget 7: the team, three opinions, then S1's two reviews (both accept, 391 is
    # right) and one of S2's before the budget refuses the rest.
    slip = Rule(role="specialist", pattern="You are Edge-case auditor", replies=[WRONG])
    result, model = await run([slip], settings_extra={"budget": {"calls": 7}}, iterations=2, team_size=3)
    assert result.stopped_reason == "budget" and by_role(model)["reviewer"] == 3
    [record] = result.iterations
    members = {m["id"]: m for m in record.state["members"]}
    scores = {c.meta.member: c.score for c in record.candidates}
    # S1 was reviewed by both peers: accepted and converged as in a finished round, scored by the share that
    # accepted (2 of 2). S2 has one review of two: neither judged nor scored from half its peers.
    assert (members["S1"]["accepted"], members["S1"]["converged"], scores["S1"]) == (True, True, 1.0)
    assert (members["S2"]["accepted"], members["S2"]["converged"], scores["S2"]) == (False, False, None)
    assert (members["S3"]["accepted"], scores["S3"]) == (False, None)
    assert record.notes[-3:-1] == ["S2: 1 of 2 reviews came back", "S3: 0 of 2 reviews came back"]


async def test_medicine_without_a_readable_decision_uses_the_pooled_differential() -> None:
    lists = [
        "<diagnosis>\n1. Wilson disease: a.\n2. Fabry disease: b.\n</diagnosis>",
        "<diagnosis>\n1. Fabry disease: a.\n2. Pompe disease: b.\n</diagnosis>",
    ]
    rules = [
        Rule(role="specialist", pattern="You are Pediatrics", replies=[lists[0]]),
        Rule(role="specialist", pattern="You are Urology", replies=[lists[1]]),
        Rule(role="specialist", pattern="You are Hematology", replies=[lists[1]]),
        Rule(role="coordinator", pattern="<team_summary>|<reply>", replies=["No idea."]),
    ]
    result, _ = await run(rules, domain="medicine", iterations=1)
    # Borda: Fabry 9 + 10 + 10 = 29, Wilson 10, Pompe 9 + 9 = 18.
    assert result.iterations[-1].state["decision"]["top10"] == ["Fabry disease", "Pompe disease", "Wilson disease"]
    assert result.answer == "Fabry disease"
    assert result.iterations[-1].notes[-1].endswith("the team's pooled differential is used")
    assert any(n == "S1: differential has 2 of 10 diagnoses" for n in result.iterations[-1].notes)


async def test_a_medicine_opinion_cut_at_max_tokens_drops_the_diagnosis_the_cut_went_through() -> None:
    cut = "<diagnosis>\n1. Fabry disease: a.\n2. Pompe disease: b.\n3. Gaucher dis"
    rules = [
        Rule(role="specialist", pattern="You are Pediatrics", replies=[cut], finish_reason="length"),
        Rule(role="specialist", replies=["<diagnosis>\n1. Fabry disease: a.\n</diagnosis>"]),
        Rule(role="coordinator", pattern="<team_summary>|<reply>", replies=["No idea."]),
    ]
    result, _ = await run(rules, domain="medicine", iterations=1)
    # Borda over the lists as read: Fabry 10 + 10 + 10, Pompe 9; the cut "Gaucher dis" is in none.
    assert result.iterations[-1].state["decision"]["top10"] == ["Fabry disease", "Pompe disease"]
    assert "S1: differential has 2 of 10 diagnoses" in result.iterations[-1].notes


def test_a_pool_named_without_the_pool_extra_is_one_line_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from tmas.errors import InputError
    from tmas.methods import create_method

    monkeypatch.setitem(sys.modules, "tmas.memory.pool", None)  # numpy and faiss not installed
    with pytest.raises(
        InputError, match=r"^pool=pools/x: MATTRL's experience pool needs .*pip install 'tmas\[pool\]'$"
    ):
        create_method("mattrl", {"pool": "pools/x"}).check_setup()


@pytest.mark.parametrize(
    ("domain", "specialties", "roles"),
    [
        ("math", None, None),
        ("medicine", MEDICINE_CATALOG, None),
        (
            "education",
            EDUCATION_CATALOG,
            ["Diagnostician", "Pedagogy Strategist", "Subject Matter Expert", "lead teacher"],
        ),
    ],
)
async def test_the_recruiting_schema_holds_the_team_size_the_catalog_and_the_teaching_roles(
    domain: str, specialties: tuple[str, ...] | None, roles: list[str] | None
) -> None:
    # Where the server constrains the reply, it cannot recruit more than n members, a department outside the domain's
    # catalog (which the reading would drop) or a role C.4.2 does not name.
    problem = Problem(problem_id="q", question=Q, answer="B") if domain == "education" else Q
    settings = scripted_settings(
        method={"name": "mattrl", "params": {"domain": domain, "team_size": 2, "iterations": 1}},
        endpoint__structured_output="json_schema",
    )
    model = ScriptedModel(SimScript(rules=[Rule(role="student", replies=["Answer: A"])]), settings)
    await solve_in_process(model, problem)
    [recruit] = [c for c in model.calls_of("coordinator") if c.reply_model is not None]
    schema = recruit.body["response_format"]["json_schema"]["schema"]["properties"]["members"]
    assert (schema["minItems"], schema["maxItems"]) == (1, 2)
    member = schema["items"]["properties"]
    assert member["specialty"].get("enum") == (list(specialties) if specialties else None)
    assert member["role"].get("enum") == roles


async def test_retries_under_a_configured_seed_replay_each_from_its_own_stored_reply(tmp_path: Path) -> None:
    # The coordinator's unreadable team, a reviewer's unreadable review and a specialist's echoing opinion are asked
    # again under a seed changed from the configured one; solved again from the store, each retry is answered by its
    # own stored reply (a default-scripted model would have answered the first attempts differently).
    opinion = "A one- or two-sentence reflection, the core reasoning, and \\boxed{the final answer alone}"
    rules = [
        Rule(role="coordinator", replies=["no team here"], times=1),
        Rule(role="specialist", replies=[opinion], times=1),
        Rule(role="reviewer", replies=["no review here"], times=1),
    ]
    settings = scripted_settings(method={"name": "mattrl", "params": {}}, sampling__seed=7)
    problem = Problem(problem_id="q", question=Q, answer="391")
    with RunStore(tmp_path / "run") as store:
        first_model = ScriptedModel(SimScript(rules=rules), settings)
        method = create_method("mattrl", {})
        first = await method.solve(
            ProblemSession(problem, StoreReplay(first_model, store), store, seed=3, params=method.params)
        )
        # A first attempt goes with the seed + its sample index; a retry with a seed changed from that.
        retried = [c for c in first_model.calls if c.body["seed"] != 7 + c.key.sample]
        assert sorted(c.role for c in retried) == ["coordinator", "reviewer", "specialist"]
        again_model = ScriptedModel(SimScript(), settings)
        replay = StoreReplay(again_model, store)
        again = await method.solve(ProblemSession(problem, replay, store, seed=3, params=method.params))
    assert again_model.calls == [] and replay.replayed == len(first_model.calls)
    assert again.answer == first.answer == "391"
    assert [r.notes for r in again.iterations] == [r.notes for r in first.iterations]


async def test_a_decision_whose_rewrite_the_budget_refused_is_read_from_the_reply_that_came_back() -> None:
    # S2 and S3 hold 390, the chair's reply (no tags) works out 391; 11 calls: the team, three opinions, six reviews
    # and the decision, whose rewrite is refused. The reply that came back decides, read as after a failed rewrite
    # (before, the stop threw it away and the team's majority, 390, was the answer).
    wrong = Rule(role="specialist", pattern="You are Computation checker|You are Edge-case auditor", replies=[WRONG])
    chair = Rule(role="coordinator", pattern="<team_summary>", replies=["By hand, 17*23 = 391: \\boxed{391}."])
    result, model = await run([wrong, chair], settings_extra={"budget": {"calls": 11}}, iterations=1)
    assert by_role(model) == {"coordinator": 2, "specialist": 3, "reviewer": 6}
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    assert record.selected == "391" and record.state["decision"]["answer"] == "391"
    decided = [u for u in transcript(result).utterances if u.kind in ("report", "decision")]
    chair_call = model.calls_of("coordinator")[-1].reply
    assert [(u.kind, u.call_id) for u in decided] == [("report", chair_call.call_id), ("decision", chair_call.call_id)]
    assert record.notes[-2:] == [
        "decision: unreadable (the budget stopped its rewrite); the answer read from its reply is used",
        "stopped: budget spent (11 calls of a budget of 11) in iteration 0",
    ]


async def test_a_round_whose_every_opinion_the_budget_refused_leaves_no_record() -> None:
    # Team of 2, S2 slips once: round 0 is the team, two opinions and two reviews (5 calls); S1 is accepted, so round
    # 1 asks S2 alone, and the budget refuses it. Nothing of round 1 finished: no record of it, as no method records
    # an iteration the stop refused whole; round 0's record says where the run stopped.
    slip = Rule(role="specialist", pattern="You are Computation checker", replies=[WRONG], times=1)
    result, model = await run([slip], settings_extra={"budget": {"calls": 5}}, team_size=2, iterations=3)
    assert len(model.calls) == 5 and result.stopped_reason == "budget" and result.answer == "391"
    assert [r.iteration for r in result.iterations] == [0]
    assert result.iterations[0].notes[-1] == "stopped: budget spent (5 calls of a budget of 5) in iteration 1"


@pytest.mark.parametrize("domain", ["math", "medicine"])
async def test_a_team_formation_whose_retry_the_budget_refused_keeps_its_first_reply_in_a_record(domain: str) -> None:
    # One call: the coordinator's team does not parse, and the budget refuses the retry. The reply was answered and
    # spent: round 0's record keeps its call and why it was unusable, and says the retry was refused (before, the stop
    # went up with no record at all).
    unusable = Rule(role="coordinator", replies=["no team here"], times=1)
    result, model = await run([unusable], settings_extra={"budget": {"calls": 1}}, domain=domain)
    assert by_role(model) == {"coordinator": 1} and result.stopped_reason == "budget"
    [record] = result.iterations
    assert record.iteration == 0 and record.candidates == [] and record.calls == 1
    assert record.replies["coordinator"].unusable == 1
    assert record.notes[0].startswith("team formation attempt 1: unusable reply: ")
    assert record.notes[1:] == [
        "team formation attempt 2: refused by the budget",
        "stopped: budget spent (1 calls of a budget of 1) in iteration 0",
    ]
    assert transcript(result).team == [] and result.answer is None


async def test_a_specialist_whose_opinion_the_budget_refused_is_noted_as_such() -> None:
    # Team of 3, 3 calls: the team and two opinions; the third specialist's is refused. It did not speak, and the
    # record says why (the viewer reads a silent member's reason in the notes).
    result, model = await run(settings_extra={"budget": {"calls": 3}}, iterations=2)
    assert by_role(model) == {"coordinator": 1, "specialist": 2}
    [record] = result.iterations
    silent = [m["id"] for m in record.state["members"] if m["spoke"] is False]
    assert len(silent) == 1 and len(record.candidates) == 2
    assert f"{silent[0]}: the budget refused its opinion call; it did not speak this round" in record.notes
