"""Grading a run of MATTRL's medicine or education cases by the domain's own metrics (``tmas cases grade``).

Medicine: the ``diagnosis`` grader ranks the gold disease in the team's final top-10, by spelling or by the
``judge`` role (A.5 rules), then Hit@1/3/5/10 and MRR. Education: the ``teaching`` grader reads the student's pre-
and post-test verdicts, then Acc_pre, Acc_post and their delta. Only each problem's last record counts, and only
problems with a gold answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmas.config import Settings
from tmas.errors import InputError
from tmas.grading.diagnosis import DIAGNOSIS, ranking_metrics
from tmas.grading.grader import GradingContext, index_grades
from tmas.grading.grades import SELECTED, GradeConfig, Grades, Item
from tmas.grading.registry import grader_named
from tmas.grading.teaching import TEACHING, teaching_metrics
from tmas.methods.mattrl_domains import DOMAINS
from tmas.methods.state import MATTRLState
from tmas.problems import Problem
from tmas.store.records import ProblemResult
from tmas.store.run_store import RunStore, check_began


@dataclass
class CaseGrades:
    """One row per graded case (in the run's order) and the metrics over them (with ``cases``, their count)."""

    rows: list[dict[str, Any]]
    metrics: dict[str, Any]


async def grade_cases(run_dir: Path, judge: Settings | None = None) -> CaseGrades:
    """Grade the run in ``run_dir``; with ``judge`` settings, medicine names are matched by the judge role (its
    calls are kept in the run's own store), else by spelling."""
    check_began(run_dir, "grade")
    with RunStore(run_dir, create=False) as store:
        # A run of a case domain (its method's ``domain`` parameter names one with a grader of its own).
        params = (store.get_meta("method") or {}).get("params") or {}
        domain = DOMAINS.get(str(params.get("domain")))
        if domain is None or domain.grader is None:
            raise InputError(f"{run_dir}: not a run of --method mattrl --domain medicine or education")
        problems = {p.problem_id: p for p in store.iter_problems() if p.answer}
        items = [last_item(r, problems[r.problem_id]) for r in store.results() if r.problem_id in problems]
        # A teaching run's records keep the pre-test; a deliberation's do not.
        name = TEACHING if any(MATTRLState.model_validate(item.state).pre is not None for item in items) else DIAGNOSIS
        grades = Grades(runs=1, mode=name)
        context = GradingContext(store, GradeConfig(mode=name), judge, grades, index_grades(store.grades()))
        verdicts = await grader_named(name).grade(items, context)
    found = [grades.findings.get(item.key, {}) for item in items]
    if name == TEACHING:
        rows = [
            {
                "problem_id": item.problem.problem_id,
                "pre": f.get("pre"),
                "post": f.get("post"),
                "pre_correct": bool(f.get("pre_correct")),
                "post_correct": verdicts[item.key][0] is True,
            }
            for item, f in zip(items, found, strict=True)
        ]
        return CaseGrades(rows, {"cases": len(rows), **teaching_metrics(rows)})
    rows = [{"problem_id": item.problem.problem_id, **f} for item, f in zip(items, found, strict=True)]
    return CaseGrades(rows, {"cases": len(rows), **ranking_metrics([f.get("rank") for f in found])})


async def case_metrics(run_dir: Path, params: dict[str, Any], judge: Settings | None) -> dict[str, Any] | None:
    """The metrics a case domain declares (``Domain.metrics``) of a run of that domain (``domain`` in its method
    parameters), with ``cases``, their count; None for a run of any other domain, or with no graded case."""
    domain = DOMAINS.get(str(params.get("domain")))
    if domain is None or domain.grader is None:
        return None
    graded = await grade_cases(run_dir, judge)
    if not graded.rows:
        return None
    return {"cases": graded.metrics["cases"], **{key: graded.metrics[key] for key in domain.metrics}}


def last_item(result: ProblemResult, problem: Problem) -> Item:
    """A result's final answer as an item: its last record's selected answer, with that record's state."""
    last = result.last
    if last is None:
        return Item((problem.problem_id, 0, SELECTED), problem, None, "")
    selected = last.selected
    return Item((problem.problem_id, last.iteration, SELECTED), problem, selected, selected or "", last.state)
