"""The accuracy of every selection rule on a run's stored candidates: what each rule would have returned, beside what
the run's own rule did return.

For each rule x pool (methods/selection.py) and each iteration t: per problem, the pick's grade is its accuracy. The
run's own rule (``own``: a method whose answer follows ``select`` and ``select_from``) is never chosen again: its
row reads the candidate the run chose after each iteration, stored with the iteration's record
(``IterationRecord.selection``), or in a record stored before selections were kept, the answer the run returned then
(``selected``, graded as the report grades it). Every other row replays its rule on the stored candidates and scores:
the rule picks from the solutions the trajectories hold at iteration t (pool ``last``: its candidates, an earlier
solution in place of an answerless refinement that carried it, and for a trajectory whose call a budget stop refused
there its solution of the iteration before, ``IterationRecord.held_over``, as the run voted) or from the candidates of
iterations 0..t (pool ``all``). Problems are counted as in metrics.py (a stopped one keeps its last iteration; one
still mid-way only up to where it got). Answers are grouped by value with ``classes`` (per problem, as the run's
votes grouped them), and with ``fallback`` an iteration whose pool has no answer takes the earlier answer, as the run
did (``answer_fallback``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tmas.grading.grades import SELECTED, Grades
from tmas.methods.selection import SELECT_FROM, SELECT_RULES, SelectFrom, SelectRule, select_answered
from tmas.reports.metrics import labeled_results, last_iteration, reached, record_at
from tmas.store.records import ProblemResult

Rule = tuple[SelectRule, SelectFrom]


@dataclass
class SelectionTable:
    iterations: list[int] = field(default_factory=list)
    # (rule, candidates it selects from) -> accuracy per iteration in ``iterations``.
    accuracy: dict[Rule, list[float]] = field(default_factory=dict)
    problems: list[int] = field(default_factory=list)
    # The run's own rule, whose row is read from what the run chose (None: every row is a replay).
    own: Rule | None = None


def has_scores(results: list[ProblemResult]) -> bool:
    return any(c.score is not None for r in results for rec in r.iterations for c in rec.candidates)


def chosen_accuracy(result: ProblemResult, t: int, grades: Grades) -> float:
    """The grade of what the run returned after iteration ``t`` (its last earlier one where it stopped): the stored
    selection's candidate, else the stored answer; 0 for a problem with no iteration."""
    record = record_at(result, t)
    if record is None:
        return 0.0
    chosen = record.selection
    if chosen is not None:
        return grades.share_correct((result.problem_id, chosen.iteration, chosen.candidate))
    return grades.share_correct((result.problem_id, record.iteration, SELECTED))


def selection_table(
    results: list[ProblemResult],
    grades: Grades,
    mode: str,
    *,
    classes: Mapping[str, Mapping[str, str]] | None = None,
    fallback: bool = False,
    own: Rule | None = None,
) -> SelectionTable:
    labeled = labeled_results(results, grades)
    table = SelectionTable(iterations=list(range(last_iteration(labeled) + 1)), own=own)
    for t in table.iterations:
        present = [r for r in labeled if reached(r, t)]
        table.problems.append(len(present))
        for rule in SELECT_RULES:
            for select_from in SELECT_FROM:
                if (rule, select_from) == own:
                    hits = sum(chosen_accuracy(result, t, grades) for result in present)
                else:
                    hits = sum(
                        _replayed(result, t, grades, mode, rule, select_from, classes, fallback) for result in present
                    )
                table.accuracy.setdefault((rule, select_from), []).append(hits / max(1, len(present)))
    return table


def _replayed(
    result: ProblemResult,
    t: int,
    grades: Grades,
    mode: str,
    rule: SelectRule,
    select_from: SelectFrom,
    classes: Mapping[str, Mapping[str, str]] | None,
    fallback: bool,
) -> float:
    """The grade of the candidate ``rule`` picks from ``select_from`` of the problem's iterations up to ``t``."""
    seen = [record for record in result.iterations if record.iteration <= t]
    own = (classes or {}).get(result.problem_id)
    # A trajectory a budget stop refused votes with the solution it held before, as the run counted it.
    refused = [r.held_over for r in seen]
    iterations = [r.candidates for r in seen]
    chosen, _ = select_answered(iterations, select_from, mode, rule, own, fallback=fallback, held_over=refused)
    if chosen is None:
        return 0.0
    origin = next(r.iteration for r in seen if any(c is chosen for c in r.candidates))
    return grades.share_correct((result.problem_id, origin, chosen.index))
