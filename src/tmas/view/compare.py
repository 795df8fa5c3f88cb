"""Runs side by side: each run's accuracy-vs-completion-tokens frontier and equal-budget row (``tmas.reports.frontier``,
the numbers ``tmas report`` shows), and a per-problem grid of who got which problem right at what cost.

Runs still going are compared on what they have finished so far: where a run's accuracy stands on fewer problems than
it holds labeled, its cells say on how many, and a note names the run and how far its problems got.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tmas.reports.frontier import BUDGETS, FrontierPoint, equal_budget
from tmas.view.cache import RunCache
from tmas.view.runs import ProblemRow, RunOverview, RunReader, RunRef


@dataclass
class ComparedRun:
    ref: RunRef
    overview: RunOverview
    points: list[FrontierPoint]
    # Per budget, the frontier's best point at or under it (None: the frontier never got that cheap).
    budget_row: list[FrontierPoint | None]
    rows: dict[str, ProblemRow]

    @property
    def label(self) -> str:
        return f"{self.ref.name} ({self.overview.method})"

    @property
    def solved(self) -> int:
        return sum(r.correct is True for r in self.rows.values())

    @property
    def graded(self) -> int:
        return sum(r.correct is not None for r in self.rows.values())

    @property
    def labeled(self) -> int:
        """Its problems with a reference answer: what its accuracies stand on once every problem has finished."""
        return self.overview.labeled

    def short(self, point: FrontierPoint) -> bool:
        """Whether ``point`` stands on fewer problems than the run holds labeled (some still mid-way, or never
        started): beside a finished run's, its accuracy is over other problems."""
        return point.problems < self.labeled

    @property
    def short_of_problems(self) -> bool:
        """Whether some of its frontier's points stand on fewer problems than it holds labeled, as ``tmas report``
        marks such a run where it shares its tables with others."""
        return any(self.short(p) for p in self.points)

    @property
    def tokens_per_problem(self) -> float:
        """Completion tokens per problem the run has started (with an iteration or a call: a pending one without a
        call spent nothing yet), as tmas report's cost table counts them."""
        started = [p for p in self.overview.problems if p.status != "pending" or p.calls]
        return sum(p.completion_tokens for p in started) / max(1, len(started))


@dataclass
class Comparison:
    runs: list[ComparedRun]
    budgets: list[int]
    # Problem ids in the first run's order, then any only later runs have.
    problem_ids: list[str]
    questions: dict[str, str]
    # Problems some runs lack: the runs were not made on the same problem set.
    not_shared: list[str] = field(default_factory=list)


def compare_runs(refs: list[RunRef], budgets: list[int] | None = None, cache: RunCache | None = None) -> Comparison:
    budgets = list(budgets or BUDGETS)
    runs: list[ComparedRun] = []
    problem_ids: list[str] = []
    questions: dict[str, str] = {}
    for ref in refs:
        with RunReader(ref, cache) as reader:
            overview = reader.overview()
        # The overview of an unchanged run is reused, and its frontier with it (MV@k over many samples is the
        # comparison's costliest part).
        points = overview.frontier
        rows = {row.problem_id: row for row in overview.problems}
        for row in overview.problems:
            if row.problem_id not in questions:
                problem_ids.append(row.problem_id)
                questions[row.problem_id] = row.question
        runs.append(ComparedRun(ref, overview, points, equal_budget(points, budgets), rows))
    not_shared = [pid for pid in problem_ids if any(pid not in run.rows for run in runs)]
    return Comparison(runs, budgets, problem_ids, questions, not_shared)


def parse_budgets(text: str | None) -> list[int] | None:
    """``?budgets=1000,4000``: the equal-budget table's columns (completion tokens per problem)."""
    if not text:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"budgets must be whole numbers of tokens separated by commas, not {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"budgets must be positive numbers of tokens, not {text!r}")
    return sorted(set(values))
