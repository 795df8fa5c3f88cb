"""Hand-written result records read as the store reads a stored run: through its one reader
(``tmas.store.records.read_result``), so a test's records are what a report or the viewer gets from a run."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tmas.store.records import ProblemResult, read_result


def as_stored(record: dict[str, Any], method: str = "tmas") -> ProblemResult:
    """``record`` (a result as JSON; the method named when it names none, and its problem in each iteration record,
    as the store writes them) as the store's reader gives it back."""
    iterations = [{"problem_id": record["problem_id"], **r} for r in record.get("iterations", [])]
    return read_result(json.dumps({"method": method, **record, "iterations": iterations}))


def as_results(records: Iterable[dict[str, Any]], method: str = "tmas") -> list[ProblemResult]:
    return [as_stored(r, method) for r in records]
