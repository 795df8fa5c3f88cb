"""The report's "paper beside ours" table: every published cell a run matches (reports/paper_numbers.py), the run's own
value at the same iteration, and the difference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tmas.reports.document import Document, Heading, Paragraph, Table
from tmas.reports.metrics import IterationMetrics, RunMetrics, short_of, stands_on
from tmas.reports.paper_numbers import CASE_METRICS, REPORTED_METRICS, PaperCell, matching_cells, setting_differences


class PaperRun(Protocol):
    """What the table reads of an evaluated run (tmas.reports.report.RunEvaluation has it)."""

    label: str
    benchmark: str
    paper_benchmark: str | None
    method: str
    params: dict[str, Any]
    model: str | None
    metrics: RunMetrics
    # Its problems with a reference answer: a figure over fewer says on how many it stands.
    labeled_problems: int
    # A case domain's metrics (medicine, education), None for answer-graded runs.
    cases: dict[str, Any] | None


def ours(e: PaperRun, cell: PaperCell) -> tuple[float, str] | None:
    """The run's value (in %) for the cell, with what the table says of the problems it stands on (``stands_on``:
    nothing where it stands on all the run's labeled problems): Pass@1 at the cell's iteration, the returned answer's
    accuracy (at the cell's iteration, else the run's last) for an accuracy cell such as MV@64, or a case domain's
    metric."""
    if cell.metric in CASE_METRICS:
        value = None if e.cases is None else e.cases.get(CASE_METRICS[cell.metric])
        return None if value is None else (100 * value, "")
    if not e.metrics.iterations:
        return None
    m: IterationMetrics | None
    if cell.metric == "pass@1":
        m = e.metrics.at(cell.iteration) if cell.iteration is not None else None
        return None if m is None or not m.problems else (100 * m.pass1, stands_on(m, e.labeled_problems))
    m = e.metrics.at(cell.iteration) if cell.iteration is not None else e.metrics.iterations[-1]
    return None if m is None or not m.problems else (100 * m.selected, stands_on(m, e.labeled_problems))


def paper_rows(e: PaperRun, paper_model: str | None = None) -> tuple[list[list[str]], int]:
    """Rows for the run (cells shared by several tables once, their sources joined) and how many matched cells lie
    beyond the run's last iteration."""
    benchmark = e.paper_benchmark or e.benchmark
    cells = [
        c
        for c in matching_cells(e.model, benchmark, e.method, e.params, model_override=paper_model)
        if c.metric in REPORTED_METRICS
    ]
    merged: dict[tuple[str, str, int | None, str], list[PaperCell]] = {}
    for c in cells:
        merged.setdefault((c.method, c.model, c.iteration, c.metric), []).append(c)
    rows: list[list[str]] = []
    beyond = 0
    differs = "; ".join(setting_differences(e.method, e.params)) or "-"
    for (method, model, iteration, metric), group in sorted(merged.items(), key=lambda kv: (kv[0][0], kv[0][2] or 0)):
        cell = group[0]
        found = ours(e, cell)
        if found is None:
            beyond += cell.metric not in CASE_METRICS
            continue
        mine, short = found
        sources = ", ".join(sorted({f"{c.paper} {c.source}" for c in group}))
        rows.append(
            [
                e.label,
                method,
                model,
                "-" if iteration is None else f"It{iteration}",
                metric,
                f"{cell.percent:.2f}",
                f"{mine:.2f}{short}",
                f"{mine - cell.percent:+.2f}",
                sources,
                differs,
            ]
        )
    return rows, beyond


def paper_section(doc: Document, runs: Sequence[PaperRun], paper_model: str | None = None) -> None:
    """The table for one benchmark's graded runs; nothing when no run matches a published cell."""
    rows: list[list[str]] = []
    beyond = 0
    short = []
    for e in runs:
        found, more = paper_rows(e, paper_model)
        rows += found
        beyond += more
        if found and short_of(e.metrics, e.labeled_problems):
            short.append(e.label)
    if not rows:
        return
    doc.add(Heading(3, "Paper beside ours"))
    doc.add(
        Paragraph(
            "Each published cell (tmas/reports/paper_numbers.csv) a run matches by model, benchmark and method, with "
            "the run's value at the same iteration (Pass@1, the returned answer's accuracy, or the domain's metric) in "
            "%, and ours minus the paper's. 'Setting' lists the run's parameters that differ from the paper's."
            + (f" {beyond} matched cells lie beyond the runs' last iterations." if beyond else "")
            + (
                f" Standing on not every problem of its run: {', '.join(short)}; its values say on how many, over "
                "fewer problems than the paper's figures and no comparison with them."
                if short
                else ""
            )
        )
    )
    headers = ["Run", "Paper row", "Model", "Iteration", "Metric", "Paper", "Ours", "Difference", "Source", "Setting"]
    doc.add(Table(headers, rows))
