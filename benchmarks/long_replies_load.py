"""A run at the scale users run thinking models: many problems, hundreds of calls in flight, replies of tens of
thousands of tokens streamed. What the orchestrator spends per call, how long its event loop is held at once, its
peak memory, and what reading the finished run back costs (the report's cost table, one iteration's calls).

The simulated server (a process of its own, the vLLM persona) answers every call with reasoning of about
``--median`` tokens (log-normal, sigma 0.2, clipped to 2/3 and 4/3 of it) and an answer of 300-2,000 tokens
(tmas.testing.long_replies), streamed in deltas of ``--chunk`` tokens; this process is the orchestrator alone.

    PYTHONPATH=src .venv/bin/python benchmarks/long_replies_load.py --out /tmp/long-load      # majority, k = 16
    PYTHONPATH=src .venv/bin/python benchmarks/long_replies_load.py --out /tmp/long-tmas --method tmas --problems 2 \\
        --iterations 10 --median 6000

Prints one JSON object. ``longest_steps_ms``: the CPU time of the event loop's longest callbacks (each one holds
every other stream while it runs), measured on the thread's own clock so that other processes on the machine do
not count. ``--profile`` writes a cProfile of the run to OUT/run.prof.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import platform
import random
import resource
import time
from asyncio import events
from pathlib import Path
from typing import Any

from tmas_critical_path import sim_server

from tmas.config import Settings
from tmas.grading.run_results import load_results
from tmas.problems import Problem
from tmas.reports.report import run_cost
from tmas.runner import prepare_run, run_problems
from tmas.store.run_store import DB_NAME, RunStore
from tmas.testing import LongReplies, SimScript


def problems(count: int) -> list[Problem]:
    rng = random.Random(27)
    out = []
    for i in range(count):
        a, b, c = rng.randrange(11, 99), rng.randrange(11, 99), rng.randrange(1, 50)
        out.append(Problem(problem_id=f"p{i:03d}", question=f"What is {a}*{b} - {c}?", answer=str(a * b - c)))
    return out


class StepClock:
    """Times every callback the event loop runs, on this thread's CPU clock; keeps the longest."""

    def __init__(self, keep: int = 5) -> None:
        self.keep = keep
        self.longest: list[float] = []
        self._run = events.Handle._run

    def __enter__(self) -> StepClock:
        run, longest, keep = self._run, self.longest, self.keep

        def timed(handle: events.Handle) -> None:
            start = time.thread_time()
            run(handle)
            longest.append(time.thread_time() - start)
            if len(longest) > 4 * keep:
                longest.sort(reverse=True)
                del longest[keep:]

        events.Handle._run = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        events.Handle._run = self._run  # type: ignore[method-assign]
        self.longest.sort(reverse=True)
        del self.longest[self.keep :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--method", choices=["majority", "tmas"], default="majority")
    parser.add_argument("--k", type=int, default=16, help="majority: samples per problem")
    parser.add_argument("--iterations", type=int, default=10, help="tmas: T (N = M = 8)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--median", type=int, default=30_000, help="reasoning tokens of a reply")
    parser.add_argument("--chunk", type=int, default=2_000, help="tokens per streamed delta")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    script = SimScript(
        persona="vllm",
        context_length=262_144,
        accuracy=0.6,
        log_limit=0,
        long_replies=LongReplies(
            reasoning_median_tokens=args.median,
            reasoning_sigma=0.2,
            reasoning_min_tokens=args.median * 2 // 3,
            reasoning_max_tokens=args.median * 4 // 3,
            chunk_tokens=args.chunk,
        ),
    )
    params: dict[str, Any] = {"k": args.k} if args.method == "majority" else {"n": 8, "m": 8}
    if args.method == "tmas":
        params["iterations"] = args.iterations
    run_dir = args.out / "run"
    with sim_server(0.0, False, script) as url:
        settings = Settings.model_validate(
            {
                "endpoint": {"base_url": [f"{url}/v1"], "model": "sim-model", "timeout_s": 60},
                "concurrency": args.concurrency,
                "sampling": {"max_tokens": 100_000},
                "method": {"name": args.method, "params": params},
            }
        )
        store, config, todo = prepare_run(run_dir, settings, problems(args.problems), resume=False)
        profile = cProfile.Profile() if args.profile else None
        with store, StepClock() as clock:
            cpu, wall = time.process_time(), time.monotonic()
            if profile is not None:
                profile.enable()
            summary = asyncio.run(run_problems(config, todo, store))
            if profile is not None:
                profile.disable()
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    if profile is not None:
        profile.dump_stats(args.out / "run.prof")
    with RunStore(run_dir, read_only=True) as stored:
        results = load_results(stored)
        start = time.perf_counter()
        run_cost(results, stored)
        cost_s = time.perf_counter() - start
        start = time.perf_counter()
        one_iteration = sum(1 for _ in stored.calls("p000", 0))
        iteration_s = time.perf_counter() - start
    figures = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_average_after": round(os.getloadavg()[0], 2),
        "calls": summary.calls,
        "failed_calls": summary.failed_calls,
        "completion_tokens": summary.completion_tokens,
        "wall_s": round(wall, 2),
        "orchestrator_cpu_s": round(cpu, 2),
        "cpu_ms_per_call": round(1000 * cpu / max(1, summary.calls), 2),
        "longest_steps_ms": [round(1000 * s, 1) for s in clock.longest],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "store_mib": round(sum(p.stat().st_size for p in run_dir.glob(f"{DB_NAME}*")) / 2**20, 1),
        "report_cost_table_s": round(cost_s, 4),
        "one_iteration_calls": one_iteration,
        "one_iteration_read_s": round(iteration_s, 4),
    }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
