"""The ``rules`` grader: Math-Verify alone (:mod:`tmas.answer_rules`, in worker processes), one verdict per item.

An item without an extracted final answer (:func:`has_answer`) is not checked: it is wrong, whatever its text says, in
every grader (the judge is never asked about it). Verdicts are stored as grader ``rules``, run 0.

:meth:`RulesGrader.grade_one` checks one item synchronously (RL's rewards): equal normalised spellings are right at
once (as in every rule check), otherwise Math-Verify decides, gold first. It is bounded in any thread
(:func:`tmas.answer_rules.check_pair_bounded`): a check past its time is undecided.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tmas.answer_rules import RuleChecker, asks_for_all, check_pair_bounded
from tmas.grading.grader import GradingContext, StoredGrades, Verdicts
from tmas.grading.grades import GradeConfig, Item
from tmas.store.run_store import GradeRow

RULES = "rules"
# The detail of the verdict on an item without an extracted final answer.
NO_ANSWER = "no extracted answer"
# Math-Verify's bound on one parse or comparison made by grade_one (the async grader's comes from its GradeConfig),
# and on the whole check where it runs off a main thread (several parses and comparisons).
RULE_TIMEOUT_S = 5
RULE_DEADLINE_S = 30.0


def has_answer(item: Item) -> bool:
    """Whether ``item`` holds a final answer to grade: a reply from which none was extracted (empty, an empty box, an
    echo of its prompt, a derivation that never concludes) is wrong, not read for one."""
    return item.answer is not None and bool(item.answer.strip())


class RulesGrader:
    name = RULES

    def __init__(self, timeout_s: int = RULE_TIMEOUT_S, deadline_s: float = RULE_DEADLINE_S) -> None:
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    def runs(self, config: GradeConfig) -> int:
        return 1

    async def grade(self, items: Sequence[Item], context: GradingContext) -> Verdicts:
        out: dict[tuple[str, int, int], bool | None] = {}
        todo: list[Item] = []
        for item in items:
            row = context.stored.get((item.key, RULES, 0))
            if row is not None and row.answer == item.answer:
                out[item.key] = row.verdict
            elif not has_answer(item):
                out[item.key] = False
                context.store.save_grades([GradeRow(*item.key, RULES, 0, item.answer, False, NO_ANSWER)])
            else:
                todo.append(item)
        if todo:
            config = context.config
            async with RuleChecker(workers=config.workers, timeout_s=config.rule_timeout_s) as checker:
                pairs = {_pair(i) for i in todo}
                checked = await asyncio.gather(*(checker.check(*pair) for pair in pairs))
                verdicts = dict(zip(pairs, checked, strict=True))
            rows = []
            for item in todo:
                verdict = verdicts[_pair(item)]
                out[item.key] = verdict.correct
                rows.append(GradeRow(*item.key, RULES, 0, item.answer, verdict.correct, verdict.detail))
            context.store.save_grades(rows)
        return {item.key: [out[item.key]] for item in items}

    def stored_runs(self, stored: StoredGrades) -> int:
        return 1

    def recall(self, items: Sequence[Item], stored: StoredGrades, runs: int) -> Verdicts:
        return {item.key: [rule_verdict(stored, item)] for item in items}

    def grade_one(self, item: Item) -> bool | None:
        if not has_answer(item):
            return False
        gold, answer, any_order = _pair(item)
        return check_pair_bounded(gold, answer, self.timeout_s, any_order, deadline_s=self.deadline_s).correct


def _pair(item: Item) -> tuple[str, str, bool]:
    """What the rules compare: the reference, the answer, and whether a listed reference is a set (the question asks
    for all of something) or its order is left to the judge."""
    return item.problem.answer or "", item.answer or "", asks_for_all(item.problem.question)


def rule_verdict(stored: StoredGrades, item: Item) -> bool | None:
    """The stored rules verdict of ``item`` (None when none is stored or the rules could not decide)."""
    row = stored.get((item.key, RULES, 0))
    return row.verdict if row is not None else None
