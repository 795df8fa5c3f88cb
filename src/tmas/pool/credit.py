"""Turn-level credit assignment (paper 003, section 3.2 and section 5.1): pure arithmetic, no I/O.

Notation follows the paper: a transcript has R turns (deliberation rounds, numbered 1..R here); at turn t each
speaking specialist i has an individual score s_{i,t} in [0, 1] from the judge (Eq. 9); G in [0, 1] is the team's
terminal outcome. The team at turn t is the specialists who spoke in it (a converged specialist that stays silent
has no utterance to credit).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

CreditScheme = Literal["naive", "difference", "shapley"]
Coalition = frozenset[str]

# Eq. 11's epsilon: keeps a turn whose every score is 0 from dividing by zero.
EPSILON = 1e-8
# Eq. 16's beta (the paper gives no value). q is a difference of judge ratings on a 0-5 scale divided by 5, so one
# judge point is 0.2 in q; beta = 5 makes one point multiply an agent's share by e. With beta = 1 the softmax is
# nearly flat on such q: q = (0.6, 0, 0) gives c = (0.47, 0.26, 0.26); beta = 5 gives (0.91, 0.05, 0.05).
DEFAULT_BETA = 5.0


def decay_weight(turn: int, rounds: int, gamma: float, *, earlier: bool = False) -> float:
    """Eq. 10: w_t = gamma^(R - t); the last turn gets weight 1, earlier ones less when gamma < 1.

    ``earlier``: the opposite direction, w_t = gamma^(t - 1), the first turn weight 1. Appendix C.1 allocates the
    education outcome this way ("higher credit to earlier instructional turns"), against Eq. 10's direction."""
    if not 1 <= turn <= rounds:
        raise ValueError(f"turn {turn} outside 1..{rounds}")
    return float(gamma ** (turn - 1 if earlier else rounds - turn))


def proportional_contributions(scores: Mapping[str, float], epsilon: float = EPSILON) -> dict[str, float]:
    """Eq. 11 (the naive scheme): c_{i,t} = s_{i,t} / (sum_j s_{j,t} + epsilon), scores non-negative."""
    negative = [agent for agent, s in scores.items() if s < 0]
    if negative:
        raise ValueError(f"Eq. 11 needs non-negative scores; {negative[0]} has {scores[negative[0]]}")
    total = sum(scores.values()) + epsilon
    return {agent: s / total for agent, s in scores.items()}


def softmax_contributions(credits: Mapping[str, float], beta: float) -> dict[str, float]:
    """Eq. 16: c_{i,t} = exp(beta q_{i,t}) / sum_j exp(beta q_{j,t}), the shared normalisation of credit scores."""
    if beta <= 0:
        raise ValueError(f"Eq. 16 needs beta > 0, got {beta}")
    if not credits:
        return {}
    top = max(credits.values())
    # Shifting by the maximum changes nothing mathematically and keeps exp() from overflowing.
    weights = {agent: math.exp(beta * (q - top)) for agent, q in credits.items()}
    total = sum(weights.values())
    return {agent: w / total for agent, w in weights.items()}


def difference_credits(full: float, without: Mapping[str, float]) -> dict[str, float]:
    """Eq. 17: q_{i,t} = F_t(TEAM) - F_t(TEAM minus i), one counterfactual per agent."""
    return {agent: full - value for agent, value in without.items()}


def sample_permutations(agents: Sequence[str], count: int, rng: random.Random) -> list[tuple[str, ...]]:
    """The orders Eq. 18 averages over: all of them when ``count`` covers every order (exact Shapley values),
    else ``count`` orders drawn uniformly (Monte Carlo)."""
    ordered = sorted(agents)
    if count >= math.factorial(len(ordered)):
        return list(itertools.permutations(ordered))
    out: list[tuple[str, ...]] = []
    for _ in range(count):
        order = list(ordered)
        rng.shuffle(order)
        out.append(tuple(order))
    return out


def coalitions_needed(permutations: Sequence[tuple[str, ...]]) -> set[Coalition]:
    """Every coalition whose value F_t the permutations ask for: each prefix of each order, the empty one included."""
    needed: set[Coalition] = set()
    for order in permutations:
        for k in range(len(order) + 1):
            needed.add(frozenset(order[:k]))
    return needed


def shapley_credits(permutations: Sequence[tuple[str, ...]], values: Mapping[Coalition, float]) -> dict[str, float]:
    """Eq. 18: q_{i,t} = E_pi[F_t(S_pi^{<i} with i) - F_t(S_pi^{<i})], the mean over ``permutations`` of each
    agent's marginal value, read from the cached coalition ``values``."""
    if not permutations:
        return {}
    totals: dict[str, float] = dict.fromkeys(permutations[0], 0.0)
    for order in permutations:
        before: Coalition = frozenset()
        for agent in order:
            with_agent = before | {agent}
            totals[agent] += values[with_agent] - values[before]
            before = with_agent
    return {agent: total / len(permutations) for agent, total in totals.items()}


def turn_reward(score: float, outcome: float, weight: float, contribution: float, lam: float) -> float:
    """Eq. 12: r_{i,t} = lambda s_{i,t} + (1 - lambda) G w_t c_{i,t}."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"Eq. 12 needs lambda in [0, 1], got {lam}")
    return lam * score + (1.0 - lam) * outcome * weight * contribution


def kept_by_threshold(rewards: Sequence[float], tau: float) -> list[int]:
    """Eq. 13: the indices with r >= tau."""
    return [i for i, r in enumerate(rewards) if r >= tau]


def kept_by_quantile(rewards: Sequence[float], top: float) -> list[int]:
    """The top ``top`` share of rewards (paper, section 4.1: the top 25 %), at least one when any exist.

    Ties at the cut are all kept, so equal rewards are never split arbitrarily.
    """
    if not 0.0 < top <= 1.0:
        raise ValueError(f"top quantile must be in (0, 1], got {top}")
    if not rewards:
        return []
    count = max(1, math.ceil(top * len(rewards)))
    cut = sorted(rewards, reverse=True)[count - 1]
    return [i for i, r in enumerate(rewards) if r >= cut]


@dataclass(frozen=True)
class TurnCredit:
    """One specialist turn's credit: s (Eq. 9), q (Eq. 17/18; None in the naive scheme), c (Eq. 11 or 16),
    w (Eq. 10) and r (Eq. 12)."""

    s: float
    q: float | None
    c: float
    w: float
    r: float


def assign_credit(
    scores: Mapping[int, Mapping[str, float]],
    rounds: int,
    outcome: float,
    *,
    lam: float,
    gamma: float,
    beta: float = DEFAULT_BETA,
    credits: Mapping[int, Mapping[str, float]] | None = None,
    epsilon: float = EPSILON,
    earlier: bool = False,
) -> dict[int, dict[str, TurnCredit]]:
    """r_{i,t} for every turn t (1..R) and speaking agent i.

    ``scores[t][i]`` is s_{i,t}. Without ``credits`` the contributions are Eq. 11's proportional shares (naive);
    with ``credits[t][i]`` = q_{i,t} (difference or Shapley) they are Eq. 16's softmax. Then Eq. 10 (``earlier``:
    decaying from the first turn, see :func:`decay_weight`) and Eq. 12.
    """
    out: dict[int, dict[str, TurnCredit]] = {}
    for turn, turn_scores in sorted(scores.items()):
        w = decay_weight(turn, rounds, gamma, earlier=earlier)
        q = credits[turn] if credits is not None else None
        c = proportional_contributions(turn_scores, epsilon) if q is None else softmax_contributions(q, beta)
        out[turn] = {
            agent: TurnCredit(
                s, None if q is None else q[agent], c[agent], w, turn_reward(s, outcome, w, c[agent], lam)
            )
            for agent, s in turn_scores.items()
        }
    return out
