"""`tmas report --no-grade` reads each run's stored grades as its last grading read them, unless --grade or
--judge-runs name another reading; a run never graded is named not graded yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_tmas, scripted_settings
from scripted_runs import scripted_run
from tmas.grading.grades import GradeConfig
from tmas.grading.runs import grade_run
from tmas.problems import Problem
from tmas.reports.report import build_report
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript


def _judged(student: str, equivalent: bool) -> Rule:
    reply = json.dumps({"reasoning": "Compared the student's value with the reference.", "equivalent": equivalent})
    return Rule(role="judge", pattern=f"<student>\n{student}\n</student>", replies=[reply])


def _report(run_dir: Path, out: Path, *flags: str) -> tuple[str, str]:
    """What `tmas report --no-grade FLAGS` says it read the grades as, and the Pass@1 (%) it shows."""
    done = run_tmas("report", str(run_dir), "-o", str(out), "--no-grade", *flags, text=True)
    assert done.returncode == 0, done.stderr
    markdown = (out / "report.md").read_text()
    pass1 = markdown.split("| cot [sim-model] | ")[1].split(" |")[0]
    return markdown.split("grading: ")[1].split(";")[0], pass1


async def test_no_grade_reads_the_stored_grades_as_the_last_grading(tmp_path: Path) -> None:
    # "5" against \text{five}: the rules cannot decide it, the judge calls it right. 391 against 391: the rules call it
    # right, this judge wrong. Each run's stored rows hold both graders' verdicts after the gradings below.
    pytest.importorskip("math_verify")
    problems = [
        Problem(problem_id="five", question="What is 2+3, in words?", answer="\\text{five}"),
        Problem(problem_id="mult", question="What is 17*23?", answer="391"),
    ]
    solutions = [
        Rule(role="solution", pattern=r"2\+3", replies=["Two and three make \\boxed{5}"]),
        Rule(role="solution", pattern=r"17\*23", replies=["It is \\boxed{391}"]),
    ]
    judge = ScriptedModel(SimScript(rules=[_judged("5", True), _judged("391", False)]), scripted_settings())
    runs = {}
    for name, gradings in {
        # Combined with two judge runs, then the rules: read as the rules', "five" undecided.
        "rules": [GradeConfig(mode="combined", judge_runs=2), GradeConfig(mode="rules")],
        # The judge with two runs, then with one: read as the judge's first run alone.
        "judge": [GradeConfig(mode="judge", judge_runs=2), GradeConfig(mode="judge", judge_runs=1)],
    }.items():
        run_dir = tmp_path / name
        model = ScriptedModel(SimScript(rules=solutions), scripted_settings(method__name="cot"))
        await scripted_run(model, run_dir, problems)
        with RunStore(run_dir, create=False) as store:
            for config in gradings:
                await grade_run(store, config, model=judge)
        runs[name] = run_dir

    # Before, both were read as combined over every stored judge run, both problems right: 100%.
    assert _report(runs["rules"], tmp_path / "r1") == ("rules, 1 judge run(s)", "50.00")  # mult right alone
    assert _report(runs["judge"], tmp_path / "r2") == ("judge, 1 judge run(s)", "50.00")  # five right alone
    # A grader named on the command line is read as named, with as many stored judge runs as it asks for (the judge
    # run holds no rules rows: combined reads the judge's verdicts throughout).
    assert _report(runs["rules"], tmp_path / "r3", "--grade", "combined") == ("combined, 2 judge run(s)", "100.00")
    assert _report(runs["judge"], tmp_path / "r4", "--grade", "judge") == ("judge, 2 judge run(s)", "50.00")
    assert _report(runs["judge"], tmp_path / "r5", "--judge-runs", "1") == ("combined, 1 judge run(s)", "50.00")


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
