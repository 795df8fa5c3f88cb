"""A result record's summary: the record without the texts, banks and notes that only a problem's own pages show.

The viewer's first views (a run page, a comparison) read answers, scores, usage and indices of every candidate of
every iteration; at a thinking model's reply lengths those are about 2 % of a result's JSON. The store keeps each
result's summary beside it (written in the same transaction), so those views parse the 2 % and not the whole.
"""

from __future__ import annotations

from typing import Any

# Fields the run page, the grades, the metrics and the frontiers never read.
_RESULT_DROP = ("text",)
_ITERATION_DROP = ("state", "notes", "replies")
_CANDIDATE_DROP = ("text", "meta")


def summarize_result(result: dict[str, Any]) -> dict[str, Any]:
    """The result without its texts, and each of its iterations summarized."""
    out = {k: v for k, v in result.items() if k not in _RESULT_DROP}
    out["iterations"] = [summarize_iteration(r) for r in result.get("iterations", [])]
    return out


def summarize_iteration(record: dict[str, Any]) -> dict[str, Any]:
    """An iteration record without its banks, notes and replies, and its candidates without their texts."""
    out = {k: v for k, v in record.items() if k not in _ITERATION_DROP}
    out["candidates"] = [{k: v for k, v in c.items() if k not in _CANDIDATE_DROP} for c in record.get("candidates", [])]
    return out
