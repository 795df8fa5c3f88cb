"""The hybrid rewards as verl's ``custom_reward_function`` (for multi-node training on Ray; see docs/rl.md).

verl imports this file by path and calls one function by name; nothing here imports verl.

- :func:`compute_score_batch` is the form to train with (``reward_model.reward_manager=batch``, verl 0.6.1: from
  0.7 verl's reward loop scores one rollout at a time and has no batch manager): verl calls it with
  ``data_sources, solution_strs, ground_truths, extra_infos`` for the whole batch. It scores each prompt group
  (``extra_info.group``) together, so eq. 7-8 take p_base from the group's own Base rollouts, and it returns one
  dict per rollout whose ``uid`` is that group. verl's batch reward manager puts every key of such a dict beside
  the batch (``reward_extra_info``) before the advantage is computed, and GRPO groups rollouts by ``uid``: so a
  prompt's Base and Bank rollouts are normalised as ONE group (eq. 6), as the paper trains. Data from ``tmas rl
  build-data --layout verl`` gives every group two rows (Base + Bank, or a prompt twice), so with
  ``rollout.n=8`` each group is 8 + 8 = 16 rollouts.
- :func:`compute_score` is the per-rollout form (``naive`` manager). It cannot see a group: experience rollouts
  get plain correctness there.

A group cut by a batch boundary never stops training: its rollouts are scored with what the batch holds (p_base
from the Base rollouts present; none present: plain correctness) and ``group_incomplete`` is 1 on them.

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
from tmas.rl.scoring import is_correct, rollout_from_example, score_rollouts

# The keys of every dict compute_score_batch returns (verl needs the same keys on every rollout of a batch).
SCORE_KEYS = ("score", "uid", "correct", "p_base", "group_incomplete", "novel", "judge_unusable")


@lru_cache(maxsize=4)
def _judge(tmas_config: str | None, judge_store: str | None) -> LLMNoveltyJudge:
    return LLMNoveltyJudge(load_settings(tmas_config), Path(judge_store) if judge_store else None)


def _is_ours(info: Any) -> bool:
    return isinstance(info, dict) and "task" in info and "group" in info


def compute_score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[str],
    extra_infos: Sequence[dict[str, Any] | None],
    *,
    beta: float = DEFAULT_BETA,
    tmas_config: str | None = None,
    judge_store: str | None = None,
    group_uid: bool = True,
    think_opened: bool = False,
    **_: Any,
) -> list[dict[str, Any]]:
    """One dict per rollout, keys :data:`SCORE_KEYS`: ``score`` (the hybrid reward), ``uid`` (the prompt group, for
    verl's GRPO grouping), ``correct`` (1/0), ``p_base`` (eq. 7, -1 where not an experience rollout or not
    measurable), ``group_incomplete`` (1 when the batch held only part of the group), ``novel`` (n_i of eq. 9) and
    ``judge_unusable`` (1 on an exploration rollout the judge gave no usable verdict on: counted as known).

    ``group_uid=False`` leaves ``uid`` out, so verl keeps its own per-row groups (the bonus then has no effect on
    the advantages: see docs/rl.md). A batch holding rows that are not from ``tmas rl build-data`` also leaves it
    out: such rows have no group, and a uid for some rows only would not line up.

    ``think_opened`` (a reward kwarg): the policy's chat template opens the think block in the prompt
    (Qwen3-4B-Thinking-2507's does), so verl's responses start inside it; a response is then thinking until its
    ``</think>``, and one cut before it has no answer (:func:`tmas.rl.scoring.completion_answer`)."""
    ours = [_is_ours(info) for info in extra_infos]
    rollouts = [
        rollout_from_example(dict(info), str(truth), solution)
        for solution, truth, info, mine in zip(solution_strs, ground_truths, extra_infos, ours, strict=True)
        if mine and info is not None
    ]
    needs_judge = any(r.task == "guideline" for r in rollouts)
    judge = _judge(tmas_config, judge_store) if needs_judge else None
    scored = iter(score_rollouts(rollouts, judge, beta=beta, partial_groups=True, think_opened=think_opened))
    with_uid = group_uid and all(ours)
    out: list[dict[str, Any]] = []
    for solution, truth, mine in zip(solution_strs, ground_truths, ours, strict=True):
        if mine:
            b = next(scored)
            row: dict[str, Any] = {
                "score": b.reward,
                "uid": b.group,
                "correct": int(b.correct),
                "p_base": -1.0 if b.p_base is None else b.p_base,
                "group_incomplete": int(b.group_note is not None),
                "novel": int(b.novelty == 1),
                "judge_unusable": int(b.task == "guideline" and b.novelty is None),
            }
        else:
            # A row from another data set: the standard correctness reward.
            ok = is_correct(solution, str(truth), think_opened=think_opened)
            row = {"score": correctness_reward(ok), "uid": "", "correct": int(ok), "p_base": -1.0}
            row.update(group_incomplete=0, novel=0, judge_unusable=0)
        if not with_uid:
            del row["uid"]
        out.append(row)
    return out


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    if not _is_ours(extra_info):
        opened = bool(kwargs.get("think_opened", False))
        return correctness_reward(is_correct(solution_str, str(ground_truth), think_opened=opened))
    assert extra_info is not None
    info = dict(extra_info)
    if info["task"] == "experience":
        info["task"] = "normal"  # no group in sight: eq. 8 needs the batch form
    kwargs["group_uid"] = False
    return float(compute_score_batch([data_source], [solution_str], [ground_truth], [info], **kwargs)[0]["score"])
