"""The report's table of the case domains' own metrics (paper 003, section 4, "Metrics"): Hit@1/3/5/10 and MRR for
medicine, Acc_pre, Acc_post and their gain for education (grading/cases.py), one row per run of the benchmark. The
columns and the paragraph under the heading are the domain's declaration (``Domain.metrics``, ``metrics_note``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tmas.methods.mattrl_domains import DOMAINS
from tmas.reports.document import Document, Heading, Paragraph, Table


class CaseRun(Protocol):
    """What the table reads of an evaluated run (tmas.reports.report.RunEvaluation has it)."""

    label: str
    params: dict[str, Any]
    cases: dict[str, Any] | None


def case_section(doc: Document, runs: Sequence[CaseRun]) -> None:
    """One table per domain among ``runs`` (of one benchmark); nothing when no run has case metrics."""
    for name, domain in DOMAINS.items():
        if not domain.metrics:
            continue
        rows = [
            [e.label, str(e.cases["cases"]), *[f"{e.cases[k]:.2f}" for k in domain.metrics]]
            for e in runs
            if e.cases is not None and DOMAINS.get(str(e.params.get("domain"))) is domain
        ]
        if not rows:
            continue
        doc.add(Heading(3, f"{name.capitalize()}: the domain's metrics (fractions, as the MATTRL paper prints them)"))
        doc.add(Paragraph(domain.metrics_note))
        doc.add(Table(["Run", "Cases", *domain.metrics.values()], rows))
