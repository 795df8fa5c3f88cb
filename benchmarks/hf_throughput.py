"""Generated tokens per second of the in-process model (transformers' continuous batching through tmas's own calls)
against padded ``generate``, and against ``transformers serve --continuous-batching`` driven by tmas's HTTP client:
same model, same prompts, same sampling.

At each concurrency C (``--concurrency 64,256``) the first C held-out problems (cycled where there are fewer) are
asked once each with CoT's prompt (the concise layout), every reply up to ``--max-tokens``:

- ``in-process``: C calls at once through :class:`tmas.llm.hf_model.HFChatModel` (chat template, per-request
  sampling and seeds, the engine's continuous batching), as a run makes them;
- ``padded generate``: the same C conversations in one left-padded ``model.generate`` batch
  (:func:`tmas.rl.hf_generate.generate`), the path the RL evaluation and GRPO rollouts take;
- ``transformers serve`` (``--serve``, needs ``fastapi``; ``--serve-path`` adds folders to its PYTHONPATH): the
  checkpoint served by ``transformers serve --continuous-batching`` and the same C calls sent by tmas's HTTP client.

Generated tokens are every token each reply generated (its end token included); the time is the wall time of the
C calls, after one warm-up call per backend. Writes OUT/throughput.json (machine, settings, each row) and prints a
table. A timing means something only on a machine running nothing else.

    python benchmarks/hf_throughput.py --out OUT                                     # 0.5B, 64 and 256 calls
    python benchmarks/hf_throughput.py --out OUT --model smollm2-135m --concurrency 4,8 --max-tokens 32 --serve
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROBLEMS = ROOT / "data" / "rl" / "level1" / "eval.jsonl"
# The model of the throughput goal (at least 15,000 generated tokens/s on one H200 in bfloat16).
THROUGHPUT_MODEL = "qwen2.5-coder-0.5b"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=THROUGHPUT_MODEL, help="checkpoint folder, GGUF or embedded model name")
    parser.add_argument("--tokenizer", help="a saved tokenizer folder for the GGUF's conversion")
    parser.add_argument("--problems", type=Path, default=DEFAULT_PROBLEMS)
    parser.add_argument("--concurrency", default="64,256", help="comma-separated numbers of calls at once")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--attn", default="sdpa", help="attention implementation of the in-process engine")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--no-generate", action="store_true", help="leave padded generate out")
    parser.add_argument("--serve", action="store_true", help="also measure transformers serve over HTTP")
    parser.add_argument("--serve-path", help="folders added to transformers serve's PYTHONPATH (os.pathsep)")
    return parser.parse_args(argv)


def conversations(problems: Path, count: int) -> list[list[dict[str, str]]]:
    from tmas.problems import load_problems
    from tmas.rl.hf_eval import cot_messages

    loaded = load_problems(problems)
    return [cot_messages(loaded[i % len(loaded)]) for i in range(count)]


def settings_for(args: argparse.Namespace, concurrency: int, **endpoint: Any) -> Any:
    from tmas.config import Settings

    data: dict[str, Any] = {
        "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens},
        "concurrency": concurrency,
        "seed": args.seed,
    }
    if endpoint:
        data["endpoint"] = endpoint
    else:
        hf = {"model": args.model, "device": args.device, "dtype": args.dtype, "attn_implementation": args.attn}
        data["hf"] = {**hf, "tokenizer": args.tokenizer, "threads": args.threads}
    return Settings.model_validate(data)


async def timed_calls(llm: Any, convs: list[list[dict[str, str]]], seed: int, sampling: Any = None) -> dict[str, Any]:
    """The conversations as concurrent solution calls, each with its own seed (over ``sampling``, a
    :class:`tmas.config.Sampling`, where the model's settings do not already hold the run's): generated tokens and
    wall time."""
    from tmas.config import Sampling
    from tmas.llm.types import CallKey, Message

    base = sampling if sampling is not None else Sampling()

    async def one(i: int, conv: list[dict[str, str]]) -> Any:
        messages = [Message(role=m["role"], content=m["content"]) for m in conv]  # type: ignore[arg-type]
        key = CallKey(problem_id=f"p{i}", role="solution")
        return await llm.chat("solution", messages, key=key, sampling=base.model_copy(update={"seed": seed + i}))

    started = time.perf_counter()
    done = await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
    wall = time.perf_counter() - started
    failed = [c.error for c in done if not c.ok]
    tokens = sum(c.usage.completion_tokens for c in done if c.ok)
    cut = sum(1 for c in done if c.ok and c.finish_reason == "length")
    return {
        "calls": len(convs),
        "failed": len(failed),
        "first_error": failed[0] if failed else None,
        "generated_tokens": tokens,
        "cut": cut,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
    }


async def in_process(args: argparse.Namespace, levels: list[int]) -> list[dict[str, Any]]:
    from tmas.llm.hf_model import open_hf_model

    rows = []
    async with open_hf_model(settings_for(args, max(levels))) as llm:
        await timed_calls(llm, conversations(args.problems, 1), args.seed)  # warm-up
        for c in levels:
            rows.append(
                {
                    "backend": "in-process",
                    "concurrency": c,
                    **await timed_calls(llm, conversations(args.problems, c), args.seed),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def padded_generate(
    args: argparse.Namespace, levels: list[int], folder: Path, device: str, dtype: str
) -> list[dict[str, Any]]:
    model, tokenizer = load_for_generate(folder, device, dtype, conversations(args.problems, 1))
    rows = []
    for c in levels:
        rows.append(
            padded_row(model, tokenizer, conversations(args.problems, c), args.temperature, args.max_tokens, args.seed)
        )
        print(json.dumps(rows[-1]), flush=True)
    del model
    return rows


def load_for_generate(folder: Path, device: str, dtype: str, warm_up: list[list[dict[str, str]]]) -> tuple[Any, Any]:
    """The checkpoint's model and tokenizer for padded ``generate``, warmed up with ``warm_up`` (8 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tmas.rl.hf_generate import GenerationSettings, generate

    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:  # SmolLM2's has none; left padding needs one (never attended to)
        tokenizer.pad_token = tokenizer.eos_token
    generate(model, tokenizer, warm_up, GenerationSettings(max_new_tokens=8))
    return model, tokenizer


def padded_row(
    model: Any, tokenizer: Any, convs: list[list[dict[str, str]]], temperature: float, max_tokens: int, seed: int
) -> dict[str, Any]:
    """The conversations in one left-padded ``generate`` batch: generated tokens and wall time."""
    import torch

    from tmas.rl.hf_generate import GenerationSettings, generate

    settings = GenerationSettings(temperature=temperature, max_new_tokens=max_tokens, seed=seed, batch_size=len(convs))
    started = time.perf_counter()
    done = generate(model, tokenizer, convs, settings)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    tokens = sum(d.tokens for d in done)
    return {
        "backend": "padded generate",
        "concurrency": len(convs),
        "calls": len(convs),
        "failed": 0,
        "first_error": None,
        "generated_tokens": tokens,
        "cut": sum(d.cut for d in done),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def transformers_serve(args: argparse.Namespace, folder: Path, device: str, dtype: str) -> Iterator[str]:
    """``transformers serve --continuous-batching`` of the checkpoint on a free loopback port, until left: its URL."""
    port = free_port()
    executable = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
    command = [executable, "serve", str(folder), "--continuous-batching", "--port", str(port), "--host", "127.0.0.1"]
    command += ["--device", device, "--dtype", dtype, "--attn-implementation", args.attn]
    env = dict(os.environ)
    if args.serve_path:
        env["PYTHONPATH"] = os.pathsep.join([args.serve_path, env.get("PYTHONPATH", "")])
    url = f"http://127.0.0.1:{port}"
    with (args.out / "serve.log").open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while not answers(f"{url}/health"):
                if server.poll() is not None:
                    raise SystemExit(f"transformers serve ended ({server.returncode}): see {args.out}/serve.log")
                if time.monotonic() > deadline:
                    raise SystemExit("transformers serve did not answer /health within 600 s")
                time.sleep(1)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


def serve_probe(url: str, model: str) -> list[dict[str, Any]]:
    """What ``transformers serve`` does with each sampling field a run sends: a greedy request first (its engine takes
    the first request's sampling), then requests that differ in one field each; the reply, or the refusal."""
    base = {"model": model, "messages": [{"role": "user", "content": "Write one sentence about the sea."}]}
    asked = [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 1},
        {"temperature": 1.0, "seed": 2},
        {"n": 2},
        {"top_k": 5},
        {"min_p": 0.1},
        {"stop": ["sea"]},
    ]
    rows = []
    for fields in asked:
        body = json.dumps({**base, "max_tokens": 20, **fields}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=600) as reply:
                choices = json.loads(reply.read())["choices"]
            rows.append({"sent": fields, "choices": [c["message"]["content"] for c in choices]})
        except urllib.error.HTTPError as exc:
            rows.append({"sent": fields, "refused": f"{exc.code} {exc.read().decode()[:200]}"})
    return rows


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


async def served(args: argparse.Namespace, levels: list[int], url: str, folder: Path) -> list[dict[str, Any]]:
    """The same calls through tmas's HTTP client to ``transformers serve`` at ``url``."""
    from tmas.llm.factory import open_model

    rows = []
    endpoint = {"base_url": [f"{url}/v1"], "model": str(folder), "context_length": 8192}
    async with open_model(settings_for(args, max(levels), **endpoint)) as llm:
        await timed_calls(llm, conversations(args.problems, 1), args.seed)  # warm-up (and the engine's start)
        for c in levels:
            row = await timed_calls(llm, conversations(args.problems, c), args.seed)
            rows.append({"backend": "transformers serve", "concurrency": c, **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def machine() -> dict[str, Any]:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | calls at once | generated tokens | cut | wall (s) | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(
            f"| {r['backend']}{failed} | {r['concurrency']} | {r['generated_tokens']:,} | {r['cut']} | "
            f"{r['wall_s']:.1f} | {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from tmas.llm.hf_checkpoint import checkpoint
    from tmas.llm.hf_engine import resolve_options

    levels = [int(c) for c in args.concurrency.split(",")]
    options = resolve_options(args.device, args.dtype)
    folder = checkpoint(args.model, dtype=options.dtype, tokenizer=args.tokenizer)
    rows = asyncio.run(in_process(args, levels))
    if not args.no_generate:
        rows += padded_generate(args, levels, folder, options.device, options.dtype)
    probe: list[dict[str, Any]] = []
    if args.serve:
        with transformers_serve(args, folder, options.device, options.dtype) as url:
            probe = serve_probe(url, str(folder))
            rows += asyncio.run(served(args, levels, url, folder))
    result = {
        "machine": machine(),
        "model": args.model,
        "checkpoint": str(folder),
        "options": vars(args) | {"out": str(args.out), "problems": str(args.problems)},
        "device": options.device,
        "dtype": options.dtype,
        "rows": rows,
        "serve_probe": probe,
    }
    (args.out / "throughput.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    for row in probe:
        print(f"transformers serve, sent {row['sent']}: {row.get('refused') or row['choices']}")


if __name__ == "__main__":
    main()
