"""A method against majority vote at about the same completion tokens, problem by problem.

Majority vote's frontier gives MV@k for every k up to the samples it drew (reports/frontier.py: an exact expectation
per problem, at k times the problem's mean completion tokens per sample). A method is paired with the MV@k whose
mean completion tokens per problem, over the problems both answered, is nearest its own; the difference is the mean
over those problems of (the method's correctness - MV@k's expected correctness), with the standard error of that
mean, sd(d) / sqrt(n) (the paired test's: what the two share per problem drops out).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

# Per problem: (correctness in [0, 1], completion tokens).
ByProblem = Mapping[str, tuple[float, float]]


@dataclass(frozen=True)
class PairedDifference:
    """A method minus MV@k over the ``problems`` both answered."""

    k: int
    tokens: float  # the method's mean completion tokens per problem
    majority_tokens: float  # MV@k's
    accuracy: float  # the method's
    majority_accuracy: float  # MV@k's (expected)
    difference: float  # mean of per-problem differences (= accuracy - majority_accuracy)
    stderr: float  # of the difference (0 with one problem)
    problems: int


def paired(method: ByProblem, majority: ByProblem, k: int) -> PairedDifference | None:
    """``method`` minus MV@k (``majority``) over the problems both hold; None where they share none."""
    shared = sorted(set(method) & set(majority))
    if not shared:
        return None
    ours = [method[p][0] for p in shared]
    theirs = [majority[p][0] for p in shared]
    differences = [a - b for a, b in zip(ours, theirs, strict=True)]
    spread = statistics.stdev(differences) / math.sqrt(len(shared)) if len(shared) > 1 else 0.0
    return PairedDifference(
        k=k,
        tokens=statistics.fmean(method[p][1] for p in shared),
        majority_tokens=statistics.fmean(majority[p][1] for p in shared),
        accuracy=statistics.fmean(ours),
        majority_accuracy=statistics.fmean(theirs),
        difference=statistics.fmean(differences),
        stderr=spread,
        problems=len(shared),
    )


def nearest_majority(method: ByProblem, majority: Mapping[int, ByProblem]) -> PairedDifference | None:
    """``method`` paired with the MV@k (``majority``: k -> per problem) nearest it in mean completion tokens per
    problem over the problems both hold (the smaller k on a tie); None where no k shares a problem with it."""
    pairs = [pair for k in sorted(majority) if (pair := paired(method, majority[k], k)) is not None]
    return min(pairs, key=lambda p: abs(p.majority_tokens - p.tokens), default=None)
