"""Grading a run's candidates against reference answers with a registered grader; grades are stored in the run and
reused.

Stored rows (table ``grades``): grader ``rules`` (run 0) and grader ``judge`` (runs 0..R-1), as the shipped graders
write them. Candidate index -1 stands for the iteration's selected answer. Each grading also records which grader it
used and how many runs per item (meta ``grading``, :class:`GradingRecord`): a run graded more than one way holds the
rows of each, and a reader of stored grades (the viewer) reads them as the last grading did.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from tmas.config import Settings
from tmas.grading.grader import GradingContext, index_grades
from tmas.grading.grades import SELECTED, GradeConfig, Grades, ItemKey, iter_items
from tmas.grading.registry import DEFAULT_GRADER, GRADERS, grader_named
from tmas.grading.run_results import load_results
from tmas.llm.model import ChatModel
from tmas.problems import Problem
from tmas.store.records import ProblemResult
from tmas.store.run_store import GradeRow, RunStore

# The run's meta key of its last grading.
GRADING_META = "grading"


class GradingRecord(BaseModel):
    """The grading last done on a run: the grader's name and its verdicts per item (the judge's runs)."""

    mode: str
    runs: int


def last_grading(store: RunStore) -> GradingRecord | None:
    """The grading last done on the run in ``store``; None where none was recorded (grades stored before gradings
    were recorded), or it names a grader not installed here."""
    try:
        record = GradingRecord.model_validate(store.get_meta(GRADING_META))
    except ValidationError:
        return None
    return record if record.mode in GRADERS and record.runs > 0 else None


async def grade_run(
    store: RunStore,
    config: GradeConfig,
    settings: Settings | None = None,
    *,
    regrade: bool = False,
    model: ChatModel | None = None,
) -> Grades:
    """Grade the run in ``store`` (reusing stored grades unless ``regrade``) and return all verdicts. A judge asks
    the ``judge`` role of ``settings``' endpoint, or ``model``, a judge model of the caller's own."""
    grader = grader_named(config.mode)
    problems = store.problems()
    results = load_results(store)
    items = list(iter_items(problems, results))
    grades = Grades(runs=grader.runs(config), mode=config.mode)
    result_ids = {r.problem_id for r in results}
    grades.unlabeled = [p.problem_id for p in problems if p.answer is None and p.problem_id in result_ids]
    if regrade:
        store.delete_grades()
    context = GradingContext(store, config, settings, grades, index_grades(store.grades()), model)
    grades.verdicts = await grader.grade(items, context)
    store.set_meta(GRADING_META, GradingRecord(mode=config.mode, runs=grades.runs).model_dump())
    return grades


def current_grades(rows: list[GradeRow], results: list[ProblemResult]) -> list[GradeRow]:
    """The stored grades of the answers the run holds now. A problem solved again (a run resumed with other
    parameters: ``k`` raised, its majority turned) may hold another answer where one was graded; that grade is not
    this answer's, and grading asks anew of such an item (each grader reuses a row only for the same answer)."""
    if not rows:
        return rows
    answers: dict[ItemKey, str | None] = {}
    for result in results:
        pid = result.problem_id
        for record in result.iterations:
            answers.update(((pid, record.iteration, c.index), c.answer) for c in record.candidates)
            answers[(pid, record.iteration, SELECTED)] = record.selected
    missing = object()
    return [g for g in rows if answers.get((g.problem_id, g.iteration, g.candidate), missing) == g.answer]


def load_last_grades(
    store: RunStore,
    *,
    results: list[ProblemResult] | None = None,
    rows: list[GradeRow] | None = None,
    problems: list[Problem] | None = None,
    heads: list[GradeRow] | None = None,
) -> Grades | None:
    """Stored grades read as the run's last grading read them: its grader, as many of the judge's runs per item as it
    asked for. A run whose grading was not recorded is read with the default grader and every stored run. The
    arguments after ``store``: as :func:`load_grades` takes them."""
    last = last_grading(store)
    config = GradeConfig(mode=last.mode) if last is not None else GradeConfig()
    runs = last.runs if last is not None else None
    return load_grades(store, config, results=results, rows=rows, runs=runs, problems=problems, heads=heads)


def load_grades(
    store: RunStore,
    config: GradeConfig,
    *,
    results: list[ProblemResult] | None = None,
    rows: list[GradeRow] | None = None,
    runs: int | None = None,
    problems: list[Problem] | None = None,
    heads: list[GradeRow] | None = None,
) -> Grades | None:
    """Verdicts from stored grades alone (no grading), of the answers the run holds now (:func:`current_grades`);
    None when the run has no grades. A run holding none of the asked grader's verdicts is read as graded by the
    rules. ``results`` and ``rows``: the run's results and grade rows where the caller has read them already (a big
    run's results are its costliest read). ``runs``: how many of the asked grader's stored runs per item to read (as
    many as a grading asked for); all of them by default. ``problems``, with ``results`` and ``rows`` of those
    problems alone: read only them (a problem's page), ``heads`` then being the run's rows that say how many runs
    each grader stored (:meth:`RunStore.grade_last_runs`), so that they are read as the whole run's are."""
    problems = store.problems() if problems is None else problems
    results = load_results(store) if results is None else results
    items = list(iter_items(problems, results))
    rows = store.grades() if rows is None else rows
    if not rows and not heads:
        return None
    # The grader and its runs as the run's grades are stored; the verdicts of the answers it holds now.
    every = index_grades(rows if heads is None else heads)
    stored = index_grades(current_grades(rows, results))
    mode = config.mode
    grader = grader_named(mode)
    stored_runs = grader.stored_runs(every)
    if stored_runs:
        runs = min(runs, stored_runs) if runs else stored_runs
    else:
        mode = DEFAULT_GRADER
        grader = grader_named(mode)
        runs = grader.stored_runs(every)
    grades = Grades(runs=runs, mode=mode)
    result_ids = {r.problem_id for r in results}
    grades.unlabeled = [p.problem_id for p in problems if p.answer is None and p.problem_id in result_ids]
    grades.verdicts = grader.recall(items, stored, runs)
    held = {key for key, _, _ in stored}
    grades.not_graded = {
        key for key, verdicts in grades.verdicts.items() if key not in held and all(v is None for v in verdicts)
    }
    return grades
