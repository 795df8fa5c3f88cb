"""The hybrid rewards as TRL reward functions: one per task, so TRL logs each component per step.

TRL calls every reward function on the whole local batch with the dataset's columns as keyword lists and sums
their outputs, skipping None; each function here answers for the rows of its own task and None elsewhere, so the
sum is exactly the task's reward. The three share one scoring of the batch (the judge is asked once per rollout).
Each scored batch is appended to ``log_path`` (JSONL: step, per-rollout reward, correctness, p_base, novelty, notes;
``step`` is the number of optimizer steps done before the batch, so 0 for the first). Under the trainer
(``hold_log``) a batch is written only once the trainer knows which of its groups the step trains on, and each row
then says so (``trained``): dynamic sampling scores groups it then drops.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tmas.llm.reasoning import THINK_OPEN
from tmas.rl.rewards import DEFAULT_BETA
from tmas.rl.scoring import NoveltyJudge, RewardBreakdown, RolloutInput, Task, rollout_from_example, score_rollouts

RewardFunc = Callable[..., list[float | None]]


def completion_text(completion: Any) -> str:
    """TRL passes a completion as text, or (conversational data) as a list of messages. A message whose thinking TRL
    parsed out (a tokenizer with a response template: ``reasoning_content``) reads as the model wrote it, the
    thinking in its think block, so that the answer is still what follows ``</think>``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(_message_text(m) for m in completion if isinstance(m, dict))
    raise TypeError(f"unexpected completion of type {type(completion).__name__}")


def _message_text(message: dict[str, Any]) -> str:
    content = str(message.get("content") or "")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return f"{THINK_OPEN}{reasoning}</think>\n\n{content}" if reasoning else content


class HybridReward:
    def __init__(
        self,
        judge: NoveltyJudge | None = None,
        *,
        beta: float = DEFAULT_BETA,
        log_path: Path | None = None,
        think_opened: bool = False,
    ) -> None:
        self.judge = judge
        self.beta = beta
        self.log_path = log_path
        # The policy's chat template opens the think block in the prompt: a completion is thinking until its
        # </think> (tmas.rl.scoring.completion_answer).
        self.think_opened = think_opened
        self._last: tuple[tuple[str, ...], list[RewardBreakdown]] | None = None
        # The optimizer steps done before the last batch scored (TRL's global_step; None outside the trainer).
        self.last_step: int | None = None
        # Set by the trainer: score() leaves the batch to record(), called with the groups the step trains on.
        self.hold_log = False
        # Every rollout scored since the last drain() (the per-step log's share).
        self._pending: list[RewardBreakdown] = []

    def rollouts(
        self, completions: Sequence[Any], extra_info: Sequence[dict[str, Any]], reward_model: Sequence[dict[str, Any]]
    ) -> list[RolloutInput]:
        return [
            rollout_from_example(info, str(rm["ground_truth"]), completion_text(c))
            for c, info, rm in zip(completions, extra_info, reward_model, strict=True)
        ]

    def score(self, completions: Sequence[Any], **columns: Any) -> list[RewardBreakdown]:
        rollouts = self.rollouts(completions, columns["extra_info"], columns["reward_model"])
        step = getattr(columns.get("trainer_state"), "global_step", None)
        # The three task functions are called one after another on the same batch: score it once.
        key = (str(step), *(f"{r.group}\x1f{r.variant}\x1f{r.completion}" for r in rollouts))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        scored = score_rollouts(rollouts, self.judge, beta=self.beta, think_opened=self.think_opened)
        self._last = (key, scored)
        self.last_step = step
        if not self.hold_log:
            self.record(scored, step)
        return scored

    def record(
        self, scored: Sequence[RewardBreakdown], step: int | None, trained: Sequence[bool] | None = None
    ) -> None:
        """Count ``scored`` in the next drain() and append it to the log, each row with whether the step trained on
        it where ``trained`` is given."""
        self._pending.extend(scored)
        if self.log_path is None:
            return
        flags: Sequence[bool | None] = [None] * len(scored) if trained is None else trained
        lines = []
        for b, flag in zip(scored, flags, strict=True):
            row = {"step": step, **b.model_dump(mode="json")}
            if flag is not None:
                row["trained"] = flag
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        with self.log_path.open("a", encoding="utf-8") as fh:
            fh.write("".join(lines))

    def last_scored(self) -> list[RewardBreakdown]:
        """The last batch scored, in the batch's order (what the reward functions returned for it)."""
        if self._last is None:
            raise RuntimeError("no batch scored yet")
        return self._last[1]

    def drain(self) -> list[RewardBreakdown]:
        """The rollouts scored since the last call."""
        pending, self._pending = self._pending, []
        return pending

    def function(self, task: Task) -> RewardFunc:
        """The reward function of ``task`` (named after it: TRL logs ``rewards/<name>/mean``)."""

        def reward(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
            return [b.reward if b.task == task else None for b in self.score(completions, **columns)]

        reward.__name__ = {"normal": "correctness", "experience": "experience", "guideline": "exploration"}[task]
        return reward

    def functions(self) -> list[RewardFunc]:
        return [self.function("normal"), self.function("experience"), self.function("guideline")]
