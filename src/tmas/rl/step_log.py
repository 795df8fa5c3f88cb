"""One line per optimizer step in ``OUT/steps.jsonl``: each hybrid-reward component and the trainer's own figures.

Per task, from the rollouts the step scored (:class:`tmas.rl.trl_rewards.HybridReward`): the mean reward and the
accuracy; for ``experience`` also the Base and Bank accuracies, p_base (eq. 7, averaged over the step's groups) and
the bonus eq. 8 paid per Bank rollout; for ``guideline`` the share the judge found novel (eq. 9) and the share it
gave no usable verdict on (counted as known). From TRL: the mean
and spread of the rewards (eq. 6 divides by that spread; ``frac_reward_zero_std`` is the share of groups whose
rollouts all got one reward, so no advantage), the loss, the completion lengths, and tokens (prompt + completion)
per second of the step; from the trainer, the rollouts' generation time and generated tokens per second of it
(``rollout/*``), and what dynamic sampling did (``dynamic/*``). A resumed run first drops the lines past its
checkpoint, so every step appears once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

from transformers import TrainerCallback

from tmas.errors import InputError
from tmas.rl.rewards import correctness_reward
from tmas.rl.scoring import TASKS, RewardBreakdown
from tmas.rl.trl_rewards import HybridReward

STEPS_FILE = "steps.jsonl"
REWARDS_FILE = "rewards.jsonl"
# TRL's figures copied into each line, under the same names.
TRL_KEYS = (
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "entropy",
    "num_tokens",
)
# Families of the trainer's own figures copied whole: the rollouts' generation (time, generated tokens per second
# of it) and dynamic sampling (groups generated, with a spread of rewards, trained without one).
TRAINER_PREFIXES = ("rollout/", "dynamic/")

Row = dict[str, Any]


def _mean(values: Sequence[float]) -> float | None:
    return mean(values) if values else None


def reward_components(scored: Sequence[RewardBreakdown]) -> Row:
    """The step's hybrid-reward components, keyed ``<task>/<figure>`` (None where the step had no such rollout)."""
    row: Row = {}
    for task in TASKS:
        mine = [b for b in scored if b.task == task]
        row[f"{task}/rollouts"] = len(mine)
        row[f"{task}/reward"] = _mean([b.reward for b in mine])
        row[f"{task}/accuracy"] = _mean([float(b.correct) for b in mine])
    experience = [b for b in scored if b.task == "experience"]
    bank = [b for b in experience if b.variant == "bank"]
    row["experience/base_accuracy"] = _mean([float(b.correct) for b in experience if b.variant == "base"])
    row["experience/bank_accuracy"] = _mean([float(b.correct) for b in bank])
    p_base = {b.group: b.p_base for b in experience if b.p_base is not None}
    row["experience/p_base"] = _mean(list(p_base.values()))
    row["experience/bonus"] = _mean([b.reward - correctness_reward(b.correct) for b in bank])
    explored = [b for b in scored if b.task == "guideline"]
    row["guideline/novel"] = _mean([float(b.novelty == 1) for b in explored])
    # Counted as known for want of a verdict (a failed judge call, an unusable reply): a judge that is down reads
    # here, not as a policy that stopped finding new strategies.
    row["guideline/judge_unusable"] = _mean([float(b.novelty is None) for b in explored])
    return row


def read_rows(path: Path) -> list[Row]:
    """The JSON objects of a log, one a line. A last line without its newline that does not read is one a stopped
    run was writing (lines are appended, and a kill can land between the writes of one): it is left out. Any other
    line that does not read is an error naming the file and the line."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    rows: list[Row] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # cut off while it was written: past the last checkpoint, trained again on --resume
            raise InputError(f"{path}: line {number} is not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}: line {number} is not a JSON object")
        rows.append(row)
    return rows


def _keep(path: Path, keep: Callable[[Row], bool]) -> None:
    if path.is_file():
        rows = [r for r in read_rows(path) if keep(r)]
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def trim_logs(out: Path, step: int) -> None:
    """Forget what a stopped run logged after its checkpoint at ``step``: those steps are trained again."""
    _keep(out / STEPS_FILE, lambda r: int(r["step"]) <= step)
    # A rollout's step there is the number of steps done before it was scored.
    _keep(out / REWARDS_FILE, lambda r: r.get("step") is not None and int(r["step"]) < step)


class StepLog(TrainerCallback):
    """Writes ``steps.jsonl``, hands each line to ``on_row`` (the progress display), and redraws the curve at
    every checkpoint and at the end (``on_save``): in the main process only, where the trainer gathers every
    process's rollouts (:func:`tmas.rl.trl_train.record_rollouts`)."""

    def __init__(
        self,
        out: Path,
        reward: HybridReward,
        on_row: Callable[[Row], None] | None = None,
        on_save: Callable[[Path], object] | None = None,
    ) -> None:
        self.path = out / STEPS_FILE
        self.reward = reward
        self.on_row = on_row
        self.save_hook = on_save
        self._clock = time.monotonic()
        self._tokens = 0.0
        self._started = self._clock
        self.first_step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After a resume, global_step and the token count are the checkpoint's.
        self.first_step = int(state.global_step)
        self._tokens = float(state.num_input_tokens_seen or 0)
        self._clock = self._started = time.monotonic()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if not state.is_world_process_zero:
            return  # one process writes the log (TRL's figures are already gathered over all of them)
        if not logs or "reward" not in logs:
            return  # the summary TRL logs at the end, not a step
        now = time.monotonic()
        tokens = float(logs.get("num_tokens", state.num_input_tokens_seen or 0))
        row: Row = {"step": int(state.global_step), "max_steps": int(state.max_steps)}
        row["step_s"] = round(now - self._clock, 3)
        row["elapsed_s"] = round(now - self._started, 3)
        row["tokens_per_s"] = round((tokens - self._tokens) / max(now - self._clock, 1e-9), 2)
        row.update({k: logs[k] for k in TRL_KEYS if k in logs})
        row.update({k: v for k, v in logs.items() if k.startswith(TRAINER_PREFIXES)})
        row.update(reward_components(self.reward.drain()))
        self._clock, self._tokens = now, tokens
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        if self.on_row is not None:
            self.on_row(row)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.save_hook is not None and state.is_world_process_zero:
            self.save_hook(self.path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.save_hook is not None and state.is_world_process_zero:
            self.save_hook(self.path)
