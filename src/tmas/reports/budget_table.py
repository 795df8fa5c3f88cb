"""The report's budget table: each run's budget per problem beside what its problems spent, counted as the budget
counts (completion tokens, or prompt + completion with ``budget.count = "total"``; calls), so an equal-budget
comparison shows whether it was one. A token budget is kept to within one call's tokens (a call waits while the calls
in flight could spend what is left: ``ProblemSession._admit``); the table shows the most any problem went past it, and
how many problems ended under the budget without being stopped by it (their method ran out of iterations or stopped by
its own rule first), with the share of the budget they spent: such a run was not at the budget it is labelled with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from tmas.config import Budget
from tmas.reports.document import Document, Heading, Paragraph, Table
from tmas.reports.metrics import Spend, spent_through
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
    # Per problem that ended done without the budget stopping it: its spend as a share of the budget (tokens where
    # the budget has a token limit, else calls).
    under: list[float]

    @property
    def limit(self) -> str:
        b = self.budget
        parts = []
        if b.tokens is not None:
            pooled = " (pooled)" if b.pool else ""
            parts.append(f"{b.tokens:,} {self.counted}{pooled}")
        if b.calls is not None:
            parts.append(f"{b.calls:,} calls")
        return ", ".join(parts) or "none"

    @property
    def counted(self) -> str:
        """The tokens the budget counts, as its figures name them."""
        return "prompt + completion tokens" if self.budget.count == "total" else "completion tokens"


def budget_spend(
    settings: Mapping[str, Any] | None,
    results: Sequence[ProblemResult],
    spend: Spend | None = None,
    asked_again: Mapping[str, int] | None = None,
) -> BudgetSpend | None:
    """The budget of a run's stored ``settings`` and the spend of its finished ``results`` (their stored calls'
    with ``spend``, as the frontier counts it: metrics.spent_through); None without a budget. Their calls as a call
    budget counts them: less each problem's calls that failed and were ``asked_again`` on resume (the new call counts
    in their place: ``ProblemSession._spent_before``)."""
    try:
        budget = Budget.model_validate((settings or {}).get("budget") or {})
    except ValidationError:
        return None
    if not budget.limited:
        return None
    finished = [r for r in results if not r.in_progress]
    tokens = {r.problem_id: spent_through(r, None, budget.spent, spend) for r in finished}
    again = asked_again or {}
    calls = {r.problem_id: _calls(r, spend) - again.get(r.problem_id, 0) for r in finished}
    ended = [r for r in finished if r.status == "done" and r.stopped_reason != BUDGET_STOP]
    if budget.tokens is not None:
        # A pooled budget's problem may have drawn from the pool past its own share: its limit is share and draws.
        limits = [(tokens[r.problem_id], budget.tokens + r.budget_drawn) for r in ended]
        under = [spent / limit for spent, limit in limits if spent < limit]
    else:
        most = budget.calls or 1
        under = [calls[r.problem_id] / most for r in ended if calls[r.problem_id] < most]
    return BudgetSpend(
        budget,
        list(tokens.values()),
        list(calls.values()),
        sum(r.stopped_reason == BUDGET_STOP for r in finished),
        under,
    )


def _calls(result: ProblemResult, spend: Spend | None) -> int:
    """The calls a finished problem made: its stored calls with ``spend``, else its result's count."""
    own = spend.get(result.problem_id) if spend is not None else None
    return result.calls if own is None else sum(spent.calls for spent in own.values())


class BudgetRun(Protocol):
    """What the table reads of an evaluated run (tmas.reports.report.RunEvaluation has it)."""

    label: str
    budget: BudgetSpend | None


def budget_section(doc: Document, runs: Sequence[BudgetRun]) -> None:
    """The budget table of ``runs`` (one benchmark); nothing when no run had a budget."""
    spends = [(e.label, e.budget) for e in runs if e.budget is not None]
    if not spends:
        return
    rows = [_row(label, spend) for label, spend in spends]
    doc.add(Heading(3, "Budget and spend per problem"))
    doc.add(
        Paragraph(
            "Each run's budget per problem beside what its finished problems spent, counted as the budget counts "
            "(completion tokens, or prompt + completion where the budget's count is total; calls). A problem stops "
            "at its first call once the budget is spent; a token budget is passed by one call's tokens at most."
        )
    )
    headers = [
        "Method",
        "Budget per problem",
        "Spent per problem (mean)",
        "Most a problem spent",
        "Stopped by it",
        "Ended under it (share spent)",
    ]
    doc.add(Table(headers, rows))
    short = [label for label, spend in spends if spend.under]
    if short:
        doc.add(
            Paragraph(
                f"Not at the budget: {', '.join(short)}. Problems that ended under the budget without being stopped "
                "by it finished their method's iterations (or its own stopping rule ended them) first, at the share "
                "of the budget shown: the run did not spend the budget it is labelled with, so it is no equal-budget "
                "point. A method of more iterations reaches the budget with more of them (a larger iterations); one "
                "of a single call (cot) cannot."
            )
        )


def _row(label: str, spend: BudgetSpend) -> list[str]:
    figures = []
    if spend.budget.tokens is not None:
        figures.append((spend.tokens, spend.counted))
    if spend.budget.calls is not None:
        figures.append((spend.calls, "calls"))
    mean = ", ".join(f"{sum(v) / len(v):,.0f} {unit}" if v else "-" for v, unit in figures)
    most = ", ".join(f"{max(v):,} {unit}" if v else "-" for v, unit in figures)
    finished = len(spend.tokens)
    under = f"{len(spend.under)} of {finished}"
    if spend.under:
        under += f" ({sum(spend.under) / len(spend.under):.0%})"
    return [label, spend.limit, mean, most, f"{spend.stopped} of {finished}", under]
