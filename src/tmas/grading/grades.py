"""What grading works on and gives: a run's gradable items, the grading configuration, and the verdicts.

An item is one candidate (or, at candidate index -1, the iteration's selected answer) of one iteration of a problem
with a reference answer. A grader (:mod:`tmas.grading.grader`) gives each item one verdict per run: ``True``,
``False`` or ``None`` (undecided, counted incorrect), and may keep what it found besides (``Grades.findings``: the
medicine domain's rank of the reference diagnosis, the education domain's pre-test verdict).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tmas.llm.types import Usage
from tmas.problems import Problem
from tmas.store.records import ProblemResult

SELECTED = -1
# The graders whose runs the grading's description tells apart (tmas.grading.rules.RULES, tmas.grading.combined).
_RULES = "rules"
_COMBINED = "combined"
# Items are keyed by (problem_id, iteration, candidate index).
ItemKey = tuple[str, int, int]


@dataclass(frozen=True)
class GradeConfig:
    # A registered grader's name (tmas.grading.registry): rules, judge or combined as shipped.
    mode: str = "combined"
    judge_runs: int = 4
    judge_retries: int = 2
    rule_timeout_s: int = 5
    workers: int = 2
    # Most judge pairs in flight at once (the client's own concurrency cap applies as well).
    judge_concurrency: int = 16


@dataclass(frozen=True)
class Item:
    key: ItemKey
    problem: Problem
    answer: str | None
    text: str
    # The iteration record's state: what the method kept beside its answer (a domain grader reads it through the
    # method's declared State).
    state: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class Grades:
    """Verdicts per item and judge run, as metrics consume them."""

    runs: int
    verdicts: dict[ItemKey, list[bool | None]] = field(default_factory=dict)
    # Problems without a reference answer: solved, not graded.
    unlabeled: list[str] = field(default_factory=list)
    mode: str = "combined"
    notes: list[str] = field(default_factory=list)
    judge_usage: Usage = field(default_factory=Usage)
    judge_calls: int = 0
    # What a grader found besides right/wrong, by item (diagnosis: ``rank``; teaching: ``pre`` and
    # ``pre_correct``): the domain metrics are computed from these and the verdicts.
    findings: dict[ItemKey, dict[str, Any]] = field(default_factory=dict)
    # Items read from stored grades that hold none for their answer (finished, or solved anew, after the run's last
    # grading): no verdict at all, counted incorrect as an undecided one is, but not undecided.
    not_graded: set[ItemKey] = field(default_factory=set)
    # How many distinct answers (of a problem) the combined grader left to the judge, the rules undecided on them,
    # where it graded now; None where not known (grades read back from the store) or not combined.
    judged: int | None = None

    def correct(self, key: ItemKey, run: int) -> bool:
        """Undecided counts as incorrect: a reply nobody could confirm is not credited."""
        verdicts = self.verdicts.get(key)
        return bool(verdicts and verdicts[run] is True)

    def share_correct(self, key: ItemKey) -> float:
        """The share of judge runs that call the item correct."""
        return sum(self.correct(key, r) for r in range(self.runs)) / self.runs

    def majority_correct(self, key: ItemKey) -> bool:
        """Correct when at least half of the judge runs say so (a candidate's one label across runs)."""
        verdicts = self.verdicts.get(key) or []
        return bool(verdicts) and sum(v is True for v in verdicts) * 2 >= len(verdicts)

    def described(self) -> str:
        """How these verdicts were given, as a report or a filter card says it: the rules alone ask no judge; the
        combined grader, where it graded now, says how many answers it asked the judge about."""
        if self.mode == _RULES:
            return "rules only, no judge"
        runs = f"{self.runs} judge run{'' if self.runs == 1 else 's'}"
        if self.mode == _COMBINED and self.judged == 0:
            return f"combined, the rules decided every answer: no judge asked ({runs} configured)"
        if self.mode == _COMBINED and self.judged is not None:
            answers = f"{self.judged} distinct answer{'' if self.judged == 1 else 's'}"
            return f"combined, {runs} on {answers} the rules left undecided"
        return f"{self.mode}, {runs}"

    def undecided(self) -> int:
        """Verdicts a grader gave as undecided (an item never graded, ``not_graded``, is none of them)."""
        return sum(v is None for key, verdicts in self.verdicts.items() if key not in self.not_graded for v in verdicts)


def iter_items(problems: list[Problem], results: list[ProblemResult]) -> Iterator[Item]:
    """Every gradable candidate (and selected answer) of every iteration of labeled problems."""
    by_id = {p.problem_id: p for p in problems}
    for result in results:
        problem = by_id.get(result.problem_id)
        if problem is None or problem.answer is None:
            continue
        for record in result.iterations:
            iteration = record.iteration
            for cand in record.candidates:
                key = (problem.problem_id, iteration, cand.index)
                yield Item(key, problem, cand.answer, cand.text, record.state)
            selected = record.selected
            yield Item((problem.problem_id, iteration, SELECTED), problem, selected, selected or "", record.state)
