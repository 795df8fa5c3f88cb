"""``tmas rl``: hybrid-reward RL data, GRPO training with TRL, and GGUF export (see docs/rl.md).

Training imports torch, transformers and TRL (the ``rl`` extra) only when ``train`` runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tmas.errors import ConfigError, InputError

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
) -> None:
    """Write normal / experience / guideline examples in the release's parquet schema, with a dataset card."""
    from tmas.rl.data import ExcludeList, build_dataset, write_dataset

    data = build_dataset(runs, ExcludeList.from_files(exclude or []), val_fraction)
    if not data.train and not data.val:
        raise ConfigError("no training example: the runs hold no labeled, non-excluded problem")
    for path in write_dataset(data, out):
        typer.echo(f"wrote {path}")
    counts = ", ".join(f"{task} {n}" for task, n in sorted(data.report.rows.items()))
    typer.echo(f"train rows: {counts or 'none'}; excluded problems: {data.report.excluded}")


@rl_app.command("train")
def train(
    data: Annotated[Path, typer.Argument(help="Parquet from 'tmas rl build-data'.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (checkpoints, rewards.jsonl, final/).")],
    model: Annotated[
        str, typer.Option("--model", help="HF checkpoint dir, GGUF file, embedded model name, or 'tiny'.")
    ] = "qwen2.5-coder-0.5b",
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="tmas TOML: the guideline judge's endpoint.")
    ] = None,
    max_steps: Annotated[int, typer.Option("--max-steps", help="Optimizer steps (A.4: 190).")] = 190,
    num_generations: Annotated[int, typer.Option("--num-generations", help="Rollouts per prompt (A.4: 16).")] = 16,
    groups_per_step: Annotated[int, typer.Option("--groups-per-step", help="Prompt groups per step and process.")] = 1,
    learning_rate: Annotated[float, typer.Option("--learning-rate", help="A.4: 1e-6.")] = 1e-6,
    max_completion_length: Annotated[int, typer.Option("--max-completion-length", help="Tokens per rollout.")] = 2048,
    use_vllm: Annotated[
        bool | None, typer.Option("--vllm/--no-vllm", help="vLLM generation (default: when installed with CUDA).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """GRPO on the hybrid rewards with TRL (defaults from the paper's appendix A.4)."""
    if not data.is_file():  # before the slow imports below
        raise InputError(f"{data}: no such data file (build one with 'tmas rl build-data')")
    from tmas.config import load_settings
    from tmas.rl.novelty import LLMNoveltyJudge
    from tmas.rl.trl_rewards import HybridReward
    from tmas.rl.trl_train import TrainOptions, build_trainer, load_dataset, load_policy

    dataset = load_dataset(data)
    judge = None
    if "guideline" in set(dataset["_source"]):
        settings = load_settings(config)
        if settings.uses_local_model:
            raise ConfigError("guideline rows need a judge endpoint: set [endpoint] or [roles.judge] (--config)")
        judge = LLMNoveltyJudge(settings, out / "judge")
    options = TrainOptions(
        output_dir=out,
        max_steps=max_steps,
        num_generations=num_generations,
        groups_per_step=groups_per_step,
        learning_rate=learning_rate,
        max_completion_length=max_completion_length,
        use_vllm=use_vllm,
        seed=seed,
    )
    policy, tokenizer = load_policy(model, dataset)
    out.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(policy, tokenizer, dataset, options, HybridReward(judge, log_path=out / "rewards.jsonl"))
    trainer.train()
    final = out / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    typer.echo(f"trained {max_steps} steps; checkpoint {final}; per-rollout rewards {out / 'rewards.jsonl'}")


@rl_app.command("export-gguf")
def export_gguf_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (e.g. OUT/final).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="GGUF file to write.")],
    outtype: Annotated[str, typer.Option("--outtype", help="f32, f16, bf16 or q8_0.")] = "f16",
    script: Annotated[Path | None, typer.Option("--convert-script", help="llama.cpp's convert_hf_to_gguf.py.")] = None,
) -> None:
    """Convert a checkpoint to GGUF with llama.cpp's converter, to serve it with --local-model."""
    from tmas.rl.export import export_gguf

    typer.echo(f"wrote {export_gguf(checkpoint, out, outtype=outtype, script=script)}")
