"""Runs stored under the names earlier versions used read as runs stored now: a reply tally's ``fallback`` count (an
answer stated without a box, now ``stated``) and an endpoint's refusals under ``KIND_fallbacks`` (now downgrades)."""

from __future__ import annotations

from pathlib import Path

from tmas.methods.base import IterationRecord, ReplyTally
from tmas.store.run_store import RunStore


def test_a_stored_reply_tally_with_the_old_count_name_reads_as_stated() -> None:
    old = ReplyTally.model_validate({"replies": 3, "unusable": 1, "fallback": 2})
    assert (old.replies, old.unusable, old.stated) == (3, 1, 2)
    assert ReplyTally.model_validate({"replies": 1, "stated": 1}).stated == 1
    assert (old + ReplyTally(replies=1, stated=1)).stated == 3
    # Written back under the current name.
    assert old.model_dump()["stated"] == 2 and "fallback" not in old.model_dump()
    stored = {
        "problem_id": "p",
        "iteration": 0,
        "candidates": [],
        "replies": {"solution": {"replies": 4, "fallback": 1}},
    }
    record = IterationRecord.model_validate(stored)
    assert record.replies["solution"].stated == 1


def test_refusals_stored_under_the_old_key_are_read_and_kept(tmp_path: Path) -> None:
    with RunStore(tmp_path / "run") as store:
        store.set_meta("stream_fallbacks", {"http://a/v1": {"role": "solution", "message": "no SSE", "at": 1.0}})
        assert list(store.downgrades("stream")) == ["http://a/v1"]
        assert store.downgrade_messages() == {"stream": {"http://a/v1": "no SSE"}}
        # A new refusal of the same kind keeps the old one beside it, under the current key.
        store.record_downgrade("stream", "http://b/v1", "verifier", "no SSE either")
        assert list(store.downgrades("stream")) == ["http://a/v1", "http://b/v1"]
        assert store.get_meta("stream_downgrades") is not None
