"""The education domain's metrics (paper 003, C.1): pre-test and post-test accuracy and the learning gain."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def teaching_metrics(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Acc_pre and Acc_post = shares of cases answered right before and after teaching; delta = Acc_post - Acc_pre."""
    n = len(rows)
    pre = sum(bool(r["pre_correct"]) for r in rows) / n if n else 0.0
    post = sum(bool(r["post_correct"]) for r in rows) / n if n else 0.0
    return {"acc_pre": pre, "acc_post": post, "delta": post - pre}
