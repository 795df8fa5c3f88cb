"""The grader seam: a grader defined in one place and registered by name grades a run, stores its verdicts, and is
read back without grading; every shipped grader grades through the same seam; unknown names are refused where they
are given."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.answers import normalize_answer
from tmas.errors import ConfigError
from tmas.grading.grader import GradingContext, StoredGrades, Verdicts
from tmas.grading.grades import SELECTED, GradeConfig, Grades, Item
from tmas.grading.registry import GRADERS
from tmas.grading.runs import grade_run, load_grades
from tmas.pool.build import BuildConfig
from tmas.problems import Problem
from tmas.store.run_store import GradeRow, RunStore
from tmas.testing import Rule, ScriptedModel, SimScript


class ExactGrader:
    """Equal normalised spellings only: two verdicts per item, the second always undecided."""

    name = "exact"

    def runs(self, config: GradeConfig) -> int:
        return 2

    async def grade(self, items: Sequence[Item], context: GradingContext) -> Verdicts:
        rows = [
            GradeRow(*item.key, self.name, 0, item.answer, _same(item), "spelling")
            for item in items
            if (item.key, self.name, 0) not in context.stored
        ]
        context.store.save_grades(rows)
        context.grades.notes.append(f"exact: {len(rows)} new verdicts")
        return {item.key: [_same(item), None] for item in items}

    def stored_runs(self, stored: StoredGrades) -> int:
        return 2 if any(grader == self.name for (_, grader, _) in stored) else 0

    def recall(self, items: Sequence[Item], stored: StoredGrades, runs: int) -> Verdicts:
        return {item.key: [stored[(item.key, self.name, 0)].verdict, None] for item in items}

    def grade_one(self, item: Item) -> bool | None:
        return _same(item)


def _same(item: Item) -> bool:
    return item.answer is not None and normalize_answer(item.answer) == normalize_answer(item.problem.answer or "")


async def test_a_registered_grader_grades_stores_and_is_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(GRADERS, "exact", ExactGrader())
    problems = [
        Problem(problem_id="right", question="What is 6*7?", answer="42"),
        Problem(problem_id="wrong", question="What is 2*3?", answer="7"),
    ]
    await scripted_run(ScriptedModel(SimScript(), scripted_settings(method__name="cot")), tmp_path / "run", problems)
    store = RunStore(tmp_path / "run", create=False)
    config = GradeConfig(mode="exact")
    grades = await grade_run(store, config)
    assert grades.mode == "exact" and grades.runs == 2
    assert grades.verdicts[("right", 0, 0)] == [True, None]
    assert grades.verdicts[("wrong", 0, SELECTED)] == [False, None]
    assert grades.notes == ["exact: 4 new verdicts"]
    assert {row.grader for row in store.grades()} == {"exact"}
    again = await grade_run(store, config)
    assert again.verdicts == grades.verdicts and again.notes == ["exact: 0 new verdicts"]
    loaded = load_grades(store, config)
    assert loaded is not None and loaded.verdicts == grades.verdicts and loaded.runs == 2
    # A run holding none of the asked grader's verdicts is read as graded by the rules (none stored: undecided).
    fallback = load_grades(store, GradeConfig(mode="judge"))
    assert fallback is not None and fallback.mode == "rules" and fallback.verdicts[("right", 0, 0)] == [None]
    store.close()


async def test_unknown_grader_names_are_refused_where_given(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="unknown grader 'exactly'"):
        BuildConfig(grade_mode="exactly")
    assert BuildConfig(grade_mode="rules").grade_mode == "rules"
    with (
        RunStore(tmp_path / "run") as store,
        pytest.raises(ConfigError, match=r"known: combined, rules, judge, diagnosis, teaching\)"),
    ):
        await grade_run(store, GradeConfig(mode="exactly"))


@pytest.mark.slow
async def test_every_registered_grader_grades_one_item_through_the_registry(tmp_path: Path) -> None:
    pytest.importorskip("math_verify")
    script = SimScript(
        rules=[
            Rule(role="judge", pattern="<predicted>", replies=["<answer>2</answer>"]),
            Rule(role="judge", pattern="<student>", replies=['{"reasoning": "5 is five", "equivalent": true}']),
        ]
    )
    judge = ScriptedModel(script, scripted_settings())
    # The rules cannot decide a number against text; the judge can.
    math = Item(
        ("math", 0, SELECTED), Problem(problem_id="math", question="What is 2+3?", answer="\\text{five}"), "5", "5"
    )
    top10 = ["Gaucher disease", "Alpha-galactosidase A deficiency"]
    medicine = Problem(problem_id="med", question="A rare disease case.", answer="Fabry disease")
    education = Problem(problem_id="edu", question="Which letter?", answer="B")
    teaching_state = {"pre": "A", "pre_correct": False, "post": "B", "post_correct": True}
    cases = {
        # name: (item, verdicts, findings, grade_one's verdict with no model)
        "combined": (math, [True], {}, None),
        "rules": (math, [None], {}, None),
        "judge": (math, [True], {}, None),
        "diagnosis": (
            Item(("med", 1, SELECTED), medicine, top10[0], "", {"decision": {"top10": top10}}),
            [True],
            {"rank": 2},
            False,  # by spelling alone Fabry disease is not in the list
        ),
        "teaching": (
            Item(("edu", 1, SELECTED), education, "B", "", teaching_state),
            [True],
            {"pre": "A", "post": "B", "pre_correct": False},
            True,
        ),
    }
    assert list(GRADERS) == list(cases) and all(g.name == name for name, g in GRADERS.items())
    for name, (item, verdicts, findings, one) in cases.items():
        grader = GRADERS[name]
        config = GradeConfig(mode=name, judge_runs=1)
        with RunStore(tmp_path / name) as store:
            grades = Grades(runs=grader.runs(config), mode=name)
            context = GradingContext(store, config, judge.settings, grades, {}, judge)
            assert await grader.grade([item], context) == {item.key: verdicts}, name
        assert grades.findings == ({item.key: findings} if findings else {}), name
        assert grader.grade_one(item) is one, name
    judged = [call.messages[-1].content for call in judge.calls_of("judge")]
    # One answer judgement each for combined and judge, one rank judgement for diagnosis; the others ask nothing.
    assert sorted("<predicted>" in body for body in judged) == [False, False, True]


@pytest.mark.slow
async def test_combined_grading_asks_the_judge_about_a_bare_list_given_in_another_order(tmp_path: Path) -> None:
    pytest.importorskip("math_verify")
    # The judge reads the problem: here it asks for an ordered pair, so the swapped pair is wrong.
    script = SimScript(
        rules=[Rule(role="judge", pattern="<student>", replies=['{"reasoning": "swapped", "equivalent": false}'])]
    )
    judge = ScriptedModel(script, scripted_settings())
    problem = Problem(problem_id="pair", question="Find the ordered pair (x, y).", answer="-\\frac{2}{9}, 4")
    same = Item(("pair", 0, 0), problem, "\\left(-2/9, 4\\right)", "")
    swapped = Item(("pair", 0, 1), problem, "4, -\\dfrac{2}{9}", "")
    # Where the question asks for all of something, the list is a set: the rules decide any order.
    every = Problem(problem_id="all", question="Find all roots of the cubic.", answer="-\\frac{2}{9}, 4")
    roots = Item(("all", 0, 0), every, "4, -\\dfrac{2}{9}", "")
    config = GradeConfig(mode="combined", judge_runs=1)
    with RunStore(tmp_path / "run") as store:
        context = GradingContext(store, config, judge.settings, Grades(runs=1, mode="combined"), {}, judge)
        verdicts = await GRADERS["combined"].grade([same, swapped, roots], context)
        rules = {(g.problem_id, g.candidate, g.verdict) for g in store.grades() if g.grader == "rules"}
    assert verdicts == {same.key: [True], swapped.key: [False], roots.key: [True]}
    # The rules took the pair in its order and left the other order undecided (before: both right, no judge asked).
    assert rules == {("pair", 0, True), ("pair", 1, None), ("all", 0, True)}
    asked = [call.messages[-1].content for call in judge.calls_of("judge")]
    assert len(asked) == 1 and "<student>\n4, -\\dfrac{2}{9}" in asked[0] and "ordered pair" in asked[0]
