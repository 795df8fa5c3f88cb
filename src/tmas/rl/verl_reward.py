"""The hybrid rewards as verl's ``custom_reward_function`` (for multi-node training on Ray; see docs/rl.md).

verl imports this file by path and calls one function by name; nothing here imports verl.

- :func:`compute_score` is the per-rollout form (``reward_model.reward_manager=naive``):
  ``compute_score(data_source, solution_str, ground_truth, extra_info)``. It cannot see a prompt group, so an
  experience rollout gets its plain correctness reward there (no eq. 8 bonus): use the batch form for that task.
- :func:`compute_score_batch` is the batch form (``reward_model.reward_manager=batch``), which verl calls with
  ``data_sources, solution_strs, ground_truths, extra_infos``. It groups the batch's rollouts by
  ``extra_info.group``, so eq. 8 sees each prompt's Base and Bank halves together, exactly as the TRL path does.

The guideline judge (eq. 9) uses the ``judge`` role of the tmas settings: a TOML file passed as the
``tmas_config`` reward kwarg, else ``$TMAS_CONFIG`` / ``./tmas.toml`` and ``TMAS_*`` variables. Its calls are kept
in the run store under ``judge_store`` (a directory) when that kwarg is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tmas.config import load_settings
from tmas.rl.novelty import LLMNoveltyJudge
from tmas.rl.rewards import DEFAULT_BETA, correctness_reward
from tmas.rl.scoring import rollout_from_example, score_rollouts


@lru_cache(maxsize=4)
def _judge(tmas_config: str | None, judge_store: str | None) -> LLMNoveltyJudge:
    return LLMNoveltyJudge(load_settings(tmas_config), Path(judge_store) if judge_store else None)


def compute_score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[str],
    extra_infos: Sequence[dict[str, Any]],
    *,
    beta: float = DEFAULT_BETA,
    tmas_config: str | None = None,
    judge_store: str | None = None,
    **_: Any,
) -> list[float]:
    rollouts = [
        rollout_from_example(dict(info), str(truth), solution)
        for solution, truth, info in zip(solution_strs, ground_truths, extra_infos, strict=True)
    ]
    needs_judge = any(r.task == "guideline" for r in rollouts)
    judge = _judge(tmas_config, judge_store) if needs_judge else None
    return [b.reward for b in score_rollouts(rollouts, judge, beta=beta)]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    if not extra_info or "task" not in extra_info:
        # A row from another data set: the standard correctness reward.
        from tmas.rl.grading import is_correct

        return correctness_reward(is_correct(solution_str, str(ground_truth)))
    info = dict(extra_info)
    if info["task"] == "experience":
        info["task"] = "normal"  # no group in sight: eq. 8 needs the batch form
    return compute_score_batch([data_source], [solution_str], [ground_truth], [info], **kwargs)[0]
