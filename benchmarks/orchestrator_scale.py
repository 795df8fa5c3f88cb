"""The orchestrator at scale: critical-path and cap efficiency, orchestrator cost, paper scale, prefix reuse.

The simulated server runs in a process of its own (as a real server would), answering every call after a fixed
latency; this process is the orchestrator alone, so its CPU time is the orchestrator's cost.

    .venv/bin/python benchmarks/orchestrator_scale.py critical [--latency 0.2] [--problems 10]
    .venv/bin/python benchmarks/orchestrator_scale.py cap --cap 16 [--latency 0.2] [--problems 10]
    .venv/bin/python benchmarks/orchestrator_scale.py cost [--problems 10] [--concurrency 64]
    .venv/bin/python benchmarks/orchestrator_scale.py scale [--problems 100] [--iterations 20]
    .venv/bin/python benchmarks/orchestrator_scale.py prefix [--problems 3]

Every mode runs TMAS with N=8, M=8 (T=5 unless said) and prints one JSON object of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import platform
import resource
import shutil
import sqlite3
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tmas_critical_path import measured_chain, server_stats, sim_server

from tmas.config import Settings
from tmas.problems import Problem
from tmas.runner import RunSummary, prepare_run, run_problems
from tmas.store.run_store import RunStore

N, M = 8, 8


def settings(url: str, iterations: int, concurrency: int) -> Settings:
    return Settings.model_validate(
        {
            "endpoint": {"base_url": [f"{url}/v1"], "model": "sim-model"},
            "concurrency": concurrency,
            "sampling": {"temperature": 0.7, "max_tokens": 256},
            # Algorithm 1 as written (the last iteration's summaries and memory update included): the chain
            # tmas_critical_path.measured_chain reads, and N + N x M + N + 2 calls an iteration.
            "method": {
                "name": "tmas",
                "params": {"n": N, "m": M, "iterations": iterations, "epsilon": 0.2, "skip_final_memory": False},
            },
        }
    )


def problems(count: int) -> list[Problem]:
    return [Problem(problem_id=f"p{i}", question=f"What is {i + 11}*{i + 7}?") for i in range(count)]


async def solve(run_dir: Path, url: str, count: int, iterations: int, concurrency: int) -> tuple[RunSummary, float]:
    """Run ``count`` problems; returns the summary and the CPU seconds this process spent in the run."""
    store, config, todo = prepare_run(run_dir, settings(url, iterations, concurrency), problems(count), resume=False)
    with store:
        cpu = time.process_time()
        summary = await run_problems(config, todo, store)
        cpu = time.process_time() - cpu
    assert summary.done == count and summary.failed_calls == 0, summary.to_dict()
    return summary, cpu


def calls_per_problem(iterations: int) -> int:
    return iterations * (N + N * M + N + 2)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def critical(args: argparse.Namespace) -> dict[str, Any]:
    """Figure 1: sum over iterations of the chain / wall time, nothing capping the fan-out."""
    sim_cpu = _children_cpu()
    with sim_server(args.latency, False) as url, tempfile.TemporaryDirectory() as scratch:
        summary, cpu = asyncio.run(solve(Path(scratch) / "run", url, args.problems, args.iterations, 100_000))
        with RunStore(Path(scratch) / "run", create=False) as store:
            chains = [measured_chain(store, N, M, f"p{i}") for i in range(args.problems)]
        peak = server_stats(url)["max_in_flight"]
    # The simulator's CPU time, collected when its process is reaped at the end of the with-block: with the
    # orchestrator's, it shows whether the two cores, not the scheduling, bound the wall time.
    sim_cpu = _children_cpu() - sim_cpu
    nominal = args.iterations * 4 * args.latency
    return {
        "mode": "critical",
        "calls": summary.calls,
        "server_max_in_flight": peak,
        "wall_s": round(summary.wall_s, 3),
        "nominal_chain_s": nominal,
        "ratio_nominal": round(nominal / summary.wall_s, 3),
        "measured_chain_s": round(max(chains), 3),
        "ratio_measured": round(max(chains) / summary.wall_s, 3),
        "orchestrator_cpu_s": round(cpu, 2),
        "simulator_cpu_s": round(sim_cpu, 2),
    }


def cap(args: argparse.Namespace) -> dict[str, Any]:
    """Figure 2: (calls x latency / C) / wall time with the global cap C binding."""
    with sim_server(args.latency, False) as url, tempfile.TemporaryDirectory() as scratch:
        summary, _ = asyncio.run(solve(Path(scratch) / "run", url, args.problems, args.iterations, args.cap))
        peak = server_stats(url)["max_in_flight"]
    ideal = summary.calls * args.latency / args.cap
    return {
        "mode": "cap",
        "cap": args.cap,
        "server_max_in_flight": peak,
        "calls": summary.calls,
        "wall_s": round(summary.wall_s, 3),
        "ideal_s": round(ideal, 3),
        "ratio": round(ideal / summary.wall_s, 3),
    }


def cost(args: argparse.Namespace) -> dict[str, Any]:
    """Figure 3: orchestrator CPU per call and calls/s against a zero-latency server in another process."""
    with sim_server(0.0, False) as url, tempfile.TemporaryDirectory() as scratch:
        summary, cpu = asyncio.run(solve(Path(scratch) / "run", url, args.problems, args.iterations, args.concurrency))
    return {
        "mode": "cost",
        "concurrency": args.concurrency,
        "calls": summary.calls,
        "wall_s": round(summary.wall_s, 3),
        "calls_per_s": round(summary.calls / summary.wall_s, 1),
        "orchestrator_cpu_s": round(cpu, 3),
        "cpu_ms_per_call": round(1000 * cpu / summary.calls, 3),
    }


def scale(args: argparse.Namespace) -> dict[str, Any]:
    """Figure 4: N=8, M=8, T=20 over many problems: wall, peak RSS, store size, resume (skip) and full replay."""
    run_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tmas-scale-"))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    with sim_server(0.0, False) as url:
        summary, cpu = asyncio.run(solve(run_dir, url, args.problems, args.iterations, args.concurrency))
        rss_run_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        store_bytes = sum(p.stat().st_size for p in run_dir.iterdir() if p.name.startswith("run.sqlite"))
        # Resume of the finished run: every problem is skipped.
        started = time.monotonic()
        with RunStore(run_dir, create=False) as store:
            config = Settings.model_validate(store.get_meta("settings"))
            skipped = asyncio.run(run_problems(config, problems(args.problems), store))
        resume_s = time.monotonic() - started
        # Replay: the results are dropped, so every problem is solved again from its stored calls (what a run
        # killed just before writing its results does on resume); the server must see no call.
        db = sqlite3.connect(run_dir / "run.sqlite")
        db.execute("DELETE FROM results")
        db.commit()
        db.close()
        before = server_stats(url)["total_requests"]
        started = time.monotonic()
        with RunStore(run_dir, create=False) as store:
            replayed = asyncio.run(run_problems(config, problems(args.problems), store))
        replay_s = time.monotonic() - started
        asked = server_stats(url)["total_requests"] - before  # type: ignore[operator]
    if not args.out:
        shutil.rmtree(run_dir)
    return {
        "mode": "scale",
        "problems": args.problems,
        "iterations": args.iterations,
        "concurrency": args.concurrency,
        "calls": summary.calls,
        "wall_s": round(summary.wall_s, 1),
        "calls_per_s": round(summary.calls / summary.wall_s, 1),
        "cpu_ms_per_call": round(1000 * cpu / summary.calls, 3),
        "peak_rss_mib_after_run": round(rss_run_mib, 1),
        "peak_rss_mib_after_replay": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "store_mib": round(store_bytes / 2**20, 1),
        "store_kib_per_call": round(store_bytes / 1024 / summary.calls, 2),
        "resume_finished_s": round(resume_s, 2),
        "resume_skipped": skipped.skipped,
        "replay_s": round(replay_s, 1),
        "replayed_calls": replayed.replayed_calls,
        "replay_server_requests": asked,
    }


def prefix(args: argparse.Namespace) -> dict[str, Any]:
    """Figure 6: per iteration, the share of prompt characters that repeat a prefix of an earlier call's prompt
    (in send order, across the whole run: what a server-side prefix cache such as vLLM's can reuse)."""
    with sim_server(0.0, False) as url, tempfile.TemporaryDirectory() as scratch:
        asyncio.run(solve(Path(scratch) / "run", url, args.problems, args.iterations, 64))
        with RunStore(Path(scratch) / "run", read_only=True) as store:
            rows = [(c.key.iteration, c.key.role, store.call_messages(c.call_id or 0)) for c in store.calls()]
    seen: list[str] = []  # earlier prompts, sorted: the longest shared prefix is with a sorted neighbour
    total: dict[int, int] = defaultdict(int)
    reused: dict[int, int] = defaultdict(int)
    by_role_total: dict[str, int] = defaultdict(int)
    by_role_reused: dict[str, int] = defaultdict(int)
    for iteration, role, messages in rows:
        # The prompt as a server's chat template lays it out: messages in order, role markers between them.
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages)
        at = bisect.bisect_left(seen, text)
        shared = max((_common(text, seen[j]) for j in (at - 1, at) if 0 <= j < len(seen)), default=0)
        seen.insert(at, text)
        total[iteration] += len(text)
        reused[iteration] += shared
        by_role_total[role] += len(text)
        by_role_reused[role] += shared
    return {
        "mode": "prefix",
        "problems": args.problems,
        "share_by_iteration": {t: round(reused[t] / total[t], 3) for t in sorted(total)},
        "share_by_role": {r: round(by_role_reused[r] / by_role_total[r], 3) for r in sorted(by_role_total)},
        "share_overall": round(sum(reused.values()) / sum(total.values()), 3),
    }


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["critical", "cap", "cost", "scale", "prefix"])
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--problems", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--cap", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", help="scale: keep the run here")
    args = parser.parse_args()
    modes = {"critical": critical, "cap": cap, "cost": cost, "scale": scale, "prefix": prefix}
    figures = modes[args.mode](args)
    figures["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    figures["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
