"""The papers' published numbers as data (``paper_numbers.csv`` beside this module), and which of them a run matches.

One row per published cell: paper, source (table), the row and column as printed, model, benchmark, method, iteration
(empty for a cell without one), metric, value as printed and its unit (``%`` or ``fraction``). Transcribed from the
TMAS paper (Tables 1-10; Figure 3 and B.2's Figure 4 give no numbers) and the MATTRL paper (Tables 1-6; its
team-size study is a figure). Cells that appear in two tables (Table 1's columns are cells of Tables 3-8) are kept
in both, and are equal in both.

A run matches a cell when its model, benchmark and method do:

- model: the cell's model name, letters and digits only, is contained in the run's (``Qwen/Qwen3-30B-A3B-Thinking-2507``
  matches ``Qwen3-30B-A3B-Thinking-2507``); the longest such name wins, so an RL-trained model's own name is preferred;
  ``paper_model`` (``tmas report --paper-model``) names it when the served name says nothing;
- benchmark: the run's ``paper_benchmark`` (set by a paper grid) or its dataset name, compared letters and digits only;
- method: :func:`paper_methods` of the run's method and parameters.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tmas.methods import METHODS

DATA = Path(__file__).with_name("paper_numbers.csv")

# The case domains' metrics as the published cells name them -> as grading/cases.py does.
CASE_METRICS = {
    "hit@1": "hit@1",
    "hit@3": "hit@3",
    "hit@5": "hit@5",
    "hit@10": "hit@10",
    "mrr": "mrr",
    "acc_pre": "acc_pre",
    "acc_post": "acc_post",
    "delta_acc": "delta",
}
# Metrics ``tmas report`` computes and can put beside a published cell.
REPORTED_METRICS = ("pass@1", "accuracy", *CASE_METRICS)


@dataclass(frozen=True)
class PaperCell:
    paper: str
    source: str
    row: str
    column: str
    model: str
    benchmark: str
    method: str
    iteration: int | None
    metric: str
    value: float
    unit: str

    @property
    def percent(self) -> float:
        """The value in percent (MATTRL prints fractions)."""
        return self.value * 100 if self.unit == "fraction" else self.value


def key(text: str) -> str:
    """Letters and digits only, lower case: how names are compared."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


@cache
def load_cells(path: Path = DATA) -> tuple[PaperCell, ...]:
    cells = []
    with path.open(newline="", encoding="utf-8") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            try:
                cells.append(
                    PaperCell(
                        paper=row["paper"],
                        source=row["source"],
                        row=row["row"],
                        column=row["column"],
                        model=row["model"],
                        benchmark=row["benchmark"],
                        method=row["method"],
                        iteration=int(row["iteration"]) if row["iteration"] else None,
                        metric=row["metric"],
                        value=float(row["value"]),
                        unit=row["unit"],
                    )
                )
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: bad published cell: {exc}") from None
    return tuple(cells)


def paper_methods(method: str, params: dict[str, Any]) -> list[str]:
    """The papers' names for a run of ``method`` with ``params`` (several where tables name it differently), as
    the method states them (``Method.paper_names``); none for a method not registered."""
    cls = METHODS.get(method)
    return cls.paper_names(params) if cls is not None else []


def paper_model(run_model: str | None, override: str | None = None) -> str | None:
    """The paper's model a run's model name stands for (the longest published name it contains)."""
    if override:
        return override
    if not run_model:
        return None
    mine = key(run_model)
    names = sorted({c.model for c in load_cells()}, key=lambda m: len(key(m)), reverse=True)
    return next((m for m in names if key(m) in mine), None)


def matching_cells(
    model: str | None, benchmark: str, method: str, params: dict[str, Any], *, model_override: str | None = None
) -> list[PaperCell]:
    """The published cells a run stands beside (any metric)."""
    wanted_model = paper_model(model, model_override)
    if wanted_model is None:
        return []
    names = set(paper_methods(method, params))
    return [
        c
        for c in load_cells()
        if key(c.model) == key(wanted_model) and key(c.benchmark) == key(benchmark) and c.method in names
    ]


def setting_differences(method: str, params: dict[str, Any]) -> list[str]:
    """The run's parameters that differ from the paper's setting of the method (``n=2 (paper 8)``); a None value is
    one left unset (PaCoRe's ``message_chars``: no cut), said as ``(paper: not set)``."""
    out = []
    cls = METHODS.get(method)
    for name, value in (cls.paper_settings if cls is not None else {}).items():
        if name in params and params[name] != value:
            paper = "paper: not set" if value is None else f"paper {value}"
            out.append(f"{name}={'not set' if params[name] is None else params[name]} ({paper})")
    return out
