"""Dynamic sampling (DAPO section 3.2) and the rollout options of ``tmas rl train``: groups without a spread of rewards
found and dropped, the batch cut to the groups kept with the loss's token count taken again (worked by hand), TRL's
configuration derived from the options, and one real GRPO step of a tiny model that trains only on the groups
whose rewards differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tmas.errors import ConfigError
from tmas.rl.dynamic_sampling import choose_groups, group_rows, groups_with_spread, keep_rows
from tmas.rl.train_options import TrainOptions


def test_groups_with_a_spread_of_rewards() -> None:
    rewards = [-1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.2, 0.2, 0.2, 0.2]
    assert groups_with_spread(rewards, 4) == [True, False, False]
    # Rounding noise is not a spread (eq. 8's bonus summed in float32 may differ in its last bits).
    assert groups_with_spread([1.45, 1.45 + 1e-9, -0.5, -1.0], 2) == [False, True]
    with pytest.raises(ValueError, match="groups of 4"):
        groups_with_spread([1.0, 1.0, 1.0], 4)


def test_groups_with_a_spread_are_chosen_first_then_the_others_fill() -> None:
    spread = [False, True, False, True, True]
    assert choose_groups(spread, 2) == [1, 3]  # the first two with a spread, in generation order
    assert choose_groups(spread, 3) == [1, 3, 4]
    # Too few with a spread: the first without one fills the batch.
    assert choose_groups(spread, 4) == [0, 1, 3, 4]
    assert group_rows([0, 2], 3) == [0, 1, 2, 6, 7, 8]
    with pytest.raises(ValueError, match="6 groups wanted of 5"):
        choose_groups(spread, 6)


def test_the_batch_is_cut_to_the_groups_kept_and_its_tokens_counted_again() -> None:
    torch = pytest.importorskip("torch")
    # Three groups of two rollouts; completion masks with 4, 3, 2, 1, 4, 0 tokens.
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    batch = {
        "prompt_ids": torch.arange(18).view(6, 3),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([0.7, -0.7, 0.0, 0.0, 1.0, -1.0]),
        "num_items_in_batch": completion_mask.sum(),  # 14
        "num_images": None,
    }
    kept = keep_rows(batch, group_rows([0, 2], 2), 6)
    assert kept["prompt_ids"].tolist() == [[0, 1, 2], [3, 4, 5], [12, 13, 14], [15, 16, 17]]
    assert kept["advantages"].tolist() == pytest.approx([0.7, -0.7, 1.0, -1.0])
    # The DAPO loss averages over the kept rows' tokens: 4 + 3 + 4 + 0 = 11, not the batch's 14.
    assert int(kept["num_items_in_batch"]) == 11
    assert kept["num_images"] is None
    # A tool mask (multi-turn) takes its tokens out of the count too: 11 - 2 = 9.
    tool_mask = torch.ones(6, 4, dtype=torch.long)
    tool_mask[0, 2:] = 0
    assert int(keep_rows(batch | {"tool_mask": tool_mask}, [0, 1, 4, 5], 6)["num_items_in_batch"]) == 9
    with pytest.raises(ValueError, match="no row"):
        keep_rows(batch, [], 6)


def test_trl_configuration_from_the_options(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from tmas.rl.trl_train import grpo_config, mixed_precision

    options = TrainOptions(
        output_dir=tmp_path,
        num_generations=8,
        groups_per_step=4,
        generate_groups=16,
        gradient_accumulation_steps=2,
        continuous_batching=True,
        dtype="bfloat16",
        temperature=0.7,
    )
    assert options.dynamic_sampling and options.generated_groups == 16
    config = grpo_config(options)
    # 16 groups x 8 rollouts generated in one batch, in two micro-batches of 64 rows (of which 32 are trained).
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (64, 2)
    assert (config.generation_batch_size, config.steps_per_generation) == (128, 2)
    assert config.use_transformers_continuous_batching and config.temperature == 0.7
    # On this CPU the engine's cache is sized small (see hf_generate).
    assert config.transformers_continuous_batching_config == {"max_memory_percent": 0.02}
    # bfloat16 autocast only for a float32 policy generating with padded generate on a GPU.
    assert not config.bf16
    plain = TrainOptions(output_dir=tmp_path)
    assert mixed_precision(plain, cuda=True) and not mixed_precision(plain, cuda=False)
    assert not mixed_precision(plain.model_copy(update={"dtype": "bfloat16"}), cuda=True)
    assert not mixed_precision(plain.model_copy(update={"continuous_batching": True}), cuda=True)
    assert not TrainOptions(output_dir=tmp_path, groups_per_step=4).dynamic_sampling


def test_mask_truncated_reaches_trl_and_is_refused_where_trl_would_misread_an_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off by default (the paper says nothing of cut rollouts); ``--mask-truncated`` is TRL's
    mask_truncated_completions. TRL takes a rollout for cut unless it ends at the tokenizer's end token or padding,
    so a policy that also ends at another token is refused rather than having its finished rollouts masked."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from typer.testing import CliRunner

    import tmas.rl.trl_train as trl_train
    from test_rl_train import row
    from tmas.cli.main import app
    from tmas.rl.data import write_parquet
    from tmas.rl.trl_rewards import HybridReward

    assert not trl_train.grpo_config(TrainOptions(output_dir=tmp_path)).mask_truncated_completions
    options = TrainOptions(output_dir=tmp_path, num_generations=2, mask_truncated=True, use_vllm=False)
    assert trl_train.grpo_config(options).mask_truncated_completions

    data = tmp_path / "train.parquet"
    write_parquet([row("normal", "p1")], data)
    seen: list[TrainOptions] = []
    monkeypatch.setattr(trl_train, "train_policy", lambda _d, o, *a, **k: (seen.append(o), (tmp_path, 0))[1])
    base = ["rl", "train", str(data), "-o", str(tmp_path / "out"), "--model", "tiny", "--num-generations", "2"]
    for flags, masked in (([], False), (["--mask-truncated"], True)):
        done = CliRunner().invoke(app, [*base, *flags])
        assert done.exit_code == 0, done.output
        assert seen.pop().mask_truncated is masked
    monkeypatch.undo()

    dataset = datasets.Dataset.from_list([row("normal", "p1")])
    model, tokenizer = trl_train.load_policy("tiny", dataset)
    trainer = trl_train.build_trainer(model, tokenizer, dataset, options, HybridReward())
    assert trainer.mask_truncated_completions
    other = next(t for t in range(len(tokenizer)) if t not in (tokenizer.eos_token_id, tokenizer.pad_token_id))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, other]
    with pytest.raises(
        ConfigError, match=rf"--mask-truncated: the policy's rollouts also end at token ids \[{other}\]"
    ):
        trl_train.build_trainer(model, tokenizer, dataset, options, HybridReward())
    # Without the option such a policy trains as before.
    trl_train.build_trainer(
        model, tokenizer, dataset, options.model_copy(update={"mask_truncated": False}), HybridReward()
    )


def test_batch_options_that_cannot_work_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--generate-groups 2 is below --groups-per-step 4"):
        TrainOptions(output_dir=tmp_path, groups_per_step=4, generate_groups=2)
    with pytest.raises(ConfigError, match="3 groups x 2 rollouts do not split into 4"):
        TrainOptions(output_dir=tmp_path, num_generations=2, groups_per_step=3, gradient_accumulation_steps=4)


@pytest.mark.slow
def test_a_grpo_step_trains_only_on_groups_whose_rewards_differ(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from conftest import settings_for
    from test_rl_train import row, verdict
    from tmas.rl.novelty import LLMNoveltyJudge
    from tmas.rl.step_log import StepLog
    from tmas.rl.trl_rewards import HybridReward
    from tmas.rl.trl_train import build_trainer, load_policy
    from tmas.testing import Rule, SimScript, SimServer

    # Guideline rollouts get alternating verdicts (rewards -0.5 and -1.0: a spread); the tiny model's normal
    # rollouts are all wrong (-1.0 each: none).
    rows = [row("guideline", "p1"), row("normal", "p2"), row("guideline", "p3"), row("normal", "p4")]
    dataset = datasets.Dataset.from_list(rows)
    model, tokenizer = load_policy("tiny", dataset, "bfloat16")
    options = TrainOptions(
        output_dir=tmp_path / "out",
        num_generations=2,
        groups_per_step=2,
        generate_groups=4,
        max_steps=1,
        max_completion_length=4,
        learning_rate=1e-3,
        use_vllm=False,
        save_steps=100,
        lora_rank=2,
        dtype="bfloat16",
        continuous_batching=True,
    )
    (tmp_path / "out").mkdir()
    with SimServer(SimScript(rules=[Rule(role="judge", replies=[verdict(1), verdict(0)])])) as judge_sim:
        reward = HybridReward(LLMNoveltyJudge(settings_for(judge_sim)), log_path=tmp_path / "rewards.jsonl")
        trainer = build_trainer(model, tokenizer, dataset, options, reward)
        trainer.add_callback(StepLog(tmp_path / "out", reward))
        assert trainer.train().global_step == 1
    # All four groups were generated and scored; the step trained on the two guideline groups only.
    scored = [json.loads(line) for line in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    assert len(scored) == 4 * 2
    assert sorted(trainer.last_trained_groups) == ["run/p1/1/guideline", "run/p3/1/guideline"]
    # Each logged rollout says whether the step trained on it: the dropped groups' rows are marked.
    assert {(r["group"], r["trained"]) for r in scored} == {
        ("run/p1/1/guideline", True),
        ("run/p2/1/normal", False),
        ("run/p3/1/guideline", True),
        ("run/p4/1/normal", False),
    }
    trained = trainer._buffered_inputs[0]
    assert trained["advantages"].shape[0] == 4 and bool((trained["advantages"] != 0).all())
    step = json.loads((tmp_path / "out" / "steps.jsonl").read_text())
    assert (step["dynamic/groups_generated"], step["dynamic/groups_with_spread"]) == (4, 2)
    assert step["dynamic/groups_trained_without_spread"] == 0
    assert step["frac_reward_zero_std"] == 0.5  # TRL's figure describes every group generated
    assert step["rollout/generated_tokens_per_s"] > 0
    # The policy generated in bfloat16 through the engine; the adapter kept float32 weights.
    trainable = {str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}
    frozen = {str(p.dtype) for p in trainer.model.parameters() if not p.requires_grad}
    assert trainable == {"torch.float32"} and frozen == {"torch.bfloat16"}


def test_train_command_passes_the_rollout_options_on(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    from typer.testing import CliRunner

    from test_rl_train import row
    from tmas.cli.main import app
    from tmas.errors import InputError
    from tmas.rl.data import write_parquet

    data = tmp_path / "train.parquet"
    write_parquet([row("normal", "p1")], data)
    base = ["rl", "train", str(data), "-o", str(tmp_path / "out"), "--model", "tiny", "--num-generations", "2"]
    refused = CliRunner().invoke(app, [*base, "--groups-per-step", "2", "--generate-groups", "1"])
    assert isinstance(refused.exception, ConfigError)
    assert "--generate-groups 1 is below --groups-per-step 2" in str(refused.exception)
    refused = CliRunner().invoke(app, [*base, "--dtype", "float16"])
    assert isinstance(refused.exception, InputError) and "--dtype 'float16'" in str(refused.exception)
    help_text = CliRunner().invoke(app, ["rl", "train", "--help"], env={"COLUMNS": "200"}).output
    for flag in ("--generate-groups", "--continuous-batching", "--dtype", "--temperature"):
        assert flag in help_text


def test_data_with_fewer_groups_than_a_step_generates_is_refused(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from test_rl_train import row
    from tmas.rl.trl_rewards import HybridReward
    from tmas.rl.trl_train import build_trainer, load_policy

    rows = [row("normal", "p1"), row("experience", "p2", "base"), row("experience", "p2", "bank")]
    dataset = datasets.Dataset.from_list(rows)
    model, tokenizer = load_policy("tiny", dataset)
    options = TrainOptions(output_dir=tmp_path, num_generations=2, groups_per_step=1, generate_groups=3, use_vllm=False)
    with pytest.raises(ConfigError, match="has 2 prompt groups, fewer than the 3 a step generates"):
        build_trainer(model, tokenizer, dataset, options, HybridReward())


def test_data_with_fewer_groups_than_a_step_generates_over_every_process_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each process generates --groups-per-step groups of its own, so a step draws that many times the processes:
    data with fewer never fills a step's batch, so no step could train. (No real second process: the count is what
    accelerate says.)"""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from types import SimpleNamespace

    import accelerate

    from test_rl_train import row
    from tmas.rl.trl_train import check_groups

    dataset = datasets.Dataset.from_list([row("normal", f"p{i}") for i in range(3)])
    options = TrainOptions(output_dir=tmp_path, num_generations=2, groups_per_step=2)
    check_groups(dataset, options)  # one process: 2 groups a step, of 3
    monkeypatch.setattr(accelerate, "PartialState", lambda: SimpleNamespace(num_processes=2))
    with pytest.raises(
        ConfigError, match="has 3 prompt groups, fewer than the 4 a step generates over its 2 processes"
    ):
        check_groups(dataset, options)


def test_an_odd_num_generations_with_experience_groups_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from test_rl_train import row
    from tmas.rl.trl_train import train_policy

    rows = [row("normal", "p1"), row("experience", "p2", "base"), row("experience", "p2", "bank")]
    dataset = datasets.Dataset.from_list(rows)
    options = TrainOptions(output_dir=tmp_path / "out", num_generations=3, use_vllm=False)
    # A model that cannot load: the data's check must come first.
    with pytest.raises(ConfigError, match="--num-generations 3 is odd: the data's experience groups"):
        train_policy(dataset, options, str(tmp_path / "no-such-model"), None)
    assert not (tmp_path / "out").exists()
    # Without an experience group, an odd count is fine: the check passes and the model is what fails.
    from tmas.errors import LocalModelError

    with pytest.raises(LocalModelError, match="no-such-model"):
        train_policy(datasets.Dataset.from_list(rows[:1]), options, str(tmp_path / "no-such-model"), None)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--num-generations", "1"), ("--max-steps", "0"), ("--groups-per-step", "0"), ("--max-completion-length", "0")],
)
def test_train_flags_out_of_range_are_a_usage_error(tmp_path: Path, flag: str, value: str) -> None:
    pytest.importorskip("datasets")
    from typer.testing import CliRunner

    from test_rl_train import row
    from tmas.cli.main import app
    from tmas.rl.data import write_parquet

    data = tmp_path / "train.parquet"
    write_parquet([row("normal", "p1")], data)
    done = CliRunner().invoke(
        app, ["rl", "train", str(data), "-o", str(tmp_path / "out"), "--model", "tiny", flag, value]
    )
    # A usage error naming the flag, not a traceback of the options' validation.
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit)
    assert flag in done.output and not (tmp_path / "out").exists()
