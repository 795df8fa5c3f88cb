"""The order in which GRPO sees training rows, keeping each prompt group whole and contiguous.

TRL forms a GRPO group from every ``num_generations`` consecutive samples of a generation batch and normalises
rewards within it (eq. 6); its reward functions see the local batch in the same order. Its own sampler repeats one
row ``num_generations`` times. This one works on prompt groups instead: a one-row group (normal, guideline) is
repeated ``num_generations`` times as TRL would, and an experience group (Base row, Bank row) yields the Base row
``num_generations / 2`` times and then the Bank row as often. So the Base and Bank rollouts of one prompt always
form one GRPO group, p_base (eq. 7) is computed from that group's own Base half, and shuffling moves whole groups
only. Batches, their reuse across ``steps_per_generation`` and ``num_iterations``, and seeding follow TRL's sampler.

Each epoch's order is a function of the seed and the epoch alone: the trainer names the epoch (``set_epoch``) before
it iterates, so a run resumed in a later epoch draws that epoch's order, and skipping the batches its checkpoint
trained leaves exactly the groups the epoch has not trained yet.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any


def prompt_groups(extra_info: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Row indices per ``extra_info.group``, in first-seen order; an experience group must be (base, bank): a Base
    or Bank row alone would fill its GRPO group with one half, which eq. 7-8 cannot score."""
    groups: dict[str, list[int]] = {}
    for index, info in enumerate(extra_info):
        groups.setdefault(str(info["group"]), []).append(index)
    for group, rows in groups.items():
        variants = [extra_info[i].get("variant") for i in rows]
        experience = any(extra_info[i].get("task") == "experience" for i in rows)
        if (len(rows) > 1 or experience) and sorted(v or "" for v in variants) != ["bank", "base"]:
            raise ValueError(f"group {group!r}: rows {rows} with variants {variants}; expected one base and one bank")
        if len(rows) == 2 and variants[0] == "bank":
            rows.reverse()
    return list(groups.values())


class PromptGroupSampler:
    def __init__(
        self,
        groups: list[list[int]],
        num_generations: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
    ) -> None:
        """``batch_size`` is in prompt groups per generation batch (TRL: generation_batch_size // num_generations)."""
        if any(len(g) == 2 for g in groups) and num_generations % 2:
            raise ValueError(f"num_generations={num_generations} is odd: Base and Bank halves must be equal (eq. 7)")
        if any(len(g) not in (1, 2) for g in groups):
            raise ValueError("a prompt group has one row, or two (base, bank)")
        self.groups = groups
        self.num_generations = num_generations
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        # Unseeded: one source for every epoch (no order to reproduce on a resume).
        self._rng = random.Random(seed)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration draws the order of (accelerate calls this at the start of every epoch)."""
        self.epoch = epoch

    def expand(self, group: list[int]) -> list[int]:
        if len(group) == 1:
            return group * self.num_generations
        half = self.num_generations // 2
        return [group[0]] * half + [group[1]] * half

    def __iter__(self) -> Iterator[int]:
        order = list(range(len(self.groups)))
        if self.shuffle:
            rng = self._rng if self.seed is None else random.Random(f"{self.seed}:{self.epoch}")
            rng.shuffle(order)
        # Incomplete last batch dropped, as TRL does.
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            chunk = order[start : start + self.batch_size]
            for _ in range(self.repeat_count):
                for g in chunk:
                    yield from self.expand(self.groups[g])
        # Iterated again without being told the epoch: the next one's order.
        self.epoch += 1

    def __len__(self) -> int:
        return (len(self.groups) // self.batch_size) * self.batch_size * self.num_generations * self.repeat_count
