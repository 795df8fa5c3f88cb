"""Grading a run's candidates against reference answers; grades are stored in the run and reused.

Modes:
- ``rules``: Math-Verify only (undecided counts as incorrect).
- ``judge``: the paper's LLM-as-judge, R independent runs (paper: 4) on the ``judge`` role's endpoint.
- ``combined``: rules first; the judge only where the rules cannot decide.

Stored rows (table ``grades``): grader ``rules`` (run 0) and grader ``judge`` (runs 0..R-1). The verdict of judge
run r for a candidate is then: the rules' verdict where decided (combined mode), else judge run r's verdict.
Candidate index -1 stands for the iteration's selected answer.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from tmas.answer_rules import RuleChecker
from tmas.config import Settings
from tmas.grading.judge import judge_once
from tmas.grading.run_results import load_results
from tmas.llm.client import LLMClient
from tmas.llm.types import Usage
from tmas.problems import Problem
from tmas.store.run_store import GradeRow, RunStore

GradeMode = Literal["rules", "judge", "combined"]
SELECTED = -1
# Items are keyed by (problem_id, iteration, candidate index).
ItemKey = tuple[str, int, int]


@dataclass(frozen=True)
class GradeConfig:
    mode: GradeMode = "combined"
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

    def undecided(self) -> int:
        return sum(v is None for verdicts in self.verdicts.values() for v in verdicts)


def iter_items(problems: list[Problem], results: list[dict[str, Any]]) -> Iterator[Item]:
    """Every gradable candidate (and selected answer) of every iteration of labeled problems."""
    by_id = {p.problem_id: p for p in problems}
    for result in results:
        problem = by_id.get(result["problem_id"])
        if problem is None or problem.answer is None:
            continue
        for record in result.get("iterations", []):
            iteration = int(record["iteration"])
            for cand in record.get("candidates", []):
                key = (problem.problem_id, iteration, int(cand["index"]))
                yield Item(key, problem, cand.get("answer"), cand.get("text") or "")
            selected = record.get("selected")
            yield Item((problem.problem_id, iteration, SELECTED), problem, selected, selected or "")


async def grade_run(
    store: RunStore,
    config: GradeConfig,
    settings: Settings | None = None,
    *,
    regrade: bool = False,
) -> Grades:
    """Grade the run in ``store`` (reusing stored grades unless ``regrade``) and return all verdicts."""
    problems = store.problems()
    results = load_results(store)
    items = list(iter_items(problems, results))
    grades = Grades(runs=config.judge_runs if config.mode != "rules" else 1, mode=config.mode)
    result_ids = {r["problem_id"] for r in results}
    grades.unlabeled = [p.problem_id for p in problems if p.answer is None and p.problem_id in result_ids]
    if regrade:
        store.delete_grades()
    stored: dict[tuple[ItemKey, str, int], GradeRow] = {
        ((g.problem_id, g.iteration, g.candidate), g.grader, g.run): g for g in store.grades()
    }

    rules: dict[ItemKey, bool | None] = {}
    if config.mode in ("rules", "combined"):
        rules = await _grade_rules(store, items, stored, config)
    need_judge = [i for i in items if config.mode == "judge" or rules.get(i.key) is None]
    judged: dict[tuple[ItemKey, int], bool | None] = {}
    if config.mode != "rules" and need_judge:
        if settings is None or settings.uses_local_model:
            grades.notes.append(
                f"no judge endpoint configured: {len(need_judge)} answers the rules could not decide stay undecided"
            )
        else:
            judged = await _grade_judge(store, need_judge, stored, config, settings, grades)

    for item in items:
        if config.mode == "rules":
            grades.verdicts[item.key] = [rules.get(item.key)]
        elif rules.get(item.key) is not None:
            grades.verdicts[item.key] = [rules[item.key]] * grades.runs
        else:
            grades.verdicts[item.key] = [judged.get((item.key, r)) for r in range(grades.runs)]
    return grades


def _no_answer(item: Item) -> bool:
    return item.answer is None and not item.text.strip()


async def _grade_rules(
    store: RunStore,
    items: list[Item],
    stored: dict[tuple[ItemKey, str, int], GradeRow],
    config: GradeConfig,
) -> dict[ItemKey, bool | None]:
    out: dict[ItemKey, bool | None] = {}
    todo: list[Item] = []
    for item in items:
        row = stored.get((item.key, "rules", 0))
        if row is not None and row.answer == item.answer:
            out[item.key] = row.verdict
        elif item.answer is None:
            # No extracted answer: nothing for the rules to compare (the judge may still read the text).
            out[item.key] = False if _no_answer(item) else None
            todo_row = GradeRow(*item.key, "rules", 0, None, out[item.key], "no extracted answer")
            store.save_grades([todo_row])
        else:
            todo.append(item)
    if not todo:
        return out
    async with RuleChecker(workers=config.workers, timeout_s=config.rule_timeout_s) as checker:
        pairs = {(i.problem.answer or "", i.answer or "") for i in todo}
        verdicts = dict(zip(pairs, await asyncio.gather(*(checker.check(g, p) for g, p in pairs)), strict=True))
    rows = []
    for item in todo:
        verdict = verdicts[(item.problem.answer or "", item.answer or "")]
        out[item.key] = verdict.correct
        rows.append(GradeRow(*item.key, "rules", 0, item.answer, verdict.correct, verdict.detail))
    store.save_grades(rows)
    return out


async def _grade_judge(
    store: RunStore,
    items: list[Item],
    stored: dict[tuple[ItemKey, str, int], GradeRow],
    config: GradeConfig,
    settings: Settings,
    grades: Grades,
) -> dict[tuple[ItemKey, int], bool | None]:
    out: dict[tuple[ItemKey, int], bool | None] = {}
    # Identical (problem, student answer) pairs are judged once per run and the verdict shared.
    groups: dict[tuple[str, str, int], list[Item]] = defaultdict(list)
    for item in items:
        student = item.answer if item.answer is not None else item.text
        for run in range(config.judge_runs):
            row = stored.get((item.key, "judge", run))
            if row is not None and row.answer == item.answer:
                out[(item.key, run)] = row.verdict
            else:
                groups[(item.problem.problem_id, student, run)].append(item)
    if not groups:
        return out
    gate = asyncio.Semaphore(config.judge_concurrency)
    async with LLMClient(settings, store) as llm:

        async def one(pid: str, student: str, run: int, members: list[Item]) -> None:
            problem = members[0].problem
            async with gate:
                verdict = await judge_once(
                    llm,
                    problem_id=pid,
                    problem=problem.question,
                    reference=problem.answer or "",
                    student=student,
                    run=run,
                    retries=config.judge_retries,
                )
            grades.judge_calls += verdict.attempts
            grades.judge_usage = grades.judge_usage + verdict.usage
            rows = [GradeRow(*m.key, "judge", run, m.answer, verdict.correct, verdict.detail) for m in members]
            for m in members:
                out[(m.key, run)] = verdict.correct
            store.save_grades(rows)

        await asyncio.gather(*(one(pid, s, r, members) for (pid, s, r), members in groups.items()))
    return out


def load_grades(store: RunStore, config: GradeConfig) -> Grades | None:
    """Verdicts from stored grades alone (no grading); None when the run has no grades for this mode."""
    problems = store.problems()
    results = load_results(store)
    items = list(iter_items(problems, results))
    rows = store.grades()
    if not rows:
        return None
    by_key: dict[tuple[ItemKey, str, int], GradeRow] = {
        ((g.problem_id, g.iteration, g.candidate), g.grader, g.run): g for g in rows
    }
    runs = max([g.run for g in rows if g.grader == "judge"], default=-1) + 1
    mode = config.mode if runs else "rules"
    grades = Grades(runs=max(1, runs) if mode != "rules" else 1, mode=mode)
    result_ids = {r["problem_id"] for r in results}
    grades.unlabeled = [p.problem_id for p in problems if p.answer is None and p.problem_id in result_ids]
    for item in items:
        rule = by_key.get((item.key, "rules", 0))
        rule_verdict = rule.verdict if rule is not None else None
        if mode == "rules":
            grades.verdicts[item.key] = [rule_verdict]
        elif rule_verdict is not None and mode == "combined":
            grades.verdicts[item.key] = [rule_verdict] * grades.runs
        else:
            grades.verdicts[item.key] = [
                (row.verdict if (row := by_key.get((item.key, "judge", r))) is not None else None)
                for r in range(grades.runs)
            ]
    return grades
