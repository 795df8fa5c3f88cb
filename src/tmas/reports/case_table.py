"""The report's table of the case domains' own metrics (paper 003, section 4, "Metrics"): Hit@1/3/5/10 and MRR for
medicine, Acc_pre, Acc_post and their gain for education (grading/cases.py), one row per run of the benchmark."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tmas.reports.document import Document, Heading, Paragraph, Table


class CaseRun(Protocol):
    """What the table reads of an evaluated run (tmas.reports.report.RunEvaluation has it)."""

    label: str
    params: dict[str, Any]
    cases: dict[str, Any] | None


# Metric key -> its column, per domain (the metric keys of grading/diagnosis.py and grading/teaching.py).
COLUMNS = {
    "medicine": {"hit@1": "Hit@1", "hit@3": "Hit@3", "hit@5": "Hit@5", "hit@10": "Hit@10", "mrr": "MRR"},
    "education": {"acc_pre": "Acc_pre", "acc_post": "Acc_post", "delta": "ΔAcc"},
}


def case_section(doc: Document, runs: Sequence[CaseRun]) -> None:
    """One table per domain among ``runs`` (of one benchmark); nothing when no run has case metrics."""
    for domain, columns in COLUMNS.items():
        rows = [
            [e.label, str(e.cases["cases"]), *[f"{e.cases[k]:.2f}" for k in columns]]
            for e in runs
            if e.cases is not None and e.params.get("domain") == domain
        ]
        if not rows:
            continue
        doc.add(Heading(3, f"{domain.capitalize()}: the domain's metrics (fractions, as the MATTRL paper prints them)"))
        doc.add(Paragraph(_EXPLAINED[domain]))
        doc.add(Table(["Run", "Cases", *columns.values()], rows))


_EXPLAINED = {
    "medicine": "Hit@k: the share of cases whose gold disease is within the team's final top k; MRR: the mean of "
    "1 / rank of the gold disease (0 where it is not in the top 10). Names match by spelling, then by the judge "
    "role (A.5 rules) unless grading by rules alone.",
    "education": "Acc_pre and Acc_post: the shares of cases the student answers right before and after teaching; "
    "ΔAcc = Acc_post - Acc_pre.",
}
