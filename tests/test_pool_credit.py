"""Credit assignment (paper 003, Eq. 10-13 and 16-18) on a hand-worked transcript.

The transcript: R = 2 turns. Turn 1: specialists S1, S2, S3 with judge scores 4, 1, 0 of 5 (s = 0.8, 0.2, 0.0).
Turn 2: only S1 and S2 speak (S3 has converged), scores 5 and 0 (s = 1.0, 0.0). G = 1, lambda = 0.5, gamma = 0.5,
so Eq. 10 gives w_1 = 0.5^(2-1) = 0.5 and w_2 = 0.5^0 = 1.

Turn objectives F_t(S) (judge score / 5) used by the difference and Shapley schemes:
  turn 1: F() = 0, F(1) = 0.4, F(2) = 0, F(3) = 0, F(12) = 0.8, F(13) = 0.4, F(23) = 0.4, F(123) = 0.8
  turn 2: F() = 0, F(1) = 1.0, F(2) = 0, F(12) = 1.0
beta = 15 ln 2, so exp(beta q) is a power of two whenever 15 q is an integer.
"""

from __future__ import annotations

import math
import random

import pytest

from tmas.pool.credit import (
    DEFAULT_BETA,
    assign_credit,
    coalitions_needed,
    decay_weight,
    difference_credits,
    kept_by_quantile,
    kept_by_threshold,
    proportional_contributions,
    sample_permutations,
    shapley_credits,
    softmax_contributions,
    turn_reward,
)

S = {1: {"S1": 0.8, "S2": 0.2, "S3": 0.0}, 2: {"S1": 1.0, "S2": 0.0}}
F1 = {
    frozenset(): 0.0,
    frozenset({"S1"}): 0.4,
    frozenset({"S2"}): 0.0,
    frozenset({"S3"}): 0.0,
    frozenset({"S1", "S2"}): 0.8,
    frozenset({"S1", "S3"}): 0.4,
    frozenset({"S2", "S3"}): 0.4,
    frozenset({"S1", "S2", "S3"}): 0.8,
}
F2 = {frozenset(): 0.0, frozenset({"S1"}): 1.0, frozenset({"S2"}): 0.0, frozenset({"S1", "S2"}): 1.0}
BETA = 15 * math.log(2)
LAM, GAMMA, G = 0.5, 0.5, 1.0


def test_eq10_decay_weights() -> None:
    assert decay_weight(1, 2, GAMMA) == pytest.approx(0.5)
    assert decay_weight(2, 2, GAMMA) == pytest.approx(1.0)
    assert decay_weight(1, 3, 0.85) == pytest.approx(0.7225)  # 0.85^2
    with pytest.raises(ValueError, match="outside"):
        decay_weight(3, 2, GAMMA)
    # Appendix C.1's direction (education): w_t = gamma^(t - 1), so the first turn weighs 1 and the third 0.85^2.
    assert decay_weight(1, 3, 0.85, earlier=True) == pytest.approx(1.0)
    assert decay_weight(3, 3, 0.85, earlier=True) == pytest.approx(0.7225)
    # In assign_credit: turn 1 of the naive example gets w = 1 (not 0.5), so r = 0.5 * 0.8 + 0.5 * 1 * 1 * 0.8 = 0.8.
    first = assign_credit(S, 2, G, lam=LAM, gamma=GAMMA, earlier=True)
    assert first[1]["S1"].w == pytest.approx(1.0) and first[1]["S1"].r == pytest.approx(0.8)
    assert first[2]["S1"].w == pytest.approx(0.5) and first[2]["S1"].r == pytest.approx(0.75)


def test_eq11_proportional_contributions() -> None:
    c = proportional_contributions(S[1])
    assert c == pytest.approx({"S1": 0.8, "S2": 0.2, "S3": 0.0})  # the scores already sum to 1
    # All-zero turn: epsilon keeps it finite, every share 0.
    assert proportional_contributions({"a": 0.0, "b": 0.0}) == {"a": 0.0, "b": 0.0}
    assert proportional_contributions({"a": 0.3, "b": 0.1}) == pytest.approx({"a": 0.75, "b": 0.25})
    with pytest.raises(ValueError, match="non-negative"):
        proportional_contributions({"a": -0.1})


def test_eq16_softmax() -> None:
    c = softmax_contributions({"a": 7 / 15, "b": 4 / 15, "c": 1 / 15}, BETA)
    assert c == pytest.approx({"a": 128 / 146, "b": 16 / 146, "c": 2 / 146})
    with pytest.raises(ValueError, match="beta > 0"):
        softmax_contributions({"a": 1.0}, 0.0)


def test_eq16_default_beta_spreads_credit() -> None:
    # Eq. 16 with the default beta = 5 on q = (0.6, 0, 0) (one agent three judge points ahead):
    # exp(5 * 0.6) = e^3, so c = e^3 / (e^3 + 2) = 0.9094 for it and 1 / (e^3 + 2) = 0.0453 for each other one.
    assert DEFAULT_BETA == 5.0
    c = softmax_contributions({"a": 0.6, "b": 0.0, "c": 0.0}, DEFAULT_BETA)
    e3 = math.exp(3)
    assert c == pytest.approx({"a": e3 / (e3 + 2), "b": 1 / (e3 + 2), "c": 1 / (e3 + 2)})
    assert c["a"] == pytest.approx(0.9094, abs=1e-4) and c["b"] == pytest.approx(0.0453, abs=1e-4)
    # beta = 1 (the old default) is nearly flat: e^0.6 / (e^0.6 + 2) = 0.4767, 1 / (e^0.6 + 2) = 0.2616.
    flat = softmax_contributions({"a": 0.6, "b": 0.0, "c": 0.0}, 1.0)
    assert flat["a"] == pytest.approx(0.4767, abs=1e-4) and flat["b"] == pytest.approx(0.2616, abs=1e-4)
    # The default reaches assign_credit: turn 1 of the difference example, q = (0.4, 0.4, 0) -> e^2 : e^2 : 1.
    q1 = {"S1": 0.4, "S2": 0.4, "S3": 0.0}
    r = assign_credit({1: S[1]}, 1, G, lam=LAM, gamma=GAMMA, credits={1: q1})
    e2 = math.exp(2)
    assert r[1]["S1"].c == pytest.approx(e2 / (2 * e2 + 1)) and r[1]["S3"].c == pytest.approx(1 / (2 * e2 + 1))


def test_eq17_difference_rewards() -> None:
    full = F1[frozenset({"S1", "S2", "S3"})]
    without = {a: F1[frozenset({"S1", "S2", "S3"}) - {a}] for a in ("S1", "S2", "S3")}
    # q1 = F(123) - F(23) = 0.4, q2 = F(123) - F(13) = 0.4, q3 = F(123) - F(12) = 0.
    assert difference_credits(full, without) == pytest.approx({"S1": 0.4, "S2": 0.4, "S3": 0.0})


def test_eq18_shapley_exact_over_all_orders() -> None:
    perms = sample_permutations(["S3", "S1", "S2"], 6, random.Random(0))
    assert len(set(perms)) == 6  # 3! orders: exact values
    assert coalitions_needed(perms) == set(F1)
    # By hand, weights 1/3 (empty before), 1/6 (one before), 1/3 (two before):
    # q1 = 0.4/3 + 0.8/6 + 0.4/6 + 0.4/3 = 7/15; q2 = 0 + 0.4/6 + 0.4/6 + 0.4/3 = 4/15; q3 = 0 + 0 + 0.4/6 + 0 = 1/15.
    q = shapley_credits(perms, F1)
    assert q == pytest.approx({"S1": 7 / 15, "S2": 4 / 15, "S3": 1 / 15})
    assert sum(q.values()) == pytest.approx(F1[frozenset({"S1", "S2", "S3"})])  # efficiency


def test_eq18_monte_carlo_uses_only_sampled_orders() -> None:
    perms = sample_permutations(["S1", "S2", "S3"], 2, random.Random(1))
    assert len(perms) == 2
    # One order alone gives each agent its marginal in that order.
    q = shapley_credits([("S2", "S1", "S3")], F1)
    assert q == pytest.approx({"S2": 0.0, "S1": 0.8, "S3": 0.0})
    assert sample_permutations(["a", "b", "c"], 4, random.Random(7)) == sample_permutations(
        ["a", "b", "c"], 4, random.Random(7)
    )


def test_eq12_reward() -> None:
    # r = lambda s + (1 - lambda) G w c = 0.5*0.8 + 0.5*1*0.5*0.8 = 0.6
    assert turn_reward(0.8, 1.0, 0.5, 0.8, 0.5) == pytest.approx(0.6)
    assert turn_reward(0.8, 0.0, 0.5, 0.8, 0.5) == pytest.approx(0.4)  # a wrong team keeps only lambda s
    with pytest.raises(ValueError, match="lambda"):
        turn_reward(0.8, 1.0, 0.5, 0.8, 1.5)


def test_naive_scheme_on_the_transcript() -> None:
    r = assign_credit(S, 2, G, lam=LAM, gamma=GAMMA)
    # turn 1: r = 0.5 s + 0.5 * 0.5 * s  (c = s here); turn 2: r = 0.5 s + 0.5 * 1 * c
    assert r[1]["S1"].r == pytest.approx(0.6)
    assert r[1]["S2"].r == pytest.approx(0.15)
    assert r[1]["S3"].r == pytest.approx(0.0)
    assert r[2]["S1"].r == pytest.approx(1.0)
    assert r[2]["S2"].r == pytest.approx(0.0)
    assert r[1]["S1"].q is None and r[1]["S1"].w == pytest.approx(0.5)
    # G = 0: only the individual term is left.
    wrong = assign_credit(S, 2, 0.0, lam=LAM, gamma=GAMMA)
    assert wrong[1]["S1"].r == pytest.approx(0.4)


def test_difference_scheme_on_the_transcript() -> None:
    q1 = difference_credits(
        F1[frozenset({"S1", "S2", "S3"})], {a: F1[frozenset({"S1", "S2", "S3"}) - {a}] for a in S[1]}
    )
    q2 = difference_credits(F2[frozenset({"S1", "S2"})], {a: F2[frozenset({"S1", "S2"}) - {a}] for a in S[2]})
    r = assign_credit(S, 2, G, lam=LAM, gamma=GAMMA, beta=BETA, credits={1: q1, 2: q2})
    # turn 1: beta q = 6 ln 2, 6 ln 2, 0 -> c = 64/129, 64/129, 1/129; r = 0.5 s + 0.25 c
    assert r[1]["S1"].c == pytest.approx(64 / 129)
    assert r[1]["S1"].r == pytest.approx(0.4 + 16 / 129)
    assert r[1]["S2"].r == pytest.approx(0.1 + 16 / 129)
    assert r[1]["S3"].r == pytest.approx(0.25 / 129)
    # turn 2: q = 1, 0 -> c = 2^15/(2^15+1), 1/(2^15+1); r = 0.5 s + 0.5 c
    assert r[2]["S1"].r == pytest.approx(0.5 + 0.5 * 32768 / 32769)
    assert r[2]["S2"].r == pytest.approx(0.5 / 32769)


def test_shapley_scheme_on_the_transcript() -> None:
    p1 = sample_permutations(["S1", "S2", "S3"], 6, random.Random(0))
    p2 = sample_permutations(["S1", "S2"], 6, random.Random(0))
    r = assign_credit(
        S, 2, G, lam=LAM, gamma=GAMMA, beta=BETA, credits={1: shapley_credits(p1, F1), 2: shapley_credits(p2, F2)}
    )
    # turn 1: q = 7/15, 4/15, 1/15 -> c = 128/146, 16/146, 2/146; r = 0.5 s + 0.25 c
    assert r[1]["S1"].q == pytest.approx(7 / 15)
    assert r[1]["S1"].r == pytest.approx(0.4 + 32 / 146)
    assert r[1]["S2"].r == pytest.approx(0.1 + 4 / 146)
    assert r[1]["S3"].r == pytest.approx(0.5 / 146)
    # turn 2: q1 = (1 + 1)/2 = 1, q2 = 0, as in the difference scheme.
    assert r[2]["S1"].r == pytest.approx(0.5 + 0.5 * 32768 / 32769)


def test_eq13_threshold_and_top_quantile() -> None:
    rewards = [0.6, 0.15, 0.0, 1.0, 0.0]  # the naive scheme's r, turn by turn
    assert kept_by_threshold(rewards, 0.5) == [0, 3]
    assert kept_by_threshold(rewards, 0.6) == [0, 3]  # r >= tau: a reward at the threshold is kept
    # Top 25 % of 5 turns: ceil(1.25) = 2.
    assert kept_by_quantile(rewards, 0.25) == [0, 3]
    assert kept_by_quantile(rewards, 0.1) == [3]
    # Ties at the cut are all kept.
    assert kept_by_quantile([0.5, 0.5, 0.1, 0.0], 0.25) == [0, 1]
    assert kept_by_quantile([], 0.25) == []
