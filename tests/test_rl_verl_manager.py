"""verl's own reward path on tmas's batch reward: verl's config (``ppo_trainer.yaml`` with the overrides docs/rl.md
gives), ``load_reward_manager`` importing ``compute_score_batch`` from ``custom_reward_function.path``, its
``BatchRewardManager`` over a ``DataProto`` batch repeated per rollout as verl's trainer does, and verl's GRPO
advantage over the uids the reward returned.

verl pins what the main environment cannot hold (numpy < 2, transformers < 5), so this file runs in the environment
``make verl-env`` builds; ``test_rl_verl.py`` runs it there, and it is skipped where verl is not installed.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest

verl = pytest.importorskip("verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import AdvantageEstimator, compute_advantage  # noqa: E402
from verl.trainer.ppo.reward import compute_reward, load_reward_manager  # noqa: E402

from tmas.rl import verl_reward  # noqa: E402

ROLLOUTS = 8  # actor_rollout_ref.rollout.n
Q = "What is 17*23?"


def byte_tokenizer() -> Any:
    """A real Hugging Face tokenizer, one token per byte (built here: no download), so decoding is exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<pad>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")


def row(task: str, variant: str | None, copy: int = 0) -> dict[str, Any]:
    """A row of ``tmas rl build-data --layout verl`` (what verl reads from the parquet)."""
    return {
        "data_source": f"tmas/{task}",
        "reward_model": {"style": "rule", "ground_truth": "391"},
        "extra_info": {
            "task": task,
            "group": f"run/p1/1/{task}",
            "variant": variant,
            "copy": copy,
            "problem_id": "p1",
            "question": Q,
            "experience_bank": [],
            "guideline_bank": [],
        },
    }


def verl_config(beta: float) -> Any:
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    overrides = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"actor_rollout_ref.rollout.n={ROLLOUTS}",
        "reward_model.reward_manager=batch",
        f"custom_reward_function.path={verl_reward.__file__}",
        "custom_reward_function.name=compute_score_batch",
        f"+custom_reward_function.reward_kwargs.beta={beta}",
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def rollout_batch(rows: list[dict[str, Any]], completions: list[str], tokenizer: Any) -> DataProto:
    """What verl's trainer holds when it asks for rewards: one uid per row, each row repeated ``ROLLOUTS`` times
    (interleaved), prompts left-padded and responses right-padded with one attention mask over both."""
    prompt = tokenizer.encode(Q)
    columns: dict[str, Any] = {key: np.array([r[key] for r in rows], dtype=object) for key in rows[0]}
    columns["input_ids"] = torch.tensor([prompt] * len(rows))
    batch = DataProto.from_single_dict(columns)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
    batch = batch.repeat(repeat_times=ROLLOUTS, interleave=True)
    pad = tokenizer.pad_token_id
    encoded = [tokenizer.encode(c) for c in completions]
    width = max(len(e) for e in encoded)
    responses = torch.tensor([e + [pad] * (width - len(e)) for e in encoded])
    mask = torch.tensor([[1] * len(prompt) + [1] * len(e) + [0] * (width - len(e)) for e in encoded])
    generated = {"prompts": batch.batch["input_ids"], "responses": responses, "attention_mask": mask}
    return batch.union(DataProto.from_dict(generated))


# The worked example of docs/rl.md: an experience group (Base row: 2 of 8 correct, p_base = 0.25; Bank row: 5 of 8)
# and a normal prompt written twice (copy 0 and 1: one group of 16, 4 correct).
BASE = ["\\boxed{391}"] * 2 + ["\\boxed{390}"] * 6
BANK = ["\\boxed{391}"] * 5 + ["no answer"] * 3
NORMAL = ["\\boxed{391}"] * 4 + ["\\boxed{7}"] * 12


@pytest.mark.parametrize(
    # Eq. 6 over the 16 rollouts with the population sigma (docs/rl.md's table); verl divides by torch.std, the
    # sample one, which scales every advantage by sqrt(15/16).
    ("beta", "bank_correct", "adv_base_correct", "adv_bank_correct", "adv_wrong"),
    [(0.3, 1.225, 0.9820, 1.1915, -0.8802), (0.6, 1.45, 0.8490, 1.2371, -0.8760)],
)
def test_verls_batch_manager_gives_the_worked_rewards_and_one_group(
    beta: float, bank_correct: float, adv_base_correct: float, adv_bank_correct: float, adv_wrong: float
) -> None:
    config = verl_config(beta)
    tokenizer = byte_tokenizer()
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0, **config.reward_model.get("reward_kwargs", {}))
    assert type(reward_fn).__name__ == "BatchRewardManager"

    rows = [row("experience", "base"), row("experience", "bank"), row("normal", None), row("normal", None, copy=1)]
    batch = rollout_batch(rows, BASE + BANK + NORMAL, tokenizer)
    rows_uid = list(batch.non_tensor_batch["uid"])
    assert len(set(rows_uid)) == 4  # verl's own uids: one per row

    # RayPPOTrainer.fit: the reward, its extra keys merged into the batch, then the advantage.
    reward_tensor, extra = compute_reward(batch, reward_fn)
    batch.batch["token_level_scores"] = reward_tensor
    batch.non_tensor_batch.update({k: np.array(v) for k, v in extra.items()})
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, config=config.algorithm)

    # The score sits on each response's last token (eq. 8's bonus on the correct Bank rollouts).
    lengths = batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1] :].sum(-1)
    scores = [float(reward_tensor[i, int(n) - 1]) for i, n in enumerate(lengths)]
    expected = [1.0] * 2 + [-1.0] * 6 + [bank_correct] * 5 + [-1.0] * 3 + [1.0] * 4 + [-1.0] * 12
    assert scores == pytest.approx(expected)
    assert float(reward_tensor.sum()) == pytest.approx(sum(expected))
    assert set(extra["p_base"][:16]) == {0.25} and set(extra["group_incomplete"]) == {0}

    # A prompt's Base and Bank rollouts are one GRPO group: the uid is the prompt group, not verl's row.
    uids = list(batch.non_tensor_batch["uid"])
    assert uids == ["run/p1/1/experience"] * 16 + ["run/p1/1/normal"] * 16
    advantages = batch.batch["advantages"][:, 0].tolist()
    scale = math.sqrt(15 / 16)
    assert advantages[0] == pytest.approx(adv_base_correct * scale, abs=1e-3)
    assert advantages[8] == pytest.approx(adv_bank_correct * scale, abs=1e-3)
    assert advantages[2] == pytest.approx(adv_wrong * scale, abs=1e-3)
    assert advantages[13] == pytest.approx(adv_wrong * scale, abs=1e-3)
    # The normal group of 16 (4 x +1, 12 x -1): mu = -0.5, sample sigma = sqrt(16/15) * 0.8660.
    assert advantages[16] == pytest.approx(1.5 / (math.sqrt(16 / 15) * math.sqrt(0.75)), abs=1e-3)
