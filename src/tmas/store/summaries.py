"""A result record's summary: the record without the texts, banks and notes that only a problem's own pages show.

The viewer's first views (a run page, a comparison) read answers, scores, usage and indices of every candidate of
every iteration; at a thinking model's reply lengths those are about 2 % of a result's JSON. The store keeps each
result's summary beside it (written in the same transaction), so those views parse the 2 % and not the whole. A
summary reads back as the same :class:`tmas.store.records.ProblemResult`, its dropped fields at their defaults.
"""

from __future__ import annotations

from typing import Any

from tmas.store.records import CandidateMeta, IterationRecord, ProblemResult

# Fields the run page, the grades, the metrics and the frontiers never read. Of a candidate's meta they read only
# ``carried_from`` (the earlier solution a trajectory holds in its place, which votes and counts in Pass@1).
_META_KEPT = {"carried_from"}
_CANDIDATE_DROP = {"text": True, "meta": {name: True for name in CandidateMeta.model_fields if name not in _META_KEPT}}
_ITERATION_DROP: dict[str, Any] = {
    "state": True,
    "notes": True,
    "replies": True,
    "candidates": {"__all__": _CANDIDATE_DROP},
}
_RESULT_DROP: dict[str, Any] = {"text": True, "iterations": {"__all__": _ITERATION_DROP}}


def summarize_result(result: ProblemResult) -> dict[str, Any]:
    """The result without its texts, and each of its iterations summarized, as the store keeps it."""
    return result.model_dump(mode="json", exclude=_RESULT_DROP)


def summarize_iteration(record: IterationRecord) -> IterationRecord:
    """An iteration record without its banks, notes and replies, and its candidates without their texts."""
    return IterationRecord.model_validate(record.model_dump(mode="json", exclude=_ITERATION_DROP))
