"""GRPO training options with the paper's appendix A.4 as defaults; ``tmas rl train`` reads its defaults here.

Kept apart from :mod:`tmas.rl.trl_train` so that reading them imports neither torch nor TRL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from tmas.errors import ConfigError
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
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    max_completion_length: int = Field(default=2048, ge=1)
    # Leave a rollout cut at max_completion_length out of the loss (TRL's mask_truncated_completions). Off, as the
    # paper says nothing of such rollouts: by default one is graded on the answer it boxed before the cut, if any.
    mask_truncated: bool = False
    max_steps: int = Field(default=190, ge=1)
    # Prompt groups per optimizer step, per process (A.4: 128 prompts over all GPUs).
    groups_per_step: int = Field(default=1, ge=1)
    # Groups generated per step; more than groups_per_step turns on dynamic sampling (DAPO): groups whose rollouts
    # all got one reward are dropped and the step trains on groups_per_step of the others. None: groups_per_step.
    generate_groups: int | None = Field(default=None, ge=1)
    # Micro-batches an optimizer step's groups are split into (each a forward and backward pass).
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    use_vllm: bool | None = None
    # transformers' continuous-batching engine for the rollouts (TRL's use_transformers_continuous_batching) rather
    # than padded generate.
    continuous_batching: bool = False
    # The policy's weights as loaded; a LoRA adapter's own weights stay float32 (peft keeps them so).
    dtype: Literal["float32", "bfloat16"] = "float32"
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

    @model_validator(mode="after")
    def _batches_divide(self) -> TrainOptions:
        generated, accumulation = self.generated_groups, self.gradient_accumulation_steps
        if generated < self.groups_per_step:
            raise ConfigError(f"--generate-groups {generated} is below --groups-per-step {self.groups_per_step}")
        for groups in {generated, self.groups_per_step}:
            if (groups * self.num_generations) % accumulation:
                raise ConfigError(
                    f"{groups} groups x {self.num_generations} rollouts do not split into {accumulation} equal "
                    "micro-batches (--gradient-accumulation-steps)"
                )
        return self

    @property
    def generated_groups(self) -> int:
        return self.generate_groups or self.groups_per_step

    @property
    def dynamic_sampling(self) -> bool:
        return self.generated_groups > self.groups_per_step


def train_default(name: str) -> Any:
    """The default of one :class:`TrainOptions` field (the CLI's flag defaults, so they are never copied)."""
    return TrainOptions.model_fields[name].default


def bf16_autocast(dtype: str, continuous_batching: bool, cuda: bool) -> bool:
    """Whether rollouts are generated under bfloat16 autocast (weights kept in ``dtype``): training's rule, which the
    pilot follows so that its rates describe the model training samples. On a GPU for a float32 policy generating
    with padded generate; not for a bfloat16 policy, nor with continuous batching (whose TRL path would cast a LoRA
    adapter's float32 weights to bfloat16), nor on a CPU."""
    return cuda and dtype == "float32" and not continuous_batching


def rollout_precision(dtype: str, continuous_batching: bool, cuda: bool) -> str:
    """The precision rollouts are generated in, as the pilot's report and training's note name it."""
    return f"{dtype}, bfloat16 autocast" if bf16_autocast(dtype, continuous_batching, cuda) else dtype
