"""GRPO with TRL on the hybrid rewards: the prompt-group sampler, one real training step of a tiny model built from a
config (CPU, no download), and the verl reward function agreeing with the TRL path on the same rollouts."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import settings_for
from tmas.agents.rollouts import RolloutView
from tmas.agents.solution import explore_prompt, generation_prompt, refine_prompt
from tmas.memory.experience_bank import ExperienceBank, ExperienceEntry
from tmas.memory.guideline_bank import Strategy
from tmas.rl.novelty import LLMNoveltyJudge
from tmas.rl.sampler import PromptGroupSampler, prompt_groups
from tmas.rl.trl_rewards import HybridReward
from tmas.testing import Rule, SimScript, SimServer

Q = "What is 17*23?"
STRATEGY = Strategy(id="G1", description="Multiply directly.", first_iteration=0, last_iteration=0)
ENTRY = ExperienceEntry(id="E1", kind="anchor", content="17*20 = 340 was verified.")


def verdict(novelty: int) -> str:
    return f'```json\n{{"identified_strategy": "s", "novelty": {novelty}, "same_as": null}}\n```'


def row(task: str, pid: str, variant: str | None = None) -> dict[str, Any]:
    """A training row as 'tmas rl build-data' writes it (see test_rl_data for the builder itself)."""
    views = [RolloutView(number=1, solution="17*23 = 381, \\boxed{381}", summary="Arithmetic slip.", score_text="0")]
    bank = ExperienceBank(entries=[ENTRY], next_id=2)
    messages = {
        "normal": generation_prompt(Q, "numeric"),
        "experience": refine_prompt(Q, "numeric", views, bank if variant == "bank" else None),
        "guideline": explore_prompt(Q, "numeric", [STRATEGY]),
    }[task]
    return {
        "prompt": [m.model_dump() for m in messages],
        "data_source": f"tmas/{task}",
        "reward_model": {"style": "rule", "ground_truth": "391"},
        "extra_info": {
            "task": task,
            "group": f"run/{pid}/1/{task}",
            "variant": variant,
            "problem_id": pid,
            "question": Q,
            "experience_bank": [{"id": "E1", "kind": "anchor", "subtype": None, "content": ENTRY.content}],
            "guideline_bank": [{"id": "G1", "description": STRATEGY.description}],
        },
        "_source": task,
    }


# ------------------------------------------------------------------------------------------ sampler
def test_prompt_groups_pair_base_and_bank() -> None:
    infos = [
        {"group": "a", "variant": None},
        {"group": "b", "variant": "bank"},
        {"group": "b", "variant": "base"},
        {"group": "c", "variant": None},
    ]
    assert prompt_groups(infos) == [[0], [2, 1], [3]]
    with pytest.raises(ValueError, match="expected one base and one bank"):
        prompt_groups([{"group": "x", "variant": "base"}, {"group": "x", "variant": "base"}])
    # An experience row without its other half: its group's rollouts would all be Base (or all Bank), and eq. 7-8
    # need both halves of one group.
    for variant in ("base", "bank"):
        with pytest.raises(ValueError, match=rf"group 'x': rows \[0\] with variants \['{variant}'\]; expected one"):
            prompt_groups([{"group": "x", "task": "experience", "variant": variant}])


def test_sampler_keeps_groups_whole_and_contiguous() -> None:
    groups = [[0], [1, 2], [3], [4, 5]]
    sampler = PromptGroupSampler(groups, num_generations=4, batch_size=2, repeat_count=2, shuffle=True, seed=3)
    order = list(sampler)
    assert len(order) == len(sampler) == 4 * 4 * 2
    chunks = [order[i : i + 4] for i in range(0, len(order), 4)]
    allowed = {(0, 0, 0, 0), (1, 1, 2, 2), (3, 3, 3, 3), (4, 4, 5, 5)}
    # Every run of num_generations samples (one GRPO group) is one prompt group: Base half, then Bank half.
    assert all(tuple(c) in allowed for c in chunks)
    # Each generation batch (2 groups) is repeated repeat_count times, and every group appears once per epoch.
    assert chunks[0:2] == chunks[2:4] and chunks[4:6] == chunks[6:8]
    assert sorted({tuple(c) for c in chunks}) == sorted(allowed)
    # Shuffling moves whole groups, seeded: the same seed gives the same order.
    assert list(PromptGroupSampler(groups, 4, 2, 2, True, 3)) == order
    with pytest.raises(ValueError, match="odd"):
        PromptGroupSampler(groups, num_generations=3)


def test_a_run_resumed_in_a_later_epoch_draws_that_epochs_order() -> None:
    groups = [[i] for i in range(8)]

    def epochs(sampler: PromptGroupSampler, which: Iterable[int]) -> list[list[int]]:
        # As accelerate's data loader does at the start of each epoch: the epoch named, where the sampler takes one.
        out = []
        for epoch in which:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            out.append(list(sampler))
        return out

    straight = epochs(PromptGroupSampler(groups, 2, seed=3), range(3))
    assert straight[0] != straight[1] and straight[1] != straight[2]
    # Resumed from a checkpoint of epoch 2, training makes a new sampler: the trainer skips the batches the checkpoint
    # trained of the order the uninterrupted run drew in epoch 2, so every group is trained once in that epoch.
    assert epochs(PromptGroupSampler(groups, 2, seed=3), [2]) == straight[2:]
    # Iterated again without an epoch named, it draws a new order each time.
    sampler = PromptGroupSampler(groups, 2, seed=3)
    assert list(sampler) != list(sampler)


# ------------------------------------------------------------------------------------------ TRL
@pytest.fixture
def judge_sim() -> Iterator[SimServer]:
    # Verdicts alternate, so rollouts that are all wrong still get different rewards (-0.5 / -1.0).
    with SimServer(SimScript(rules=[Rule(role="judge", replies=[verdict(1), verdict(0)])])) as server:
        yield server


@pytest.mark.slow
def test_one_grpo_step_changes_the_weights(judge_sim: SimServer, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from tmas.rl.trl_train import TrainOptions, build_trainer, load_policy

    rows = [row("guideline", "p1"), row("experience", "p2", "base"), row("experience", "p2", "bank")]
    rows.append(row("guideline", "p3"))
    dataset = datasets.Dataset.from_list(rows)
    model, tokenizer = load_policy("tiny", dataset)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    options = TrainOptions(
        output_dir=tmp_path / "out",
        num_generations=4,
        groups_per_step=3,
        max_steps=1,
        max_completion_length=6,
        learning_rate=1e-3,
        use_vllm=False,
        save_steps=100,
    )
    log = tmp_path / "rewards.jsonl"
    reward = HybridReward(LLMNoveltyJudge(settings_for(judge_sim)), log_path=log)
    trainer = build_trainer(model, tokenizer, dataset, options, reward)
    # A.4's defaults reach TRL's config.
    assert (trainer.args.epsilon, trainer.args.epsilon_high, trainer.args.beta) == (0.2, 0.255, 0.0)
    assert (trainer.args.delta, trainer.args.loss_type, trainer.num_generations) == (10.0, "dapo", 4)
    result = trainer.train()
    assert result.global_step == 1

    changed = [name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())]
    assert changed, "one GRPO step left every weight as it was"
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(logged) == 3 * 4  # three prompt groups of four rollouts, scored once although TRL has 3 functions
    assert all(r["trained"] is True for r in logged)  # no dynamic sampling: the step trains on every group
    experience = [r for r in logged if r["task"] == "experience"]
    # The experience group reached the reward functions whole: two Base and two Bank rollouts, one p_base.
    assert sorted(r["variant"] for r in experience) == ["bank", "bank", "base", "base"]
    assert len({r["group"] for r in experience}) == 1 and len({r["p_base"] for r in experience}) == 1
    rewards = {r["reward"] for r in logged if r["task"] == "guideline"}
    assert len(rewards) > 1  # varied rewards, so the loss was not zero
    # Eq. 6 on the hybrid reward (the sum of the three task functions, one answering per rollout), per prompt
    # group: A_i = (r_i - mu) / (sigma + delta), TRL's sigma the sample deviation and delta 1e-4. Every token of a
    # rollout carries its A_i. (TRL shuffles the rows it trains on, so the advantages are compared as a multiset.)
    expected = []
    for group in {r["group"] for r in logged}:
        mine = [r["reward"] for r in logged if r["group"] == group]
        mu = sum(mine) / len(mine)
        sigma = math.sqrt(sum((r - mu) ** 2 for r in mine) / (len(mine) - 1))
        expected += [(r - mu) / (sigma + 1e-4) for r in mine]
    trained = trainer._buffered_inputs[0]["advantages"].tolist()
    assert sorted(trained) == pytest.approx(sorted(expected), abs=1e-5)
    assert trainer.args.multi_objective_aggregation == "sum_then_normalize"
    assert len([r for r in judge_sim.requests if r.role == "judge"]) == 8
    history = trainer.state.log_history[0]
    assert {"rewards/exploration/mean", "rewards/experience/mean"} <= set(history)
    assert not math.isnan(history["rewards/exploration/mean"])


@pytest.mark.slow
def test_the_clipped_ratio_counts_the_rollouts_cut_at_the_length_limit_alone(tmp_path: Path) -> None:
    """A rollout ends at any of the policy's end tokens, its generation config's too; TRL's clipped_ratio took every
    rollout that did not end at the tokenizer's for cut. Here half the rollouts end at once at the other end token and
    half never end (cut at 5 tokens): half are cut, and the finished ones are 1 token long (TRL logged 1.0 and 0)."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from tmas.rl.trl_train import TrainOptions, build_trainer, load_policy

    dataset = datasets.Dataset.from_list([row("normal", "p1"), row("normal", "p2")])
    model, tokenizer = load_policy("tiny", dataset)
    other = tokenizer.convert_tokens_to_ids("391")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, other]

    def steer(module: Any, inputs: Any, logits: Any) -> Any:
        # Even rows of the batch write the other end token first; odd rows never write an end token.
        logits = logits.clone()
        logits[0::2, ..., other] += 1e4
        logits[1::2, ..., [tokenizer.eos_token_id, other]] -= 1e4
        return logits

    model.lm_head.register_forward_hook(steer)
    options = TrainOptions(
        output_dir=tmp_path / "out",
        num_generations=2,
        groups_per_step=2,
        max_steps=1,
        max_completion_length=5,
        use_vllm=False,
        save_steps=100,
    )
    trainer = build_trainer(model, tokenizer, dataset, options, HybridReward())
    trainer.train()
    history = trainer.state.log_history[0]
    assert history["completions/clipped_ratio"] == 0.5
    assert history["completions/mean_terminated_length"] == history["completions/max_terminated_length"] == 1.0
    assert history["completions/mean_length"] == 3.0  # (1 + 5) / 2: the rollouts were as described


def test_every_training_option_reaches_what_trl_trains_with(tmp_path: Path) -> None:
    """Each option of ``tmas rl train``, set off its default, is what the trainer TRL builds holds: its config, the
    generation config its rollouts are sampled with, its policy (LoRA, weights' dtype) and its reward (eq. 8's beta).
    A new option that reaches none of them fails here."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("peft")
    from tmas.rl.trl_train import TrainOptions, build_trainer, load_policy, reward_for

    options = TrainOptions(
        output_dir=tmp_path / "out",
        num_generations=4,
        learning_rate=3e-5,
        epsilon=0.1,
        epsilon_high=0.3,
        clip_coefficient=5.0,
        kl_beta=0.01,
        experience_beta=0.4,
        temperature=0.8,
        top_p=0.9,
        max_completion_length=64,
        mask_truncated=True,
        max_steps=7,
        groups_per_step=2,
        generate_groups=3,
        gradient_accumulation_steps=2,
        use_vllm=False,
        continuous_batching=True,
        dtype="bfloat16",
        save_steps=3,
        max_time_s=60.0,
        seed=11,
        lora_rank=4,
        lora_alpha=16,
    )
    defaults = TrainOptions(output_dir=tmp_path)
    assert [f for f in TrainOptions.model_fields if getattr(options, f) == getattr(defaults, f)] == []
    dataset = datasets.Dataset.from_list([row("normal", f"p{i}") for i in range(3)])
    model, tokenizer = load_policy("tiny", dataset, options.dtype)
    trainer = build_trainer(model, tokenizer, dataset, options, reward_for(options, None, tokenizer=tokenizer))
    args, generation = trainer.args, trainer.generation_config
    frozen = next(p for name, p in trainer.model.named_parameters() if "lora" not in name)
    received = {
        "output_dir": Path(args.output_dir),
        "num_generations": trainer.num_generations,
        "learning_rate": args.learning_rate,
        "epsilon": trainer.epsilon_low,
        "epsilon_high": trainer.epsilon_high,
        "clip_coefficient": args.delta,  # TRL's two-sided bound on the ratio (A.4's clipping coefficient)
        "kl_beta": trainer.beta,
        "experience_beta": trainer.hybrid_reward.beta,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "max_completion_length": generation.max_new_tokens,
        "mask_truncated": trainer.mask_truncated_completions,
        "max_steps": args.max_steps,
        "groups_per_step": trainer.train_groups,
        "generate_groups": args.generation_batch_size // options.num_generations,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "use_vllm": trainer.use_vllm,
        "continuous_batching": trainer.use_transformers_continuous_batching,
        "dtype": str(frozen.dtype).removeprefix("torch."),
        "save_steps": args.save_steps,
        "seed": args.seed,
        "lora_rank": trainer.model.peft_config["default"].r,
        "lora_alpha": trainer.model.peft_config["default"].lora_alpha,
    }
    assert received == {f: getattr(options, f) for f in received}
    # The one option TRL never sees: train_policy's time limit (test_a_time_limit_ends_training_after_a_step...).
    assert set(TrainOptions.model_fields) - set(received) == {"max_time_s"}
    # The sampling TRL adds nothing to: the log-probabilities at the rollouts' temperature, no top-k cut and no
    # repetition penalty, and the rollouts end at the policy's end tokens.
    assert trainer.temperature == 0.8 and not generation.top_k and generation.repetition_penalty == 1.0
    assert generation.eos_token_id == [tokenizer.eos_token_id]


@pytest.mark.slow
def test_the_learning_rate_asked_for_is_the_rate_of_every_step(tmp_path: Path) -> None:
    """A.4 gives one learning rate: every optimizer step uses it, whatever --max-steps is (the Trainer's default
    schedule decayed it linearly to 0 at --max-steps: 1e-3 at step 1, 1e-3 * (190 - 3) / 190 at step 4)."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from tmas.rl.trl_train import TrainOptions, build_trainer, load_policy

    dataset = datasets.Dataset.from_list([row("normal", "p1")])
    model, tokenizer = load_policy("tiny", dataset)
    options = TrainOptions(output_dir=tmp_path / "out", num_generations=2, learning_rate=1e-3, use_vllm=False)
    trainer = build_trainer(model, tokenizer, dataset, options, HybridReward())
    trainer.create_optimizer_and_scheduler(num_training_steps=options.max_steps)
    rates = []
    for _ in range(4):
        rates.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert rates == [1e-3] * 4


@pytest.mark.slow
def test_a_time_limit_ends_training_after_a_step_with_its_final_adapter(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("peft")
    from tmas.rl.trl_train import TrainOptions, train_policy

    dataset = datasets.Dataset.from_list([row("normal", f"p{i}") for i in range(3)])
    out = tmp_path / "out"
    options = TrainOptions(
        output_dir=out,
        num_generations=2,
        max_steps=3,
        max_completion_length=4,
        use_vllm=False,
        save_steps=100,
        lora_rank=2,
        max_time_s=1e-6,  # passed during the first step
    )
    final, steps = train_policy(dataset, options, "tiny", None, live=False)
    assert steps == 1
    assert (final / "adapter_config.json").is_file() and (final / "tmas_base.json").is_file()
    assert len((out / "steps.jsonl").read_text().splitlines()) == 1
    # The step it stopped at is a checkpoint (save_steps alone would give none), so --resume goes on from it.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]


def test_under_several_processes_the_main_ones_clock_ends_training_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-time: each process measures its own time, and one that stopped alone while another trained on would
    leave that one waiting for it at its next gather. The main process's decision is handed to all (no real second
    process: the broadcast hands back the main one's)."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    import accelerate.utils
    from transformers import TrainerControl

    from tmas.rl.trl_train import TimeLimit

    main_says: list[bool] = []

    def broadcast(values: list[Any], from_process: int) -> None:
        assert from_process == 0
        values[:] = main_says

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    for own_clock_passed, main_passed in ((True, False), (False, True), (True, True), (False, False)):
        main_says[:] = [main_passed]
        control = TrainerControl()
        TimeLimit(1e-9 if own_clock_passed else 1e9).on_step_end(SimpleNamespace(world_size=2), None, control)
        assert (control.should_training_stop, control.should_save) == (main_passed, main_passed)
    # One process: its own clock, nothing broadcast.
    main_says[:] = [False]
    control = TrainerControl()
    TimeLimit(1e-9).on_step_end(SimpleNamespace(world_size=1), None, control)
    assert control.should_training_stop and control.should_save


def test_rows_the_rewards_cannot_read_are_refused_before_training(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from tmas.errors import InputError
    from tmas.rl.data import write_parquet
    from tmas.rl.scoring import is_correct
    from tmas.rl.trl_train import load_dataset

    good = [row("normal", "p1"), row("experience", "p2", "base"), row("experience", "p2", "bank")]
    write_parquet(good, tmp_path / "good.parquet")
    assert len(load_dataset(tmp_path / "good.parquet")) == 3
    # A missing answer reaches the grader as the text 'None', which a rollout answering \boxed{None} matches.
    assert is_correct("\\boxed{None}", str(None))

    def refused(rows: list[dict[str, Any]]) -> str:
        path = tmp_path / "bad.parquet"
        write_parquet(rows, path)
        with pytest.raises(InputError) as caught:
            load_dataset(path)
        return str(caught.value)

    for missing in (None, " "):
        bad = [*good[:2], {**good[2], "reward_model": {"style": "rule", "ground_truth": missing}}]
        assert refused(bad).endswith("bad.parquet: row 2 has no reference answer (reward_model.ground_truth)")
    no_group = {**good[0], "extra_info": {"task": "normal", "question": Q}}
    assert "row 0: extra_info has no task and group of 'tmas rl build-data'" in refused([no_group])
    no_question = {**good[0], "extra_info": {"task": "normal", "group": "g"}}
    assert "row 0: extra_info has no question" in refused([no_question])
    no_variant = {**good[1], "extra_info": {**good[1]["extra_info"], "variant": None}}
    assert "row 0: an experience row whose variant is not base or bank" in refused([no_variant, good[2]])
    assert "group 'run/p2/1/experience'" in refused([good[1], good[1]])  # two Base rows, no Bank
    # A Base or Bank row whose other half is not in the file: refused here, not at the step that first draws it.
    assert "bad.parquet: group 'run/p2/1/experience': rows [1] with variants ['base']" in refused(good[:2])
    assert "bad.parquet: group 'run/p2/1/experience': rows [1] with variants ['bank']" in refused([good[0], good[2]])


def test_group_alignment_is_checked(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from tmas.errors import ConfigError
    from tmas.rl.trl_train import TrainOptions, check_group_alignment, grpo_config

    config = grpo_config(TrainOptions(output_dir=tmp_path, num_generations=4, groups_per_step=1))
    check_group_alignment(config)
    config.steps_per_generation = 1
    config.per_device_train_batch_size = 6
    with pytest.raises(ConfigError, match="not a multiple"):
        check_group_alignment(config)


# ------------------------------------------------------------------------------------------ verl
def test_verl_batch_equals_trl_path(tmp_path: Path) -> None:
    from tmas.rl import verl_reward

    rules = [
        Rule(role="judge", pattern="ROUTE-NEW", replies=[verdict(1)]),
        Rule(role="judge", replies=[verdict(0)]),
    ]
    with SimServer(SimScript(rules=rules)) as sim:
        config = tmp_path / "tmas.toml"
        config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "sim-model"\n')
        rows = [row("normal", "p0")] * 2 + [row("experience", "p2", "base")] * 2 + [row("experience", "p2", "bank")] * 2
        rows += [row("guideline", "p3")] * 4
        completions = [
            "\\boxed{391}", "\\boxed{390}",  # normal
            "\\boxed{1}", "\\boxed{391}",  # base: p_base = 0.5
            "\\boxed{391}", "no answer",  # bank: 1 + 0.6 * 0.5
            "ROUTE-NEW \\boxed{391}", "ROUTE-NEW \\boxed{3}", "old \\boxed{391}", "old \\boxed{3}",
        ]  # fmt: skip
        expected = [1.0, -1.0, -1.0, 1.0, 1.3, -1.0, 1.0, -0.5, 0.2, -1.0]

        hybrid = HybridReward(LLMNoveltyJudge(settings_for(sim)))
        columns = {"extra_info": [r["extra_info"] for r in rows], "reward_model": [r["reward_model"] for r in rows]}
        messages = [[{"role": "assistant", "content": c}] for c in completions]
        per_function = [f([r["prompt"] for r in rows], messages, **columns) for f in hybrid.functions()]
        trl_total = [sum(v for v in values if v is not None) for values in zip(*per_function, strict=True)]
        # Each rollout is answered by exactly one of the three functions (TRL sums them, skipping None).
        assert all(sum(v is not None for v in values) == 1 for values in zip(*per_function, strict=True))

        verl_scores = verl_reward.compute_score_batch(
            data_sources=[r["data_source"] for r in rows],
            solution_strs=completions,
            ground_truths=[r["reward_model"]["ground_truth"] for r in rows],
            extra_infos=[r["extra_info"] for r in rows],
            tmas_config=str(config),
        )
        assert trl_total == pytest.approx(expected)
        assert [s["score"] for s in verl_scores] == pytest.approx(trl_total)
        # Each rollout's uid is its prompt group, so verl's GRPO normalises a group's Base and Bank halves together.
        assert [s["uid"] for s in verl_scores] == [r["extra_info"]["group"] for r in rows]
        assert [s["p_base"] for s in verl_scores][2:6] == [0.5] * 4
        # The per-rollout form: correctness and exploration as above; experience without a group gets no bonus.
        single = verl_reward.compute_score(
            "tmas/experience", "\\boxed{391}", "391", rows[4]["extra_info"], tmas_config=str(config)
        )
        assert single == 1.0
        assert verl_reward.compute_score("gsm8k", "\\boxed{7}", "7", None) == 1.0


def test_experience_beta_reaches_the_reward(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from tmas.rl.trl_train import TrainOptions, reward_for

    # A group of 2 Base (1 correct: p_base = 0.5) and 2 Bank (1 correct): eq. 8 gives the correct Bank rollout
    # 1 + beta * (1 - 0.5): 1.1 with --experience-beta 0.2, 1.3 with the paper's 0.6.
    rows = [row("experience", "p1", "base")] * 2 + [row("experience", "p1", "bank")] * 2
    completions = ["\\boxed{391}", "\\boxed{1}", "\\boxed{391}", "\\boxed{1}"]
    columns = {"extra_info": [r["extra_info"] for r in rows], "reward_model": [r["reward_model"] for r in rows]}
    for beta, bank_correct in ((0.2, 1.1), (0.6, 1.3)):
        reward = reward_for(TrainOptions(output_dir=tmp_path, experience_beta=beta), None)
        experience = reward.function("experience")
        assert experience([r["prompt"] for r in rows], completions, **columns) == pytest.approx(
            [1.0, -1.0, bank_correct, -1.0]
        )
    assert TrainOptions(output_dir=tmp_path).experience_beta == 0.6


def test_the_reward_reads_completions_as_the_policy_template_opens_them(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from tmas.rl.tiny import CHAT_TEMPLATE, tiny_tokenizer
    from tmas.rl.trl_train import TrainOptions, reward_for

    # A template that opens the think block in the prompt (as Qwen3-4B-Thinking-2507's does): TRL's completions then
    # start inside it, and one cut while it thinks, boxing a guess on the way, has no final answer: reward -1.
    thinking = tiny_tokenizer(["x"])
    thinking.chat_template = CHAT_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
    rows = [row("normal", "p1")] * 2
    columns = {"extra_info": [r["extra_info"] for r in rows], "reward_model": [r["reward_model"] for r in rows]}
    completions = ["17*23: maybe \\boxed{391}, then check 17*20 = 340 and", "17*23 = 391.</think>\n\n\\boxed{391}"]
    options = TrainOptions(output_dir=tmp_path)
    correctness = reward_for(options, None, tokenizer=thinking).function("normal")
    assert correctness([r["prompt"] for r in rows], completions, **columns) == [-1.0, 1.0]
    # A template that does not open it: the cut completion's box is its answer.
    plain = reward_for(options, None, tokenizer=tiny_tokenizer(["x"])).function("normal")
    assert plain([r["prompt"] for r in rows], completions, **columns) == [1.0, 1.0]
    # Conversational completions, the thinking parsed out by a tokenizer's response template (the finished one)
    # or left in the content (the cut one, which has no </think> to parse at): read the same.
    messages = [
        [{"role": "assistant", "content": completions[0]}],
        [{"role": "assistant", "reasoning_content": "17*23 = 391.", "content": "\\boxed{391}"}],
    ]
    assert correctness([r["prompt"] for r in rows], messages, **columns) == [-1.0, 1.0]


# ------------------------------------------------------------------------------------------ logs and LoRA
def test_step_components_and_resume_trimming(tmp_path: Path) -> None:
    from tmas.rl.scoring import RewardBreakdown
    from tmas.rl.step_log import read_rows, reward_components, trim_logs

    def b(task: str, correct: bool, reward: float, **kw: Any) -> RewardBreakdown:
        return RewardBreakdown(task=task, group=f"g-{task}", correct=correct, reward=reward, **kw)  # type: ignore[arg-type]

    scored = [
        b("experience", True, 1.0, variant="base", p_base=0.5),
        b("experience", False, -1.0, variant="base", p_base=0.5),
        b("experience", True, 1.3, variant="bank", p_base=0.5),
        b("experience", False, -1.0, variant="bank", p_base=0.5),
        b("guideline", True, 1.0, novelty=1),
        b("guideline", False, -1.0, novelty=0),
    ]
    row = reward_components(scored)
    assert row["normal/rollouts"] == 0 and row["normal/reward"] is None
    assert row["experience/reward"] == pytest.approx(0.075)
    assert (row["experience/base_accuracy"], row["experience/bank_accuracy"], row["experience/p_base"]) == (
        0.5,
        0.5,
        0.5,
    )
    assert row["experience/bonus"] == pytest.approx(0.15)  # 0.6 * (1 - 0.5) on one of two Bank rollouts
    assert (row["guideline/accuracy"], row["guideline/novel"], row["guideline/reward"]) == (0.5, 0.5, 0.0)
    assert row["guideline/judge_unusable"] == 0.0
    # Two more the judge gave no usable verdict on (counted as known), one it could not tell (-1, a verdict).
    scored += [
        b("guideline", True, 0.2, novelty=None, judge_note="judge call failed: HTTP 503; counted as known"),
        b("guideline", False, -1.0, novelty=None, judge_note="judge reply unusable (no JSON): counted as known"),
        b("guideline", False, -1.0, novelty=-1),
    ]
    row = reward_components(scored)
    assert (row["guideline/rollouts"], row["guideline/novel"], row["guideline/judge_unusable"]) == (5, 0.2, 0.4)

    (tmp_path / "steps.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (tmp_path / "rewards.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 0, 1, 2)))
    trim_logs(tmp_path, 2)  # resumed from checkpoint-2: step 3 (scored at step 2) is trained again
    assert [r["step"] for r in read_rows(tmp_path / "steps.jsonl")] == [1, 2]
    assert [r["step"] for r in read_rows(tmp_path / "rewards.jsonl")] == [0, 0, 1]


def test_under_several_processes_the_main_one_alone_writes_the_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under accelerate every process runs the trainer and its callbacks, and each scores its own share of a batch.
    The main process writes steps.jsonl and the rewards log, the latter with every process's rollouts gathered
    (each once, with whether the step trained on it); another process writes neither. No real second process:
    the rank is what the trainer state and the accelerator say, and the gather hands back the other rank's share."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    import accelerate.utils
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from tmas.rl.step_log import StepLog, read_rows
    from tmas.rl.trl_train import record_rollouts

    def scored_batch(answers: list[str]) -> HybridReward:
        reward = HybridReward(log_path=out / "rewards.jsonl")
        reward.hold_log = True  # as the trainer sets it
        rows = [row("normal", "p1")] * len(answers)
        columns = {k: [r[k] for r in rows] for k in ("extra_info", "reward_model")}
        reward.score([f"\\boxed{{{a}}}" for a in answers], trainer_state=TrainerState(global_step=3), **columns)
        return reward

    out = tmp_path / "out"
    out.mkdir()
    args, control = TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerControl()
    other = scored_batch(["391", "7"])
    share: list[Any] = []
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda rows: [*rows, *share])
    record_rollouts(other, [False, False], SimpleNamespace(num_processes=2, is_main_process=False))
    saved: list[Path] = []
    steps = StepLog(out, other, on_save=saved.append)
    not_main = TrainerState(global_step=4, max_steps=5, is_world_process_zero=False)
    steps.on_log(args, not_main, control, logs={"reward": 0.0, "loss": 0.1})
    steps.on_save(args, not_main, control)
    steps.on_train_end(args, not_main, control)
    assert not (out / "rewards.jsonl").exists() and not (out / "steps.jsonl").exists() and not saved

    # The main process: its own two rollouts (trained) and the other process's two (a group the step dropped).
    main = scored_batch(["391", "7"])
    assert not (out / "rewards.jsonl").exists()  # held until the trainer knows what the step trains on
    share[:] = zip(other.last_scored(), [False, False], strict=True)
    record_rollouts(main, [True, True], SimpleNamespace(num_processes=2, is_main_process=True))
    logged = read_rows(out / "rewards.jsonl")
    assert [(r["step"], r["correct"], r["trained"]) for r in logged] == [
        (3, True, True),
        (3, False, True),
        (3, True, False),
        (3, False, False),
    ]
    StepLog(out, main).on_log(args, TrainerState(global_step=4, max_steps=5), control, logs={"reward": 0.0})
    (step,) = read_rows(out / "steps.jsonl")
    # The step's components count every process's rollouts, not the main process's alone.
    assert (step["step"], step["normal/rollouts"], step["normal/accuracy"]) == (4, 4, 0.5)


def test_another_process_leaves_the_logs_to_the_main_one_when_training_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting over (no checkpoint) forgets the logged steps; only the main process rewrites the logs, so that
    processes started together do not race on the file."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from types import SimpleNamespace

    import accelerate

    from tmas.errors import LocalModelError
    from tmas.rl.trl_train import TrainOptions, train_policy

    out = tmp_path / "out"
    out.mkdir()
    logged = '{"step": 1}\n{"step": 2}\n'
    (out / "steps.jsonl").write_text(logged)
    dataset = datasets.Dataset.from_list([row("normal", "p1"), row("normal", "p2")])  # a group per process
    options = TrainOptions(output_dir=out, num_generations=2, use_vllm=False)
    for main, left in ((False, logged), (True, "")):
        monkeypatch.setattr(
            accelerate, "PartialState", lambda main=main: SimpleNamespace(is_main_process=main, num_processes=2)
        )
        # A model that cannot load: the logs were dealt with before it.
        with pytest.raises(LocalModelError, match="no-such-model"):
            train_policy(dataset, options, str(tmp_path / "no-such-model"), None)
        assert (out / "steps.jsonl").read_text() == left


def test_another_process_writes_no_file_and_draws_no_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process runs training: the main one alone records the base model a LoRA run adapts (and saves the
    built tiny one under OUT/base), saves the tokenizer beside the final weights and draws the progress bar, so that
    processes started together neither race on a file nor draw one bar each. The trainer stands in (it saves its
    weights by its own rule); the rank is what accelerate says."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from types import SimpleNamespace

    import accelerate
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from tmas.rl import trl_train
    from tmas.rl.train_progress import TrainProgress

    class Trainer:
        def remove_callback(self, callback: Any) -> None: ...

        def add_callback(self, callback: Any) -> None: ...

        def train(self, resume_from_checkpoint: str | None = None) -> Any:
            return SimpleNamespace(global_step=1)

        def save_model(self, path: str) -> None: ...

    monkeypatch.setattr(trl_train, "build_trainer", lambda *a: Trainer())
    dataset = datasets.Dataset.from_list([row("normal", "p1"), row("normal", "p2")])  # a group per process
    written = {}
    for main in (False, True):
        out = tmp_path / f"main-{main}"
        options = trl_train.TrainOptions(output_dir=out, num_generations=2, use_vllm=False, lora_rank=2)
        monkeypatch.setattr(
            accelerate, "PartialState", lambda main=main: SimpleNamespace(is_main_process=main, num_processes=2)
        )
        trl_train.train_policy(dataset, options, "tiny", None, live=False)
        written[main] = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written[False] == []
    assert {"tmas_base.json", "base/config.json", "final/tokenizer.json", "final/tmas_base.json"} <= set(written[True])

    args, control = TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerControl()
    for main in (False, True):
        progress = TrainProgress(live=True)
        progress.on_train_begin(args, TrainerState(max_steps=5, is_world_process_zero=main), control)
        assert (progress._progress is not None) is main
        progress.on_train_end(args, TrainerState(), control)


def test_logs_cut_off_by_a_kill_resume_and_other_bad_lines_are_named(tmp_path: Path) -> None:
    """A run killed while it appended to its logs leaves a last line without its end: a resume (or a start over a
    run stopped before its first checkpoint) drops it, as a line past the checkpoint. A bad line anywhere else is
    a one-line error naming the file and the line."""
    from tmas.errors import InputError
    from tmas.rl.step_log import read_rows, trim_logs

    steps, rewards = tmp_path / "steps.jsonl", tmp_path / "rewards.jsonl"
    steps.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    rewards.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 2, "task": "nor')
    trim_logs(tmp_path, 2)  # resumed from checkpoint-2
    assert [r["step"] for r in read_rows(steps)] == [1, 2]
    assert [r["step"] for r in read_rows(rewards)] == [0, 1]
    assert steps.read_text() == '{"step": 1}\n{"step": 2}\n'
    trim_logs(tmp_path, 0)  # started again with no checkpoint: every line goes
    assert steps.read_text() == rewards.read_text() == ""

    steps.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(InputError) as raised:
        trim_logs(tmp_path, 3)
    assert str(raised.value).startswith(f"{steps}: line 2 is not JSON (")
    steps.write_text('{"step": 1}\n[2]\n')
    with pytest.raises(InputError, match=r"steps.jsonl: line 2 is not a JSON object$"):
        read_rows(steps)


def test_a_lora_adapter_merges_into_a_checkpoint_that_loads(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("datasets")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from tmas.rl.export import merge_adapter
    from tmas.rl.trl_train import TrainOptions, load_policy, lora_config, record_base

    model, tokenizer = load_policy("tiny", datasets.Dataset.from_list([row("normal", "p1")]))
    run = tmp_path / "run"
    run.mkdir()
    record_base(run, "tiny", model, tokenizer)
    config = lora_config(TrainOptions(output_dir=run, lora_rank=4))
    config.init_lora_weights = False  # random weights on both LoRA matrices: an adapter that changes the model
    adapted = peft.get_peft_model(model, config)
    adapted.save_pretrained(run / "final")  # as a LoRA run leaves OUT/final, its base recorded in OUT

    merged = merge_adapter(run / "final", tmp_path / "merged")
    assert not (merged / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(merged)
    base = AutoModelForCausalLM.from_pretrained(run / "base")
    ids = torch.tensor([tokenizer.encode("What is 17*23? \\boxed{ 391 }")])
    with torch.no_grad():
        want, got, before = adapted(ids).logits, loaded(ids).logits, base(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, before, atol=1e-3)


def test_the_end_token_is_read_from_the_gguf(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from tmas.llm.hf_checkpoint import gguf_eos_id

    for name, eos in (("with.gguf", 151645), ("without.gguf", None)):
        writer = gguf.GGUFWriter(str(tmp_path / name), "qwen2")
        if eos is not None:
            writer.add_eos_token_id(eos)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        assert gguf_eos_id(tmp_path / name) == eos


@pytest.mark.slow
def test_a_gguf_policy_is_converted_once_and_read_from_the_cache_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gguf")
    from tmas.llm import hf_checkpoint
    from tmas.llm.weights import resolve_model
    from tmas.rl import trl_train

    try:
        resolve_model("smollm2-135m")
    except Exception as exc:  # the embedded weights are a package of their own
        pytest.skip(f"SmolLM2-135M not installed: {exc}")
    monkeypatch.setenv("TMAS_CACHE_DIR", str(tmp_path / "cache"))
    conversions: list[Path] = []

    def counted(gguf: Path) -> Any:
        conversions.append(gguf)
        return convert(gguf)

    convert = hf_checkpoint.gguf_tokenizer
    for module in (hf_checkpoint, trl_train):
        monkeypatch.setattr(module, "gguf_tokenizer", counted, raising=False)
    # Training, its --judge-model and a later --resume or export each load the policy: the tokenizer (a minute or
    # more for the 0.5B model) is converted by the first only.
    model, tokenizer = trl_train.load_policy("smollm2-135m")
    again, tokenizer_again = trl_train.load_policy("smollm2-135m", dtype="bfloat16")
    assert len(conversions) == 1
    assert tokenizer_again.eos_token == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer_again.encode("What is 17*23?") == tokenizer.encode("What is 17*23?")
    assert str(again.dtype) == "torch.bfloat16" and str(model.dtype) == "torch.float32"
    weight = next(iter(model.state_dict()))
    assert again.state_dict()[weight].float().allclose(model.state_dict()[weight], atol=1e-2)
