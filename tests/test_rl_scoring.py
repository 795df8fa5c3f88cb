"""Scoring rollouts: correctness by the harness's rules, eq. 8 per prompt group, eq. 9 with the guideline judge
answering over HTTP from the simulated server (its verdicts 1, 0, -1 and an unusable reply)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import settings_for
from tmas.agents.guideline_judge import StrategyView, judge_prompt, parse_novelty
from tmas.agents.output import AgentOutputError
from tmas.rl.novelty import LLMNoveltyJudge
from tmas.rl.scoring import RolloutInput, score_rollouts
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

STRATEGIES = [StrategyView(id="G1", description="Multiply directly.")]


def verdict(novelty: int) -> str:
    return f'```json\n{{"identified_strategy": "something", "novelty": {novelty}, "same_as": null}}\n```'


def judge_script() -> SimScript:
    """The judge answers by a marker in the student's solution: NEW -> 1, OLD -> 0, VAGUE -> -1, else garbage."""
    rules = [
        Rule(role="judge", pattern="ROUTE-NEW", replies=[verdict(1)]),
        Rule(role="judge", pattern="ROUTE-OLD", replies=[verdict(0)]),
        Rule(role="judge", pattern="ROUTE-VAGUE", replies=[verdict(-1)]),
        Rule(role="judge", replies=["I think it is rather new, honestly."]),
    ]
    return SimScript(rules=rules)


@pytest.fixture
def judge_sim() -> Iterator[SimServer]:
    """:func:`judge_script` served over HTTP."""
    with SimServer(judge_script()) as server:
        yield server


def explore(completion: str) -> RolloutInput:
    return RolloutInput(
        task="guideline",
        group="run/p1/1/guideline",
        question="What is 17*23?",
        ground_truth="391",
        completion=completion,
        strategies=STRATEGIES,
    )


def test_parse_novelty() -> None:
    assert parse_novelty(verdict(1)).novelty == 1
    assert parse_novelty('{"identified_strategy": "x", "classification": "-1"}').novelty == -1
    assert parse_novelty('{"novelty": 0.0, "same_as": " G2 "}').same_as == "G2"
    for bad in ("", "no json here", '{"novelty": 2}', '{"identified_strategy": "x"}'):
        with pytest.raises(AgentOutputError):
            parse_novelty(bad)
    with pytest.raises(AgentOutputError, match="truncated"):
        parse_novelty(verdict(1), truncated=True)


def test_judge_prompt_keeps_problem_text_as_data() -> None:
    messages = judge_prompt("Is {{ 1 + 1 }} two?", STRATEGIES, "Answer {% raw %}")
    assert "Is {{ 1 + 1 }} two?" in messages[-1].content
    assert "- [G1] Multiply directly." in messages[-1].content
    assert "Answer {% raw %}" in messages[-1].content


def test_novelty_table_through_the_judge(tmp_path: Path) -> None:
    # The judge on a model of one's own, whose settings name no endpoint: nothing is provisioned or asked but it.
    model = ScriptedModel(judge_script())
    assert not model.settings.endpoint.base_url
    judge = LLMNoveltyJudge(model.settings, store_dir=tmp_path / "judge", model=model)
    rollouts = [
        explore("ROUTE-NEW ... so \\boxed{391}"),  # correct, novel
        explore("ROUTE-OLD ... so \\boxed{391}"),  # correct, known
        explore("ROUTE-NEW ... so \\boxed{390}"),  # wrong, novel
        explore("ROUTE-OLD ... so \\boxed{390}"),  # wrong, known
        explore("ROUTE-VAGUE ... \\boxed{391}"),  # correct, judge cannot tell -> known
        explore("garbled \\boxed{391}"),  # correct, unusable judge reply -> known
    ]
    scored = score_rollouts(rollouts, judge)
    assert [b.reward for b in scored] == [1.0, 0.2, -0.5, -1.0, 0.2, 0.2]
    assert [b.correct for b in scored] == [True, True, False, False, True, True]
    assert [b.novelty for b in scored] == [1, 0, 1, 0, -1, None]
    assert scored[4].judge_note is not None and "(-1)" in scored[4].judge_note
    assert scored[5].judge_note is not None and "unusable" in scored[5].judge_note
    assert [b.judge_note for b in scored[:4]] == [None] * 4
    # One judge call per rollout, each showing the guideline bank and that rollout.
    assert len(model.calls) == len(model.calls_of("judge")) == 6
    assert all("- [G1] Multiply directly." in call.messages[-1].content for call in model.calls)
    # The calls are kept: a second scoring replays them from the store without asking the model again.
    assert [b.reward for b in score_rollouts(rollouts, judge)] == [1.0, 0.2, -0.5, -1.0, 0.2, 0.2]
    assert len(model.calls) == 6


def test_experience_groups_are_scored_apart() -> None:
    def rollout(group: str, variant: str, answer: str) -> RolloutInput:
        return RolloutInput(
            task="experience",
            group=group,
            variant=variant,  # type: ignore[arg-type]
            question="q",
            ground_truth="12",
            completion=f"\\boxed{{{answer}}}",
        )

    # Group a: Base 0/2 -> p_base 0, bonus 0.6. Group b: Base 2/2 -> p_base 1, no bonus. Interleaved on purpose.
    batch = [
        rollout("a", "base", "1"),
        rollout("b", "base", "12"),
        rollout("a", "base", "2"),
        rollout("b", "base", "12"),
        rollout("a", "bank", "12"),
        rollout("b", "bank", "12"),
        rollout("a", "bank", "3"),
        rollout("b", "bank", "4"),
    ]
    scored = score_rollouts(batch)
    assert [b.reward for b in scored] == pytest.approx([-1, 1, -1, 1, 1.6, 1.0, -1, -1])
    assert [b.p_base for b in scored] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="group 'a'"):
        score_rollouts(batch[:1] + batch[4:5] + batch[6:7])


def test_correctness_uses_the_harness_rules() -> None:
    def normal(completion: str, truth: str) -> float:
        rollout = RolloutInput(task="normal", group="g", question="q", ground_truth=truth, completion=completion)
        return score_rollouts([rollout])[0].reward

    assert normal("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0  # Math-Verify: equal values
    assert normal("\\boxed{ 391 }", "391") == 1.0
    assert normal("the answer is 391", "391") == -1.0  # no boxed answer: not credited
    assert normal("\\boxed{392}", "391") == -1.0


def test_boxes_joined_into_one_answer_are_graded_together() -> None:
    def reward(completion: str, truth: str, question: str = "Find n.") -> float:
        rollout = RolloutInput(task="normal", group="g", question=question, ground_truth=truth, completion=completion)
        return score_rollouts([rollout])[0].reward

    # Hedging between two values is no answer of either; listing every solution is the answer to "find all".
    assert reward("So $\\boxed{4}$ or $\\boxed{3}$.", "3") == -1.0
    assert reward("The solutions are $\\boxed{4}$ and $\\boxed{3}$.", "3, 4", "Find all n with n^2 + 12 = 7n.") == 1.0
    # Boxes apart are not joined: the last one is the answer.
    assert reward("First \\boxed{4}.\n\nOn checking, \\boxed{3}.", "3") == 1.0


def test_a_box_in_the_thinking_is_no_answer() -> None:
    def normal(completion: str) -> float:
        rollout = RolloutInput(task="normal", group="g", question="q", ground_truth="391", completion=completion)
        return score_rollouts([rollout])[0].reward

    # The answer after the thinking is what is graded, where the thinking boxed another value or the same.
    assert normal("Maybe \\boxed{391}? No: 17*23 needs a check.</think>\n\nThe answer is 392.") == -1.0
    assert normal("<think>Maybe \\boxed{391}? No.</think>\n\nSo \\boxed{391}.") == 1.0
    assert normal("Maybe \\boxed{392}.</think>\n\nSo \\boxed{391}.") == 1.0
    # Cut inside a think block it opened: no answer yet, whatever the thinking boxed.
    assert normal("<think>17*23: maybe \\boxed{391}, but first check 17*20 = 340, and") == -1.0


def test_a_completion_that_starts_inside_an_opened_think_block() -> None:
    # Qwen3-4B-Thinking-2507's chat template ends the prompt with "<think>", so a completion holds only the closing
    # tag, and one cut while it thinks holds no tag at all: the box in it is a step of the work, not a final answer.
    def normal(completion: str, think_opened: bool) -> float:
        rollout = RolloutInput(task="normal", group="g", question="q", ground_truth="391", completion=completion)
        return score_rollouts([rollout], think_opened=think_opened)[0].reward

    cut = "17*23: maybe \\boxed{391}, but first check 17*20 = 340, and"
    assert normal(cut, think_opened=True) == -1.0  # no final answer (standard correctness reward: -1)
    assert normal(cut, think_opened=False) == 1.0  # a model that does not think: its last box is its answer
    # Finished: the answer after </think> is graded, as without the flag.
    assert normal("Maybe \\boxed{392}.</think>\n\nSo \\boxed{391}.", think_opened=True) == 1.0
    assert normal("<think>Maybe \\boxed{391}.</think>\n\nIt is 392.", think_opened=True) == -1.0


def test_exploration_without_a_judge_is_an_error() -> None:
    with pytest.raises(ValueError, match="guideline judge"):
        score_rollouts([explore("\\boxed{391}")])


def test_judge_outcomes_are_json_serialisable(judge_sim: SimServer) -> None:
    scored = score_rollouts([explore("ROUTE-VAGUE \\boxed{1}")], LLMNoveltyJudge(settings_for(judge_sim)))
    assert json.loads(scored[0].model_dump_json())["reward"] == -1.0


async def test_the_judge_called_from_a_running_event_loop_answers_on_its_own_model() -> None:
    # A trainer may call the reward function from inside its own event loop: the judge runs in a thread of its own.
    model = ScriptedModel(judge_script())
    judge = LLMNoveltyJudge(model.settings, model=model)
    [outcome] = judge([explore("ROUTE-NEW ... so \\boxed{391}")])
    assert outcome.novelty == 1 and len(model.calls_of("judge")) == 1


def test_unusable_replies_in_a_group_are_wrong_and_a_uniform_group_has_no_advantage() -> None:
    from tmas.rl.dynamic_sampling import groups_with_spread
    from tmas.rl.rewards import Variant, group_advantages

    def rollout(group: str, variant: Variant, completion: str) -> RolloutInput:
        return RolloutInput(
            task="experience",
            group=group,
            variant=variant,
            question="What is 17*23?",
            ground_truth="391",
            completion=completion,
        )

    # An empty reply, a box never closed, an empty box and a reply cut inside its thinking have no answer: r_i = -1.
    base = ["", "\\boxed{391", "So \\boxed{}.", "\\boxed{391}"]
    bank = ["<think>17*23: maybe \\boxed{391}, check", "\\boxed{391}", "It is \\boxed{391}.", "   "]
    batch = [rollout("a", "base", c) for c in base] + [rollout("a", "bank", c) for c in bank]
    # Eq. 7: p_base = 1/4. Eq. 8: a correct Bank rollout gets 1 + 0.6 * (1 - 1/4) = 1.45.
    rewards = [b.reward for b in score_rollouts(batch)]
    assert rewards == pytest.approx([-1, -1, -1, 1, -1, 1.45, 1.45, -1])
    # Eq. 6 (population sigma): mu = (-5 + 1 + 2.9) / 8 = -0.1375; deviations -0.8625 (x5), 1.1375, 1.5875 (x2);
    # sigma^2 = (5 * 0.74390625 + 1.29390625 + 2 * 2.52015625) / 8 = 1.25671875, sigma = 1.1210347.
    assert group_advantages(rewards) == pytest.approx(
        [-0.76938] * 3 + [1.01469] + [-0.76938] + [1.41610] * 2 + [-0.76938], abs=1e-5
    )

    # Every rollout wrong (eq. 8: all -1) or every rollout right (p_base = 1, so no bonus: all +1): sigma = 0, so
    # eq. 6 gives every rollout A = 0, and dynamic sampling finds no spread in the group.
    wrong = [rollout("w", v, "\\boxed{390}") for v in ("base", "base", "bank", "bank")]
    right = [rollout("r", v, "\\boxed{391}") for v in ("base", "base", "bank", "bank")]
    uniform = [b.reward for b in score_rollouts(wrong + right)]
    assert uniform == [-1.0] * 4 + [1.0] * 4
    assert group_advantages(uniform[:4]) == group_advantages(uniform[4:]) == [0.0] * 4
    assert groups_with_spread(uniform, 4) == [False, False]
    assert groups_with_spread(rewards, 8) == [True]
