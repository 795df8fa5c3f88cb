"""Grades while a run is live: stored grades where ``tmas report`` wrote them, else an exact check by rules.

Stored grades are read with the grader and the number of judge runs of the run's last grading
(:func:`tmas.grading.runs.last_grading`), so the figures are those of the last report; those of a run graded before
gradings were recorded are read with the default grader (``combined``: the rules' verdicts, the judge's where the
rules could not decide).

The exact check decides what it can decide at once and nothing more: the same answer after the spelling
normalization majority vote uses, or two plain numbers (integers, decimals, scientific notation, fractions as ``a/b``
or ``\\frac{a}{b}``: those votes key by their value) compared as rationals; a reference of digits with leading
zeros ("017") only by its digits; a reference that reads both as a number in digit groups and as a list ("60,100")
as right against either reading, wrong against one other plain number ("60101") or a list of as many plain numbers
with other values than its items ("60, 101"), and undecided otherwise. Anything else (symbolic or textual answers)
is left undecided for ``tmas report`` (Math-Verify and the LLM judge). Like ``tmas.answer_rules``, a "wrong" is only
ever said between plain numbers; an iteration that returned no answer at all is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

from tmas.answer_classes import other_list, plain_number
from tmas.answer_rules import leading_zeros
from tmas.answers import last_boxed, list_reading, normalize_answer
from tmas.grading.grades import SELECTED, Grades, ItemKey
from tmas.grading.runs import current_grades, last_grading, load_last_grades
from tmas.problems import Problem
from tmas.store.records import ProblemResult
from tmas.store.run_store import GradeRow, RunStore

# The source of a verdict the viewer worked out itself (shown as "rules"; stored ones show their grading mode).
LIVE = "live"

# "x=5", "n = 12": a single variable named before the value.
_NAMED = re.compile(r"[A-Za-z]\w*=(.+)")


def exact_number(answer: str) -> Fraction | None:
    """The exact rational an answer spells, or None when it is not a plain number: what votes read as one
    (:func:`tmas.answer_classes.plain_number`), boxed or named ("n = 12") or not, in digit groups ("1,000") or not
    (:func:`tmas.answers.ungrouped`: "3, 125" is a list)."""
    text = _unboxed(answer)
    named = _NAMED.fullmatch(text)
    text = named.group(1) if named else text
    return plain_number(text)


def _unboxed(answer: str) -> str:
    """The normalized spelling of ``answer``, of what its box holds where it is boxed."""
    text = normalize_answer(answer)
    boxed = last_boxed(answer) if text.startswith("\\boxed") else None
    return normalize_answer(boxed) if boxed is not None else text


@lru_cache(maxsize=100_000)
def exact_verdict(reference: str, answer: str | None) -> bool | None:
    """Correct, wrong, or None (the exact rules cannot tell)."""
    if answer is None or not answer.strip():
        return False
    if normalize_answer(reference) == normalize_answer(answer):
        return True
    if leading_zeros(reference):  # a code or a grid's rows: only the same digits are that answer
        return None
    gold, pred = exact_number(reference), exact_number(answer)
    listed = list_reading(reference)
    if listed is not None:  # "60,100": the number 60100 or the list "60, 100"
        return _either_reading(gold, listed, pred, answer)
    if gold is None or pred is None:
        return None
    return gold == pred


def _either_reading(number: Fraction | None, listed: str, pred: Fraction | None, answer: str) -> bool | None:
    """The verdict on ``answer`` against a reference read both as ``number`` and as the list ``listed``: right where it
    is either; wrong where it is one other plain number (never a list of two or more), or a list of as many plain
    numbers whose set of values is not that of the list's items (never one number); else undecided."""
    if normalize_answer(listed) == normalize_answer(answer) or (pred is not None and pred == number):
        return True
    if pred is not None and number is not None:
        return False
    return False if other_list(_unboxed(answer), listed) else None


@dataclass
class LiveGrades:
    """Verdicts as metrics read them, and which of them the viewer worked out itself."""

    grades: Grades
    live: set[ItemKey] = field(default_factory=set)
    # The stored grades' mode ("rules", "combined", "judge"); None when the run has none.
    stored_mode: str | None = None
    # Whether the stored grades are read as the run's last grading recorded (else with the default grader).
    recorded: bool = False

    def source(self, key: ItemKey) -> str | None:
        if key not in self.grades.verdicts:
            return None
        return LIVE if key in self.live else self.stored_mode


# Per problem: the result record the verdicts were worked out from (the cache keeps an unchanged result as the same
# object) and those verdicts.
Memo = dict[str, tuple[ProblemResult, dict[ItemKey, list[bool | None]]]]


def live_grades(
    store: RunStore,
    problems: list[Problem],
    results: list[ProblemResult],
    memo: Memo | None = None,
    *,
    one_problem: bool = False,
) -> LiveGrades | None:
    """Stored verdicts where graded, exact-rule verdicts elsewhere; None when no problem has a reference answer.

    With ``memo`` (kept by the caller between calls), an unchanged result's verdicts are not worked out again. With
    ``one_problem`` (``problems`` and ``results`` hold one problem's: its page), only that problem's stored grades are
    read, and read as the whole run's are."""
    if not any(p.answer is not None for p in problems):
        return None
    if one_problem:
        rows = store.grades(problem_id=problems[0].problem_id)
        heads: list[GradeRow] | None = store.grade_last_runs()
        graded_run = bool(heads)
    else:
        rows, heads = store.grades(), None
        graded_run = bool(rows)
    recorded = graded_run and last_grading(store) is not None
    stored = load_last_grades(store, results=results, rows=rows, problems=problems, heads=heads) if graded_run else None
    # Grades of answers since replaced do not count: those items are checked live, as tmas report grades them anew.
    graded = {(g.problem_id, g.iteration, g.candidate) for g in current_grades(rows, results)}
    grades = stored or Grades(runs=1, mode="rules")
    if stored is None:
        result_ids = {r.problem_id for r in results}
        grades.unlabeled = [p.problem_id for p in problems if p.answer is None and p.problem_id in result_ids]
    out = LiveGrades(grades, stored_mode=stored.mode if stored else None, recorded=recorded)
    references = {p.problem_id: p.answer for p in problems if p.answer is not None}
    for result in results:
        pid = result.problem_id
        reference = references.get(pid)
        if reference is None:
            continue
        hit = memo.get(pid) if memo is not None and not graded else None
        if hit is not None and hit[0] is result:
            verdicts = hit[1]
        else:
            verdicts = _exact_verdicts(result, reference, graded, grades.runs)
            if memo is not None and not graded:
                memo[pid] = (result, verdicts)
        grades.verdicts.update(verdicts)
        out.live.update(verdicts)
    return out


def _exact_verdicts(
    result: ProblemResult, reference: str, graded: set[ItemKey], runs: int
) -> dict[ItemKey, list[bool | None]]:
    """The exact rules' verdict on every item of tmas.grading.grades.iter_items (each candidate and each iteration's
    selected answer) that has no stored grade; walked without building an Item each: big runs have 100,000."""
    pid = result.problem_id
    out: dict[ItemKey, list[bool | None]] = {}
    for record in result.iterations:
        it = record.iteration
        pairs = [((pid, it, c.index), c.answer) for c in record.candidates]
        pairs.append(((pid, it, SELECTED), record.selected))
        for key, given in pairs:
            if key not in graded:
                out[key] = [exact_verdict(reference, given)] * runs
    return out
