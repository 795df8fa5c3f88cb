"""The hybrid rewards of TMAS's RL scheme (paper section 3.3): pure functions of correctness, group and novelty.

Each rollout is first graded correct or not (:func:`tmas.rl.scoring.is_correct`); the three task rewards then shape
that signal, and GRPO turns a prompt group's rewards into advantages. Nothing here does I/O or knows about a trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

# A.4: "the maximum bonus coefficient beta = 0.6".
DEFAULT_BETA = 0.6
# Eq. 6 leaves delta's value open; the paper trains with verl, whose GRPO advantage uses epsilon = 1e-6.
DEFAULT_DELTA = 1e-6

Variant = Literal["base", "bank"]
# Guideline-judge verdicts: 1 novel, 0 known, -1 cannot tell.
Novelty = Literal[1, 0, -1]

# Eq. 9, keyed by (correct, novel).
EXPLORATION_TABLE: dict[tuple[bool, bool], float] = {
    (True, True): 1.0,
    (True, False): 0.2,
    (False, True): -0.5,
    (False, False): -1.0,
}


def correctness_reward(correct: bool) -> float:
    """Standard correctness reward (section 3.3): r_i = +1 when the final answer is correct, -1 otherwise."""
    return 1.0 if correct else -1.0


def base_accuracy(correct: Sequence[bool], variants: Sequence[Variant]) -> float:
    """Eq. 7: p_base = (1/|B_base|) * sum over the Base group of I[r_i = 1]."""
    if len(correct) != len(variants):
        raise ValueError(f"{len(correct)} correctness flags for {len(variants)} variants")
    base = [c for c, v in zip(correct, variants, strict=True) if v == "base"]
    if not base:
        raise ValueError("the group has no Base rollout, so p_base (eq. 7) is undefined")
    return sum(base) / len(base)


def experience_rewards(
    correct: Sequence[bool], variants: Sequence[Variant], beta: float = DEFAULT_BETA, *, equal_halves: bool = True
) -> list[float]:
    """Eq. 8 over one prompt's group: a correct Bank rollout gets r_i + beta * (1 - p_base); every other rollout
    keeps its correctness reward r_i. Base and Bank must each hold half of the group (section 3.3), unless
    ``equal_halves`` is off (a group cut by a verl batch boundary: p_base from the Base rollouts present)."""
    n_base = sum(v == "base" for v in variants)
    if equal_halves and n_base * 2 != len(variants):
        raise ValueError(f"a group of {len(variants)} rollouts has {n_base} Base ones: the split must be equal")
    p_base = base_accuracy(correct, variants)
    bonus = beta * (1.0 - p_base)
    return [
        correctness_reward(c) + (bonus if c and v == "bank" else 0.0) for c, v in zip(correct, variants, strict=True)
    ]


def is_novel(novelty: Novelty | None) -> bool:
    """n_i of eq. 9 from the judge's verdict: only 1 is novel; -1 (cannot tell) and no verdict count as known."""
    return novelty == 1


def exploration_reward(correct: bool, novelty: Novelty | None) -> float:
    """Eq. 9: +1.0 correct and novel, +0.2 correct and known, -0.5 wrong and novel, -1.0 wrong and known."""
    return EXPLORATION_TABLE[(correct, is_novel(novelty))]


def group_advantages(rewards: Sequence[float], delta: float = DEFAULT_DELTA) -> list[float]:
    """Eq. 6: A_i = (r_i - mu) / (sigma + delta), with mu the group mean and sigma the population standard
    deviation sqrt((1/N) * sum (r_i - mu)^2) (the paper divides by N, not N - 1)."""
    if not rewards:
        return []
    n = len(rewards)
    mu = sum(rewards) / n
    sigma = math.sqrt(sum((r - mu) ** 2 for r in rewards) / n)
    return [(r - mu) / (sigma + delta) for r in rewards]
