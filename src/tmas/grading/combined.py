"""The ``combined`` grader (the default): the rules first, the judge only where the rules cannot decide.

An item the rules decide has that verdict in every judge run; the others have the judge's R verdicts. Nothing is
stored under ``combined``: the rows are the rules' and the judge's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from tmas.grading.grader import GradingContext, StoredGrades, Verdicts
from tmas.grading.grades import GradeConfig, Item
from tmas.grading.judge import JudgeGrader
from tmas.grading.rules import RulesGrader, rule_verdict


class CombinedGrader:
    name = "combined"

    def __init__(self) -> None:
        self._rules = RulesGrader()
        self._judge = JudgeGrader()

    def runs(self, config: GradeConfig) -> int:
        return self._judge.runs(config)

    async def grade(self, items: Sequence[Item], context: GradingContext) -> Verdicts:
        rules = await self._rules.grade(items, context)
        undecided = [item for item in items if rules[item.key][0] is None]
        context.grades.judged = len({(item.key[0], item.answer) for item in undecided})
        judged = await self._judge.grade(undecided, context) if undecided else {}
        runs = self.runs(context.config)
        return {item.key: judged[item.key] if item.key in judged else rules[item.key] * runs for item in items}

    def stored_runs(self, stored: StoredGrades) -> int:
        return self._judge.stored_runs(stored)

    def recall(self, items: Sequence[Item], stored: StoredGrades, runs: int) -> Verdicts:
        judged = self._judge.recall(items, stored, runs)
        return {
            item.key: [verdict] * runs if (verdict := rule_verdict(stored, item)) is not None else judged[item.key]
            for item in items
        }

    def grade_one(self, item: Item) -> bool | None:
        return self._rules.grade_one(item)  # the judge is never asked synchronously
