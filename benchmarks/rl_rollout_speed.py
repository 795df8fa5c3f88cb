"""Rollout generation speed for GRPO: padded ``generate`` (what TRL's GRPO trainer runs by default) against
transformers' continuous-batching engine (``generate_batch``, TRL's ``use_transformers_continuous_batching``), on
the same model, the same prompts and the same sampling.

The prompts are the first ``--groups`` prompt groups of a training parquet, each expanded to ``--num-generations``
rollouts as training expands it (:mod:`tmas.rl.sampler`), all in one call as TRL makes one call per step. Each
engine, weight type and LoRA setting is run ``--repeats`` times (every call cold, as TRL's is: the continuous
engine builds its cache each step); a row reports the generated tokens (up to and including the end token), the
call's seconds and generated tokens per second, and the share cut at ``--max-new-tokens``.

    python benchmarks/rl_rollout_speed.py --model qwen2.5-coder-0.5b --data data/rl/level1/train.parquet \\
        --groups 16 --num-generations 8 --max-new-tokens 384 --dtype float32 --dtype bfloat16 --lora-rank 4 \\
        --out rollout_speed.json

Timings mean something only on a machine doing nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def prompts(data: Path, groups: int, num_generations: int) -> list[list[dict[str, str]]]:
    from tmas.rl.pilot import expanded_rows
    from tmas.rl.trl_train import load_dataset

    rows = load_dataset(data).to_list()
    all_groups, order = expanded_rows([r["extra_info"] for r in rows], num_generations)
    if groups > len(all_groups):
        raise SystemExit(f"{data} has {len(all_groups)} prompt groups, fewer than --groups {groups}")
    return [rows[i]["prompt"] for i in order[: groups * num_generations]]


def with_lora(model: Any, rank: int) -> Any:
    """The adapter training attaches (every linear layer of the blocks; its weights float32, as peft keeps them)."""
    if not rank:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def measure(model: Any, tokenizer: Any, conversations: list[Any], engine: str, settings: Any) -> dict[str, Any]:
    import torch

    from tmas.rl.hf_generate import completion, generate_continuous, generate_padded, render, stop_ids

    stops = stop_ids(model, tokenizer)
    texts = [render(tokenizer, c) for c in conversations]
    run = generate_continuous if engine == "continuous" else generate_padded
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    rows = run(model, tokenizer, texts, settings.model_copy(update={"batch_size": len(texts)}), stops)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    done = [completion(tokenizer, row, stops, settings.max_new_tokens) for row in rows]
    tokens = sum(c.tokens for c in done)
    return {
        "sequences": len(done),
        "generated_tokens": tokens,
        "seconds": round(seconds, 3),
        "generated_tokens_per_s": round(tokens / seconds, 1),
        "cut_rate": round(sum(c.cut for c in done) / len(done), 3),
        "mean_tokens": round(tokens / len(done), 1),
    }


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint dir, GGUF file, embedded model name or 'tiny'")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer saved before (for a GGUF --model)")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "rl" / "level1" / "train.parquet")
    parser.add_argument("--groups", type=int, default=16, help="prompt groups (one training step's)")
    parser.add_argument("--num-generations", type=int, default=8, help="rollouts per group")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", action="append", choices=("padded", "continuous"), help="(repeatable)")
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="(repeatable)")
    parser.add_argument("--lora-rank", type=int, action="append", help="0: no adapter (repeatable)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)

    import torch

    from tmas.rl.hf_generate import GenerationSettings
    from tmas.rl.trl_train import load_dataset, load_policy

    conversations = prompts(args.data, args.groups, args.num_generations)
    settings = GenerationSettings(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for dtype in args.dtype or ["float32", "bfloat16"]:
        for rank in args.lora_rank or [0]:
            model, tokenizer = load_policy(args.model, load_dataset(args.data), dtype, args.tokenizer)
            model = with_lora(model, rank).to(device).eval()
            for engine in args.engine or ["padded", "continuous"]:
                for repeat in range(args.repeats):
                    row = {"engine": engine, "dtype": dtype, "lora_rank": rank, "repeat": repeat}
                    row |= measure(model, tokenizer, conversations, engine, settings)
                    print(json.dumps(row), flush=True)
                    results.append(row)
            del model
    report = {
        "model": args.model,
        "data": str(args.data),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": settings.model_dump(mode="json") | {"groups": args.groups, "num_generations": args.num_generations},
        "rows": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
