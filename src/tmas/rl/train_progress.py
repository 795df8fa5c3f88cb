"""The training run's progress: a live bar on a terminal, one plain line per step otherwise.

Each step shows the step count, the mean reward, tokens per second and the time left, estimated from the mean
duration of the steps this process has run (a resumed run does not count the time before its checkpoint).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from transformers import TrainerCallback

from tmas.rl.step_log import Row


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def step_text(row: Row, first_step: int) -> str:
    """``reward -0.42 · 85 tok/s · 0:40:00 left`` for a line of steps.jsonl."""
    done = int(row["step"]) - first_step
    left = (int(row["max_steps"]) - int(row["step"])) * float(row["elapsed_s"]) / max(done, 1)
    reward = row.get("reward")
    shown = f"{reward:+.3f}" if isinstance(reward, int | float) else "-"
    return f"reward {shown} · {row['tokens_per_s']:.0f} tok/s · {_clock(left)} left"


class TrainProgress(TrainerCallback):
    """Takes the place of the trainer's own bar; :class:`tmas.rl.step_log.StepLog` hands it each step's line."""

    def __init__(self, *, live: bool | None = None) -> None:
        self.live = sys.stderr.isatty() if live is None else live
        self.first_step = 0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.first_step = int(state.global_step)
        if not self.live or not state.is_world_process_zero:
            return  # under several processes the main one alone draws it (and alone gets the steps' lines)
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=Console(stderr=True, highlight=False),
        )
        self._task = self._progress.add_task("starting", total=int(state.max_steps), completed=self.first_step)
        self._progress.start()

    def update(self, row: Row) -> None:
        text = step_text(row, self.first_step)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=int(row["step"]), description=text)
        else:
            print(f"step {row['step']}/{row['max_steps']} · {text}", file=sys.stderr, flush=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
