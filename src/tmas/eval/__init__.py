"""Evaluation harness: problem generators, grading (Math-Verify rules, LLM judge), metrics, analyses, reports.

Needs the ``eval`` extra (math-verify, matplotlib, scipy) for grading by rules, plots and the statistical test.
"""

from tmas.eval.grading import GradeConfig, Grades, grade_run, load_grades
from tmas.eval.metrics import RunMetrics, compute_metrics, majority_answer, pass_at_1
from tmas.eval.report import build_report, evaluate_run, write_report

__all__ = [
    "GradeConfig",
    "Grades",
    "RunMetrics",
    "build_report",
    "compute_metrics",
    "evaluate_run",
    "grade_run",
    "load_grades",
    "majority_answer",
    "pass_at_1",
    "write_report",
]
