"""Throughput of the embedded model server's two backends, serving Qwen2.5-Coder-0.5B on this machine.

Measures, per backend:

* generation: aggregate completion tokens/s with 1 and 4 concurrent requests of 128 tokens (temperature 0,
  a prompt asking for a long essay; llama-server gets ``ignore_eos`` so every request generates all 128;
  llama-cpp-python has no such option, and its ``logit_bias`` runs a per-token Python logits processor that
  would slow it down unfairly, so it relies on the prompt; the counts used are the servers' reported
  ``completion_tokens``), after a warm-up;
* prompt processing: prompt tokens/s for a ~1,500-token prompt with ``max_tokens=1`` (each prompt starts
  differently, so no prompt cache can help).

Results go to ``benchmarks/results/local_server_throughput.json``; a Markdown table is printed.

Setup (``llama-cpp-python`` is not a tmas dependency; install it into the venv only for this)::

    pip install -e '.[local]'
    pip install 'llama-cpp-python[server]'

Run::

    python benchmarks/local_server_throughput.py            # both backends
    python benchmarks/local_server_throughput.py --backends llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tmas.config import LocalModel
from tmas.llm.local_command import default_threads
from tmas.llm.local_server import LocalServer

RESULTS = Path(__file__).parent / "results" / "local_server_throughput.json"
GEN_TOKENS = 128
LONG_WRITE = (
    "Write a very long, detailed essay on the history of computing, from the abacus to modern GPUs. "
    "Use many sections and explain every step in depth."
)
_FILLER = [
    "The committee reviewed the quarterly budget and approved new funds for road repairs in the north.",
    "A small bakery on the corner sells rye bread, almond croissants and strong black coffee every morning.",
    "Engineers measured the bridge's vibration under load and found it well within the design margins.",
    "The library extended its opening hours so that students could prepare for their final examinations.",
    "Rainfall this spring was twice the seasonal average, which delayed the planting of wheat and barley.",
]


def long_prompt(nonce: int, lines: int = 52) -> str:
    # ~1,500 tokens; the nonce comes first so that no two prompts share a cached prefix.
    body = "\n".join(f"Note {nonce}-{i}: {_FILLER[i % len(_FILLER)]}" for i in range(lines))
    return f"Run {nonce}. Read these notes and reply with one word.\n{body}"


def eos_suppression(backend: str) -> dict[str, Any]:
    # llama-cpp-python: nothing (see the module docstring); the long-essay prompt runs past 128 tokens.
    return {"ignore_eos": True} if backend == "llama-server" else {}


async def chat(
    session: aiohttp.ClientSession, srv: LocalServer, prompt: str, max_tokens: int, extra: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    body = {
        "model": srv.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    start = time.perf_counter()
    async with session.post(f"{srv.base_url}/chat/completions", json=body) as resp:
        resp.raise_for_status()
        data: dict[str, Any] = await resp.json()
    return data, time.perf_counter() - start


async def generation(
    session: aiohttp.ClientSession, srv: LocalServer, backend: str, concurrency: int, rounds: int
) -> dict[str, Any]:
    extra = eos_suppression(backend)
    tokens = 0
    start = time.perf_counter()
    for r in range(rounds):
        batch = [chat(session, srv, f"({r}.{i}) {LONG_WRITE}", GEN_TOKENS, extra) for i in range(concurrency)]
        for data, _ in await asyncio.gather(*batch):
            tokens += int(data["usage"]["completion_tokens"])
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": concurrency * rounds,
        "completion_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
    }


async def prompt_processing(session: aiohttp.ClientSession, srv: LocalServer, reps: int) -> dict[str, Any]:
    prompt_tokens = 0
    wall = 0.0
    server_rates: list[float] = []
    for rep in range(reps):
        data, seconds = await chat(session, srv, long_prompt(1000 + rep), 1, {})
        prompt_tokens += int(data["usage"]["prompt_tokens"])
        wall += seconds
        timings = data.get("timings")  # llama-server reports its own prompt speed
        if isinstance(timings, dict) and "prompt_per_second" in timings:
            server_rates.append(float(timings["prompt_per_second"]))
    return {
        "requests": reps,
        "prompt_tokens_each": prompt_tokens // reps,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(prompt_tokens / wall, 1),
        "server_reported_tokens_per_s": round(sum(server_rates) / len(server_rates), 1) if server_rates else None,
    }


async def bench_backend(
    backend: str, model: str, rounds: int, reps: int, levels: list[int] | None = None
) -> dict[str, Any]:
    cfg = LocalModel(model=model, server=backend, parallel=4, ctx_per_slot=4096, startup_timeout_s=600)
    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=1800)
    async with LocalServer(cfg) as srv, aiohttp.ClientSession(timeout=timeout) as session:
        startup_s = time.perf_counter() - started
        await chat(session, srv, "Say hello.", 16, {})  # warm-up
        gen = [await generation(session, srv, backend, c, rounds) for c in levels or [1, 4]]
        pp = await prompt_processing(session, srv, reps)
        no_repack = srv.no_repack
    return {
        "backend": backend,
        "startup_s": round(startup_s, 1),
        "no_repack_fallback": no_repack,
        "generation": gen,
        "prompt_processing": pp,
    }


def machine() -> dict[str, Any]:
    model_name = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model_name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": model_name,
        "cores": default_threads(),
        "memory_gib": round(mem_gib, 1),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def table(results: list[dict[str, Any]]) -> str:
    levels = sorted({g["concurrency"] for res in results if "error" not in res for g in res["generation"]})
    rows = [
        "| backend | "
        + " | ".join(f"gen tok/s, {c} concurrent" for c in levels)
        + " | prompt tok/s (~1.5k-token prompt) | startup s |",
        "|---|" + "---:|" * (len(levels) + 2),
    ]
    for res in results:
        if "error" in res:
            rows.append(f"| {res['backend']} | error: {res['error']} |" + " |" * (len(levels) + 1))
            continue
        by_c = {g["concurrency"]: g["tokens_per_s"] for g in res["generation"]}
        rows.append(
            f"| {res['backend']} | "
            + " | ".join(str(by_c.get(c, "")) for c in levels)
            + f" | {res['prompt_processing']['tokens_per_s']} | {res['startup_s']} |"
        )
    return "\n".join(rows)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["llama-server", "llama-cpp-python"])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--rounds", type=int, default=2, help="waves of requests per concurrency level")
    parser.add_argument("--prompt-reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="concurrency levels to measure")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    mach = machine()  # before the runs, so the load average shows what else was running
    results: list[dict[str, Any]] = []
    for backend in args.backends:
        print(f"benchmarking {backend} ...", file=sys.stderr, flush=True)
        try:
            results.append(await bench_backend(backend, args.model, args.rounds, args.prompt_reps, args.concurrency))
        except Exception as exc:  # one backend failing should not lose the other's figures
            results.append({"backend": backend, "error": str(exc).splitlines()[0]})
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": args.model,
        "generation_tokens": GEN_TOKENS,
        "server": {"parallel": 4, "ctx_per_slot": 4096, "threads": default_threads()},
        "machine": mach,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
