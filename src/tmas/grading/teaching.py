"""The education domain's grading (paper 003, C.1): pre-test and post-test accuracy and the learning gain.

The method checks the student's pre- and post-test letters against the reference while it runs and keeps both
verdicts in the record's state. The ``teaching`` grader reads them: an item's verdict is the post-test's (wrong
until the teaching is done), and both answers and the pre-test's verdict are kept in ``Grades.findings``. Nothing is
stored in the grades table: the run's records hold them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tmas.grading.grader import GradingContext, StoredGrades, Verdicts
from tmas.grading.grades import GradeConfig, Item
from tmas.methods.state import MATTRLState

TEACHING = "teaching"


def teaching_metrics(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Acc_pre and Acc_post = shares of cases answered right before and after teaching; delta = Acc_post - Acc_pre."""
    n = len(rows)
    pre = sum(bool(r["pre_correct"]) for r in rows) / n if n else 0.0
    post = sum(bool(r["post_correct"]) for r in rows) / n if n else 0.0
    return {"acc_pre": pre, "acc_post": post, "delta": post - pre}


class TeachingGrader:
    name = TEACHING

    def runs(self, config: GradeConfig) -> int:
        return 1

    async def grade(self, items: Sequence[Item], context: GradingContext) -> Verdicts:
        for item in items:
            state = _teaching_state(item.state)
            if state is not None:
                found = {"pre": state.pre, "post": state.post, "pre_correct": bool(state.pre_correct)}
                context.grades.findings[item.key] = found
        return self.recall(items, context.stored, 1)

    def stored_runs(self, stored: StoredGrades) -> int:
        return 1  # the records' states hold the verdicts

    def recall(self, items: Sequence[Item], stored: StoredGrades, runs: int) -> Verdicts:
        return {item.key: [self.grade_one(item)] for item in items}

    def grade_one(self, item: Item) -> bool | None:
        """The post-test's verdict; None for a record of another domain."""
        state = _teaching_state(item.state)
        return bool(state.post_correct) if state is not None else None


def _teaching_state(state: Mapping[str, Any]) -> MATTRLState | None:
    """A record's state read as MATTRL's (methods/state.py) when it holds a teaching pre-test; else None."""
    return MATTRLState.model_validate(dict(state)) if "pre" in state else None
