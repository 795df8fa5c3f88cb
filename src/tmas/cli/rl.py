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
    data: Annotated[Path, typer.Argument(help="Parquet from 'tmas rl build-data'.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (checkpoints, rewards.jsonl, final/).")],
    model: Annotated[
        str, typer.Option("--model", help="HF checkpoint dir, GGUF file, embedded model name, or 'tiny'.")
    ] = "qwen2.5-coder-0.5b",
    config: ConfigOpt = None,
    max_steps: Annotated[int, typer.Option("--max-steps", help="Optimizer steps (A.4: 190).")] = train_default(
        "max_steps"
    ),
    num_generations: Annotated[
        int, typer.Option("--num-generations", help="Rollouts per prompt (A.4: 16).")
    ] = train_default("num_generations"),
    groups_per_step: Annotated[
        int, typer.Option("--groups-per-step", help="Prompt groups per step and process.")
    ] = train_default("groups_per_step"),
    learning_rate: Annotated[float, typer.Option("--learning-rate", help="A.4: 1e-6.")] = train_default(
        "learning_rate"
    ),
    experience_beta: Annotated[
        float, typer.Option("--experience-beta", help="Eq. 8's maximum bonus coefficient beta (A.4: 0.6).", min=0)
    ] = train_default("experience_beta"),
    max_completion_length: Annotated[
        int, typer.Option("--max-completion-length", help="Tokens per rollout.")
    ] = train_default("max_completion_length"),
    use_vllm: Annotated[
        bool | None, typer.Option("--vllm/--no-vllm", help="vLLM generation (default: when installed with CUDA).")
    ] = train_default("use_vllm"),
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
    if not data.is_file():  # before the slow imports below
        raise InputError(f"{data}: no such data file (build one with 'tmas rl build-data')")
    from tmas.rl.checkpoints import resume_point

    start = resume_point(out, resume)
    if start is not None:
        typer.echo(f"resuming from {start}")
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
        settings = ModelFlags(config=config).settings()
        if settings.uses_local_model:
            raise ConfigError(
                "guideline rows need a judge: --judge-model, or an endpoint in [endpoint] or [roles.judge] (--config)"
            )
        judge = LLMNoveltyJudge(settings, out / "judge")
    options = TrainOptions(
        output_dir=out,
        max_steps=max_steps,
        num_generations=num_generations,
        groups_per_step=groups_per_step,
        learning_rate=learning_rate,
        experience_beta=experience_beta,
        max_completion_length=max_completion_length,
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


@rl_app.command("export-gguf")
def export_gguf_cmd(
    checkpoint: Annotated[
        Path, typer.Argument(help="Hugging Face checkpoint or LoRA adapter directory (e.g. OUT/final).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="GGUF file to write.")],
    outtype: Annotated[str, typer.Option("--outtype", help="f32, f16, bf16 or q8_0.")] = "f16",
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

    written = export_gguf(checkpoint, out, outtype=outtype, script=script, base=base, merged_dir=merged_dir)
    typer.echo(f"wrote {written}")
