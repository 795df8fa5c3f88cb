"""`tmas report --no-grade` on a run never graded names it not graded yet. How it reads a graded run's stored grades
(as its last grading read them, unless --grade or --judge-runs name another reading) is tested beside the viewer's
reading of them, in test_view_grading.py."""

from __future__ import annotations

from pathlib import Path

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.problems import Problem
from tmas.reports.report import build_report
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
