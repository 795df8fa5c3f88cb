"""One batch of rollouts -> hybrid rewards (paper section 3.3), shared by the TRL and verl adapters.

A rollout carries what its training example says (task, group, Base/Bank variant, question, guideline bank, ground
truth) and the completion. Scoring grades every rollout (the last ``\\boxed{}`` answer after its thinking, by the
registered ``rules`` grader in the calling thread; an undecided answer counts as wrong), asks the guideline judge
about the exploration rollouts, and applies eq. 8 per prompt group (never across groups: p_base comes from the Base
half of the same group) and eq. 9 per rollout. Both trainers call :func:`score_rollouts`, so they give the same
rewards on the same rollouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from tmas.agents.guideline_judge import StrategyView
from tmas.answers import final_boxed
from tmas.grading.grades import Item
from tmas.grading.registry import grader_named
from tmas.grading.rules import RULES
from tmas.llm.reasoning import THINK_OPEN, split_reasoning
from tmas.problems import Problem
from tmas.rl.rewards import (
    DEFAULT_BETA,
    Novelty,
    Variant,
    base_accuracy,
    correctness_reward,
    experience_rewards,
    exploration_reward,
)

Task = Literal["normal", "experience", "guideline"]
TASKS: tuple[Task, ...] = ("normal", "experience", "guideline")


class RolloutInput(BaseModel):
    task: Task
    group: str
    variant: Variant | None = None
    question: str
    ground_truth: str
    completion: str
    strategies: list[StrategyView] = Field(default_factory=list)


class JudgeOutcome(BaseModel):
    """The guideline judge's answer on one rollout: ``novelty`` None when its reply was unusable (``note`` says why)."""

    novelty: Novelty | None
    note: str | None = None


# A judge takes the exploration rollouts of a batch and returns one outcome each, in order.
NoveltyJudge = Callable[[Sequence[RolloutInput]], list[JudgeOutcome]]


class RewardBreakdown(BaseModel):
    task: Task
    group: str
    variant: Variant | None = None
    correct: bool
    reward: float
    p_base: float | None = None
    novelty: Novelty | None = None
    # Why the judge's verdict was not used as given (cannot tell, unusable reply): the rollout counted as known.
    judge_note: str | None = None
    # Why eq. 8 could not be applied as written (a group's Base half missing from the batch, unequal halves).
    group_note: str | None = None


def completion_answer(completion: str, *, think_opened: bool = False) -> str | None:
    """A completion's final answer: its final boxed answer (:func:`tmas.answers.final_boxed`: the last box, with the
    boxes joined to it by "or", "and" or commas, so "\\boxed{4} or \\boxed{3}" offers both and is no answer of 3)
    in what it says after its thinking. A box in the thinking is a step of the work, not the answer: a completion that
    closes its thinking without boxing an answer has none, and one cut inside a think block it opened (no
    ``</think>``) has none either.

    ``think_opened``: the prompt's chat template opened the think block (Qwen3-*-Thinking-2507, DeepSeek-R1
    distills), so the completion starts inside it: all of it is thinking until its ``</think>``, and one cut before
    that tag, which then holds no tag at all, has no answer."""
    if think_opened and THINK_OPEN not in completion:
        completion = THINK_OPEN + completion
    content, _ = split_reasoning(completion)
    return final_boxed(content) or None


def is_correct(completion: str, ground_truth: str, *, question: str = "", think_opened: bool = False) -> bool:
    """Whether a completion's final answer (:func:`completion_answer`) is right; a reward is never given for an
    answer the rules cannot confirm."""
    problem = Problem(problem_id="rollout", question=question, answer=ground_truth)
    answer = completion_answer(completion, think_opened=think_opened)
    item = Item(("rollout", 0, 0), problem, answer, completion)
    return grader_named(RULES).grade_one(item) is True


def rollout_from_example(extra_info: dict[str, Any], ground_truth: str, completion: str) -> RolloutInput:
    """A rollout of a training example, from the example's ``extra_info`` (as :mod:`tmas.rl.data` writes it)."""
    try:
        return RolloutInput(
            task=extra_info["task"],
            group=extra_info["group"],
            variant=extra_info.get("variant") or None,
            question=extra_info["question"],
            ground_truth=ground_truth,
            completion=completion,
            strategies=extra_info.get("guideline_bank") or [],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"training example's extra_info is not from 'tmas rl build-data': {exc}") from None


def score_rollouts(
    rollouts: Sequence[RolloutInput],
    judge: NoveltyJudge | None = None,
    *,
    beta: float = DEFAULT_BETA,
    partial_groups: bool = False,
    think_opened: bool = False,
) -> list[RewardBreakdown]:
    """The hybrid reward of every rollout, in order. A group whose halves are not equal is an error unless
    ``partial_groups`` (verl, where a batch boundary can cut a group): then p_base comes from the Base rollouts
    present, a group with none gets plain correctness, and ``group_note`` says so. ``think_opened``: the policy's
    chat template opens the think block in the prompt (see :func:`completion_answer`)."""
    correct = [
        is_correct(r.completion, r.ground_truth, question=r.question, think_opened=think_opened) for r in rollouts
    ]
    out: list[RewardBreakdown | None] = [None] * len(rollouts)

    # Eq. 8, one prompt group at a time.
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rollouts):
        if r.task == "experience":
            groups.setdefault(r.group, []).append(i)
    for group, members in groups.items():
        variants: list[Variant] = []
        for i in members:
            variant = rollouts[i].variant
            if variant is None:
                raise ValueError(f"group {group!r}: an experience rollout without a Base/Bank variant")
            variants.append(variant)
        flags = [correct[i] for i in members]
        n_base = variants.count("base")
        note = None
        if partial_groups and n_base * 2 != len(variants):
            note = f"group incomplete in this batch ({n_base} Base, {len(variants) - n_base} Bank rollouts)"
        try:
            if note is not None and n_base == 0:
                # No Base rollout to measure p_base (eq. 7) with: the Bank rollouts keep their correctness reward.
                p_base: float | None = None
                rewards = [correctness_reward(c) for c in flags]
                note += ": no p_base, no eq. 8 bonus"
            else:
                rewards = experience_rewards(flags, variants, beta, equal_halves=note is None)
                p_base = base_accuracy(flags, variants)
        except ValueError as exc:
            raise ValueError(f"group {group!r}: {exc}") from None
        for i, variant, reward in zip(members, variants, rewards, strict=True):
            out[i] = RewardBreakdown(
                task="experience",
                group=group,
                variant=variant,
                correct=correct[i],
                reward=reward,
                p_base=p_base,
                group_note=note,
            )

    # Eq. 9: the judge sees every exploration rollout of the batch at once (its calls run concurrently).
    explore = [i for i, r in enumerate(rollouts) if r.task == "guideline"]
    if explore:
        if judge is None:
            raise ValueError("exploration rollouts need a guideline judge (none configured)")
        outcomes = judge([rollouts[i] for i in explore])
        if len(outcomes) != len(explore):
            raise ValueError(f"the judge returned {len(outcomes)} verdicts for {len(explore)} rollouts")
        for i, outcome in zip(explore, outcomes, strict=True):
            note = outcome.note
            if outcome.novelty == -1 and note is None:
                note = "judge could not tell the strategy (-1): counted as known"
            out[i] = RewardBreakdown(
                task="guideline",
                group=rollouts[i].group,
                correct=correct[i],
                reward=exploration_reward(correct[i], outcome.novelty),
                novelty=outcome.novelty,
                judge_note=note,
            )

    for i, r in enumerate(rollouts):
        if r.task == "normal":
            out[i] = RewardBreakdown(
                task="normal", group=r.group, correct=correct[i], reward=correctness_reward(correct[i])
            )
    return [b for b in out if b is not None]
