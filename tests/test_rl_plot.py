"""The reward curve reads what the step log holds: a hand-written ``steps.jsonl`` gives the plotted series worked
out below, a component a step did not have (``null``) leaves that step out of its line, and the running mean of the
reward covers the last five steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")


def drawn(monkeypatch: pytest.MonkeyPatch, steps: Path, png: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every line plot_steps drew, by label: its steps and values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tmas.rl.plot import plot_steps

    figures: list[Any] = []
    close = plt.close

    def keep(fig: Any = None) -> None:
        figures.append(fig)
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    assert plot_steps(steps, png) == png and png.stat().st_size > 0
    (figure,) = figures
    return {
        str(line.get_label()): ([int(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
        for ax in figure.axes
        for line in ax.get_lines()
    }


def test_the_curve_holds_the_logged_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rewards = [-1.0, -0.5, 0.0, 0.5, 1.0, 0.5]
    rows = []
    for step, reward in enumerate(rewards, 1):
        row: dict[str, Any] = {"step": step, "reward": reward, "normal/reward": reward, "normal/accuracy": 0.25}
        # Experience rollouts only on even steps (null otherwise, as reward_components writes a task without any).
        even = step % 2 == 0
        row["experience/reward"] = 0.075 if even else None
        row["experience/bonus"] = 0.15 if even else None
        row["guideline/novel"] = None
        rows.append(row)
    steps = tmp_path / "steps.jsonl"
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))

    lines = drawn(monkeypatch, steps, tmp_path / "rewards.png")
    assert lines["all rollouts"] == ([1, 2, 3, 4, 5, 6], rewards)
    assert lines["normal"] == ([1, 2, 3, 4, 5, 6], rewards)
    assert lines["normal accuracy"] == ([1, 2, 3, 4, 5, 6], [0.25] * 6)
    # Eq. 8's reward and bonus: only the steps that had experience rollouts.
    assert lines["experience (eq. 8)"] == ([2, 4, 6], [0.075] * 3)
    assert lines["Bank bonus paid (eq. 8)"] == ([2, 4, 6], [0.15] * 3)
    # No step had a guideline rollout (eq. 9): no line at all.
    assert "novel share (eq. 9)" not in lines and "guideline (eq. 9)" not in lines
    # Mean of 5 steps: steps 1-5 -> (-1 - 0.5 + 0 + 0.5 + 1) / 5 = 0; steps 2-6 -> (-0.5 + 0 + 0.5 + 1 + 0.5) / 5 = 0.3.
    assert lines["all, mean of 5 steps"][0] == [5, 6]
    assert lines["all, mean of 5 steps"][1] == pytest.approx([0.0, 0.3])


def test_no_step_logged_draws_nothing(tmp_path: Path) -> None:
    from tmas.rl.plot import plot_steps

    assert plot_steps(tmp_path / "steps.jsonl", tmp_path / "rewards.png") is None
    assert not (tmp_path / "rewards.png").exists()
