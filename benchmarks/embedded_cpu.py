"""The embedded default on a CPU, measured as a new user runs it.

Runs the README's commands on an embedded model (the default, Qwen2.5-Coder-1.5B, or ``--local-model NAME``;
llama-server on this machine's cores) and collects these figures into OUT/embedded_cpu.json and a Markdown table
on standard output:

- ``seeds``: ``tmas solve "What is 17*23?" --seed S`` for S = 1..N: the printed answers, how many are 391, the
  answers equal to a value the old prompts showed (42), wall time, tokens and the cached share of prompt tokens;
- ``majority``: majority vote (k = 4, the embedded defaults) on ``tmas data generate --family all --n 4 --level 1
  --seed 7`` (28 problems), graded by rules: MV@1 (the expected accuracy of one sample: every method's first sample
  is the same prompt, so this is CoT's), MV@2, MV@4, echo anomalies and parse failures per role;
- ``tmas``: TMAS with the embedded defaults (the ``local`` preset) on the same 28 problems: wall time, calls,
  prompt tokens and the share served from the server's cache, accuracy of the returned answer;
- ``ceiling``: what this machine's cores can do at all with the embedded model (llama.cpp's ``llama-bench``: prompt
  processing and generation, tokens per second, on the threads the embedded server uses), and from it the least
  time the ``tmas`` part's prompt (less the cached share) and completion tokens need, so a wall time can be read
  against the machine it was measured on.

Every part runs the ``tmas`` CLI in a subprocess (each starts and stops the embedded model) and reads the run
directory it kept. A part whose figures are in OUT/embedded_cpu.json is skipped; a run directory left by an
interrupted part is resumed (``--resume``), so running the same command again continues.

    python benchmarks/embedded_cpu.py --out /tmp/cpu                 # every part
    python benchmarks/embedded_cpu.py --out /tmp/cpu --parts tmas,ceiling    # TMAS, then the machine's speed
    python benchmarks/embedded_cpu.py --out /tmp/cpu05 --local-model qwen2.5-coder-0.5b --parts seeds,ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tmas.config import LocalModel
from tmas.data.generators import FAMILIES, generate
from tmas.grading.grades import GradeConfig
from tmas.grading.run_results import load_results
from tmas.jsonl import write_jsonl
from tmas.llm.local_command import llama_server_bin_dir, replica_threads
from tmas.llm.weights import resolve_model
from tmas.reports.report import evaluate_run
from tmas.store.run_store import RunStore

QUESTION = "What is 17*23?"
# A value the prompts used to show as an example answer: an answer equal to it was copied.
OLD_EXAMPLE = "42"
PARTS = ("seeds", "majority", "tmas", "ceiling")
TMAS_CLI = [sys.executable, "-m", "tmas"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created, or continued)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--seeds", type=int, default=10, help="seeds of the solve part (1..N)")
    parser.add_argument("--per-family", type=int, default=4, help="generated problems per family (7 families)")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--problem-seed", type=int, default=7)
    parser.add_argument(
        "--local-model", default=LocalModel().model, help="embedded model name or GGUF path (default: the default)"
    )
    args = parser.parse_args(argv)
    # Every command of every part runs on this model; a record made on another one is not continued.
    args.model_flags = ["--local-model", args.local_model]
    return args


def _run(command: list[str], log: Path) -> float:
    """Run a tmas command, its output to ``log``; the wall time in seconds. A failed command stops the script."""
    started = time.monotonic()
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"embedded_cpu: {' '.join(command)} exited {done.returncode}; see {log}")
    return time.monotonic() - started


def _store_figures(run_dir: Path) -> dict[str, Any]:
    """Calls, tokens and the cached share of prompt tokens over every call the run kept."""
    with RunStore(run_dir, create=False) as store:
        calls = [c for c in store.calls() if c.error is None]
        results = load_results(store)
    prompt = sum(c.usage.prompt_tokens for c in calls)
    cached = sum(c.usage.cached_prompt_tokens or 0 for c in calls)
    candidates = [c for r in results for it in r.iterations for c in it.candidates]
    answers = [c.answer for c in candidates]
    return {
        "calls": len(calls),
        "prompt_tokens": prompt,
        "completion_tokens": sum(c.usage.completion_tokens for c in calls),
        "cached_prompt_tokens": cached,
        "cached_share": cached / prompt if prompt else None,
        "truncated_calls": sum(c.finish_reason == "length" for c in calls),
        "candidates": len(candidates),
        "candidates_answering_old_example": sum(a == OLD_EXAMPLE for a in answers),
        "candidates_without_answer": sum(a is None for a in answers),
        "answers": [r.answer for r in results],
    }


async def _evaluation(run_dir: Path) -> dict[str, Any]:
    """Rule grades and the report's per-role reply counts."""
    e = await evaluate_run(run_dir, GradeConfig(mode="rules"), None)
    last = e.metrics.iterations[-1] if e.metrics.iterations else None
    return {
        "problems": e.problems,
        "done": e.done,
        "accuracy": last.selected if last else None,
        "per_iteration": [
            {"iteration": m.iteration, "pass1": m.pass1, "selected": m.selected, "tokens": m.tokens_per_problem}
            for m in e.metrics.iterations
        ],
        "frontier": [
            {"label": f.label, "completion_tokens": round(f.tokens), "accuracy": f.accuracy} for f in e.frontier
        ],
        "replies": {
            role: {"replies": t.replies, "unusable": t.unusable, "truncated": t.truncated, "echo": t.echo}
            for role, t in e.replies.items()
        },
        "fallbacks": e.downgrades,
    }


def part_seeds(out: Path, seeds: int, model_flags: list[str]) -> dict[str, Any]:
    rows = []
    for seed in range(1, seeds + 1):
        run_dir = out / "seeds" / f"seed{seed}"
        if run_dir.exists():
            rows.append(json.loads((run_dir / "row.json").read_text()))
            continue
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        command = [*TMAS_CLI, "solve", QUESTION, "--seed", str(seed), "--run-dir", str(run_dir), *model_flags]
        wall = _run(command, out / "seeds.log")
        row = {"seed": seed, "wall_s": round(wall, 1), **_store_figures(run_dir)}
        row["answer"] = row.pop("answers")[0]
        row["replies"] = asyncio.run(_evaluation(run_dir))["replies"]
        (run_dir / "row.json").write_text(json.dumps(row, indent=2))
        rows.append(row)
        print(f"seed {seed}: {row['answer']!r} in {wall:.0f} s", flush=True)
    return {
        "command": f'tmas solve "{QUESTION}" --seed S {" ".join(model_flags)}',
        "runs": rows,
        "printed_391": sum(r["answer"] == "391" for r in rows),
        "printed_old_example": sum(r["answer"] == OLD_EXAMPLE for r in rows),
        "printed_no_answer": sum(r["answer"] is None for r in rows),
    }


def _problems(out: Path, args: argparse.Namespace) -> Path:
    path = out / "problems.jsonl"
    if not path.exists():
        problems = [
            p
            for family in FAMILIES
            for p in generate(family, args.per_family, level=args.level, seed=args.problem_seed)
        ]
        write_jsonl(problems, path)
    return path


def part_run(out: Path, args: argparse.Namespace, method: str, extra: list[str]) -> dict[str, Any]:
    problems = _problems(out, args)
    run_dir = out / method
    command = [*TMAS_CLI, "run", str(problems), "--method", method, "-o", str(run_dir), "--seed", "1", *extra]
    command += args.model_flags
    # An interrupted part continues from its store (its settings are stored with it).
    started = [*TMAS_CLI, "run", "--resume", str(run_dir)] if run_dir.exists() else command
    wall = _run(started, out / f"{method}.log")
    figures = _store_figures(run_dir)
    figures.pop("answers")
    return {
        "command": " ".join(["tmas", *command[3:]]).replace(str(out) + "/", ""),
        "wall_s": round(wall, 1),
        **figures,
        **asyncio.run(_evaluation(run_dir)),
    }


def part_ceiling(record: dict[str, Any], model: str) -> dict[str, Any]:
    """llama-bench's prompt-processing (512 tokens) and generation (64 tokens, one sequence) speed on the embedded
    model and threads, and the ``tmas`` part's tokens over them: the time those tokens need on these cores alone."""
    bin_dir, local = llama_server_bin_dir(), LocalModel()
    threads = replica_threads(local)
    command = [str(bin_dir / "llama-bench"), "-m", str(resolve_model(model)), "-t", str(threads)]
    command += ["-p", "512", "-n", "64", "-r", "3", "-o", "json"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    rows = json.loads(done.stdout)
    speed = {("prompt" if row["n_prompt"] else "generation"): row["avg_ts"] for row in rows}
    figures: dict[str, Any] = {
        "command": " ".join(["llama-bench", *command[1:]]),
        "model": model,
        "threads": threads,
        "prompt_tokens_per_s": round(speed["prompt"], 1),
        "generation_tokens_per_s": round(speed["generation"], 1),
    }
    tmas = record.get("tmas")
    if tmas:
        # One sequence's generation speed: the four slots decode in one batch, which is faster per token, so this
        # is an upper bound on the generation time; the prompt time is a lower bound (no decoding shares the batch).
        uncached = tmas["prompt_tokens"] - tmas["cached_prompt_tokens"]
        figures["tmas_prompt_s"] = round(uncached / speed["prompt"])
        figures["tmas_generation_s_one_sequence"] = round(tmas["completion_tokens"] / speed["generation"])
    return figures


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "embedded_cpu.json"
    record: dict[str, Any] = json.loads(record_path.read_text()) if record_path.exists() else {}
    record.setdefault("model", args.local_model)
    if record["model"] != args.local_model:
        sys.exit(f"embedded_cpu: {record_path} was measured on {record['model']}; give another --out")
    record.setdefault(
        "machine",
        {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    )
    for part in [p.strip() for p in args.parts.split(",") if p.strip()]:
        if part not in PARTS:
            sys.exit(f"embedded_cpu: unknown part {part!r}; parts are {', '.join(PARTS)}")
        if part in record:
            continue
        started = datetime.now(UTC).isoformat(timespec="seconds")
        if part == "seeds":
            figures = part_seeds(out, args.seeds, args.model_flags)
        elif part == "ceiling":
            figures = part_ceiling(record, args.local_model)
        elif part == "majority":
            figures = part_run(out, args, "majority", ["--temperature", "0.3", "--max-tokens", "640"])
        else:
            figures = part_run(out, args, "tmas", [])
        record[part] = {"started": started, **figures}
        record_path.write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "machine"}, indent=2)[:20000])


if __name__ == "__main__":
    main()
