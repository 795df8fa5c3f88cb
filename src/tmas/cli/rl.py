"""``tmas rl``: hybrid-reward RL data, GRPO training with TRL, and GGUF export (see docs/rl.md).

Training imports torch, transformers and TRL (the ``rl`` extra) only when ``train`` runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tmas.cli.options import ConfigOpt, ModelFlags
from tmas.errors import ConfigError, InputError
from tmas.rl.train_options import train_default

# The policy model of training and of the pilot's rollouts.
PolicyOpt = Annotated[
    str, typer.Option("--model", help="HF checkpoint dir, GGUF file, embedded model name, or 'tiny'.")
]
# The prompt groups that training and the pilot read.
DataArg = Annotated[Path, typer.Argument(help="Parquet from 'tmas rl build-data'.")]
# What llama.cpp's convert_hf_to_gguf.py writes (its --outtype).
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0", "auto")

rl_app = typer.Typer(
    help="Hybrid-reward RL: training data from TMAS runs, GRPO training, GGUF export.", no_args_is_help=True
)


@rl_app.command("build-data")
def build_data(
    runs: Annotated[list[Path], typer.Argument(help="TMAS run directories (any teacher endpoint).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Parquet file to write (train split).")],
    exclude: Annotated[
        list[Path] | None,
        typer.Option(
            "--exclude", "-x", help="JSONL of evaluation problems to keep out, by id and question (repeatable)."
        ),
    ] = None,
    val_fraction: Annotated[
        float, typer.Option("--val-fraction", help="Share of questions (by hash) for OUT's .val.parquet.", min=0, max=1)
    ] = 0.0,
    mix: Annotated[
        str,
        typer.Option(
            "--mix",
            help="normal:experience:guideline weights of prompt groups (section 4.2: 2.2:1.6:0.6), or 'all'.",
        ),
    ] = "2.2:1.6:0.6",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the mix's draw and of the file's group order.")] = 0,
    layout: Annotated[
        str, typer.Option("--layout", help="'trl' (tmas rl train) or 'verl': every group as two rows, see docs/rl.md.")
    ] = "trl",
    context_length: Annotated[
        int | None,
        typer.Option(
            "--context-length",
            help="The teacher's context window, to fit R_{t-1} as the runs did when it is not in their settings.",
            min=1,
        ),
    ] = None,
) -> None:
    """Write normal / experience / guideline examples in the release's parquet schema, with a dataset card."""
    from tmas.rl.data import ExcludeList, build_dataset, parse_mix, write_dataset

    if layout not in ("trl", "verl"):
        raise InputError(f"--layout {layout!r}: expected trl or verl")
    data = build_dataset(
        runs,
        ExcludeList.from_files(exclude or []),
        val_fraction,
        mix=parse_mix(mix),
        seed=seed,
        layout="verl" if layout == "verl" else "trl",
        context_length=context_length,
    )
    if not data.train and not data.val:
        raise ConfigError("no training example: the runs hold no labeled, non-excluded problem")
    for path in write_dataset(data, out):
        typer.echo(f"wrote {path}")
    r = data.report
    counts = ", ".join(
        f"{task} {r.groups[task]} of {r.available[task]}" for task in ("normal", "experience", "guideline")
    )
    typer.echo(f"train prompt groups (drawn of available): {counts}; rows: {sum(r.rows.values())};")
    typer.echo(f"excluded problems: {r.excluded}")


@rl_app.command("train")
def train(
    data: DataArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (checkpoints, rewards.jsonl, final/).")],
    model: PolicyOpt = "qwen2.5-coder-0.5b",
    config: ConfigOpt = None,
    max_steps: Annotated[int, typer.Option("--max-steps", help="Optimizer steps (A.4: 190).", min=1)] = train_default(
        "max_steps"
    ),
    num_generations: Annotated[
        int, typer.Option("--num-generations", help="Rollouts per prompt (A.4: 16).", min=2)
    ] = train_default("num_generations"),
    groups_per_step: Annotated[
        int, typer.Option("--groups-per-step", help="Prompt groups an optimizer step trains on (per process).", min=1)
    ] = train_default("groups_per_step"),
    generate_groups: Annotated[
        int | None,
        typer.Option(
            "--generate-groups",
            help="Groups generated per step; above --groups-per-step, dynamic sampling (DAPO) drops groups whose"
            " rollouts all got one reward and trains on --groups-per-step of the others.",
            min=1,
        ),
    ] = train_default("generate_groups"),
    gradient_accumulation_steps: Annotated[
        int,
        typer.Option("--gradient-accumulation-steps", help="Micro-batches a step's groups are split into.", min=1),
    ] = train_default("gradient_accumulation_steps"),
    temperature: Annotated[
        float, typer.Option("--temperature", help="Rollout sampling temperature (A.4 leaves it open).", min=0.01)
    ] = train_default("temperature"),
    top_p: Annotated[
        float, typer.Option("--top-p", help="Rollout sampling top_p (nucleus; 1: none).", min=0.01, max=1.0)
    ] = train_default("top_p"),
    learning_rate: Annotated[float, typer.Option("--learning-rate", help="A.4: 1e-6.")] = train_default(
        "learning_rate"
    ),
    experience_beta: Annotated[
        float, typer.Option("--experience-beta", help="Eq. 8's maximum bonus coefficient beta (A.4: 0.6).", min=0)
    ] = train_default("experience_beta"),
    max_completion_length: Annotated[
        int, typer.Option("--max-completion-length", help="Tokens per rollout.", min=1)
    ] = train_default("max_completion_length"),
    mask_truncated: Annotated[
        bool,
        typer.Option(
            "--mask-truncated/--train-truncated",
            help="Leave rollouts cut at --max-completion-length out of the loss (TRL's mask_truncated_completions).",
        ),
    ] = train_default("mask_truncated"),
    use_vllm: Annotated[
        bool | None, typer.Option("--vllm/--no-vllm", help="vLLM generation (default: when installed with CUDA).")
    ] = train_default("use_vllm"),
    continuous_batching: Annotated[
        bool,
        typer.Option(
            "--continuous-batching/--padded-generate",
            help="Rollouts by transformers' continuous-batching engine, or by padded generate.",
        ),
    ] = train_default("continuous_batching"),
    dtype: Annotated[
        str, typer.Option("--dtype", help="The policy's weights: float32 or bfloat16 (a LoRA adapter stays float32).")
    ] = train_default("dtype"),
    seed: Annotated[int, typer.Option("--seed")] = train_default("seed"),
    lora_rank: Annotated[
        int, typer.Option("--lora-rank", help="Train a LoRA adapter of this rank (peft); 0: every weight.", min=0)
    ] = train_default("lora_rank"),
    lora_alpha: Annotated[
        int | None, typer.Option("--lora-alpha", help="LoRA's alpha (default: twice the rank).", min=1)
    ] = train_default("lora_alpha"),
    save_steps: Annotated[
        int, typer.Option("--save-steps", help="A checkpoint in OUT every this many steps.", min=1)
    ] = train_default("save_steps"),
    max_time: Annotated[
        float | None,
        typer.Option(
            "--max-time",
            help="Stop after the step that passes this many seconds, with a checkpoint and OUT/final as usual.",
            min=0.001,
        ),
    ] = train_default("max_time_s"),
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue a stopped run from OUT's last checkpoint.")
    ] = False,
    judge_model: Annotated[
        str | None,
        typer.Option(
            "--judge-model",
            help="Judge guideline rollouts (eq. 9) with this frozen model in-process (HF dir, GGUF or embedded name,"
            " e.g. the base model) instead of the judge endpoint; never the model being trained.",
        ),
    ] = None,
) -> None:
    """GRPO on the hybrid rewards with TRL (defaults from the paper's appendix A.4)."""
    check_data(data)  # before the slow imports below
    if dtype not in ("float32", "bfloat16"):
        raise InputError(f"--dtype {dtype!r}: expected float32 or bfloat16")
    from tmas.rl.checkpoints import resume_point
    from tmas.rl.pilot import pilot_paths, read_report, sampling_differences

    pilot = read_report(data)
    differences = []
    if pilot is not None:
        precision = training_precision(dtype, continuous_batching, use_vllm)
        differences = sampling_differences(pilot, temperature, top_p, max_completion_length, precision)
    if differences:
        typer.echo(
            f"note: {data} holds the prompt groups a pilot kept for their right rates at its sampling, which this"
            f" training does not repeat: {', '.join(differences)}; see {pilot_paths(data)['report']}",
            err=True,
        )
    start = resume_point(out, resume)
    if start is not None:
        typer.echo(f"resuming from {start}")
    from tmas.grading.judge import JUDGE_ROLE, judge_route
    from tmas.llm.routes import check_api_keys
    from tmas.rl.novelty import LLMNoveltyJudge
    from tmas.rl.scoring import NoveltyJudge
    from tmas.rl.step_log import REWARDS_FILE, STEPS_FILE
    from tmas.rl.train_options import TrainOptions
    from tmas.rl.trl_train import PLOT_FILE, load_dataset, train_policy

    dataset = load_dataset(data)
    judge: NoveltyJudge | None = None
    if "guideline" in set(dataset["_source"]) and judge_model is not None:
        from tmas.rl.hf_judge import load_judge

        judge = load_judge(judge_model)
    elif "guideline" in set(dataset["_source"]):
        # Loaded as every command's are; the policy's --model and the training --seed are this command's own.
        chosen = ModelFlags(config=config)
        route = judge_route(chosen.settings())
        if route is None:
            raise ConfigError(
                "guideline rows need a judge: --judge-model, or an endpoint in [endpoint] or [roles.judge] (--config)"
            )
        check_api_keys(route, [JUDGE_ROLE], chosen.key_origin)  # before a training that would call it
        judge = LLMNoveltyJudge(route, out / "judge")
    options = TrainOptions(
        output_dir=out,
        max_steps=max_steps,
        num_generations=num_generations,
        groups_per_step=groups_per_step,
        generate_groups=generate_groups,
        gradient_accumulation_steps=gradient_accumulation_steps,
        temperature=temperature,
        top_p=top_p,
        continuous_batching=continuous_batching,
        dtype="bfloat16" if dtype == "bfloat16" else "float32",
        learning_rate=learning_rate,
        experience_beta=experience_beta,
        max_completion_length=max_completion_length,
        mask_truncated=mask_truncated,
        use_vllm=use_vllm,
        seed=seed,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        save_steps=save_steps,
        max_time_s=max_time,
    )
    final, steps = train_policy(dataset, options, model, judge, resume_from=start)
    typer.echo(f"trained {steps} steps; {'adapter' if lora_rank else 'checkpoint'} {final}")
    typer.echo(f"per-step rewards {out / STEPS_FILE} (curve {out / PLOT_FILE}), per rollout {out / REWARDS_FILE}")


def check_data(data: Path) -> None:
    """Refuse a DATA argument that names no file."""
    if not data.is_file():
        raise InputError(f"{data}: no such data file (build one with 'tmas rl build-data')")


def training_precision(dtype: str, continuous_batching: bool, use_vllm: bool | None) -> str | None:
    """The precision ``tmas rl train`` generates its rollouts in with these flags; None where vLLM generates them
    (in the precision vLLM loads the model in)."""
    from tmas.rl.train_options import rollout_precision
    from tmas.rl.trl_train import vllm_available

    if vllm_available() if use_vllm is None else use_vllm:
        return None
    import torch

    return rollout_precision(dtype, continuous_batching, torch.cuda.is_available())


@rl_app.command("pilot")
def pilot(
    data: DataArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="Parquet of the prompt groups kept (rates beside it).")],
    model: PolicyOpt = "qwen2.5-coder-0.5b",
    samples: Annotated[
        int, typer.Option("--samples", help="Rollouts per prompt group (as --num-generations).", min=2)
    ] = 8,
    temperatures: Annotated[
        list[float] | None,
        typer.Option("--temperature", help="Rollout temperature to try (repeatable; the best is chosen).", min=0.01),
    ] = None,
    top_p: Annotated[
        float, typer.Option("--top-p", help="Rollout sampling top_p (as tmas rl train's --top-p).", min=0.01, max=1.0)
    ] = train_default("top_p"),
    max_completion_length: Annotated[
        int, typer.Option("--max-completion-length", help="Tokens per rollout.", min=1)
    ] = 384,
    min_rate: Annotated[
        float, typer.Option("--min-rate", help="Keep groups right at least this often.", min=0, max=1)
    ] = 0.1,
    max_rate: Annotated[float, typer.Option("--max-rate", help="... and at most this often.", min=0, max=1)] = 0.9,
    engine: Annotated[
        str, typer.Option("--engine", help="continuous (transformers' continuous batching) or padded (generate).")
    ] = "continuous",
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="The policy's weights: float32 or bfloat16, as tmas rl train's --dtype (generated in the precision"
            " training generates in with it).",
        ),
    ] = train_default("dtype"),
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            help="Rollouts generated at once: prompt groups are sampled in chunks of about this many, whatever"
            " the size of DATA.",
            min=1,
        ),
    ] = 256,
    limit_groups: Annotated[
        int | None, typer.Option("--limit-groups", help="Only the first N prompt groups of DATA.", min=1)
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    max_time: Annotated[
        float | None,
        typer.Option(
            "--max-time",
            help="Seconds (loading included) after which no chunk of groups starts; the groups reached are reported.",
            min=1,
        ),
    ] = None,
) -> None:
    """Sample every prompt group before training, at each --temperature, and keep the groups the model gets right
    --min-rate..--max-rate of the time, at the temperature that keeps the most (rates and a card beside OUT)."""
    check_data(data)
    if engine not in ("continuous", "padded") or dtype not in ("float32", "bfloat16"):
        raise InputError(f"--engine {engine!r} / --dtype {dtype!r}: expected continuous|padded and float32|bfloat16")
    if min_rate > max_rate:
        raise InputError(f"--min-rate {min_rate} is above --max-rate {max_rate}")
    if samples % 2:
        raise InputError(
            f"--samples {samples} is odd: an experience group's Base and Bank halves must be equal (eq. 7)"
        )
    from tmas.rl.hf_generate import GenerationSettings
    from tmas.rl.pilot import pilot_paths, run_pilot

    settings = GenerationSettings(
        top_p=top_p,
        max_new_tokens=max_completion_length,
        seed=seed,
        batch_size=batch_size,
        engine="continuous" if engine == "continuous" else "padded",
    )
    report = run_pilot(
        data,
        out,
        model,
        temperatures=temperatures or [train_default("temperature")],
        samples=samples,
        settings=settings,
        min_rate=min_rate,
        max_rate=max_rate,
        dtype=dtype,
        limit_groups=limit_groups,
        max_time_s=max_time,
    )
    for s in report.temperatures:
        typer.echo(
            f"temperature {s.temperature:g}: right {s.right_rate:.1%} of {s.rollouts} rollouts, {s.groups_in_band} of"
            f" {s.groups} groups in band, {s.groups_with_spread} with a spread"
        )
    if report.measured_groups < report.groups:
        typer.echo(f"stopped for time: {report.measured_groups} of {report.groups} prompt groups sampled")
    typer.echo(f"chosen temperature {report.chosen_temperature:g}; kept {report.kept_rows} of {report.rows} rows")
    typer.echo(f"wrote {out} (rates {pilot_paths(out)['rates']}, card {pilot_paths(out)['card']})")


@rl_app.command("export-gguf")
def export_gguf_cmd(
    checkpoint: Annotated[
        Path, typer.Argument(help="Hugging Face checkpoint or LoRA adapter directory (e.g. OUT/final).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="GGUF file to write.")],
    outtype: Annotated[str, typer.Option("--outtype", help=", ".join(OUTTYPES) + ".")] = "f16",
    script: Annotated[Path | None, typer.Option("--convert-script", help="llama.cpp's convert_hf_to_gguf.py.")] = None,
    base: Annotated[
        str | None, typer.Option("--base", help="An adapter's base model (default: the --model it was trained on).")
    ] = None,
    merged_dir: Annotated[
        Path | None, typer.Option("--merged-dir", help="Keep the adapter merged into its base here (HF checkpoint).")
    ] = None,
) -> None:
    """Convert a checkpoint to GGUF with llama.cpp's converter, to serve it with --local-model; a LoRA adapter is
    merged into its base model first."""
    from tmas.rl.export import export_gguf

    if outtype not in OUTTYPES:  # before an adapter is merged, which takes minutes
        raise InputError(f"--outtype {outtype!r}: choose {', '.join(OUTTYPES)}")
    written = export_gguf(checkpoint, out, outtype=outtype, script=script, base=base, merged_dir=merged_dir)
    typer.echo(f"wrote {written}")
