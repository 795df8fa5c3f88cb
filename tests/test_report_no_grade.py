"""`tmas report --no-grade` on a run never graded names it not graded yet. How it reads a graded run's stored grades
(as its last grading read them, unless --grade or --judge-runs name another reading) is tested beside the viewer's
reading of them, in test_view_grading.py."""

from __future__ import annotations

from pathlib import Path

from conftest import scripted_settings
from scripted_runs import scripted_run
from stored_records import as_stored
from tmas.grading.grades import GradeConfig
from tmas.problems import Problem
from tmas.reports.report import build_report
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript


async def test_no_grade_on_a_run_never_graded_says_so(tmp_path: Path) -> None:
    """A run no grading has touched has no grades to read: its section says it is not graded yet, as when --grade
    names a reading, and shows no Pass@1. Before, it read as graded by the default grader with no problem labeled."""
    problems = [Problem(problem_id="mult", question="What is 17*23?", answer="391")]
    script = SimScript(rules=[Rule(role="solution", replies=["It is \\boxed{391}"])])
    model = ScriptedModel(script, scripted_settings(method__name="cot"))
    await scripted_run(model, tmp_path / "run", problems)
    markdown = (await build_report([tmp_path / "run"], tmp_path / "out", None, None, grade=False))["markdown"]
    text = markdown.read_text()
    assert "cot [sim-model]: not graded yet (run 'tmas report' without --no-grade)." in text
    assert "grading: " not in text and "Pass@1 (%) at selected iterations" not in text


async def test_answers_solved_after_the_last_grading_are_named_not_graded_not_undecided(tmp_path: Path) -> None:
    """A problem solved after the run was graded has no stored grade: --no-grade counts its answers incorrect, as an
    undecided verdict is, and the run's section says so, on a line of its own naming them not graded. Before, they
    read as the grader's undecided verdicts."""
    problems = [Problem(problem_id="mult", question="What is 17*23?", answer="391")]
    script = SimScript(rules=[Rule(role="solution", replies=["It is \\boxed{391}"])])
    model = ScriptedModel(script, scripted_settings(method__name="cot"))
    run = tmp_path / "run"
    await scripted_run(model, run, problems)
    await build_report([run], tmp_path / "graded", GradeConfig(mode="rules"), None)
    # Then a second problem is solved, right, and the report is written from the stored grades alone.
    with RunStore(run) as store:
        store.add_problems([Problem(problem_id="later", question="What is 2*3?", answer="6")])
        result = as_stored(
            {
                "problem_id": "later",
                "iterations": [{"iteration": 0, "selected": "6", "candidates": [{"index": 0, "answer": "6"}]}],
            },
            method="cot",
        )
        store.save_iteration(result.iterations[0])
        store.save_result(result)
    text = (await build_report([run], tmp_path / "out", None, None, grade=False))["markdown"].read_text()
    # Pass@1 (A.2) = 1/|P| * sum_i c_i / n_i = (1/1 + 0/1) / 2: mult right, later's answer (not graded) counted wrong.
    assert "| cot [sim-model] | 50.00 |" in text
    assert "grading: rules only, no judge; 0 undecided verdicts (counted incorrect)" in text
    # later's candidate and its returned answer.
    assert (
        "not graded yet: 2 answers (candidates and returned answers) of 1 problem, solved after the run's last "
        "grading, counted incorrect in every figure ('tmas report' without --no-grade grades them)"
    ) in text
