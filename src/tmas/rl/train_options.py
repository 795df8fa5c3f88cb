"""GRPO training options with the paper's appendix A.4 as defaults; ``tmas rl train`` reads its defaults here.

Kept apart from :mod:`tmas.rl.trl_train` so that reading them imports neither torch nor TRL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from tmas.rl.rewards import DEFAULT_BETA


class TrainOptions(BaseModel):
    output_dir: Path
    num_generations: int = Field(default=16, ge=2)
    learning_rate: float = 1e-6
    epsilon: float = 0.20
    epsilon_high: float = 0.255
    clip_coefficient: float | None = 10.0
    kl_beta: float = 0.0
    experience_beta: float = DEFAULT_BETA
    temperature: float = 1.0
    top_p: float = 0.95
    max_completion_length: int = Field(default=2048, ge=1)
    max_steps: int = Field(default=190, ge=1)
    # Prompt groups per optimizer step, per process (A.4: 128 prompts over all GPUs).
    groups_per_step: int = Field(default=1, ge=1)
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    use_vllm: bool | None = None
    # A checkpoint every this many steps (the last two are kept): what --resume continues from.
    save_steps: int = Field(default=5, ge=1)
    # Training stops after the step that passes this many seconds (counted from its first step) and writes OUT/final
    # as after the last step; None: no limit.
    max_time_s: float | None = Field(default=None, gt=0)
    seed: int = 0
    # LoRA (peft) rank; 0 trains every weight, as the paper does. A LoRA run saves only the adapter, which
    # 'tmas rl export-gguf' merges into the base weights.
    lora_rank: int = Field(default=0, ge=0)
    # LoRA's scale numerator; None: twice the rank.
    lora_alpha: int | None = Field(default=None, ge=1)


def train_default(name: str) -> Any:
    """The default of one :class:`TrainOptions` field (the CLI's flag defaults, so they are never copied)."""
    return TrainOptions.model_fields[name].default
