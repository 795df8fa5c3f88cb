"""The grading flags of ``tmas eval``, ``report``, ``sweep`` and ``data filter``: ``--grade`` (a registered
grader's name) and ``--judge-runs``, read as one :class:`tmas.grading.grades.GradeConfig`."""

from __future__ import annotations

from typing import Annotated

import typer

from tmas.errors import InputError
from tmas.grading.grades import GradeConfig

GradeModeOpt = Annotated[
    str,
    typer.Option(
        "--grade",
        help="A registered grader: combined (rules, then the judge), rules, judge; diagnosis and teaching grade"
        " MATTRL's medicine and education runs.",
    ),
]
JudgeRunsOpt = Annotated[int, typer.Option("--judge-runs", help="Independent LLM-judge runs (paper: 4).")]
# tmas report's: with --no-grade and neither named, each run's stored grades are read as its last grading read them.
ReportGradeOpt = Annotated[
    str | None,
    typer.Option(
        "--grade",
        help="A registered grader: combined (rules, then the judge; the default), rules, judge; diagnosis and teaching"
        " grade MATTRL's medicine and education runs. With --no-grade: the grader whose stored verdicts are read"
        " (default: each run's last grading).",
    ),
]
ReportJudgeRunsOpt = Annotated[
    int | None,
    typer.Option(
        "--judge-runs",
        help="Independent LLM-judge runs (paper: 4; the default). With --no-grade: how many stored runs are read"
        " (default: as each run's last grading).",
    ),
]


def read_grade_flags(grade: str, judge_runs: int) -> GradeConfig:
    from tmas.grading.registry import GRADERS

    if grade not in GRADERS:
        raise InputError(f"--grade {grade!r}: choose {', '.join(GRADERS)}")
    if judge_runs < 1:
        raise InputError("--judge-runs must be at least 1")
    return GradeConfig(mode=grade, judge_runs=judge_runs)


def grade_words(config: GradeConfig) -> str:
    """The flags that ask for ``config`` again on a later command line (each with a leading space; none for the
    defaults), for the command a stopped one says to continue with."""
    default = GradeConfig()
    words = "" if config.mode == default.mode else f" --grade {config.mode}"
    return words + ("" if config.judge_runs == default.judge_runs else f" --judge-runs {config.judge_runs}")


def read_report_grade_flags(grade: str | None, judge_runs: int | None, *, no_grade: bool) -> GradeConfig | None:
    """``tmas report``'s grading: None (each run read as its last grading) with ``--no-grade`` and neither flag named,
    else the flags as given over the defaults (combined, 4 judge runs)."""
    if no_grade and grade is None and judge_runs is None:
        return None
    default = GradeConfig()
    return read_grade_flags(
        default.mode if grade is None else grade, default.judge_runs if judge_runs is None else judge_runs
    )


def check_grading_installed(config: GradeConfig) -> None:
    """Before a run whose report grades by rules: Math-Verify is there (else the run's calls would be spent before
    the grading fails)."""
    from tmas.answer_rules import ensure_math_verify

    if config.mode in ("combined", "rules"):
        ensure_math_verify()
