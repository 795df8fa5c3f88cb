"""The rollouts ``tmas rl pilot`` measures and those ``tmas rl train`` generates are sampled alike: the settings a
user gives reach TRL's generation config, the pilot neither adds nor drops one the trainer has, and training says
where it samples otherwise than the pilot that kept its rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from test_rl_train import row


def train_options(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[Any, Any]:
    """``tmas rl train ARGS`` run in-process up to training: the options it trains with, and the command's result."""
    pytest.importorskip("trl")
    from typer.testing import CliRunner

    from tmas.cli.main import app
    from tmas.rl import trl_train

    seen: list[Any] = []

    def train_policy(dataset: Any, options: Any, model_spec: str, judge: Any, **kwargs: Any) -> tuple[Path, int]:
        seen.append(options)
        return options.output_dir / "final", 0

    monkeypatch.setattr(trl_train, "train_policy", train_policy)
    result = CliRunner().invoke(app, ["rl", "train", *args])
    assert result.exit_code == 0, result.output
    return seen[0], result


def normal_rows(path: Path) -> Path:
    from tmas.rl.data import write_parquet

    write_parquet([row("normal", "p1"), row("normal", "p2")], path)
    return path


@pytest.mark.slow
def test_trains_top_p_and_sampling_settings_reach_trls_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    from tmas.rl.trl_rewards import HybridReward
    from tmas.rl.trl_train import build_trainer, load_policy

    data = normal_rows(tmp_path / "train.parquet")
    args = [str(data), "-o", str(tmp_path / "out"), "--model", "tiny", "--num-generations", "2", "--no-vllm"]
    args += ["--top-p", "0.8", "--temperature", "0.6", "--max-completion-length", "7"]
    options, _ = train_options(monkeypatch, args)
    dataset = datasets.Dataset.from_list([row("normal", "p1")])
    model, tokenizer = load_policy("tiny", dataset)
    trainer = build_trainer(model, tokenizer, dataset, options, HybridReward())
    config = trainer.generation_config
    assert (config.top_p, config.temperature, config.max_new_tokens, config.top_k) == (0.8, 0.6, 7, 0)
    # Not given: A.4's defaults.
    options, _ = train_options(monkeypatch, args[:5])
    assert (options.top_p, options.temperature) == (0.95, 1.0)


@pytest.mark.slow
def test_the_pilot_samples_as_training_whatever_the_checkpoints_generation_config(tmp_path: Path) -> None:
    """A checkpoint's generation_config.json may name sampling of its own (Qwen2.5's instruct models: top_k 20, a
    repetition penalty 1.05 to 1.1); TRL's rollouts override it, and the pilot's must as well."""
    datasets = pytest.importorskip("datasets")
    from tmas.rl.hf_generate import GenerationSettings, generate
    from tmas.rl.train_options import TrainOptions
    from tmas.rl.trl_rewards import HybridReward
    from tmas.rl.trl_train import build_trainer, load_policy

    dataset = datasets.Dataset.from_list([row("normal", "p1")])
    model, tokenizer = load_policy("tiny", dataset)
    model.generation_config.update(repetition_penalty=1.3, top_k=20, top_p=0.8, temperature=0.7)
    options = TrainOptions(output_dir=tmp_path / "out", num_generations=2, use_vllm=False, max_completion_length=3)
    options = options.model_copy(update={"temperature": 0.6, "top_p": 0.9})
    trainer = build_trainer(model, tokenizer, dataset, options, HybridReward())
    trained, _ = model._prepare_generation_config(trainer.generation_config)

    prepared: list[Any] = []
    original = model._prepare_generation_config

    def recorded(*args: Any, **kwargs: Any) -> Any:
        prepared.append(original(*args, **kwargs))
        return prepared[-1]

    model._prepare_generation_config = recorded
    settings = GenerationSettings(temperature=0.6, top_p=0.9, max_new_tokens=3, engine="padded")
    generate(model, tokenizer, [row("normal", "p1")["prompt"]], settings)
    piloted = prepared[0][0]
    keys = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
    assert {k: getattr(piloted, k) for k in keys} == {k: getattr(trained, k) for k in keys}
    assert (piloted.repetition_penalty, piloted.top_k, piloted.top_p) == (1.0, 0, 0.9)


def pilot_report(
    kept: Path, temperature: float | None, top_p: float, max_new_tokens: int, precision: str | None = None
) -> None:
    from tmas.rl.pilot import PilotReport, pilot_paths

    report = PilotReport(
        model="tiny",
        data="all.parquet",
        samples=2,
        max_new_tokens=max_new_tokens,
        top_p=top_p,
        min_rate=0.1,
        max_rate=0.9,
        temperatures=[],
        chosen_temperature=temperature,
        reason="r",
        kept_groups=2,
        kept_rows=2,
        rows=4,
        precision=precision,
    )
    pilot_paths(kept)["report"].write_text(report.model_dump_json(), encoding="utf-8")


@pytest.mark.slow
def test_training_on_a_pilots_rows_says_where_it_samples_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = normal_rows(tmp_path / "kept.parquet")
    args = [str(kept), "-o", str(tmp_path / "out"), "--model", "tiny", "--temperature", "0.6"]
    args += ["--max-completion-length", "384"]
    # The pilot's settings: nothing to say.
    pilot_report(kept, 0.6, 0.95, 384)
    _, result = train_options(monkeypatch, args)
    assert "note:" not in result.stderr
    # Its top_p and length, not the temperature it chose (here the defaults: top_p 0.95).
    pilot_report(kept, 0.6, 0.8, 256)
    _, result = train_options(monkeypatch, args)
    note = result.stderr.strip()
    assert note.startswith(f"note: {kept} holds the prompt groups a pilot kept")
    assert note.endswith(f"top_p 0.8 (here 0.95), max tokens 256 (here 384); see {tmp_path / 'kept.pilot.json'}")
    _, result = train_options(monkeypatch, [*args, "--top-p", "0.8", "--max-completion-length", "256"])
    assert "note:" not in result.stderr
    _, result = train_options(monkeypatch, [*args[:5], "--top-p", "0.8", "--max-completion-length", "256"])
    assert "temperature 0.6 (here 1)" in result.stderr and "top_p" not in result.stderr
    # A report cut off (its pilot killed while it was written) is named, before any model loads.
    (tmp_path / "kept.pilot.json").write_text('{"model": "tiny"', encoding="utf-8")
    from typer.testing import CliRunner

    from tmas.cli.main import app

    refused = CliRunner().invoke(app, ["rl", "train", *args])
    assert "kept.pilot.json: not a report of 'tmas rl pilot'" in str(refused.exception)


def scripted(model: Any, tokenizer: Any, *after: dict[str, str]) -> None:
    """``model`` then writes in batch row b, after each token named in ``after[b]`` (the last one for the rows
    after), the token it names, and the tokenizer's end token after any other (every other token made unlikely by
    far): rollouts that are the same at any temperature, whichever path generates them."""
    import torch

    tables = [
        {tokenizer.convert_tokens_to_ids(k): tokenizer.convert_tokens_to_ids(v) for k, v in t.items()} for t in after
    ]

    def hook(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        ids = kwargs.get("input_ids")
        ids = args[0] if ids is None else ids
        forced = torch.full_like(output.logits[:, -1, :], -1e4)
        for b, last in enumerate(ids[:, -1].tolist()):
            forced[b, tables[min(b, len(tables) - 1)].get(last, tokenizer.eos_token_id)] = 1e4
        output.logits[:, -1, :] = forced
        return output

    model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.slow
def test_training_ends_rollouts_and_rewards_them_where_the_pilot_does(tmp_path: Path) -> None:
    """A checkpoint's generation config may name end tokens besides its tokenizer's (Qwen2.5's instruct models:
    <|im_end|> and <|endoftext|>). The pilot and the evaluation end a rollout at the first of them; TRL's rollouts
    ended at the tokenizer's alone, so the text it rewarded and the tokens it trained ran on past it."""
    datasets = pytest.importorskip("datasets")
    from tmas.rl.hf_generate import GenerationSettings, generate
    from tmas.rl.tiny import tiny_model, tiny_tokenizer
    from tmas.rl.train_options import TrainOptions
    from tmas.rl.trl_rewards import HybridReward
    from tmas.rl.trl_train import build_trainer

    example = row("normal", "p1")
    tokenizer = tiny_tokenizer([m["content"] for m in example["prompt"]])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    model = tiny_model(len(tokenizer))
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end]
    # "17", then the second end token, then "23" and the tokenizer's end token; the second row of a batch writes
    # "23" before, so the first is padded after its end.
    script = {"assistant": "17", "17": "<|endoftext|>", "<|endoftext|>": "23"}
    scripted(model, tokenizer, script, {**script, "assistant": "23", "23": "17"})

    piloted = generate(model, tokenizer, [example["prompt"]], GenerationSettings(temperature=1.0, max_new_tokens=6))
    assert [(c.text, c.tokens, c.cut) for c in piloted] == [("17", 2, False)]

    rewarded: list[str] = []

    class Recorded(HybridReward):
        def score(self, completions: Any, **columns: Any) -> Any:
            rewarded.extend(str(c[0]["content"]) for c in completions)
            return super().score(completions, **columns)

    dataset = datasets.Dataset.from_list([example])
    options = TrainOptions(output_dir=tmp_path / "out", num_generations=2, use_vllm=False, max_completion_length=6)
    trainer = build_trainer(model, tokenizer, dataset, options, Recorded())
    assert trainer.generation_config.eos_token_id == [tokenizer.eos_token_id, end]
    batch = trainer._generate_and_score_completions([example, example])
    assert rewarded[:2] == ["17", "23 17"]
    # Trained: each rollout and its end token, nothing after it (neither text nor padding).
    trained = [
        ids[mask.bool()].tolist() for ids, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
    ]
    words = tokenizer.convert_tokens_to_ids(["17", "23"])
    assert trained == [[words[0], end], [words[1], words[0], end]]


@pytest.mark.slow
def test_the_pilot_loads_the_policy_in_the_dtype_training_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pilot loaded the policy in bfloat16 by default and training in float32: its right rates described
    rollouts of another precision than training's. Both default to training's dtype now, and the report names the
    precision its rollouts were generated in, training's own for those flags."""
    import json

    import torch
    from typer.testing import CliRunner

    from tmas.cli.main import app
    from tmas.rl import trl_train
    from tmas.rl.pilot import pilot_paths
    from tmas.rl.train_options import rollout_precision

    loaded: list[Any] = []
    original = trl_train.load_policy

    def recorded(*args: Any, **kwargs: Any) -> Any:
        model, tokenizer = original(*args, **kwargs)
        loaded.append(next(model.parameters()).dtype)
        return model, tokenizer

    monkeypatch.setattr(trl_train, "load_policy", recorded)
    data, kept = normal_rows(tmp_path / "all.parquet"), tmp_path / "kept.parquet"
    args = ["rl", "pilot", str(data), "-o", str(kept), "--model", "tiny", "--samples", "2"]
    CliRunner().invoke(app, [*args, "--max-completion-length", "2", "--engine", "padded"])
    options, _ = train_options(monkeypatch, [str(data), "-o", str(tmp_path / "out"), "--model", "tiny", "--no-vllm"])
    assert loaded == [getattr(torch, options.dtype)] == [torch.float32]
    report = json.loads(pilot_paths(kept)["report"].read_text())
    cuda = torch.cuda.is_available()
    assert report["precision"] == rollout_precision(options.dtype, options.continuous_batching, cuda)
    assert "Generated in float32" in pilot_paths(kept)["card"].read_text()


@pytest.mark.slow
def test_training_says_where_it_generates_in_another_precision_than_the_pilot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from tmas.rl.train_options import rollout_precision

    kept = normal_rows(tmp_path / "kept.parquet")
    args = [str(kept), "-o", str(tmp_path / "out"), "--model", "tiny", "--no-vllm", "--temperature", "0.6"]
    here = rollout_precision("float32", False, torch.cuda.is_available())
    pilot_report(kept, 0.6, 0.95, 2048, here)
    _, result = train_options(monkeypatch, args)
    assert "note:" not in result.stderr
    pilot_report(kept, 0.6, 0.95, 2048, "bfloat16")
    _, result = train_options(monkeypatch, args)
    assert f"precision bfloat16 (here {here}); see" in result.stderr
    _, result = train_options(monkeypatch, [*args, "--dtype", "bfloat16"])
    assert "note:" not in result.stderr
