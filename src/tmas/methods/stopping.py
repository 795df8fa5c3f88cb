"""When a vote is decided: the Beta stopping criterion of Adaptive-Consistency (Aggarwal et al. 2023, "Let's Sample
Step by Step: Adaptive-Consistency for Efficient Reasoning and Coding with LLMs", section 3).

With v1 and v2 the votes of the two leading answers, the leader's share p of those two votes has, under a uniform
prior, the posterior Beta(v1 + 1, v2 + 1). Sampling stops once P(p > 1/2) reaches a threshold (the paper's default:
0.95): the leader is then unlikely to be overtaken by the runner-up. The criterion's probability is the posterior mass
above 1/2,

    P(p > 1/2) = integral_{1/2..1} p^v1 (1 - p)^v2 dp / B(v1 + 1, v2 + 1)

(the ratio of integrals Adaptive-Consistency's BetaStoppingCriteria evaluates numerically). For whole counts the
integral is a binomial sum (the Beta CDF at x is the chance of at least v1 + 1 successes in v1 + v2 + 1 Bernoulli(x)
trials), computed exactly:

    P(p > 1/2) = sum_{j = 0..v1} C(v1 + v2 + 1, j) / 2^(v1 + v2 + 1)

Worked by hand: (v1, v2) = (1, 0) gives 3/4; (2, 1) gives 11/16; a unanimous vote of v gives 1 - 2^-(v + 1), so at
0.95 four agreeing samples stop (31/32) and three do not (15/16).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from math import comb

# Adaptive-Consistency's default threshold on P(p > 1/2).
BETA_THRESHOLD = 0.95


def beta_stop_probability(leading: int, runner_up: int) -> float:
    """P(p > 1/2) for p ~ Beta(leading + 1, runner_up + 1): how sure the leader is to stay ahead of the runner-up."""
    if leading < 0 or runner_up < 0:
        raise ValueError(f"vote counts must not be negative ({leading}, {runner_up})")
    n = leading + runner_up + 1
    return float(sum(comb(n, j) for j in range(leading + 1)) / 2**n)


@dataclass(frozen=True)
class VoteStop:
    """The Beta criterion read on a vote: the two leading counts, the probability, and whether it stops."""

    leading: int
    runner_up: int
    probability: float
    stop: bool


def beta_vote_stop(keys: Iterable[str], threshold: float = BETA_THRESHOLD) -> VoteStop:
    """The criterion on the votes ``keys`` (one class key per answered sample; unanswered samples do not vote)."""
    counts = [n for _, n in Counter(keys).most_common(2)] + [0, 0]
    leading, runner_up = counts[0], counts[1]
    probability = beta_stop_probability(leading, runner_up)
    return VoteStop(leading, runner_up, probability, leading > 0 and probability >= threshold)


def fewest_votes_to_stop(threshold: float = BETA_THRESHOLD) -> int:
    """The fewest samples after which the criterion can stop: that many agreeing votes (1 - 2^-(v + 1) >= threshold;
    4 at 0.95)."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"the stopping threshold must be between 0 and 1, not {threshold}")
    votes = 1
    while beta_stop_probability(votes, 0) < threshold:
        votes += 1
    return votes
