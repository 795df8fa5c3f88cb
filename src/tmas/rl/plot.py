"""The training curve from ``OUT/steps.jsonl``: rewards above (all rollouts and each task's), the components of
eq. 7-9 below (accuracy per task, the experience groups' p_base and bonus, the exploration rollouts' novel share).
A step holds few prompt groups, so the reward of all rollouts is also drawn as a running mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tmas.rl.step_log import Row, read_rows

# Steps in the running mean of the reward.
WINDOW = 5

REWARDS = (
    ("reward", "all rollouts"),
    ("normal/reward", "normal"),
    ("experience/reward", "experience (eq. 8)"),
    ("guideline/reward", "guideline (eq. 9)"),
)
COMPONENTS = (
    ("normal/accuracy", "normal accuracy"),
    ("experience/base_accuracy", "Base accuracy = p_base (eq. 7)"),
    ("experience/bank_accuracy", "Bank accuracy"),
    ("experience/bonus", "Bank bonus paid (eq. 8)"),
    ("guideline/accuracy", "guideline accuracy"),
    ("guideline/novel", "novel share (eq. 9)"),
)


def _series(rows: list[Row], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in points], [v for _, v in points]


def _panel(ax: Any, rows: list[Row], lines: tuple[tuple[str, str], ...], ylabel: str) -> None:
    for key, label in lines:
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, label=label)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def plot_steps(steps_jsonl: Path, png: Path) -> Path | None:
    """Draw the curve into ``png``; None when no step has been logged yet."""
    rows = read_rows(steps_jsonl)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps, values = _series(rows, "reward")
    if len(steps) >= WINDOW:
        running = [sum(values[i - WINDOW + 1 : i + 1]) / WINDOW for i in range(WINDOW - 1, len(values))]
        top.plot(steps[WINDOW - 1 :], running, color="black", linewidth=2, label=f"all, mean of {WINDOW} steps")
    _panel(top, rows, REWARDS, "mean reward")
    top.set_title(f"GRPO on the hybrid rewards: {len(rows)} steps ({steps_jsonl.parent.name})")
    _panel(bottom, rows, COMPONENTS, "share / bonus")
    bottom.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
