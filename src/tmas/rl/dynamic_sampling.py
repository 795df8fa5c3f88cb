"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): a GRPO group whose rollouts all got one reward has zero
advantage (eq. 6 divides its zero deviation away), so it adds nothing to the gradient but tokens to the loss's
denominator. More groups are generated than a step trains on; those without a spread are dropped and the step's
batch is filled from the others.

TRL 1.13 has no such option, so :class:`tmas.rl.trl_train.TMASGRPOTrainer` applies these functions to the batch
its ``_generate_and_score_completions`` returns: the groups to keep are chosen from the rewards, then every per-row
tensor is cut to their rows and the loss's token count is taken again over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Rewards closer than this count as one reward (TRL's own zero-std test is torch.isclose on the deviation).
SPREAD_TOLERANCE = 1e-6
# The per-row masks whose product marks the tokens the loss averages over (TRL: completion_mask, times tool_mask in
# multi-turn runs).
LOSS_MASKS = ("completion_mask", "tool_mask")


def groups_with_spread(rewards: Sequence[float], num_generations: int) -> list[bool]:
    """Per consecutive group of ``num_generations`` rewards: whether they differ (the group has an advantage)."""
    if num_generations < 1 or len(rewards) % num_generations:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {num_generations}")
    out = []
    for start in range(0, len(rewards), num_generations):
        group = rewards[start : start + num_generations]
        out.append(max(group) - min(group) > SPREAD_TOLERANCE)
    return out


def choose_groups(spread: Sequence[bool], wanted: int) -> list[int]:
    """``wanted`` group indices: those with a spread first, in generation order, then, where too few have one,
    the first of the others (they train nothing but keep the batch its size). Returned in ascending order."""
    if wanted > len(spread):
        raise ValueError(f"{wanted} groups wanted of {len(spread)} generated")
    ranked = [i for i, s in enumerate(spread) if s] + [i for i, s in enumerate(spread) if not s]
    return sorted(ranked[:wanted])


def group_rows(groups: Sequence[int], num_generations: int) -> list[int]:
    return [g * num_generations + i for g in groups for i in range(num_generations)]


def keep_rows(batch: dict[str, Any], rows: Sequence[int], total_rows: int) -> dict[str, Any]:
    """The batch cut to ``rows``: every tensor whose first dimension is the batch's rows is indexed, and
    ``num_items_in_batch`` (the DAPO loss's token count) is counted again over the rows kept."""
    import torch

    if not rows:
        raise ValueError("no row to keep")
    index: Any = None
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == total_rows:
            if index is None:
                index = torch.tensor(list(rows), dtype=torch.long, device=value.device)
            out[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list) and len(value) == total_rows:
            out[key] = [value[i] for i in rows]
        else:
            out[key] = value
    if "num_items_in_batch" in batch:
        mask = out["completion_mask"]
        for key in LOSS_MASKS[1:]:
            if key in out:
                mask = mask * out[key]
        previous = batch["num_items_in_batch"]
        counted = mask.sum()
        out["num_items_in_batch"] = counted.to(previous.device) if isinstance(previous, torch.Tensor) else counted
    return out
