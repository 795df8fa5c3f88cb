"""The report's budget table: each run's budget per problem beside what its problems spent, counted as the budget
counts (completion tokens, or prompt + completion with ``budget.count = "total"``; calls), so an equal-budget
comparison shows whether it was one. A token budget is kept to within one call's tokens (a call waits while the calls
in flight could spend what is left: ``ProblemSession._admit``); the table shows the most any problem went past it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from tmas.config import Budget
from tmas.reports.document import Document, Heading, Paragraph, Table
from tmas.store.records import BUDGET_STOP, ProblemResult


@dataclass
class BudgetSpend:
    """A run's budget and its finished problems' spend, as the budget counts it."""

    budget: Budget
    # Per finished problem: tokens as the budget counts them, and calls.
    tokens: list[int]
    calls: list[int]
    # Problems the budget stopped (``stopped_reason = "budget"``).
    stopped: int

    @property
    def limit(self) -> str:
        b = self.budget
        parts = []
        if b.tokens is not None:
            pooled = " (pooled)" if b.pool else ""
            parts.append(f"{b.tokens:,} {b.count} tokens{pooled}")
        if b.calls is not None:
            parts.append(f"{b.calls:,} calls")
        return ", ".join(parts) or "none"


def budget_spend(settings: Mapping[str, Any] | None, results: Sequence[ProblemResult]) -> BudgetSpend | None:
    """The budget of a run's stored ``settings`` and the spend of its finished ``results``; None without a budget."""
    try:
        budget = Budget.model_validate((settings or {}).get("budget") or {})
    except ValidationError:
        return None
    if not budget.limited:
        return None
    finished = [r for r in results if not r.in_progress]
    return BudgetSpend(
        budget,
        [budget.spent(r.usage) for r in finished],
        [r.calls for r in finished],
        sum(r.stopped_reason == BUDGET_STOP for r in finished),
    )


class BudgetRun(Protocol):
    """What the table reads of an evaluated run (tmas.reports.report.RunEvaluation has it)."""

    label: str
    budget: BudgetSpend | None


def budget_section(doc: Document, runs: Sequence[BudgetRun]) -> None:
    """The budget table of ``runs`` (one benchmark); nothing when no run had a budget."""
    rows = [_row(e.label, e.budget) for e in runs if e.budget is not None]
    if not rows:
        return
    doc.add(Heading(3, "Budget and spend per problem"))
    doc.add(
        Paragraph(
            "Each run's budget per problem beside what its finished problems spent, counted as the budget counts "
            "(completion tokens, or prompt + completion where the budget's count is total; calls). A problem stops "
            "at its first call once the budget is spent; a token budget is passed by one call's tokens at most."
        )
    )
    headers = ["Method", "Budget per problem", "Spent per problem (mean)", "Most a problem spent", "Stopped by it"]
    doc.add(Table(headers, rows))


def _row(label: str, spend: BudgetSpend) -> list[str]:
    figures = []
    if spend.budget.tokens is not None:
        figures.append((spend.tokens, "tokens"))
    if spend.budget.calls is not None:
        figures.append((spend.calls, "calls"))
    mean = ", ".join(f"{sum(v) / len(v):,.0f} {unit}" if v else "-" for v, unit in figures)
    most = ", ".join(f"{max(v):,} {unit}" if v else "-" for v, unit in figures)
    return [label, spend.limit, mean, most, f"{spend.stopped} of {len(spend.tokens)}"]
