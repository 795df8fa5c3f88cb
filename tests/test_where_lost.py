"""Where a run loses its answers (tmas.reports.where_lost): scripted Verify-Refine and TMAS runs whose every
candidate, verdict and answer change is worked out by hand below, read back by the analysis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from stored_records import as_results
from tmas.grading.grades import GradeConfig, Grades
from tmas.grading.runs import grade_run
from tmas.methods.base import ReplyTally
from tmas.problems import Problem
from tmas.reports.where_lost import WhereLost, run_where_lost, where_lost
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript
from tmas.view.app import view_app
from web_helpers import AppThread, get, run_ref_for

PROBLEMS = [
    Problem(problem_id="p1", question="What is 17*23?", answer="391"),
    Problem(problem_id="p2", question="What is 12*12?", answer="144"),
    Problem(problem_id="p3", question="What is 15*15?", answer="225"),
    Problem(problem_id="p4", question="What is 13*13?", answer="169"),
]
CUT = "Thirteen times ten is 130, and thirteen times three is"


def boxed(value: int) -> str:
    return f"Multiplying it out step by step gives {value}.\n\n\\boxed{{{value}}}"


def verdict(score: float) -> str:
    return json.dumps({"analysis": "Checked each step of the computation.", "score": score})


# The verifier's verdict depends only on the answer it reads, and is wrong both ways on p1 and once on p2.
SCORES = {391: 0, 390: 1, 144: 1, 140: 0, 141: 1, 220: 0, 221: 0, 225: 1, 170: 0, 171: 0, 172: 0}
VERIFIER = [Rule(role="verifier", pattern=rf"\\boxed\{{{a}\}}", replies=[verdict(s)]) for a, s in SCORES.items()]

# Verify-Refine, n = 2, m = 1, T = 2: two solutions per problem, each verified, then corrected from its report.
# (Each solution rule answers its problem's two first calls in order: candidate 0, then candidate 1.)
#   problem  it0 candidates (score)   it0 selected  it1 candidates (score)   it1 selected   returned
#   p1 391   391 (0), 390 (1)         390 wrong     391 (0), 390 (1)         390 wrong      wrong: 391 in the last it
#   p2 144   144 (1), 140 (0)         144 right     141 (1), 140 (0)         141 wrong      wrong: 144 only at it0
#   p3 225   220 (0), 221 (0)         220 wrong     225 (1), 221 (0)         225 right      right
#   p4 169   170 (0), cut, no answer  170 wrong     171 (0), 172 (0)         171 wrong      wrong: never right
VERIFY_REFINE = [
    Rule(role="solution", pattern=r"17\*23", replies=[boxed(391), boxed(390)]),
    Rule(role="solution", pattern=r"12\*12", replies=[boxed(144), boxed(140)]),
    Rule(role="solution", pattern=r"15\*15", replies=[boxed(220), boxed(221)]),
    Rule(role="solution", pattern=r"13\*13", replies=[boxed(170)], times=1),
    Rule(role="solution", pattern=r"13\*13", replies=[CUT], finish_reason="length"),
    *[
        Rule(role="corrector", pattern=rf"{q}.*\\boxed\{{{before}\}}", replies=[boxed(after)])
        for q, before, after in (
            (r"17\*23", 391, 391),
            (r"17\*23", 390, 390),
            (r"12\*12", 144, 141),
            (r"12\*12", 140, 140),
            (r"15\*15", 220, 225),
            (r"15\*15", 221, 221),
            (r"13\*13", 170, 171),
        )
    ],
    Rule(role="corrector", pattern=r"13\*13", replies=[boxed(172)]),  # from the cut solution
    *VERIFIER,
]


async def verify_refine_run(run_dir: Path) -> None:
    """The Verify-Refine run above, into ``run_dir`` (not graded)."""
    settings = scripted_settings(method={"name": "verify_refine", "params": {"n": 2, "m": 1, "iterations": 2}})
    await scripted_run(ScriptedModel(SimScript(rules=VERIFY_REFINE), settings), run_dir, PROBLEMS)


async def graded_run(
    run_dir: Path, method: str, rules: list[Rule], problems: list[Problem], **params: object
) -> Grades:
    """A run of ``method`` on ``problems`` answered by ``rules``, graded by the rules (Math-Verify)."""
    pytest.importorskip("math_verify")
    settings = scripted_settings(method={"name": method, "params": params})
    await scripted_run(ScriptedModel(SimScript(rules=rules), settings), run_dir, problems)
    with RunStore(run_dir, create=False) as store:
        return await grade_run(store, GradeConfig(mode="rules"))


def answers(run_dir: Path) -> dict[str, list[list[str | None]]]:
    """Each problem's candidate answers per iteration, as stored."""
    with RunStore(run_dir, read_only=True) as store:
        return {
            p.problem_id: [[c.answer for c in r.candidates] for r in store.iterations(p.problem_id)]
            for p in store.problems()
        }


async def test_a_verify_refine_run_says_where_it_lost_each_answer(tmp_path: Path) -> None:
    run_dir = tmp_path / "vr"
    grades = await graded_run(run_dir, "verify_refine", VERIFY_REFINE, PROBLEMS, n=2, m=1, iterations=2)
    # The run went as the table above says.
    assert answers(run_dir) == {
        "p1": [["391", "390"], ["391", "390"]],
        "p2": [["144", "140"], ["141", "140"]],
        "p3": [["220", "221"], ["225", "221"]],
        "p4": [["170", None], ["171", "172"]],
    }
    lost = run_where_lost(run_dir, "verify_refine", grades)

    assert lost.selection is not None
    assert (lost.selection.problems, lost.selection.returned_right) == (4, 1)
    assert (lost.selection.in_last, lost.selection.only_earlier, lost.selection.never_right) == (["p1"], ["p2"], ["p4"])
    assert lost.selection.passed_over == 2

    # Right candidates (one verification each): p1 391 twice (0, 0), p2 144 (1), p3 225 (1): 2 of 4 passed.
    # Wrong answered ones: p1 390 twice (1, 1), p2 140 twice and 141 (0, 0, 1), p3 220, 221 twice (all 0), p4 170,
    # 171, 172 (all 0): 3 of 11 passed. The cut candidate's verification is left out.
    v = lost.verifier
    assert v is not None
    assert (v.right_passed, v.right, v.wrong_passed, v.wrong) == (2, 4, 3, 11)
    assert (v.no_score, v.answerless) == (0, 1)
    # ROC area: a right 0 beats no wrong score and ties the 8 wrong 0s (4 each); a right 1 beats the 8 wrong 0s and
    # ties the 3 wrong 1s (9.5 each): (4 + 4 + 9.5 + 9.5) / (4 x 11) = 27 / 44.
    assert v.separation is not None and v.separation.auc == pytest.approx(27 / 44)

    # One step per problem: p1 390 -> 390 unchanged, p2 right -> wrong, p3 wrong -> right, p4 170 -> 171 both wrong.
    c = lost.changes
    assert c is not None
    assert (c.steps, c.changed) == (4, 3)
    assert (c.better, c.worse, c.neither) == ([("p3", 1)], [("p2", 1)], [("p4", 1)])

    # 8 solution replies, p4's second cut at max_tokens with no answer; 8 corrections and 16 verdicts, all usable.
    assert lost.replies == {
        "corrector": ReplyTally(replies=8),
        "solution": ReplyTally(replies=8, truncated=1, unusable=1),
        "verifier": ReplyTally(replies=16),
    }


# TMAS, n = 2, m = 2, T = 2, on p1 alone. Its solution rule answers the four solution calls in order; the verifier
# passes 390 every time, 392 never, and 391 every other time (its replies alternate 1, 0 in call order):
#   it0: 391 (1, 0: score 0.5), 390 (1, 1: score 1) -> 390 wrong
#   it1: 391 (1, 0: score 0.5), 392 (0, 0: score 0) -> 391 right
TMAS_RULES = [
    Rule(role="solution", pattern=r"17\*23", replies=[boxed(391), boxed(390), boxed(391), boxed(392)]),
    Rule(role="verifier", pattern=r"\\boxed\{391\}", replies=[verdict(1), verdict(0)]),
    Rule(role="verifier", pattern=r"\\boxed\{390\}", replies=[verdict(1)]),
    Rule(role="verifier", pattern=r"\\boxed\{392\}", replies=[verdict(0)]),
]


async def test_a_tmas_run_says_how_its_verifier_and_iterations_did(tmp_path: Path) -> None:
    run_dir = tmp_path / "tmas"
    grades = await graded_run(run_dir, "tmas", TMAS_RULES, PROBLEMS[:1], n=2, m=2, iterations=2)
    assert answers(run_dir) == {"p1": [["391", "390"], ["391", "392"]]}
    lost = run_where_lost(run_dir, "tmas", grades)
    assert lost.selection is not None and lost.selection.returned_right == 1 and lost.selection.passed_over == 0
    v = lost.verifier
    assert v is not None
    # Right: the two 391 candidates, one of each pair of verifications passing; wrong: 390 twice passed, 392 never.
    assert (v.right_passed, v.right, v.wrong_passed, v.wrong) == (2, 4, 2, 4)
    # Scores right 0.5, 0.5 against wrong 1, 0: each right one outscores one of the two wrong ones: 2 / 4.
    assert v.separation is not None and v.separation.auc == pytest.approx(0.5)
    assert lost.changes is not None and (lost.changes.steps, lost.changes.better) == (1, [("p1", 1)])
    # Four solutions and eight verdicts; the last iteration's summaries and memory update are skipped.
    assert {role: t.replies for role, t in lost.replies.items()} == {
        "experience": 1,
        "guideline": 1,
        "solution": 4,
        "summary": 2,
        "verifier": 8,
    }


async def test_parts_apply_by_the_methods_traits(tmp_path: Path) -> None:
    # Majority vote: no selection rule, no verifier, and its samples are one pool, not revisions; replies still count.
    run_dir = tmp_path / "mv"
    rules = [Rule(role="solution", pattern=r"17\*23", replies=[boxed(391), boxed(390), boxed(390)])]
    grades = await graded_run(run_dir, "majority", rules, PROBLEMS[:1], k=3)
    lost = run_where_lost(run_dir, "majority", grades)
    assert (lost.selection, lost.verifier, lost.changes) == (None, None, None)
    assert set(lost.why_not) == {"selection", "verifier", "changes"}
    assert lost.replies == {"solution": ReplyTally(replies=3)}
    assert isinstance(lost, WhereLost)


async def test_the_viewer_page_shows_where_the_run_lost_its_answers(tmp_path: Path) -> None:
    # Not graded by tmas report: the viewer's live exact rules grade the integers as the report's rules do.
    run_dir = tmp_path / "vr"
    await verify_refine_run(run_dir)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, run_page = get(f"{viewer.url}/run/{ref.key}")
        assert status == 200 and f'href="/run/{ref.key}/where-lost"' in run_page.decode()
        status, body = get(f"{viewer.url}/run/{ref.key}/where-lost")
    assert status == 200
    page = body.decode()

    def cells(table: str) -> list[str]:
        part = page.split(f'id="{table}"')[1].split("</table>")[0]
        return [c.split(">", 1)[1] for c in part.split("<td")[1:] for c in [c.split("</td>")[0]]]

    # The figures worked out in test_a_verify_refine_run_says_where_it_lost_each_answer.
    assert cells("lost-selection") == ["4", "25.0% (1)", "50.0% (2)", "25.0% (1)", "25.0% (1)", "25.0% (1)"]
    assert cells("lost-verifier") == ["50.0% (2 of 4)", "27.3% (3 of 11)", "0.614", "0", "1"]
    assert cells("lost-changes") == ["4", "75.0% (3)", "25.0% (1)", "25.0% (1)", "25.0% (1)"]
    assert cells("lost-replies") == [
        *["corrector", "8", "0.0% (0)", "0.0% (0)"],
        *["solution", "8", "12.5% (1)", "12.5% (1)"],
        *["verifier", "16", "0.0% (0)", "0.0% (0)"],
    ]
    # Each problem passed over and each step that changed the answer links to its page.
    assert f'href="/run/{ref.key}/problem?id=p1">p1</a>' in page.split('id="lost-in-last"')[1].split("</p>")[0]
    assert f'href="/run/{ref.key}/problem?id=p2">p2</a>' in page.split('id="lost-only-earlier"')[1].split("</p>")[0]
    assert 'iteration?id=p3&amp;t=1">p3 it1</a>' in page.split('id="changes-better"')[1].split("</p>")[0]
    assert 'iteration?id=p2&amp;t=1">p2 it1</a>' in page.split('id="changes-worse"')[1].split("</p>")[0]
    assert "live" in page and "exact rules cannot decide" in page
    # The rule the figures follow, said as the report says it: a tie between the judge runs counts right.
    assert "a candidate is right when at least half of the judge runs say so" in " ".join(page.split())


async def test_the_viewer_page_of_a_run_without_references_shows_the_replies_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "free"
    unlabeled = [p.model_copy(update={"answer": None}) for p in PROBLEMS[:1]]
    settings = scripted_settings(method={"name": "majority", "params": {"k": 2}})
    await scripted_run(ScriptedModel(SimScript(), settings), run_dir, unlabeled)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, body = get(f"{viewer.url}/run/{ref.key}/where-lost")
    page = body.decode()
    assert status == 200 and "nothing to grade" in page and 'id="lost-selection"' not in page
    assert '<td>solution</td><td class="num">2</td>' in page


def test_a_half_score_does_not_pass_and_verifications_without_a_score_are_left_out() -> None:
    # One problem, one iteration: a right candidate verified 1, 0.5 and unreadable; a wrong one verified 0.5 and
    # failed; a failed call (never counted); an answerless candidate with one verification.
    candidates = [
        {"index": 0, "answer": "391", "score": 0.5, "meta": {"verifications": [{"score": 1}, {"score": 0.5}, {}]}},
        {"index": 1, "answer": "390", "score": 0.25, "meta": {"verifications": [{"score": 0.5}, {"score": None}]}},
        {"index": 2, "answer": None, "error": "timeout", "meta": {"verifications": [{"score": 1}]}},
        {"index": 3, "answer": None, "score": 0.0, "meta": {"verifications": [{"score": 1}]}},
    ]
    results = [{"problem_id": "p1", "iterations": [{"iteration": 0, "candidates": candidates, "selected": "391"}]}]
    grades = Grades(runs=1, verdicts={("p1", 0, 0): [True], ("p1", 0, 1): [False], ("p1", 0, -1): [True]})
    v = where_lost("verify_refine", as_results(results, "verify_refine"), grades, {}).verifier
    assert v is not None
    assert (v.right_passed, v.right, v.wrong_passed, v.wrong, v.no_score, v.answerless) == (1, 2, 0, 1, 2, 1)
    # Scores of the answered candidates: right 0.5 against wrong 0.25.
    assert v.separation is not None and v.separation.auc == 1.0


def test_an_answer_kept_from_one_iteration_to_the_next_is_no_change() -> None:
    # p1 keeps 3 (judged right, then undecided: the judge's, not the step's); p2 goes 4 -> 5 (wrong -> right).
    def iteration(t: int, selected: str) -> dict[str, object]:
        return {"iteration": t, "selected": selected, "candidates": [{"index": 0, "answer": selected}]}

    results = [
        {"problem_id": "p1", "iterations": [iteration(0, "3"), iteration(1, "3")]},
        {"problem_id": "p2", "iterations": [iteration(0, "4"), iteration(1, "5")]},
    ]
    verdicts = {("p1", 0, -1): [True], ("p1", 1, -1): [None], ("p2", 0, -1): [False], ("p2", 1, -1): [True]}
    changes = where_lost("verify_refine", as_results(results, "verify_refine"), Grades(runs=1, verdicts=verdicts), {})
    assert changes.changes is not None
    assert (changes.changes.steps, changes.changes.better, changes.changes.worse) == (2, [("p2", 1)], [])


def test_the_viewers_verdicts_label_answers_as_the_losses_count_them() -> None:
    # Two judge runs split on p's returned answer: "at least half" makes it right, so the losses count p as returned
    # right, and the viewer's problem list must mark it right too (a strict majority of two runs marked it wrong).
    from tmas.view.runs import verdict

    results = [
        {
            "problem_id": "p",
            "iterations": [
                {"iteration": 0, "selected": "7", "candidates": [{"index": 0, "answer": "7", "text": "7"}]},
            ],
        }
    ]
    grades = Grades(runs=2, verdicts={("p", 0, 0): [True, False], ("p", 0, -1): [True, False]})
    lost = where_lost("verify_refine", as_results(results, "verify_refine"), grades, {})
    assert lost.selection is not None and lost.selection.returned_right == 1
    assert verdict(grades, ("p", 0, -1)) is True and verdict(grades, ("p", 0, 0)) is True
    # An undecided run counts against, as in the report's shares: one yes of three is not right.
    three = Grades(runs=3, verdicts={("p", 0, -1): [True, None, None], ("p", 0, 0): [None, None, None]})
    assert verdict(three, ("p", 0, -1)) is False and not three.majority_correct(("p", 0, -1))
    # Undecided in every run, or never graded: no verdict.
    assert (
        verdict(three, ("p", 0, 0)) is None
        and verdict(three, ("q", 0, -1)) is None
        and verdict(None, ("p", 0, 0)) is None
    )


async def test_a_section_with_nothing_to_show_is_left_out(tmp_path: Path) -> None:
    from dataclasses import dataclass

    from tmas.reports.document import Document
    from tmas.reports.where_lost import where_lost_section

    @dataclass
    class Run:
        label: str
        losses: WhereLost | None

    # CoT, every call refused: one iteration of a failed candidate. CoT neither selects, verifies nor revises, and
    # no reply came back to count: no part has a row, so neither the heading nor its note is written.
    run_dir = tmp_path / "cot"
    grades = await graded_run(run_dir, "cot", [Rule(role="solution", fault="http_400")], PROBLEMS[:1])
    doc = Document("report")
    where_lost_section(doc, [Run("cot", run_where_lost(run_dir, "cot", grades))])
    assert doc.blocks == []
    # With a run that has replies to count, the section is there.
    counted = tmp_path / "mv"
    mv_grades = await graded_run(counted, "majority", [Rule(role="solution", replies=[boxed(391)])], PROBLEMS[:1], k=1)
    mv = Run("mv", run_where_lost(counted, "majority", mv_grades))
    where_lost_section(doc, [Run("cot", run_where_lost(run_dir, "cot", grades)), mv])
    assert "### Where the runs lose their answers" in doc.markdown() and "| mv | solution | 1 |" in doc.markdown()


# TMAS, n = 2, m = 1, T = 2, on sin 45 degrees: the first candidate of each iteration is right, written otherwise at
# it1, and the only one the verifier passes; the other candidate, 1, is wrong.
#   it0: \frac{\sqrt{2}}{2} (1), 1 (0) -> \frac{\sqrt{2}}{2} right
#   it1: \frac{1}{\sqrt{2}} (1), 1 (0) -> \frac{1}{\sqrt{2}} right: the same answer, so no change
SIN45 = Problem(problem_id="s", question="What is sin 45 degrees?", answer="\\frac{\\sqrt{2}}{2}")
RESPELLED = [
    Rule(role="solution", replies=[boxed("\\frac{\\sqrt{2}}{2}"), boxed(1), boxed("\\frac{1}{\\sqrt{2}}"), boxed(1)]),
    Rule(role="verifier", pattern=r"\\boxed\{1\}", replies=[verdict(0)]),
    Rule(role="verifier", replies=[verdict(1)]),
]


async def test_a_right_answer_written_otherwise_is_no_change_in_the_report_or_the_viewer(tmp_path: Path) -> None:
    from dataclasses import dataclass

    from tmas.reports.document import Document
    from tmas.reports.where_lost import where_lost_section

    @dataclass
    class Run:
        label: str
        losses: WhereLost | None

    run_dir = tmp_path / "tmas"
    grades = await graded_run(run_dir, "tmas", RESPELLED, [SIN45], n=2, m=1, iterations=2)
    assert answers(run_dir) == {"s": [["\\frac{\\sqrt{2}}{2}", "1"], ["\\frac{1}{\\sqrt{2}}", "1"]]}
    # The rules grade both returned answers right: each equals the reference.
    assert grades.majority_correct(("s", 0, -1)) and grades.majority_correct(("s", 1, -1))
    changes = run_where_lost(run_dir, "tmas", grades).changes
    assert changes is not None
    assert (changes.steps, changes.changed, changes.better, changes.worse, changes.neither) == (1, 0, [], [], [])

    # The report and the viewer (reading the grades the report stored) show the same row: one step, none changed.
    doc = Document("report")
    where_lost_section(doc, [Run("tmas", run_where_lost(run_dir, "tmas", grades))])
    assert "| tmas | 1 | 0.0% (0) | 0.0% (0) | 0.0% (0) | 0.0% (0) |" in doc.markdown()
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, body = get(f"{viewer.url}/run/{ref.key}/where-lost")
    assert status == 200
    part = body.decode().split('id="lost-changes"')[1].split("</table>")[0]
    cells = [c.split(">", 1)[1].split("</td>")[0] for c in part.split("<td")[1:]]
    assert cells == ["1", "0.0% (0)", "0.0% (0)", "0.0% (0)", "0.0% (0)"]


async def test_the_viewer_page_of_a_proof_mode_run_grades_nothing_as_the_report_does(tmp_path: Path) -> None:
    # A proof-mode TMAS run of a problem that carries a reference answer: its candidates hold proofs and no answers.
    # The report leaves such a run ungraded; the viewer's page must not grade it either (against the reference,
    # every proof would read as wrong: "no right candidate" for every problem) and shows the reply counts alone.
    run_dir = tmp_path / "proof"
    proof = "## Solution\nSeventeen times twenty-three is 340 + 51, which is 391."
    settings = scripted_settings(method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 1, "mode": "proof"}})
    rules = [Rule(role="solution", replies=[proof]), Rule(role="verifier", replies=[verdict(1)])]
    await scripted_run(ScriptedModel(SimScript(rules=rules), settings), run_dir, PROBLEMS[:1])
    assert answers(run_dir) == {"p1": [[None, None]]}
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, body = get(f"{viewer.url}/run/{ref.key}/where-lost")
    page = body.decode()
    assert status == 200 and "proof mode" in page
    assert 'id="lost-selection"' not in page and 'id="lost-verifier"' not in page
    # Two solutions and two verdicts, all usable.
    assert '<td>solution</td><td class="num">2</td>' in page and '<td>verifier</td><td class="num">2</td>' in page
