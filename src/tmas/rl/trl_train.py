"""GRPO with TRL on the hybrid rewards (paper section 3.3, the optimiser's settings from appendix A.4).

A.4 -> GRPOConfig: 16 rollouts per prompt (``num_generations``), learning rate 1e-6 (constant), clip range [0.20, 0.255]
(``epsilon``, ``epsilon_high``), clipping coefficient 10.0 (TRL's two-sided bound ``delta``: the ratio is capped at
10 for negative advantages, as verl's dual clip ``clip_ratio_c`` does), no KL term (``beta`` 0), no entropy bonus
(TRL has none). Eq. 6's 1/sum|o_i| token averaging is TRL's ``dapo`` loss. TRL normalises a group's rewards with the
sample standard deviation and adds 1e-4; eq. 6 (and :func:`tmas.rl.rewards.group_advantages`) uses the population
one: for 16 rollouts the advantages differ by a factor of about 1.03. Not A.4's, for one GPU: replies of at most
2,048 tokens (A.4: 80K) and one prompt group a step (A.4: 128 prompts); ``docs/rl.md``'s verl recipe has A.4's.

Prompt groups are kept whole by :class:`tmas.rl.sampler.PromptGroupSampler`; each process's generation batch must
hold whole groups (checked here), so the reward functions always see a prompt's Base and Bank halves together.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, cast

from transformers import TrainerCallback
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from tmas.errors import ConfigError, InputError
from tmas.llm.hf_checkpoint import checkpoint, load_gguf
from tmas.llm.weights import resolve_model
from tmas.rl.checkpoints import checkpoint_step
from tmas.rl.data import COLUMNS
from tmas.rl.dynamic_sampling import choose_groups, group_rows, groups_with_spread, keep_rows
from tmas.rl.hf_generate import continuous_batching_options, stop_ids, template_opens_think
from tmas.rl.plot import plot_steps
from tmas.rl.sampler import PromptGroupSampler, prompt_groups
from tmas.rl.scoring import TASKS, NoveltyJudge
from tmas.rl.step_log import REWARDS_FILE, StepLog, trim_logs
from tmas.rl.tiny import tiny_model, tiny_tokenizer
from tmas.rl.train_options import TrainOptions, bf16_autocast
from tmas.rl.train_progress import TrainProgress
from tmas.rl.trl_rewards import HybridReward

# Beside a LoRA adapter (OUT and OUT/final): the --model it was trained on, which export-gguf merges it into.
BASE_FILE = "tmas_base.json"
PLOT_FILE = "rewards.png"


def vllm_available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def grpo_config(options: TrainOptions) -> GRPOConfig:
    """TRL's configuration. A step generates ``generated_groups`` groups in one batch (TRL's generation batch:
    ``per_device_train_batch_size * steps_per_generation`` rows, ``steps_per_generation`` defaulting to the
    accumulation steps) and trains on ``groups_per_step`` of them, split into the accumulation's micro-batches."""
    import torch

    cuda = torch.cuda.is_available()
    use_vllm = vllm_available() if options.use_vllm is None else options.use_vllm
    accumulation = options.gradient_accumulation_steps
    return GRPOConfig(
        output_dir=str(options.output_dir),
        num_generations=options.num_generations,
        per_device_train_batch_size=options.generated_groups * options.num_generations // accumulation,
        gradient_accumulation_steps=accumulation,
        learning_rate=options.learning_rate,
        # A.4's one learning rate, every step (verl's default schedule, as in docs/rl.md's verl recipe); the
        # Trainer's default decays it linearly to 0 at --max-steps, so that a run stopped for time trained at a rate
        # set by --max-steps.
        lr_scheduler_type="constant",
        epsilon=options.epsilon,
        epsilon_high=options.epsilon_high,
        delta=options.clip_coefficient,
        beta=options.kl_beta,
        loss_type="dapo",
        scale_rewards="group",
        temperature=options.temperature,
        top_p=options.top_p,
        max_completion_length=options.max_completion_length,
        mask_truncated_completions=options.mask_truncated,
        max_steps=options.max_steps,
        use_vllm=use_vllm,
        # Colocated only: TRL's server mode generates for every num_generations-th prompt alone (it assumes a
        # group repeats one prompt), which would give an experience group's Bank rollouts the Base prompt.
        vllm_mode="colocate",
        use_transformers_continuous_batching=options.continuous_batching and not use_vllm,
        transformers_continuous_batching_config=continuous_batching_options(cuda) or None,
        logging_steps=1,
        save_steps=options.save_steps,
        # --resume needs only the last one; the one before survives a kill during a save.
        save_total_limit=2,
        seed=options.seed,
        use_cpu=not cuda,
        bf16=mixed_precision(options, cuda),
        report_to=[],
    )


def mixed_precision(options: TrainOptions, cuda: bool) -> bool:
    """Autocast to bfloat16 (weights kept float32) on a GPU, for a float32 policy generating with padded generate
    as before. Off for a bfloat16 policy, and with continuous batching: TRL's engine path casts the whole model,
    a LoRA adapter's float32 weights included, to bfloat16 before each generation when this is on, and the adapter
    would then train in bfloat16. There the policy generates in its own ``dtype``."""
    return bf16_autocast(options.dtype, options.continuous_batching, cuda)


class TMASGRPOTrainer(GRPOTrainer):
    """TRL's GRPO trainer with the prompt-group sampler (see :mod:`tmas.rl.sampler`), the rollouts' generation
    timed (``rollout/*`` in the step's log) and, where more groups are generated than trained, dynamic sampling
    (see :mod:`tmas.rl.dynamic_sampling`; ``dynamic/*`` in the step's log)."""

    def __init__(
        self,
        *args: Any,
        hybrid_reward: HybridReward,
        train_groups: int | None = None,
        stops: Sequence[int] = (),
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.hybrid_reward = hybrid_reward
        # Its rewards log is written here, once the groups the step trains on are known (record_rollouts).
        hybrid_reward.hold_log = True
        # Every token that ends a rollout (:func:`tmas.rl.hf_generate.stop_ids`); TRL's own is the tokenizer's alone.
        self.stops = frozenset(stops)
        # Groups a step trains on; None: every group generated.
        self.train_groups = train_groups
        # The groups (extra_info.group) the last step trained on.
        self.last_trained_groups: list[str] = []
        if train_groups is not None and self.accelerator.num_processes > 1:
            raise ConfigError("dynamic sampling (--generate-groups) runs in one process only")

    def training_mode(self) -> bool:
        return bool(getattr(self.model, "training", False))

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        dataset = self.train_dataset if dataset is None else dataset
        args = cast(GRPOConfig, self.args)
        generations = int(self.num_generations or args.num_generations or 1)
        return PromptGroupSampler(
            prompt_groups(dataset["extra_info"]),
            num_generations=generations,
            batch_size=int(args.generation_batch_size or generations) // generations,
            repeat_count=self.num_iterations * int(args.steps_per_generation or 1),
            shuffle=bool(self.shuffle_dataset),
            seed=args.seed,
        )

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)  # type: ignore[no-untyped-call]
        completion_ids, logprobs = cut_at_stops(completion_ids, logprobs, self.stops)
        seconds = max(time.monotonic() - started, 1e-9)
        tokens = sum(len(ids) for ids in completion_ids)
        mode = "train" if self.training_mode() else "eval"
        self._metrics[mode]["rollout/generate_s"].append(seconds)
        self._metrics[mode]["rollout/generated_tokens_per_s"].append(tokens / seconds)
        return completion_ids, logprobs

    def _generate(self, prompts: list[Any]) -> Any:
        out = super()._generate(prompts)
        self.log_cut_rollouts(out[1])  # its completion ids
        return out

    def log_cut_rollouts(self, completion_ids: Sequence[Sequence[int]]) -> None:
        """TRL's ``completions/clipped_ratio`` and ``completions/*_terminated_length`` of the batch just generated,
        counted again: a rollout was cut at the length limit where it ends at none of the policy's end tokens. TRL's
        own count takes a rollout that does not end at the tokenizer's end token for cut, so every one that ended at
        another of them (a generation config's ``<|endoftext|>``) counted as cut, and its length as no finished one."""
        import torch

        device = self.accelerator.device
        ends = self.stops | {self._tokenizer.eos_token_id}
        cut = torch.tensor([not ids or ids[-1] not in ends for ids in completion_ids], dtype=torch.bool, device=device)
        cut = self.accelerator.gather(cut)
        lengths = self.accelerator.gather(torch.tensor([len(ids) for ids in completion_ids], device=device)).float()
        finished = lengths[~cut] if bool((~cut).any()) else torch.zeros(1, device=device)  # TRL's 0 where none
        metrics = self._metrics["train" if self.training_mode() else "eval"]
        metrics["completions/clipped_ratio"][-1] = cut.float().mean().item()
        metrics["completions/mean_terminated_length"][-1] = finished.mean().item()
        metrics["completions/min_terminated_length"][-1] = finished.min().item()
        metrics["completions/max_terminated_length"][-1] = finished.max().item()

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        n = int(self.num_generations or 1)
        groups = [str(x["extra_info"]["group"]) for x in inputs[::n]]
        training = self.training_mode()
        if self.train_groups is None or not training:
            self.last_trained_groups = groups if training else []
            record_rollouts(self.hybrid_reward, [training] * len(inputs), self.accelerator)
            return batch
        rewards = [b.reward for b in self.hybrid_reward.last_scored()]
        spread = groups_with_spread(rewards, n)
        chosen = choose_groups(spread, self.train_groups)
        metrics = self._metrics["train"]
        metrics["dynamic/groups_generated"].append(float(len(spread)))
        metrics["dynamic/groups_with_spread"].append(float(sum(spread)))
        metrics["dynamic/groups_trained_without_spread"].append(float(sum(not spread[g] for g in chosen)))
        self.last_trained_groups = [groups[g] for g in chosen]
        kept = set(chosen)
        record_rollouts(self.hybrid_reward, [row // n in kept for row in range(len(inputs))], self.accelerator)
        return keep_rows(batch, group_rows(chosen, n), len(inputs))


def record_rollouts(reward: HybridReward, trained: Sequence[bool], accelerator: Any) -> None:
    """The last batch ``reward`` scored, each rollout with whether the step trains on it, into the rewards log and
    the step's reward components: every process's rollouts (each scores its own share of the batch), gathered and
    recorded by the main process alone, so that no row is written twice and none is lost."""
    rows: list[tuple[Any, bool]] = list(zip(reward.last_scored(), trained, strict=True))
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    if accelerator.is_main_process:
        reward.record([b for b, _ in rows], reward.last_step, [t for _, t in rows])


def cut_at_stops(completion_ids: Any, logprobs: Any, stops: Collection[int]) -> tuple[list[list[int]], Any]:
    """Each rollout up to its first end token, that token kept (TRL masks only what follows the tokenizer's end
    token: a row that stopped at another one would keep the padding after it), its logprobs cut alike."""
    ids_out: list[list[int]] = []
    logprobs_out: list[Any] | None = None if logprobs is None else []
    for i, ids in enumerate(completion_ids):
        ids = [int(t) for t in ids]
        end = next((j + 1 for j, token in enumerate(ids) if token in stops), len(ids))
        ids_out.append(ids[:end])
        if logprobs_out is not None:
            logprobs_out.append(logprobs[i][:end])
    return ids_out, logprobs_out


class TimeLimit(TrainerCallback):
    """Ends training after the step that passes ``seconds`` (from the first step of this process), with a
    checkpoint of that step, so that a bounded run still writes its final adapter and ``--resume`` continues from
    exactly where it stopped. Under several processes the main one's clock decides for all: one that stopped alone
    would leave the others waiting for it in their next step's gather."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        stop = [time.monotonic() - self.started >= self.seconds]
        if args.world_size > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(stop, from_process=0)
        if stop[0]:
            control.should_training_stop = True
            control.should_save = True


def check_group_alignment(config: GRPOConfig) -> None:
    """Each process's generation batch must hold whole prompt groups, or a group would be split between processes
    and its p_base computed from half of it."""
    local = config.per_device_train_batch_size * (config.steps_per_generation or 1)
    if local % (config.num_generations or 1):
        raise ConfigError(
            f"per-process generation batch {local} is not a multiple of num_generations={config.num_generations}"
        )


def reward_for(
    options: TrainOptions, judge: NoveltyJudge | None, log_path: Path | None = None, *, tokenizer: Any = None
) -> HybridReward:
    """The hybrid reward the options ask for (eq. 8's beta is ``experience_beta``), reading completions as the
    policy's ``tokenizer`` writes their prompts: where its chat template opens the think block, a completion is
    thinking until its ``</think>``, and one cut before it has no answer."""
    opened = tokenizer is not None and template_opens_think(tokenizer)
    return HybridReward(judge, beta=options.experience_beta, log_path=log_path, think_opened=opened)


def lora_config(options: TrainOptions) -> Any:
    """peft's LoRA on every linear layer of the blocks (not the output head), or None for full training."""
    if not options.lora_rank:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise ConfigError("--lora-rank needs peft: pip install 'tmas[rl]'") from None
    alpha = options.lora_alpha or 2 * options.lora_rank
    return LoraConfig(
        r=options.lora_rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )


def check_groups(dataset: Any, options: TrainOptions) -> None:
    """The data's prompt groups fill the batches the options ask for, checked before any model loads: enough groups
    for one step's generation batch (each process generates its own share), and an even ``num_generations`` where
    an experience group's Base and Bank rows each take half of its rollouts (eq. 7)."""
    from accelerate import PartialState

    groups = prompt_groups(dataset["extra_info"])
    processes = PartialState().num_processes
    wanted = options.generated_groups * processes
    if len(groups) < wanted:
        # The sampler yields whole generation batches only: none would ever be filled, so no step could train.
        over = f" over its {processes} processes" if processes > 1 else ""
        raise ConfigError(
            f"the data has {len(groups)} prompt groups, fewer than the {wanted} a step generates{over}"
            " (--generate-groups, else --groups-per-step, per process)"
        )
    if options.num_generations % 2 and any(len(g) == 2 for g in groups):
        raise ConfigError(
            f"--num-generations {options.num_generations} is odd: the data's experience groups split their rollouts"
            " into equal Base and Bank halves (eq. 7)"
        )


def build_trainer(
    model: Any, tokenizer: Any, dataset: Any, options: TrainOptions, reward: HybridReward
) -> TMASGRPOTrainer:
    config = grpo_config(options)
    check_group_alignment(config)
    check_groups(dataset, options)
    # The rollouts end where the pilot's and the evaluation's do: at the first of the tokenizer's end token and those
    # the model's generation config names (TRL stops at the tokenizer's alone). vLLM reads the generation config's
    # end tokens itself.
    stops = stop_ids(model, tokenizer)
    if options.mask_truncated:
        check_truncation_test(stops, tokenizer)
    if not config.use_vllm:
        config.generation_kwargs = {"eos_token_id": stops}
    return TMASGRPOTrainer(
        model=model,
        reward_funcs=list[Any](reward.functions()),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(options),
        hybrid_reward=reward,
        train_groups=options.groups_per_step if options.dynamic_sampling else None,
        stops=stops,
    )


def check_truncation_test(stops: Sequence[int], tokenizer: Any) -> None:
    """TRL counts a rollout as cut at the length limit when its last token is neither the tokenizer's end token nor
    its padding; a rollout that ended at another of the policy's end tokens would be left out of the loss too."""
    others = [t for t in stops if t not in (tokenizer.eos_token_id, tokenizer.pad_token_id)]
    if others:
        raise ConfigError(
            f"--mask-truncated: the policy's rollouts also end at token ids {others} (its generation config), which"
            " TRL would take for rollouts cut at the length limit; train without --mask-truncated"
        )


def load_dataset(path: Path) -> Any:
    import datasets
    import pyarrow.parquet as pq

    try:
        # Its schema first: datasets would log its own error line before raising on a file that is no parquet.
        pq.read_schema(path)
        data = datasets.Dataset.from_parquet(str(path))
    except Exception as exc:  # pyarrow's ArrowInvalid and others: the file is no parquet this reads
        raise InputError(f"{path}: not a parquet file of 'tmas rl build-data' ({type(exc).__name__}: {exc})") from None
    missing = set(COLUMNS) - set(data.column_names)
    if missing:
        raise InputError(f"{path}: missing columns {sorted(missing)} (not from 'tmas rl build-data')")
    if any(info.get("copy") for info in data["extra_info"]):
        raise InputError(f"{path}: written with --layout verl (for verl); build it with --layout trl for TRL")
    check_rows(path, data["reward_model"], data["extra_info"])
    return data


def check_rows(path: Path, reward_model: list[Any], extra_info: list[Any]) -> None:
    """Every row holds what the rewards read, before any model loads: a reference answer (a missing one would be
    graded as the text 'None'), the task, prompt group and question 'tmas rl build-data' writes, and whole groups."""
    for index, (answer, info) in enumerate(zip(reward_model, extra_info, strict=True)):
        truth = answer.get("ground_truth") if isinstance(answer, dict) else None
        if truth is None or not str(truth).strip():
            raise InputError(f"{path}: row {index} has no reference answer (reward_model.ground_truth)")
        if not isinstance(info, dict) or info.get("task") not in TASKS or not info.get("group"):
            raise InputError(f"{path}: row {index}: extra_info has no task and group of 'tmas rl build-data'")
        if not isinstance(info.get("question"), str):
            raise InputError(f"{path}: row {index}: extra_info has no question (of 'tmas rl build-data')")
        if info["task"] == "experience" and info.get("variant") not in ("base", "bank"):
            raise InputError(f"{path}: row {index}: an experience row whose variant is not base or bank")
    try:
        prompt_groups(extra_info)
    except ValueError as exc:
        raise InputError(f"{path}: {exc}") from None


def load_policy(
    spec: str, dataset: Any = None, dtype: str = "float32", tokenizer_dir: Path | None = None
) -> tuple[Any, Any]:
    """The model to train and its tokenizer: ``tiny`` (from a config, for smoke runs), a Hugging Face checkpoint
    directory, or a GGUF file / embedded model name (dequantised by transformers, which needs ``gguf``), with its
    weights in ``dtype``. A GGUF is dequantised once into tmas's checkpoint cache with its tokenizer (converting that
    takes a minute or more), and read from there by every later command; ``tokenizer_dir`` is a tokenizer saved from
    this GGUF before: the GGUF's weights are then read directly, with that tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = getattr(torch, dtype)
    if spec == "tiny":
        texts = [m["content"] for row in (dataset or []) for m in row["prompt"]]
        texts += [str(row["reward_model"]["ground_truth"]) for row in (dataset or [])]
        tokenizer = tiny_tokenizer([*texts, "\\boxed{", "}"])
        return tiny_model(len(tokenizer)).to(weights), tokenizer
    path = Path(spec).expanduser()
    if not path.is_dir() and tokenizer_dir is None:
        # Its tokenizer ends text where the file's chat model ends (TRL stops generating and masks completions there).
        path = checkpoint(spec, dtype="float32")
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=weights), AutoTokenizer.from_pretrained(path)
    # Every weight unpacked into a dense float32 tensor (not kept in GGUF blocks), then cast to the training dtype.
    model = load_gguf(resolve_model(spec), dtype=torch.float32).to(weights)
    return model, AutoTokenizer.from_pretrained(tokenizer_dir)


def record_base(out: Path, spec: str, model: Any, tokenizer: Any) -> None:
    """Note the base model a LoRA run adapts; ``tiny`` (built, not loaded) is saved under OUT/base first."""
    if spec == "tiny":
        spec = str((out / "base").resolve())
        model.save_pretrained(spec)
        tokenizer.save_pretrained(spec)
    elif Path(spec).expanduser().exists():
        spec = str(Path(spec).expanduser().resolve())
    (out / BASE_FILE).write_text(json.dumps({"model": spec}) + "\n", encoding="utf-8")


def train_policy(
    dataset: Any,
    options: TrainOptions,
    model_spec: str,
    judge: NoveltyJudge | None,
    *,
    resume_from: Path | None = None,
    live: bool | None = None,
) -> tuple[Path, int]:
    """Train, checkpointing every ``save_steps`` into OUT and continuing from ``resume_from``; write OUT/final
    (the model, or the LoRA adapter and its base's name), OUT/steps.jsonl and the curve OUT/rewards.png.
    Returns the final directory and the number of steps done."""
    check_groups(dataset, options)
    out = options.output_dir
    out.mkdir(parents=True, exist_ok=True)
    from accelerate import PartialState

    # The main process alone writes files (the logs, the base model's record, the final tokenizer), as several would
    # race on each, and alone draws the progress.
    main = PartialState().is_main_process
    if main:
        # Steps after the checkpoint are trained again; without one (a run stopped before its first), all of them.
        trim_logs(out, checkpoint_step(resume_from) if resume_from is not None else 0)
    policy, tokenizer = load_policy(model_spec, dataset, options.dtype)
    if options.lora_rank and main:
        record_base(out, model_spec, policy, tokenizer)
    reward = reward_for(options, judge, out / REWARDS_FILE, tokenizer=tokenizer)
    trainer = build_trainer(policy, tokenizer, dataset, options, reward)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    progress = TrainProgress(live=live)
    # In place of the trainer's own display (a bar, or its logs printed when bars are off).
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(progress)
    if options.max_time_s is not None:
        trainer.add_callback(TimeLimit(options.max_time_s))
    trainer.add_callback(StepLog(out, reward, on_row=progress.update, on_save=lambda p: plot_steps(p, out / PLOT_FILE)))
    result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    final = out / "final"
    trainer.save_model(str(final))  # by the main process (the trainer's own rule)
    if main:
        tokenizer.save_pretrained(str(final))
        if options.lora_rank:
            (final / BASE_FILE).write_text((out / BASE_FILE).read_text(encoding="utf-8"), encoding="utf-8")
    return final, int(result.global_step)
