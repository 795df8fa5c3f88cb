"""The hybrid rewards (paper section 3.3) against values worked by hand from eq. 6-9."""

from __future__ import annotations

import math

import pytest

from tmas.rl.rewards import (
    base_accuracy,
    correctness_reward,
    experience_rewards,
    exploration_reward,
    group_advantages,
)


def test_correctness_reward() -> None:
    # Standard correctness reward (section 3.3): r_i = +1 for a correct final answer, -1 otherwise.
    assert correctness_reward(True) == 1.0
    assert correctness_reward(False) == -1.0


def test_experience_reward_half_solved_by_base() -> None:
    # Base: 1 of 2 correct -> p_base = 0.5 (eq. 7); a correct Bank rollout gets 1 + 0.6 * (1 - 0.5) = 1.3 (eq. 8).
    correct = [True, False, True, False]
    variants = ["base", "base", "bank", "bank"]
    assert base_accuracy(correct, variants) == 0.5
    assert experience_rewards(correct, variants) == pytest.approx([1.0, -1.0, 1.3, -1.0])


def test_experience_reward_when_base_never_solves() -> None:
    # p_base = 0: the full bonus beta = 0.6, so a correct Bank rollout gets 1.6; wrong ones stay at -1.
    correct = [False, False, False, True, False, True]
    variants = ["base", "base", "base", "bank", "bank", "bank"]
    assert base_accuracy(correct, variants) == 0.0
    assert experience_rewards(correct, variants) == pytest.approx([-1.0, -1.0, -1.0, 1.6, -1.0, 1.6])


def test_experience_reward_when_base_always_solves() -> None:
    # p_base = 1: no bonus; correct Base rollouts never get one in any case.
    correct = [True, True, True, False]
    variants = ["base", "base", "bank", "bank"]
    assert base_accuracy(correct, variants) == 1.0
    assert experience_rewards(correct, variants) == [1.0, 1.0, 1.0, -1.0]


def test_experience_reward_beta_and_bad_groups() -> None:
    # beta = 0.2, p_base = 0.25: bonus 0.2 * 0.75 = 0.15.
    correct = [True, False, False, False, True, True, False, False]
    variants = ["base"] * 4 + ["bank"] * 4
    assert experience_rewards(correct, variants, beta=0.2) == pytest.approx([1, -1, -1, -1, 1.15, 1.15, -1, -1])
    with pytest.raises(ValueError, match="split must be equal"):
        experience_rewards([True, False, True], ["base", "bank", "bank"])
    with pytest.raises(ValueError, match="no Base rollout"):
        base_accuracy([True], ["bank"])


@pytest.mark.parametrize(
    ("correct", "novelty", "reward"),
    [
        (True, 1, 1.0),  # correct and novel
        (True, 0, 0.2),  # correct and known
        (False, 1, -0.5),  # wrong and novel
        (False, 0, -1.0),  # wrong and known
        (True, -1, 0.2),  # the judge cannot tell: counted as known
        (False, -1, -1.0),
        (True, None, 0.2),  # no usable verdict: counted as known
        (False, None, -1.0),
    ],
)
def test_exploration_reward_table(correct: bool, novelty: int | None, reward: float) -> None:
    # Eq. 9's four cases, read off the paper's table: (r_i, n_i) = (+1, 1) -> +1.0, (+1, 0) -> +0.2, (-1, 1) -> -0.5,
    # (-1, 0) -> -1.0; a verdict other than 1 is n_i = 0.
    assert exploration_reward(correct, novelty) == reward  # type: ignore[arg-type]


def test_group_advantages_one_against_three() -> None:
    # The advantage of eq. 6, A_i = (r_i - mu) / (sigma + delta), delta 1e-6 (negligible at 1e-5 relative).
    # Rewards (1.6, -1, -1, -1): mu = -0.35; deviations 1.95 and -0.65 (x3); population variance
    # (1.95^2 + 3 * 0.65^2) / 4 = 5.07 / 4 = 1.2675, sigma = 1.12583 = 0.65 * sqrt(3).
    # So A = (1.95, -0.65, -0.65, -0.65) / (0.65 * sqrt(3)) = (sqrt(3), -1/sqrt(3), -1/sqrt(3), -1/sqrt(3)).
    adv = group_advantages([1.6, -1.0, -1.0, -1.0])
    assert adv == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], rel=1e-5)


def test_group_advantages_uses_population_std_and_delta() -> None:
    # Eq. 6's advantage with sigma = sqrt((1/N) sum (r_i - mu)^2), the population deviation.
    # (1, -1): mu = 0, population sigma = 1 (the sample std would be sqrt(2)), so A = +-1 / (1 + delta).
    assert group_advantages([1.0, -1.0], delta=0.5) == pytest.approx([1 / 1.5, -1 / 1.5])
    # All equal: sigma = 0 and delta keeps the division finite: every advantage is 0.
    assert group_advantages([0.2, 0.2, 0.2]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)
    assert group_advantages([]) == []
