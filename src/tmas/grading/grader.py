"""The seam every way of grading a run's answers implements (:class:`Grader`), and what a grader is handed.

A grader keeps its verdicts in the run's store (table ``grades``, rows named after the grader that decided them), so
a second grading reuses them and :func:`tmas.grading.runs.load_grades` reads them back without grading. A new
grader is one module implementing :class:`Grader`, listed in :mod:`tmas.grading.registry`; ``tmas eval --grade NAME``
and a pool's ``grade_mode = "NAME"`` then use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from tmas.config import Settings
from tmas.grading.grades import GradeConfig, Grades, Item, ItemKey
from tmas.llm.factory import open_model
from tmas.llm.model import ChatModel
from tmas.store.run_store import GradeRow, RunStore

# A run's stored verdicts by (item, grader name, judge run).
StoredGrades = dict[tuple[ItemKey, str, int], GradeRow]
# An item's verdicts, one per run of the grader.
Verdicts = dict[ItemKey, list[bool | None]]


def index_grades(rows: Sequence[GradeRow]) -> StoredGrades:
    return {((g.problem_id, g.iteration, g.candidate), g.grader, g.run): g for g in rows}


@dataclass
class GradingContext:
    """The run being graded: its store (for stored verdicts and new ones), the configuration, the settings of the
    ``judge`` role's endpoint (None: no judge), the grades under way (for notes and the judge's usage), and a judge
    ``model`` of the caller's own, used instead of the endpoint (its own settings where none are given)."""

    store: RunStore
    config: GradeConfig
    settings: Settings | None
    grades: Grades
    stored: StoredGrades
    model: ChatModel | None = None

    @property
    def judge_settings(self) -> Settings | None:
        """What the judge role resolves against: the settings given, else the judge model's; None: no judge."""
        if self.settings is None and self.model is not None:
            return self.model.settings
        return self.settings

    def open_judge(self, settings: Settings) -> AbstractAsyncContextManager[ChatModel]:
        """The judge model on ``settings``, its calls asked once and replayed afterwards from the run's store."""
        return open_model(settings, self.store, log_dir=self.store.run_dir, model=self.model)


class Grader(Protocol):
    """One way of deciding which answers are right, registered under ``name``."""

    @property
    def name(self) -> str: ...

    def runs(self, config: GradeConfig) -> int:
        """Verdicts per item when grading with ``config`` (the judge's R independent runs; 1 for the rules)."""
        ...

    async def grade(self, items: Sequence[Item], context: GradingContext) -> Verdicts:
        """A verdict list for every item, reusing the verdicts the store holds for the same answer."""
        ...

    def stored_runs(self, stored: StoredGrades) -> int:
        """Verdicts per item the store holds for this grader (0: none)."""
        ...

    def recall(self, items: Sequence[Item], stored: StoredGrades, runs: int) -> Verdicts:
        """The stored verdicts alone (no grading), ``runs`` per item; None where none is stored."""
        ...

    def grade_one(self, item: Item) -> bool | None:
        """One item at once, synchronously, with no model and no store (an RL trainer's reward threads); None where
        this grader cannot decide that way."""
        ...
